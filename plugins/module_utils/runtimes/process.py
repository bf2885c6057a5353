# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A bare process tree on the host, dumped and restored by CRIU."""
from __future__ import annotations

import os
import signal

from ..core import procfs
from .criu import Criu
from ..core.errors import InvalidTarget
from .base import Backend, criu_preflight


class ProcessBackend(Backend):
    name = "process"
    # CRIU restores the tree under its own pids, in the host's pid namespace; its restore takes a gate
    capabilities = Backend.capabilities._replace(restores_host_pids=True, gates_restore=True)

    def __init__(self, criu_path=None, criu_options=(), timeout=None, tcp_established=False):
        self.criu = Criu(criu_path)
        self.extra = list(criu_options or ())
        self.timeout = timeout
        self.tcp_established = bool(tcp_established)
        self._shell_job = False  # resolve() decides

    def preflight(self, full=True):
        return criu_preflight(self.criu, full)

    def resolve(self, target):
        st = procfs.validate_target(int(target))
        tree = procfs.process_tree(int(target))
        self._refuse_foreign_session(tree)
        # CRIU dumps a session or process group only when its leader is inside the tree; otherwise
        # (a terminal, or a daemon that is not a session leader) it must treat them as external.
        self._shell_job = (st["tty_nr"] != 0 or st["session"] not in tree or st["pgrp"] not in tree)
        return int(target), tree

    @staticmethod
    def _refuse_foreign_session(tree):
        """A session or process group id of 0 means its leader lives outside this pid namespace (a
        process started by `docker exec`, `kubectl exec` or a CI runner without setsid). CRIU refuses
        to dump it even as a shell job, so refuse here, before anything is frozen."""
        for pid in tree:
            st = procfs.read_stat(pid)
            if st is not None and (st["session"] == 0 or st["pgrp"] == 0):
                raise InvalidTarget(
                    "pid %d (%s) has its session or process-group leader outside this pid namespace "
                    "(its session id reads 0 here); CRIU cannot dump such a process; nothing was frozen"
                    % (pid, st["comm"]), stage="preflight", pid=pid,
                    hint="start the workload in its own session (setsid, or start_new_session=True), "
                         "or run the checkpoint from the pid namespace that holds its session leader")

    def dump(self, target, image_dir, work_dir, after):
        shell_job = self._shell_job
        res = self.criu.dump(int(target), image_dir, work_dir, after=after,
                             shell_job=shell_job, extra=self.criu_flags(), timeout=self.timeout)
        return {"backend": self.name, "root_pid": int(target), "shell_job": shell_job,
                "criu_options": self.extra, "auto_flags": list(self.auto_flags), "criu_seconds": res.seconds}

    def restore(self, image_dir, work_dir, manifest, gate=None):
        rt = manifest.get("runtime") or {}
        root, _res = self.criu.restore(image_dir, work_dir, shell_job=rt.get("shell_job", False),
                                       extra=self.criu_flags(manifest), timeout=self.timeout, gate=gate)
        return procfs.process_tree(root)

    def resume(self, pids):
        """Let a tree left stopped by a dump run again."""
        _signal_each(pids, signal.SIGCONT)

    def kill(self, pids):
        _signal_each(pids, signal.SIGKILL)
        procfs.wait_gone(pids, 10)


def _signal_each(pids, signum):
    """Send the signal to every pid; one that is already gone (or no longer ours to signal) is passed over."""
    for p in pids:
        try:
            os.kill(p, signum)
        except OSError:
            pass
