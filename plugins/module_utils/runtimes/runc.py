# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A runc container, checkpointed and restored by runc (which drives CRIU).

The CUDA stage stays the engine's: the driver resolves pids in the host's pid namespace (measured on
driver 580), so the engine works on the container's host pids, found through ``runc state``.

- after=exit:    ``runc checkpoint`` (the container is gone afterwards; ``runc restore`` recreates it)
- after=running: ``runc checkpoint --leave-running``
- after=stopped: ``runc pause``, then ``runc checkpoint --leave-running``: the container stays frozen
  (cgroup freezer) until ``runc resume`` (roll back) or ``runc delete --force`` (commit).
A restored container's stdout and stderr go to a pipe read by a small detached relay that appends to
``<work dir>/container.log``: CRIU can only dump a container whose stdio are pipes, never host files.
"""
from __future__ import annotations

import json
import os
import subprocess

from .. import discovery
from ..errors import CommandError, InvalidTarget
from ..run import find_binary, kill_command, run
from .base import ContainerBackend, ns_pid


class RuncBackend(ContainerBackend):
    name = "runc"
    can_hold_stopped = True  # paused (cgroup freezer)

    def __init__(self, runc_path=None, root=None, bundle=None, criu_path=None, criu_options=(), timeout=None):
        super(RuncBackend, self).__init__(criu_path, criu_options, timeout)
        self.runc_path = runc_path
        self.root = root
        self.bundle = bundle

    # -- helpers -------------------------------------------------------------------------------
    def _runc(self):
        return find_binary("runc", self.runc_path, what="install runc, or pass runc_path")

    def _cmd(self, *args):
        cmd = [self._runc()]
        if self.root:
            cmd += ["--root", self.root]
        return cmd + list(args)

    def state(self, container, required=True):
        res = run(self._cmd("state", container), stage="preflight", check=False)
        if res.rc != 0:
            if not required:
                return None
            where = " under root %s" % self.root if self.root else ""
            raise InvalidTarget("no runc container %r%s: %s" % (container, where, (res.stderr or res.stdout).strip()[:300]),
                                stage="preflight", hint="check the id (runc list) and runc_root")
        return json.loads(res.stdout)

    def _criu_flags(self):
        # runc passes its own options to CRIU; ours go through a CRIU configuration file only, so
        # only the flags runc knows are offered here.
        out = []
        for opt in self.extra:
            if opt in ("--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks"):
                out.append(opt)
            else:
                raise InvalidTarget("criu option %s cannot be passed through runc (runc accepts --tcp-established, "
                                    "--ext-unix-sk, --shell-job, --file-locks)" % opt, stage="preflight")
        return out

    # -- Backend ---------------------------------------------------------------------------------
    def runtime_facts(self):
        res = run(self._cmd("--version"), stage="preflight")
        return {"runc_version": res.stdout.splitlines()[0].split()[-1] if res.stdout else None}

    def resolve(self, target):
        self.container = str(target)
        st = self.state(self.container)
        if st.get("status") != "running":
            raise InvalidTarget("runc container %s is %s, not running; nothing was frozen"
                                % (self.container, st.get("status")), stage="preflight",
                                hint="resume or start it first")
        pid = int(st["pid"])
        self._bundle_seen = st.get("bundle")
        tree = discovery.process_tree(pid)
        self._ns = {str(p): ns_pid(p) for p in tree}
        return pid, tree

    def dump(self, target, image_dir, work_dir, after):
        self._criu_flags()
        if after == "stopped":
            run(self._cmd("pause", self.container), stage="runtime-dump")
        args = ["checkpoint", "--image-path", image_dir, "--work-path", work_dir]
        if after in ("running", "stopped"):
            args.append("--leave-running")
        args += self._criu_flags() + [self.container]
        try:
            res = run(self._cmd(*args), stage="runtime-dump", timeout=self.timeout, new_session=True,
                      hint="see dump.log in the work dir")
        except CommandError as exc:
            log = os.path.join(work_dir, "dump.log")
            if os.path.exists(log):
                with open(log, errors="replace") as fh:
                    exc.stderr = (exc.stderr or "") + "\n--- %s ---\n" % log + "".join(
                        [ln for ln in fh if "Error" in ln][-15:])
            if after == "stopped":
                run(self._cmd("resume", self.container), stage="runtime-dump", check=False)
            raise
        return {"backend": self.name, "container": self.container, "root_pid": int(target),
                "bundle": self._bundle_seen, "runc_root": self.root, "ns_pids": self._ns,
                "criu_options": self.extra, "criu_seconds": round(res.seconds, 6)}

    def restore(self, image_dir, work_dir, manifest):
        rt = manifest.get("runtime") or {}
        self.container = rt.get("container") or self.container
        bundle = self.bundle or rt.get("bundle")
        if not bundle or not os.path.isfile(os.path.join(bundle, "config.json")):
            raise InvalidTarget("runc bundle %s has no config.json on this host: the container's bundle (rootfs "
                                "and config) must be there to restore it" % bundle, stage="preflight",
                                hint="copy the bundle to the target, or pass bundle")
        if self.state(self.container, required=False):
            raise InvalidTarget("a runc container %s already exists on this host; refusing to start a second copy"
                                % self.container, stage="preflight",
                                hint="delete it (runc delete) if it is a leftover, or restore elsewhere")
        log = open(os.path.join(work_dir, "container.log"), "ab")
        # The relay holds the read end of the container's stdio pipe and outlives this module.
        relay = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
        log.close()
        try:
            args = ["restore", "--detach", "--image-path", image_dir, "--work-path", work_dir, "--bundle", bundle]
            args += self._criu_flags() + [self.container]
            # A session of its own: a restore that runs past runtime_timeout is killed with its CRIU.
            proc = subprocess.Popen(self._cmd(*args), stdin=subprocess.DEVNULL, stdout=relay.stdin,
                                    stderr=relay.stdin, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                kill_command(proc, True)
                proc.wait()
                rc = None
        finally:
            relay.stdin.close()
        if rc != 0:
            rlog = os.path.join(work_dir, "restore.log")
            lines = []
            if os.path.exists(rlog):
                with open(rlog, errors="replace") as fh:
                    lines = fh.readlines()
            if rc is None:  # hung: where CRIU stopped says more than its (absent) errors
                raise CommandError("runc restore did not finish within runtime_timeout (%ss) and was killed with "
                                   "its CRIU" % self.timeout, stage="runtime-restore", cmd=self._cmd(*args),
                                   stderr="".join(lines[-8:]), hint="see restore.log in the work dir")
            raise CommandError("runc restore exited with rc=%d" % rc, stage="runtime-restore",
                               cmd=self._cmd(*args), rc=rc, stderr="".join([ln for ln in lines if "Error" in ln][-15:]))
        st = self.state(self.container)
        return discovery.process_tree(int(st["pid"]))

    def bind(self, manifest):
        super(RuncBackend, self).bind(manifest)
        if self.root is None:
            self.root = (manifest.get("runtime") or {}).get("runc_root")

    def is_held(self, pids):
        st = self.state(self.container, required=False) if self.container else None
        return st is None or st.get("status") == "paused"

    def resume(self, pids):
        if self.container:
            run(self._cmd("resume", self.container), stage="resume-source", check=False)

    def remove(self):
        run(self._cmd("delete", "--force", self.container), stage="cleanup", check=False)
