# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where a transfer goes: the target host, reached over its own ssh (Target), and the ssh command line that
reaches it. Every value is checked here, since it becomes part of that command line."""
from __future__ import annotations

import re
import shlex

from ..core.errors import InvalidTarget

FAST_CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"
HOST_RE = re.compile(r"^[A-Za-z0-9_.:%\[\]-]+\Z")
USER_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*\Z")
PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+-]+\Z")


class Target(object):
    """Where an image goes: a host reached with ssh as ``user`` on ``port``, and the receiver's Python.
    Every value is checked here, since it becomes part of an ssh command line."""

    def __init__(self, host, user="root", port=22, ssh_args=(), python="python3", io_timeout=120, become=False):
        host = str(host or "")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address as an inventory may write it; ssh wants it bare
        if not HOST_RE.match(host) or host.startswith("-"):
            raise InvalidTarget("transfer host %r is not a host name or address" % host, stage="preflight")
        if not USER_RE.match(str(user or "")):
            raise InvalidTarget("transfer user %r is not a user name" % user, stage="preflight")
        if not PYTHON_RE.match(str(python or "")) or str(python).startswith("-"):
            raise InvalidTarget("transfer python %r must be a command name or an absolute path" % python,
                                stage="preflight")
        if not 0 < int(port) < 65536:
            raise InvalidTarget("transfer port %r is out of range" % port, stage="preflight")
        if int(io_timeout) < 1:
            raise InvalidTarget("io_timeout must be at least 1 second, got %r" % io_timeout, stage="preflight")
        self.host, self.user, self.port = host, str(user), int(port)
        self.ssh_args, self.python, self.io_timeout = [str(a) for a in ssh_args or ()], str(python), int(io_timeout)
        # A user other than root reaches the receiver through a passwordless sudo (the inventory's become):
        # it writes into root's image and journal directories.
        self.become = bool(become) and self.user != "root"

    def remote_command(self, *words):
        """The shell command that runs ``words`` on the target, through sudo when the target becomes root."""
        return "exec " + " ".join((["sudo", "-n", "--"] if self.become else []) + [shlex.quote(w) for w in words])

    def ssh(self):
        # The user's ssh arguments first: for ssh, the first value given for an option wins. AES-GCM is
        # preferred over OpenSSH's default chacha20-poly1305: on the CI kind of machine (AES-NI) one ssh
        # stream moved 1.06 GB/s with aes128-gcm against 0.69 GB/s with chacha20 (docs/benchmarks).
        # A target that stops answering is given up after about io_timeout seconds (the source may be
        # frozen meanwhile); one that does not answer at all, after the connect timeout.
        interval = max(1, min(15, self.io_timeout // 3))
        return ["ssh"] + self.ssh_args + [
            "-p", str(self.port), "-l", self.user, "-o", "BatchMode=yes", "-o", "Compression=no",
            "-o", "Ciphers=" + FAST_CIPHERS, "-o", "ServerAliveInterval=%d" % interval,
            "-o", "ServerAliveCountMax=%d" % max(1, self.io_timeout // interval),
            "-o", "ConnectTimeout=%d" % min(30, max(5, self.io_timeout)), "--", self.host]

    def __str__(self):
        return self.host
