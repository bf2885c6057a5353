# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A checkpoint's plan: everything decided before anything is touched (the preflight).

The tree, its CUDA pids and their states, each process's state and identity, what the runtime and
CRIU need, the GPUs each CUDA process holds, the host's facts for the manifest. Whatever the workload
or its runtime cannot go through is refused here with InvalidTarget, before anything is frozen.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket

from ..core import image
from ..core import procfs, sockets
from ..core.errors import DriverUnavailable, InvalidTarget
from ..core.journal import identities
from ..cuda import devices as gpu_devices
from ..cuda import driver as cuda
from ..cuda import nccl
from ..cuda import processes as gpu_procs
from ..cuda import usage as gpu_usage
from . import cooperative, quiesce

IMAGE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


class CheckpointOptions(object):
    """What a checkpoint may be told; every option has a default."""

    def __init__(self, leave_running=False, leave_stopped=False, lock_timeout=30.0, libcuda_path=None,
                 check_mode=False, sign_key=None, parallel=True, progress_file=None, nonce=None,
                 journal_wait=30.0, host_huge_pages=False, quiesce_signal=None, quiesce_command=None,
                 quiesce_timeout=30.0, image_id=None, image_in_memory=False, image_memory_bytes=None,
                 quiesce_mode="release", quiesce_lease=600.0):
        if leave_running and leave_stopped:
            raise InvalidTarget("leave_running and leave_stopped exclude each other", stage="preflight")
        if lock_timeout is None or float(lock_timeout) <= 0:
            raise InvalidTarget("lock_timeout must be positive, got %s" % lock_timeout, stage="preflight")
        self.leave_running, self.leave_stopped = bool(leave_running), bool(leave_stopped)
        self.lock_timeout, self.libcuda_path = float(lock_timeout), libcuda_path
        self.check_mode, self.sign_key, self.parallel = check_mode, sign_key, parallel
        self.progress_file, self.nonce, self.journal_wait = progress_file, nonce, journal_wait
        self.host_huge_pages = bool(host_huge_pages)
        if quiesce_signal and quiesce_command:
            raise InvalidTarget("quiesce_signal and quiesce_command exclude each other", stage="preflight")
        if quiesce_timeout is None or float(quiesce_timeout) <= 0:
            raise InvalidTarget("quiesce_timeout must be positive, got %s" % quiesce_timeout, stage="preflight")
        self.quiesce_mode = quiesce_mode or "release"
        if self.quiesce_mode not in cooperative.MODES:
            raise InvalidTarget("quiesce_mode must be one of %s, got %r" % (", ".join(cooperative.MODES), quiesce_mode),
                                stage="preflight")
        self.quiesce_lease, self.quiesce_timeout = float(quiesce_lease or 0), float(quiesce_timeout)
        self.quiesce_signal = quiesce.signal_number(quiesce_signal) if quiesce_signal else None
        self.cooperative = False
        if self.quiesce_mode == "cooperative":
            self.choose_cooperative(quiesce_command)
        self.quiesce_command = list(quiesce_command) if quiesce_command else None
        # The manifest's id, chosen by the caller when a receiver must know it before the image exists (a
        # protected job's push to its replica checks it); a new uuid otherwise.
        self.image_id = _checked_image_id(image_id)
        # The image in a tmpfs of its own (in_memory.py), sized to ``image_memory_bytes`` or to the estimate.
        self.image_in_memory = bool(image_in_memory)
        self.image_memory_bytes = int(image_memory_bytes) if image_memory_bytes else None

    def choose_cooperative(self, quiesce_command=None):
        """The checkpoint is a cooperative one (quiesce_mode cooperative, or auto with the helper announced)."""
        if quiesce_command or getattr(self, "quiesce_command", None):
            raise InvalidTarget("quiesce_mode cooperative asks the job by a signal; it excludes quiesce_command",
                                stage="preflight")
        if self.quiesce_lease < 2 * self.quiesce_timeout:
            raise InvalidTarget("quiesce_lease (%s) must be at least twice quiesce_timeout (%s): a rank waits that "
                                "long for its resume" % (self.quiesce_lease, self.quiesce_timeout), stage="preflight")
        self.cooperative = True
        self.quiesce_signal = self.quiesce_signal or quiesce.signal_number("SIGUSR1")

    @property
    def after(self):
        return "running" if self.leave_running else "stopped" if self.leave_stopped else "exit"


def _checked_image_id(image_id):
    if image_id is None:
        return None
    text = str(image_id)
    if not IMAGE_ID_RE.match(text):
        raise InvalidTarget("image_id %r must be 1-128 letters, digits, '.', '_' or '-'" % (image_id,), stage="preflight")
    return text


@dataclasses.dataclass
class CheckpointContext(object):
    """What the steps share: the plan (made by plan_checkpoint), and what each step did (for the undos).
    Every field is declared here: a step that sets a name not declared fails (AttributeError)."""
    # -- the plan
    target: object                # what the user named (a pid, a container, a pod)
    image_dir: str
    root: int                     # the workload's root host pid
    pids: list                    # its tree's host pids
    cuda_pids: list
    drv: object                   # the driver's checkpoint API, or None
    host: dict                    # the host's facts for the manifest (host_facts)
    gpu_stage: str
    runtime_facts: dict
    identities: dict              # the tree's process identities (journal.identities)
    states: dict                  # each pid's /proc state before anything was frozen
    cuda_gpus: dict               # each CUDA pid's GPUs (a restore onto other GPUs maps from them)
    after: str                    # exit|running|stopped
    backend: object
    opts: object                  # the CheckpointOptions
    coop: dict = None             # a cooperative checkpoint's request number and ranks
    migration_id: str = None      # the journal's id, in a migration
    calls0: int = 0               # the driver's calls made before the checkpoint (its report counts from here)
    warnings: list = dataclasses.field(default_factory=list)      # the checks the plan could not make, said
    # -- what the steps did
    made: dict = None             # the image directory made (image.prepare_dir), for its undo
    work: str = None              # the image's state directory (image.state_dir)
    in_memory: dict = None        # the image's tmpfs (in_memory.plan), with image_in_memory
    quiesce: dict = None          # what the quiesce (signal, command or cooperative) answered
    frozen_at: float = None       # when the workload was frozen (time.time())
    locked: list = dataclasses.field(default_factory=list)        # CUDA pids locked
    checkpointed: list = dataclasses.field(default_factory=list)  # CUDA pids checkpointed
    hasher: object = None         # the checksums taken while the image is written (chunk_hasher)
    runtime_info: dict = None     # what the runtime's dump returned
    listen_ports: list = dataclasses.field(default_factory=list)  # TCP ports the tree listened on as it was dumped
    keep_image: bool = False      # the workload lives only in this image: its undo must not remove it
    pid_map: dict = dataclasses.field(default_factory=dict)       # dumped pid: its pid after a dump that runs on
    manifest: dict = None
    journal_data: dict = dataclasses.field(default_factory=dict)  # each phase's journal fields, for its transition

    def __setattr__(self, name, value):
        if name not in self.__dataclass_fields__:
            raise AttributeError("CheckpointContext declares no field %s" % name)
        object.__setattr__(self, name, value)


def host_facts(drv=None):
    """The host's facts for a manifest: its name, kernel, driver, GPUs and the driver's device UUIDs."""
    gpus, source = gpu_usage.gpus()
    return {"hostname": socket.gethostname(), "kernel": os.uname().release, "arch": os.uname().machine,
            "driver_version": gpu_usage.driver_version() or (gpus[0]["driver_version"] if gpus else None),
            "cuda_api_version": cuda.api_version_string(drv.api_version) if drv else None,
            "gpus": gpus, "gpu_source": source,
            "cuda_device_uuids": drv.device_uuids() if drv else []}


def find_cuda_pids(drv, pids, driver_problem, host_pids=True):
    """CUDA pids among ``pids`` with their driver state; refuse when a GPU user can't be handled.
    ``host_pids`` False: the pids are a sandbox's, whose device files the host's /proc cannot show."""
    if drv is None:
        holders = [p for p in pids if host_pids and gpu_procs.nvidia_fds(p)]
        if holders:
            raise DriverUnavailable("pid %s uses the GPU but the driver's checkpoint API is unavailable: %s"
                                    % (holders[0], driver_problem), stage="preflight", pid=holders[0],
                                    hint=driver_problem.hint if driver_problem is not None else None)
        return [], {}
    states = {}
    for p in pids:
        s = drv.cuda_state(p)
        if s is not None:
            states[p] = s
    # A GPU device user the driver does not know (an NVML tool, a non-CUDA GPU API) cannot be moved
    # off the GPU, and CRIU would fail on its device files: say so before freezing anything.
    strays = [p for p in pids if host_pids and p not in states and gpu_procs.nvidia_fds(p)]
    if strays:
        p = strays[0]
        raise InvalidTarget("pid %d (%s) holds %s but the driver does not report it as a CUDA process; its GPU state "
                            "cannot be checkpointed" % (p, (procfs.read_stat(p) or {}).get("comm"),
                                                        ", ".join(gpu_procs.nvidia_fds(p))),
                            stage="preflight", pid=p, hint="stop that process or leave it out of the tree")
    return [p for p in pids if p in states], states


def _refuse_what_the_runtime_cannot(backend, opts, root):
    """The runtime's own refusals: how the workload is to be left (CRIU's network lock is plan_tree's)."""
    backend.check_after(opts.after)
    if opts.leave_stopped and not backend.capabilities.can_hold_stopped:
        raise InvalidTarget("the %s runtime cannot hold a workload stopped after its checkpoint; nothing was frozen"
                            % backend.name, stage="preflight",
                            hint="checkpoint it without leave_stopped; its image is the way back")
    return backend.preflight()


def _distributed(backend, pids, coop=False):
    """The verdict on a distributed (NCCL) job in the tree (cuda/nccl.py), refused before anything is frozen when the
    driver could not restore it, or when a rank's connection leads out of the tree (another host: a multi-node job).
    Returns the verdict; its ``restorable`` lets the tree's own TCP connections (torchrun's rendezvous) be dumped.
    ``coop`` (quiesce_mode cooperative): a job whose ranks will release their communicators before the freeze is
    judged again once they have (cooperative.check_released); its rendezvous connections are dumped too."""
    if backend.capabilities.cuda_in_sandbox:  # (a sandbox's processes are not the host's: /proc cannot tell)
        if coop:
            raise InvalidTarget("quiesce_mode cooperative cannot reach the ranks inside a %s sandbox (the host does "
                                "not see them); nothing was frozen" % backend.name, stage="preflight")
        return {"distributed": False, "restorable": False, "ranks": [], "refusal": None}
    verdict = nccl.judge(pids, cooperative=coop)
    first = (verdict["ranks"] or [{}])[0].get("pid")
    if verdict["refusal"]:
        raise InvalidTarget(verdict["refusal"] + "; nothing was frozen", stage="preflight", pid=first,
                            hint="restart the job with that environment, or let it release its communicators itself "
                                 "(quiesce_mode: cooperative, tools/gpuckpt_quiesce.py; docs/multi_gpu.md)")
    outside = sockets.tcp_outside(pids) if verdict["restorable"] or coop else []
    if outside:
        raise InvalidTarget("NCCL job of pid %d holds TCP connections whose other end is not in the checkpointed tree "
                            "(%s): a rank or its rendezvous is on another host (a multi-node job) or in another "
                            "process tree; nothing was frozen" % (first, ", ".join(outside[:3])), stage="preflight",
                            pid=first, hint="checkpoint the tree that holds every rank and its rendezvous (torchrun's "
                                            "root); jobs whose ranks span hosts are not checkpointed (docs/multi_gpu.md)")
    if coop:  # (its ranks release their communicators before the freeze: judged again then)
        verdict = dict(verdict, restorable=True)
    return verdict


def _cuda_processes(backend, opts, root, pids, verdict):
    """The driver, why it is missing (or None), and the tree's CUDA pids, each running and of features
    the driver's checkpoint API can restore (NCCL ranks: as the distributed verdict decided)."""
    drv, driver_problem = backend.load_cuda(opts.libcuda_path)
    sandboxed = backend.capabilities.cuda_in_sandbox
    cuda_pids, states = find_cuda_pids(drv, backend.cuda_candidates(root, pids), driver_problem,
                                       host_pids=not sandboxed)
    for p in ([] if sandboxed else cuda_pids):  # (a sandbox's pids are not the host's: /proc cannot tell)
        features = [f for f in gpu_procs.unsupported_features(p)
                    if not (verdict["restorable"] and f == gpu_procs.NCCL_FEATURE)]
        if features:
            raise InvalidTarget("pid %d uses %s, which the driver's checkpoint API does not support (it checkpoints "
                                "such a process but cannot restore it, so the job would stay frozen); nothing was "
                                "frozen" % (p, " and ".join(features)), stage="preflight", pid=p,
                                hint="use the framework's own checkpoints for such jobs")
    busy = {p: s for p, s in states.items() if s != "running"}
    if busy:
        p, s = sorted(busy.items())[0]
        raise InvalidTarget("CUDA pid %d is %s, not running: another checkpoint is in progress or failed"
                            % (p, s), stage="preflight", pid=p,
                            hint="restore/unlock it first (gpu_restore on its image) or investigate")
    return drv, driver_problem, cuda_pids


def _gpu_stage(backend, drv, driver_problem, cuda_pids):
    """What becomes of the GPU stage, as the result and the manifest say it."""
    if cuda_pids and backend.capabilities.owns_cuda_stage:
        return "done by the %s runtime itself" % backend.name
    if cuda_pids:
        return "done"
    if drv is None:
        return "skipped: no CUDA driver on this host (%s); CPU-only workload" % driver_problem.msg
    return "skipped: no process of the tree is a CUDA process"


def cooperative_ranks(verdict, cuda_pids, root):
    """The processes a cooperative checkpoint asks: the tree's NCCL ranks and those that announced the helper. A
    launcher with a CUDA context of its own (torchrun's agent under PyTorch 2.11, seen on 2 x H100) is locked and
    checkpointed with them, but not asked: it has no communicator to release and does not catch the signal. Every
    CUDA process (or the root) when no process is either."""
    ranks = {r["pid"] for r in verdict.get("ranks") or []} | set(cooperative.announced(cuda_pids))
    return [p for p in cuda_pids if p in ranks] or cuda_pids or [root]


def _check_quiesce(backend, opts, root, cuda_pids):
    if opts.quiesce_signal and backend.capabilities.cuda_in_sandbox:
        raise InvalidTarget("quiesce_signal cannot reach processes inside a %s sandbox (the host does not see them); "
                            "nothing was frozen" % backend.name, stage="preflight",
                            hint="use quiesce_command, which runs inside the sandbox")
    if opts.quiesce_signal:
        quiesce.check_caught(cuda_pids or [root], *opts.quiesce_signal)


def _cuda_gpus(cuda_pids, sandboxed):
    """The GPUs each CUDA process holds (its open device files), read while it runs: the checkpoint
    closes them. What a restore onto other GPUs maps from (see cuda/devices.py)."""
    if sandboxed:
        return {}
    inv = gpu_devices.inventory() if cuda_pids else []
    return {str(p): gpu_devices.process_gpus(p, inv) for p in cuda_pids}


def plan_checkpoint(target, image_dir, opts, backend, migration_id=None):
    """Everything decided before anything is touched: the tree, its CUDA pids and their states, each
    process's state and identity, what the runtime and CRIU need. Raises InvalidTarget to refuse.
    Returns the CheckpointContext the steps share."""
    root, pids = backend.resolve(target)
    runtime_facts = _refuse_what_the_runtime_cannot(backend, opts, root)
    if opts.quiesce_mode == "auto" and not backend.capabilities.cuda_in_sandbox and cooperative.announced(pids):
        opts.choose_cooperative()  # (a rank of the tree runs tools/gpuckpt_quiesce.py's Cooperative)
    verdict = _distributed(backend, pids, coop=opts.cooperative)
    # file locks, external unix sockets, TCP: the runtime's flags, or a refusal
    backend.plan_tree(pids, internal_tcp=verdict["restorable"])
    image.check_dir(image_dir)
    drv, driver_problem, cuda_pids = _cuda_processes(backend, opts, root, pids, verdict)
    gpu_stage = _gpu_stage(backend, drv, driver_problem, cuda_pids)
    coop_pids = cooperative_ranks(verdict, cuda_pids, root) if opts.cooperative else None
    _check_quiesce(backend, opts, root, coop_pids or cuda_pids)
    proc_states = {str(p): (procfs.read_stat(p) or {}).get("state") for p in pids}
    # (the cooperative request's number is decided now: a give-back record must know it before anything is asked)
    coop = {"request": cooperative.request_number(), "pids": coop_pids} if opts.cooperative else None
    cuda_gpus = _cuda_gpus(cuda_pids, backend.capabilities.cuda_in_sandbox)
    warnings = []
    if cuda_pids and backend.capabilities.cuda_in_sandbox:  # (a check that cannot be made says so)
        warnings.append("the %s sandbox's CUDA processes are not the host's, so whether they are NCCL ranks, which "
                        "the driver may be unable to restore (docs/multi_gpu.md), was not checked" % backend.name)
    # The host's facts for the manifest are read now: asking NVML or nvidia-smi while the workload is
    # frozen added 0.05-0.7 s of downtime (more with the push's streams busy on the same cores).
    return CheckpointContext(target=target, image_dir=image_dir, root=root, pids=pids, cuda_pids=cuda_pids, drv=drv,
                             host=host_facts(drv), gpu_stage=gpu_stage, runtime_facts=runtime_facts,
                             identities=identities(pids), states=proc_states, cuda_gpus=cuda_gpus, after=opts.after,
                             backend=backend, opts=opts, coop=coop, migration_id=migration_id,
                             calls0=len(drv.calls) if drv else 0, warnings=warnings)
