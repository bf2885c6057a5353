# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A gVisor (runsc) sandbox, checkpointed and restored by runsc itself.

A sandbox runs its processes on gVisor's own kernel: the host sees only the sandbox (runsc-sandbox and
its stubs), never the workload's processes, so neither CRIU nor the host's driver can reach them. So:
- the CUDA stage runs INSIDE the sandbox: ``runsc exec <id> <tool> --action lock|checkpoint|restore|
  unlock --pid <pid>`` with the sandbox's own pids, found with ``runsc ps`` and ``--get-state`` (a
  process the driver does not know answers an error). The tool is a cuda-checkpoint: NVIDIA's, or the
  collection's own (roles/cuda_checkpoint/files/cuda_checkpoint.c, built to run on any glibc), bind-mounted
  read-only into the container (``cuda_checkpoint_path`` inside; see docs/runtimes.md for the spec entry).
  The engine keeps its rules (all locked before any checkpoint, all restored before any unlock, rollback
  on any failure); only where the calls run changes (SandboxCuda below).
- RAM and CPU state: ``runsc checkpoint --image-path`` (gVisor saves its whole kernel: processes, tmpfs,
  sockets), ``runsc restore --image-path --bundle`` (a new sandbox from the image).
- after=exit:    ``runsc checkpoint``; the stopped container is deleted so that its id is free again
- after=running: ``runsc checkpoint -leave-running``
- after=stopped: ``runsc pause``, then ``runsc checkpoint -leave-running``: the sandbox stays paused
  until ``runsc resume`` (roll back) or ``runsc delete -force`` (commit).
The workload's host pids are the sandbox's own process (one identity for the journal); its CUDA pids
are the sandbox's pids, which a restore keeps.

Newer runsc releases (release-20260608 and later) can run the CUDA stage themselves: ``runsc checkpoint
--cuda-checkpoint-path`` toggles every CUDA process inside the sandbox (lock + checkpoint each, in
parallel) before saving it, and its restore toggles them back. ``cuda_stage="runsc"`` uses that (the
flag is looked for in ``runsc help checkpoint`` and its absence refused before anything is frozen);
the order and the failure handling of the CUDA stage are then runsc's, and the engine checks the CUDA
processes run after a restore. The default, ``engine``, keeps the stage here.
GPU sandboxes need runsc's nvproxy to support the host's driver (580.x from release-20260608).
"""
from __future__ import annotations

import json
import os
import re
import time
from ..cuda import processes as gpu_procs
from ..cuda import driver as cuda
from ..core.errors import CommandError, DriverError, DriverUnavailable, GpuCkptError, InvalidTarget
from .cli import RuntimeCli
from .base import ContainerBackend
from .oci import OciCliBackend

DEFAULT_TOOL = "/usr/local/bin/cuda-checkpoint"  # where the seeds' runsc integration mounts it
TOOL_ERROR = re.compile(r"failed for pid (\d+): (\S+) \((\d+)\)")
EXEC_TIMEOUT = 120.0  # seconds for one tool call inside the sandbox (a lock waits for running kernels)


class SandboxCuda(cuda.StateQueries):
    """The driver's checkpoint calls for processes inside a sandbox: each runs the cuda-checkpoint tool
    there (``runsc exec``), with the sandbox's pids. It answers like driver.CudaDriver, so that the
    engine's steps and undos stay the same; device facts come from the host's driver when it loads."""

    def __init__(self, backend, libcuda_path=None, host_driver=None):
        self.backend, self.libcuda_path, self.host = backend, libcuda_path, host_driver
        self.calls = []
        self.api_version = host_driver.api_version if host_driver else 0

    @property
    def tool(self):
        """The tool's path inside the sandbox: the backend's, which a restore takes from the image."""
        return self.backend.tool

    def device_uuids(self):
        return self.host.device_uuids() if self.host else []

    def info(self):
        out = dict(self.host.info()) if self.host else {"checkpoint_api": None}
        out.update(where="inside the sandbox", tool=self.tool)
        return out

    def _tool(self, call, pid, args, stage, timeout=EXEC_TIMEOUT):
        env = ["GPUCKPT_LIBCUDA=%s" % self.libcuda_path] if self.libcuda_path else []
        start = time.monotonic()
        res = self.backend.exec_in(env, [self.tool] + list(args) + ["--pid", str(pid)], timeout=timeout, stage=stage)
        secs = time.monotonic() - start
        self.calls.append({"call": call, "pid": pid, "seconds": secs, "rc": res.rc})
        if res.rc == 0:
            return res.stdout.strip(), secs
        err = (res.stderr or res.stdout or "").strip()
        m = TOOL_ERROR.search(err)
        if res.rc == 1 and m:
            code = int(m.group(3))
            raise DriverError(call, code, m.group(2), pid=pid, stage=stage, hint=cuda.unsupported_hint(code))
        if res.rc == 3:
            raise DriverUnavailable("inside sandbox %s: %s" % (self.backend.container, err[-300:]), stage=stage,
                                    pid=pid, hint="the NVIDIA driver's libraries must be visible inside the sandbox "
                                                  "(nvproxy), driver 570 or newer")
        raise CommandError("the cuda-checkpoint tool %s could not run inside sandbox %s (rc=%s): %s"
                           % (self.tool, self.backend.container, res.rc, err[-300:]), stage=stage, pid=pid,
                           cmd=res.cmd, rc=res.rc, stderr=err[-2000:],
                           hint="bind-mount a cuda-checkpoint (NVIDIA's, or the collection's: the cuda_checkpoint "
                                "role builds it) read-only at %s in the container's spec, or set "
                                "cuda_checkpoint_path" % self.tool)

    def get_state(self, pid):
        out, _secs = self._tool("cuCheckpointProcessGetState", pid, ["--get-state"], "preflight")
        names = {v: k for k, v in cuda.STATE_NAMES.items()}
        return names.get(out.split()[-1] if out else "", -1)

    def cuda_state(self, pid):
        """As the driver's; a sandbox without a usable driver inside and without NVIDIA devices in its spec
        is a CPU sandbox (None), one with devices is an error."""
        try:
            return super(SandboxCuda, self).cuda_state(pid)
        except DriverUnavailable:
            if self.backend.gpu_in_spec():
                raise
            return None

    def lock(self, pid, timeout_ms=30000):
        return self._tool("cuCheckpointProcessLock", pid, ["--action", "lock", "--timeout", str(int(timeout_ms))],
                          "lock", timeout=EXEC_TIMEOUT + timeout_ms / 1000.0)[1]

    def checkpoint(self, pid):
        return self._tool("cuCheckpointProcessCheckpoint", pid, ["--action", "checkpoint"], "checkpoint")[1]

    def restore(self, pid, gpu_pairs=None):
        args = ["--action", "restore"]
        if gpu_pairs:
            args += ["--device-map", ",".join("%s=%s" % (o, n) for o, n in gpu_pairs)]
        return self._tool("cuCheckpointProcessRestore", pid, args, "cuda-restore")[1]

    def unlock(self, pid):
        return self._tool("cuCheckpointProcessUnlock", pid, ["--action", "unlock"], "unlock")[1]


class _CudaStageCapabilities(object):
    """RunscBackend.capabilities, two fixed records: held by runsc pause; gVisor saves its own kernel, and its
    processes are out of the host's sight. owns_cuda_stage is the backend's CUDA stage (runsc_cuda_stage, then the
    image's own, see bind); read on the class, the engine's (the default)."""
    ENGINE = ContainerBackend.capabilities._replace(can_hold_stopped=True, uses_criu=False, cuda_in_sandbox=True)
    RUNSC = ENGINE._replace(owns_cuda_stage=True)

    def __get__(self, backend, cls=None):
        return self.RUNSC if backend is not None and backend.cuda_stage == "runsc" else self.ENGINE


class RunscBackend(OciCliBackend):
    name = "runsc"
    capabilities = _CudaStageCapabilities()
    root_record = "runsc_root"
    list_format = "-format"
    cuda_stage = "engine"  # who runs the CUDA stage: the engine, or runsc's own checkpoint and restore
    passes_criu_flags = ()

    def __init__(self, runsc_path=None, root=None, bundle=None, runsc_flags=(), tool=None, timeout=None,
                 cuda_stage="engine", tcp_established=False):
        super(RunscBackend, self).__init__(None, (), timeout, tcp_established=tcp_established)
        if cuda_stage not in ("engine", "runsc"):
            raise InvalidTarget("runsc_cuda_stage must be engine or runsc, got %r" % cuda_stage, stage="preflight")
        # runsc: runsc's own checkpoint and restore run the CUDA stage (release-20260608 and later)
        self.cuda_stage = cuda_stage
        self.runsc_path, self.root, self.bundle = runsc_path, root, bundle
        self.runsc_flags = [str(f) for f in (runsc_flags or ())]
        for flag in self.runsc_flags:
            if not flag.startswith("--") or flag.split("=", 1)[0] in ("--root",):
                raise InvalidTarget("runsc_flags takes runsc's global flags as --name=value (not %r; the root is "
                                    "runsc_root); nothing was done" % flag, stage="preflight")
        self.tool = tool or DEFAULT_TOOL
        self._bundle_seen = self.sandbox_host_pid = None
        self.driver = None
        self.cli = self._make_cli()

    # -- the runsc command line ---------------------------------------------------------------------------
    def _make_cli(self):
        """runsc with its state's root and the user's global flags (made again when bind takes the image's)."""
        return RuntimeCli("runsc", self.runsc_path, "install gVisor's runsc, or pass runsc_path",
                          (["--root", self.root] if self.root else []) + self.runsc_flags)

    def exec_in(self, env, argv, timeout=None, stage=None):
        """Run ``argv`` inside the container (its namespaces, root and environment, plus ``env``)."""
        args = ["exec"]
        for e in env:
            args += ["-env", e]
        return self.cli.run(*(args + [self.container] + list(argv)), timeout=timeout, check=False, stage=stage)

    def sandbox_pids(self):
        res = self.cli.run("ps", "-format", "json", self.container, stage="preflight")
        return [int(p) for p in json.loads(res.stdout or "[]") or []]

    # -- what the engine asks of a sandbox -----------------------------------------------------------------
    def load_cuda(self, libcuda_path):
        """The CUDA calls for this sandbox's processes (inside it); the host's driver only for facts."""
        host, _problem = cuda.load(libcuda_path)
        self.driver = SandboxCuda(self, libcuda_path or os.environ.get("GPUCKPT_LIBCUDA"), host)
        return self.driver, None

    def cuda_candidates(self, root, pids):
        """The sandbox's pids, the ones the tool is asked about. A sandbox that has no tool and no NVIDIA
        device in its spec is a CPU sandbox: no candidates (the GPU stage is skipped)."""
        inside = self.sandbox_pids()
        if inside and not self.gpu_in_spec():
            probe = self.exec_in([], [self.tool, "--help"], timeout=30, stage="preflight")
            if probe.rc != 0:
                return []
        return inside

    def gpu_in_spec(self):
        """Whether the sandbox uses NVIDIA GPUs, as far as the host can tell: NVIDIA devices in its spec (the
        container toolkit's CDI puts them there), nvproxy among runsc's flags, or NVIDIA device files open
        in the sandbox's own host process (nvproxy opens them on the host)."""
        try:
            with open(os.path.join(self._bundle_seen or self.bundle or "", "config.json")) as fh:
                spec = json.load(fh)
        except (OSError, ValueError):
            spec = {}
        devices = ((spec.get("linux") or {}).get("devices") or [])
        if any("nvidia" in (d.get("path") or "") for d in devices):
            return True
        if any(f.startswith("--nvproxy") and not f.endswith("=false") for f in self.runsc_flags):
            return True
        return bool(self.sandbox_host_pid and gpu_procs.nvidia_fds(self.sandbox_host_pid))

    def plan_tree(self, pids, internal_tcp=False):
        """runsc saves its own kernel's state (files, sockets, TCP included): there are no CRIU flags."""
        self.auto_flags, self.criu_needs = [], {}
        return []

    def criu_flags(self, manifest=None):
        return []

    # -- Backend ---------------------------------------------------------------------------------------------
    def present(self):
        return self.cli.installed() and os.path.isdir(self.root or "/var/run/runsc")

    def preflight(self, full=True):
        res = self.cli.run("--version", stage="preflight")
        facts = {"runsc_version": res.stdout.splitlines()[0].split()[-1] if res.stdout else None,
                 "runsc_flags": self.runsc_flags}
        if full or self.capabilities.owns_cuda_stage:
            helptext = self.cli.run("help", "checkpoint", stage="preflight", check=False)
            facts["runsc_cuda_checkpoint_flag"] = "cuda-checkpoint-path" in (helptext.stdout + helptext.stderr)
            if self.capabilities.owns_cuda_stage and not facts["runsc_cuda_checkpoint_flag"]:
                raise InvalidTarget("runsc_cuda_stage is runsc, but this runsc (%s) has no --cuda-checkpoint-path (gVisor "
                                    "release-20260608 and later have it); nothing was frozen" % facts["runsc_version"],
                                    stage="preflight", hint="upgrade runsc, or leave runsc_cuda_stage at engine")
        return facts

    def runtime_facts(self):
        return self.preflight(full=False)

    def resolve(self, target):
        st = self.running_state(target)
        self.sandbox_host_pid = pid = int(st["pid"])
        return pid, [pid]

    def dump(self, target, image_dir, work_dir, after):
        if after == "stopped":
            self.cli.run("pause", self.container, stage="runtime-dump")
        args = ["checkpoint", "-image-path", image_dir]
        if self.capabilities.owns_cuda_stage:  # runsc toggles every CUDA process inside the sandbox with the tool there
            args.append("--cuda-checkpoint-path=%s" % self.tool)
        if after in ("running", "stopped"):
            args.append("-leave-running")
        try:
            res = self.cli.run(*(args + [self.container]), stage="runtime-dump", timeout=self.timeout,
                               new_session=True)
        except CommandError:
            if after == "stopped":
                self.cli.run("resume", self.container, stage="runtime-dump", check=False)
            raise
        if after == "exit":  # the sandbox is gone; free its id for a restore here (a rollback)
            self.cli.run("delete", "-force", self.container, stage="runtime-dump", check=False)
        return {"backend": self.name, "container": self.container, "root_pid": int(target),
                "bundle": self._bundle_seen, "runsc_root": self.root, "runsc_flags": self.runsc_flags,
                "cuda_checkpoint_path": self.tool, "cuda_stage": "runsc" if self.capabilities.owns_cuda_stage else "engine",
                "runsc_seconds": round(res.seconds, 6)}

    def restore(self, image_dir, work_dir, manifest):
        bundle = self.restore_bundle(manifest)
        # The sandbox that `runsc restore -detach` leaves behind inherits its stdio: a pipe would never
        # reach its end, so both go to the container's log (gVisor, unlike CRIU, takes files as stdio).
        log_path = os.path.join(work_dir, "container.log")
        log = open(log_path, "ab")
        start = log.tell()
        args = ["restore", "-detach", "-image-path", image_dir, "-bundle", bundle, self.container]
        try:
            rc = self.cli.run_detaching(args, log, log, timeout=self.timeout)
        finally:
            log.close()
        if rc != 0:
            self.remove()  # a half-made sandbox must not stay
            with open(log_path, "rb") as fh:
                fh.seek(start)
                said = fh.read().decode("utf-8", "replace")[-3000:]
            what = ("did not finish within runtime_timeout (%ss)" % self.timeout if rc is None
                    else "exited with rc=%d" % rc)
            raise CommandError("runsc restore %s" % what,
                               stage="runtime-restore", cmd=self.cli.argv(*args), rc=rc, stderr=said,
                               hint="see container.log in the work dir")
        st = self.state(self.container)
        return [int(st["pid"])]

    def map_pids(self, manifest, new_pids):
        """The sandbox keeps its pids: the CUDA pids are the dumped ones, if the sandbox has them."""
        want = list(manifest["target"]["cuda_pids"])
        if want:
            have = set(self.sandbox_pids())
            missing = [p for p in want if p not in have]
            if missing:
                raise GpuCkptError("the restored sandbox has no process %s (it has %s)" % (missing[0], sorted(have)),
                                   stage="runtime-restore")
        return want

    def bind(self, manifest):
        super(RunscBackend, self).bind(manifest)
        rt = manifest.get("runtime") or {}
        if not self.runsc_flags:
            self.runsc_flags = list(rt.get("runsc_flags") or [])
        self.cli = self._make_cli()
        if self.tool == DEFAULT_TOOL and rt.get("cuda_checkpoint_path"):
            self.tool = rt["cuda_checkpoint_path"]
        if rt.get("cuda_stage"):
            # The image says who restores its CUDA processes, whatever this host's runsc_cuda_stage says: an
            # image whose CUDA stage the engine ran, restored with runsc's stage, would stay checkpointed.
            self.cuda_stage = "runsc" if rt["cuda_stage"] == "runsc" else "engine"

    def is_held(self, pids):
        st = self.state(self.container, required=False) if self.container else None
        return st is None or st.get("status") == "paused"

    def resume(self, pids):
        st = self.state(self.container, required=False) if self.container else None
        if st and st.get("status") == "paused":
            self.cli.run("resume", self.container, stage="resume-source")

    def remove(self):
        self.cli.run("delete", "-force", self.container, stage="cleanup", check=False)

    def probe(self, root_pid, argv, timeout, stage="probe"):
        """The user's probe or quiesce command, run inside the sandbox (``runsc exec``): the host cannot
        enter a gVisor sandbox's namespaces."""
        return self.exec_in([], argv, timeout=timeout, stage=stage)
