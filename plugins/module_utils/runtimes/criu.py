# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""CRIU: find it, require 4.x, `criu check`, dump and restore a process tree."""
from __future__ import annotations

import os
import re

from ..core.errors import CommandError, GpuCkptError
from ..core.run import find_binary, run

MIN_VERSION = (4, 0)


def log_excerpt(path, limit=25):
    """The lines of a CRIU log a person needs: its errors, else its last lines."""
    try:
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ""
    # "Can't setup RLIMIT_NOFILE" is harmless (hosts without CAP_SYS_RESOURCE): leave it out.
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    picked = (errors or lines)[-limit:]
    return "\n".join(picked)


class Criu(object):
    def __init__(self, path=None):
        self.path = find_binary("criu", path, what="install CRIU 4.x (role gpuckpt.fleet.criu) or set criu_path")
        self._version = None

    def version(self):
        if self._version is None:
            res = run([self.path, "--version"], timeout=30, stage="preflight")
            m = re.search(r"Version:\s*([0-9][0-9.]*)", res.stdout)
            if not m:
                raise GpuCkptError("cannot read CRIU's version from %r" % res.stdout.strip(), stage="preflight",
                                   cmd=res.cmd)
            self._version = m.group(1)
        return self._version

    def require_version(self):
        v = self.version()
        parts = tuple(int(x) for x in v.split(".")[:2])
        if parts < MIN_VERSION:
            raise GpuCkptError("CRIU %s at %s is too old: gpuckpt.fleet needs CRIU %d.%d or newer"
                               % (v, self.path, MIN_VERSION[0], MIN_VERSION[1]), stage="preflight",
                               hint="install CRIU 4.x (role gpuckpt.fleet.criu)")
        return v

    def check(self):
        """`criu check`: returns (ok, output)."""
        res = run([self.path, "check"], timeout=60, check=False, stage="preflight")
        out = (res.stdout + res.stderr).strip()
        return res.rc == 0, out

    def dump(self, pid, images_dir, work_dir, after="exit", shell_job=False, extra=(), timeout=None):
        """``after``: what becomes of the tree once dumped: exit (CRIU kills it), running, or stopped."""
        cmd = [self.path, "dump", "-t", pid, "-D", images_dir, "-W", work_dir, "-o", "dump.log", "-v2"]
        if after == "running":
            cmd.append("--leave-running")
        elif after == "stopped":
            cmd.append("--leave-stopped")
        if shell_job:
            cmd.append("--shell-job")
        cmd.extend(extra)
        return self._run(cmd, os.path.join(work_dir, "dump.log"), "criu-dump", pid, timeout)

    def restore(self, images_dir, work_dir, shell_job=False, extra=(), timeout=None, gate=None):
        """``gate``: a criu_gate.RestoreGate that holds the restored tree until the engine's verdict."""
        pidfile = os.path.join(work_dir, "restore.pid")
        if os.path.exists(pidfile):
            os.unlink(pidfile)
        cmd = [self.path, "restore", "-D", images_dir, "-W", work_dir, "-o", "restore.log", "-v2",
               "--restore-detached", "--pidfile", pidfile]
        if shell_job:
            cmd.append("--shell-job")
        cmd.extend(extra)
        if gate is not None:
            cmd.extend(gate.criu_args)
        # A shell job is restored into criu's own session: give criu a new one, or the workload would
        # belong to the ssh session of the module and die of SIGHUP when that session ends.
        res = self._run(cmd, os.path.join(work_dir, "restore.log"), "criu-restore", None, timeout, new_session=True)
        with open(pidfile) as fh:
            return int(fh.read().strip()), res

    def _run(self, cmd, log, stage, pid, timeout, new_session=False):
        try:
            return run(cmd, timeout=timeout, stage=stage, pid=pid, new_session=new_session)
        except CommandError as exc:
            exc.stderr = ((exc.stderr or "") + "\n--- %s ---\n%s" % (log, log_excerpt(log))).strip()
            raise
