# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The only place that starts commands: argv lists, timeouts, errors that carry cmd/rc/stdout/stderr."""
from __future__ import annotations

import os
import signal
import shutil
import subprocess
import time

from .errors import CommandError, GpuCkptError

# Where root-only tools live on hosts whose PATH (ssh, cron, AWX) leaves out the sbin dirs.
EXTRA_BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def find_binary(name, explicit=None, required=True, what=None):
    """Return the path of ``name`` (or ``explicit`` when given), else raise a clear error."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise GpuCkptError("%s not found or not executable at %s" % (name, explicit), stage="preflight")
    found = shutil.which(name)
    if not found:
        for d in EXTRA_BIN_DIRS:
            cand = os.path.join(d, name)
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                found = cand
                break
    if not found and required:
        raise GpuCkptError("%s is not installed on this host (searched PATH and %s)"
                           % (name, ", ".join(EXTRA_BIN_DIRS)), stage="preflight",
                           hint=what or "install it (roles: gpuckpt.fleet.criu) or pass its path")
    return found


class Result(object):
    __slots__ = ("cmd", "rc", "stdout", "stderr", "seconds")

    def __init__(self, cmd, rc, stdout, stderr, seconds):
        self.cmd, self.rc, self.stdout, self.stderr, self.seconds = cmd, rc, stdout, stderr, seconds


def _tail(text, limit=4000):
    text = text or ""
    return text if len(text) <= limit else "...(cut)...\n" + text[-limit:]


def kill_command(proc, group):
    """Kill a command that ran past its time: with ``group`` (it has a session of its own) its whole
    process group, so that a hung helper (CRIU under runc) goes with it."""
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:
        pass


def run(cmd, timeout=None, check=True, stage=None, pid=None, env=None, cwd=None, hint=None, input_text=None,
        new_session=False):
    """Run ``cmd`` (an argv list), never through a shell. Raises CommandError when check and rc != 0.
    ``new_session``: start it in a session of its own, detached from the caller's (ssh) session."""
    cmd = [str(c) for c in cmd]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                                universal_newlines=True, start_new_session=new_session,
                                stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL)
    except OSError as exc:
        raise CommandError("cannot run %s: %s" % (cmd[0], exc), stage=stage, pid=pid, cmd=cmd, hint=hint)
    try:
        out, err = proc.communicate(input=input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_command(proc, new_session)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something outside its group still holds its pipes
            out, err = "", ""
        raise CommandError("%s timed out after %ss and was killed" % (os.path.basename(cmd[0]), timeout),
                           stage=stage, pid=pid, cmd=cmd, rc=None, stdout=_tail(out), stderr=_tail(err), hint=hint)
    res = Result(cmd, proc.returncode, out, err, time.monotonic() - start)
    if check and proc.returncode != 0:
        raise CommandError("%s exited with rc=%d" % (os.path.basename(cmd[0]), proc.returncode), stage=stage,
                           pid=pid, cmd=cmd, rc=proc.returncode, stdout=_tail(out), stderr=_tail(err), hint=hint)
    return res


def run_detaching(cmd, stdout, stderr, timeout=None, env=None):
    """Run a command that leaves a daemon behind (``runc restore --detach``, ``runsc restore -detach``),
    its output to ``stdout``/``stderr`` (files or pipes the caller reads: the daemon inherits them, so
    they are never this function's pipes). It runs in a session of its own: past ``timeout`` seconds
    it is killed with its whole process group (the CRIU it started). Returns its exit status, or None
    when it was killed."""
    proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_command(proc, True)
        proc.wait()
        return None
