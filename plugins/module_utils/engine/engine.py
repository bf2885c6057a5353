# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The two-stage engine, importable without Ansible.

checkpoint: plan (preflight, touches nothing) -> image dir -> lock every CUDA pid -> checkpoint every
            CUDA pid (VRAM -> host RAM) -> runtime dump (RAM + CPU state -> image dir) -> checksums +
            manifest -> (a migration) deliver the image to the target
restore:    verify image -> runtime restore -> CUDA restore every pid -> unlock every pid -> validate

A checkpoint is a plan and a list of steps, each carrying its undo. Any failure runs the undo of the
steps done, newest first, so the workload runs on: unlock what was locked, restore what was
checkpointed, thaw (or restore from the image) what was dumped, remove the partial image. Rules kept
by the order of the steps: lock all before checkpointing any, restore all before unlocking any. In a
migration each step is a transition of the source's journal, under its lock, and a recovery's fence
stops the steps at the next one; delivering the image to the target is the last step and has no undo:
from there on only the migration's settlement decides (see migration.py).

A restore in a migration moves the target's journal from received to restoring under its lock, and
records the restored processes' identities before it unlocks them, so a recovery always knows what a
restore brought up, even when that restore's module died. Validation compares the restored tree with
the dumped one: a process that was a zombie or stopped at the dump may be so again; a CUDA process
that does not run is a failure.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..core import procfs
from ..cuda import usage as gpu_usage
from ..cuda import processes as gpu_procs
from ..core import hugepages
from ..core import image
from . import quiesce
from ..cuda import devices as gpu_devices
from ..cuda import driver as cuda
from ..core.errors import DriverUnavailable, GpuCkptError, ImageError, InvalidTarget, TransactionError
from ..core.journal import Fenced, identities, process_identity, same_process
from ..core.progress import StageProgress
from ..runtimes.base import network_lock_problem
from ..runtimes.process import ProcessBackend

COLLECTION_VERSION = "0.1.0"
CHECKPOINT_STAGES = ("cuda_lock", "cuda_checkpoint", "runtime_dump", "checksum", "manifest", "push")
RESTORE_STAGES = ("wait_pids_free", "verify", "preflight", "runtime_restore", "cuda_restore", "probe",
                  "cuda_unlock", "validate")
STOPPED = ("T", "t")
DEAD = ("Z", "X")


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class _Clock(object):
    """Per-stage wall time, in seconds; tells ``progress`` (a StageProgress, or None) as stages end."""

    def __init__(self, progress=None):
        self.stages = {}
        self._t = None
        self.progress = progress
        self.resumed_at = None

    def start(self):
        self._t = time.monotonic()
        if self.progress:
            self.progress.start()

    def stop(self, stage):
        self.stages[stage] = round(self.stages.get(stage, 0.0) + time.monotonic() - self._t, 6)
        self._t = time.monotonic()
        if self.progress:
            self.progress.stage_done(stage, self.stages[stage])


def _driver_seconds(drv, since):
    out = {}
    if drv is not None:
        for c in drv.calls[since:]:
            key = c["call"].replace("cuCheckpointProcess", "").lower()
            out[key] = round(out.get(key, 0.0) + c["seconds"], 6)
    return out


def host_facts(drv=None):
    gpus, source = gpu_usage.gpus()
    return {"hostname": socket.gethostname(), "kernel": os.uname().release, "arch": os.uname().machine,
            "driver_version": gpu_usage.driver_version() or (gpus[0]["driver_version"] if gpus else None),
            "cuda_api_version": cuda.api_version_string(drv.api_version) if drv else None,
            "gpus": gpus, "gpu_source": source,
            "cuda_device_uuids": drv.device_uuids() if drv else []}


def _error_fields(exc):
    if isinstance(exc, GpuCkptError):
        out = {k: getattr(exc, k) for k in ("cmd", "rc", "stdout", "stderr", "driver_error")}
        out["details"] = exc.details
        return out
    return {}


def _find_cuda_pids(drv, pids, driver_problem, host_pids=True):
    """CUDA pids among ``pids`` with their driver state; refuse when a GPU user can't be handled.
    ``host_pids`` False: the pids are a sandbox's, whose device files the host's /proc cannot show."""
    if drv is None:
        holders = [p for p in pids if host_pids and gpu_procs.nvidia_fds(p)]
        if holders:
            raise DriverUnavailable("pid %s uses the GPU but the driver's checkpoint API is unavailable: %s"
                                    % (holders[0], driver_problem), stage="preflight", pid=holders[0],
                                    hint=getattr(driver_problem, "hint", None))
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


class _NoHangup(object):
    """Ignore SIGHUP while a transaction runs: a controller that dies (ssh closes) must not kill the
    module half-way between lock and dump and leave the workload frozen. The journal tells
    recover.yml what to finish."""

    def __enter__(self):
        try:
            self.old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread
            self.old = None
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGHUP, self.old)
        return False


def _each(pids, fn, parallel):
    """fn(pid) for every pid, in order, or on one thread per pid (the driver call releases the GIL).
    Parallel is the default: for 3 processes of 2 GiB on an H200 the driver's checkpoint took 1.8 s in
    parallel against 5.0 s one after another, restore 1.0 s against 2.2 s (docs/benchmarks).
    Returns the pids done; raises the first error (with ``done``: the pids done) after every call."""
    if not parallel or len(pids) < 2:
        done = []
        for p in pids:
            try:
                fn(p)
            except Exception as exc:
                exc.done = done  # the undo must cover exactly these
                raise
            done.append(p)
        return done
    with ThreadPoolExecutor(len(pids)) as pool:
        futures = [(p, pool.submit(fn, p)) for p in pids]
    done, first_error = [], None
    for p, f in futures:
        exc = f.exception()
        if exc is None:
            done.append(p)
        elif first_error is None:
            first_error = exc
    if first_error is not None:
        first_error.done = done
        raise first_error
    return done


# ---- steps with their undo -----------------------------------------------------------------------------
class Step(object):
    """One step of a transaction: ``do(ctx)``, and ``undo(ctx)`` that puts back what ``do`` changed.
    ``phase``: the journal phase to record once it is done. ``partial``: the undo also puts back a ``do``
    that failed half-way (it undoes what the context records as done: the pids locked so far...);
    otherwise a step that fails is left to its runtime (a failed dump thaws its tree itself)."""

    def __init__(self, name, do, undo=None, phase=None, partial=False):
        self.name, self.do, self.undo, self.phase, self.partial = name, do, undo, phase, partial


def run_steps(steps, ctx, journal=None):
    """Run ``steps`` in order. A journal's fence is checked before each; on any failure the done steps'
    undos run newest first, and TransactionError says whether the workload was put back (an undo
    that fails is reported, and the others still run)."""
    done = []
    try:
        for step in steps:
            if journal is not None:
                journal.check_fence(step.name)
            try:
                step.do(ctx)
            except Exception:
                if step.partial:
                    done.append(step)
                raise
            done.append(step)
            if journal is not None and step.phase:
                journal.transition(step.phase, **ctx.journal_data.pop(step.phase, {}))
        return
    except Exception as exc:  # noqa: BLE001 - any failure is undone
        failure = exc
    problems = []
    for step in reversed(done):
        if step.undo is None:
            continue
        try:
            step.undo(ctx)
        except Exception as exc:  # noqa: BLE001 - report it, keep undoing the rest
            problems.append("undo of %s: %s" % (step.name, getattr(exc, "msg", exc)))
    ok = not problems
    if journal is not None:
        try:
            journal.transition("rolled_back" if ok else "rollback_failed", error=str(failure), problems=problems)
        except GpuCkptError:
            pass  # nothing was planned yet, or the journal cannot be written: the result says what happened
    stage = getattr(failure, "stage", None) or "checkpoint"
    where = " for pid %s" % failure.pid if getattr(failure, "pid", None) else ""
    state = ("the workload was rolled back and runs on" if ok else
             "ROLLBACK INCOMPLETE, the workload may be frozen: " + "; ".join(problems))
    kept = "; its image is kept in %s" % ctx.image_dir if ctx.keep_image else "; no image was kept"
    if isinstance(failure, InvalidTarget) and not done:
        raise failure  # refused before anything was touched: the error says so itself
    reason = getattr(failure, "msg", failure)
    raise TransactionError("checkpoint failed at stage %s%s: %s; %s%s" % (stage, where, reason, state, kept),
                           stage=stage, pid=getattr(failure, "pid", None), rolled_back=ok,
                           hint=getattr(failure, "hint", None), **_error_fields(failure))


# ---- checkpoint -------------------------------------------------------------------------------------
class CheckpointOptions(object):
    """What a checkpoint may be told; every option has a default."""

    def __init__(self, leave_running=False, leave_stopped=False, lock_timeout=30.0, libcuda_path=None,
                 check_mode=False, sign_key=None, parallel=True, progress_file=None, nonce=None,
                 journal_wait=30.0, host_huge_pages=False, quiesce_signal=None, quiesce_command=None,
                 quiesce_timeout=30.0):
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
        self.quiesce_signal = quiesce.signal_number(quiesce_signal) if quiesce_signal else None
        self.quiesce_command = list(quiesce_command) if quiesce_command else None
        self.quiesce_timeout = float(quiesce_timeout)

    @property
    def after(self):
        return "running" if self.leave_running else "stopped" if self.leave_stopped else "exit"


class _Ctx(object):
    """What the steps share: the plan, and what each step did (for the undos)."""

    def __init__(self, **kw):
        self.locked, self.checkpointed = [], []
        self.made = None
        self.keep_image = False
        self.runtime_info = None
        self.hasher = None
        self.quiesce = None
        self.manifest = None
        self.journal_data = {}
        self.__dict__.update(kw)


def plan_checkpoint(target, image_dir, opts, backend):
    """Everything decided before anything is touched: the tree, its CUDA pids and their states, each
    process's state and identity, what the runtime and CRIU need. Raises InvalidTarget to refuse."""
    root, pids = backend.resolve(target)
    backend.check_after(opts.after)
    if opts.leave_stopped and not getattr(backend, "can_hold_stopped", True):
        raise InvalidTarget("the %s runtime cannot hold a workload stopped after its checkpoint; nothing was frozen"
                            % backend.name, stage="preflight",
                            hint="checkpoint it without leave_stopped; its image is the way back")
    runtime_facts = backend.preflight()
    net_problem = network_lock_problem(root, getattr(backend, "extra", ())) if backend.uses_criu else None
    if net_problem:
        raise InvalidTarget(net_problem + "; nothing was frozen", stage="preflight", pid=root,
                            hint="install iptables (the gpuckpt.fleet.criu role does), or run the workload "
                                 "on the host's network")
    backend.plan_tree(pids)  # file locks, external unix sockets: the runtime's flags, or a refusal
    image.check_dir(image_dir)
    drv, driver_problem = backend.load_cuda(opts.libcuda_path)
    sandboxed = backend.cuda_in_sandbox
    cuda_pids, states = _find_cuda_pids(drv, backend.cuda_candidates(root, pids), driver_problem,
                                        host_pids=not sandboxed)
    for p in ([] if sandboxed else cuda_pids):  # (a sandbox's pids are not the host's: /proc cannot tell)
        features = gpu_procs.unsupported_features(p)
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
    if cuda_pids and backend.owns_cuda_stage:
        gpu_stage = "done by the %s runtime itself" % backend.name
    elif cuda_pids:
        gpu_stage = "done"
    elif drv is None:
        gpu_stage = "skipped: no CUDA driver on this host (%s); CPU-only workload" % driver_problem.msg
    else:
        gpu_stage = "skipped: no process of the tree is a CUDA process"
    if opts.quiesce_signal and sandboxed:
        raise InvalidTarget("quiesce_signal cannot reach processes inside a %s sandbox (the host does not see them); "
                            "nothing was frozen" % backend.name, stage="preflight",
                            hint="use quiesce_command, which runs inside the sandbox")
    if opts.quiesce_signal:
        quiesce.check_caught(cuda_pids or [root], *opts.quiesce_signal)
    proc_states = {str(p): (procfs.read_stat(p) or {}).get("state") for p in pids}
    # The GPUs each CUDA process holds (its open device files), read while it runs: the checkpoint
    # closes them. What a restore onto other GPUs maps from (see gpus.py).
    inv = gpu_devices.inventory() if cuda_pids and not sandboxed else []
    cuda_gpus = {str(p): gpu_devices.process_gpus(p, inv) for p in ([] if sandboxed else cuda_pids)}
    # The host's facts for the manifest are read now: asking NVML or nvidia-smi while the workload is
    # frozen added 0.05-0.7 s of downtime (more with the push's streams busy on the same cores).
    return _Ctx(target=target, image_dir=image_dir, root=root, pids=pids, cuda_pids=cuda_pids, drv=drv,
                host=host_facts(drv),
                gpu_stage=gpu_stage, runtime_facts=runtime_facts, identities=identities(pids),
                states=proc_states, cuda_gpus=cuda_gpus, after=opts.after, backend=backend, opts=opts)


def _checkpoint_steps(ctx, clock, sender):
    """The checkpoint's steps, each with its undo (see the module doc)."""
    drv, opts, backend = ctx.drv, ctx.opts, ctx.backend
    lock_ms = int(opts.lock_timeout * 1000)

    def make_dir(c):
        c.made = image.prepare_dir(c.image_dir)
        c.work = image.state_dir(c.image_dir)
        c.journal_data["planned"] = {
            "pids": c.pids, "cuda_pids": c.cuda_pids, "identities": c.identities, "states": c.states,
            "image_dir": c.image_dir, "image_dir_identity": c.made["identity"], "image_dir_created": c.made["created"],
            "after": c.after, "nonce": opts.nonce, "runtime": backend.name, "container": getattr(backend, "container", None),
            "pod": getattr(backend, "pod", None), "owner": process_identity(os.getpid())}

    def discard_dir(c):
        if not c.keep_image:
            image.discard(c.image_dir, c.made)

    def ask_to_quiesce(c):
        """The workload gives back what it need not keep (see quiesce.py); it runs on meanwhile."""
        if opts.quiesce_signal:
            c.quiesce = quiesce.by_signal(c.cuda_pids or [c.root], opts.quiesce_signal[0], opts.quiesce_signal[1],
                                          opts.quiesce_timeout)
        elif opts.quiesce_command:
            c.quiesce = quiesce.by_command(backend, c.root, opts.quiesce_command, opts.quiesce_timeout)

    def begin_freeze(c):
        c.frozen_at = time.time()
        c.journal_data["freezing"] = {"frozen_at": c.frozen_at}
        clock.start()

    def lock(c):
        for p in c.cuda_pids:  # one after another: each is fast, and the order is the freeze order
            drv.lock(p, lock_ms)
            c.locked.append(p)
        clock.stop("cuda_lock")

    def unlock(c):
        for p in c.locked:
            drv.unlock(c.pid_map.get(p, p))

    def checkpoint_gpu(c):
        try:
            c.checkpointed.extend(_each(c.cuda_pids, drv.checkpoint, opts.parallel))
        except Exception as exc:
            c.checkpointed.extend(getattr(exc, "done", []))
            raise
        clock.stop("cuda_checkpoint")

    def restore_gpu(c):
        for p in c.checkpointed:
            drv.restore(c.pid_map.get(p, p))

    def dump(c):
        if sender is not None:
            sender.watch(c.image_dir)  # the page files' completed pieces go while the dump writes them
        c.hasher = image.ChunkHasher(c.image_dir).follow()  # and are hashed while it writes them
        c.runtime_info = backend.dump(c.root, c.image_dir, c.work, c.after)
        clock.stop("runtime_dump")
        if sender is not None:
            sender.complete(c.image_dir)  # the rest goes while the checksums are taken

    def undump(c):
        """Put back what the dump left: thaw a held tree, or bring an exited one back from its image."""
        if c.hasher is not None:
            c.hasher.stop()
        if c.after == "stopped":
            backend.resume([p for p in c.pids if c.states.get(str(p)) not in STOPPED])
        elif c.after == "exit":
            if backend.name == "process":
                procfs.wait_gone(c.pids, 10)  # PID 1 may take a second to reap the dumped tree
            try:
                new_pids, _cuda = _restore_from(c.image_dir, {"target": {"pids": c.pids, "cuda_pids": [],
                                                                         "states": c.states},
                                                              "runtime": c.runtime_info}, backend, None, None, _Clock())
            except Exception:
                c.keep_image = True  # the workload lives only in this image now
                raise
            c.pid_map = dict(zip(c.pids, new_pids)) if len(new_pids) == len(c.pids) else {}

    def resume_gpu_now(c):
        """leave_running: the image is on disk; give the GPU back to the source at once, then hash."""
        restore_gpu(c)
        unlock(c)
        c.checkpointed, c.locked = [], []
        clock.stop("cuda_resume_source")

    def write_manifest(c):
        files = c.hasher.checksums() if c.hasher is not None else image.checksum_files(c.image_dir)
        clock.stop("checksum")
        host = dict(c.host)
        host.update(c.runtime_facts)
        m = {"id": str(uuid.uuid4()), "created": _now(), "tool": "gpuckpt.fleet", "tool_version": COLLECTION_VERSION,
             "host": host, "runtime": c.runtime_info,
             "target": {"workload": str(c.target), "root_pid": c.root, "pids": c.pids, "cuda_pids": c.cuda_pids,
                        "identities": c.identities, "states": c.states, "after": c.after,
                        "gpus": c.cuda_gpus,
                        "processes": [gpu_procs.process_info(p) for p in c.pids] if c.after == "running" else
                        [{"pid": p} for p in c.pids]},
             "gpu_stage": c.gpu_stage, "leave_running": c.after == "running", "leave_stopped": c.after == "stopped",
             "frozen_at": c.frozen_at,
             "sizes": {"image_bytes": sum(f["size"] for f in files.values()), "files": len(files),
                       "hashed_during_dump": c.hasher.hashed_early() if c.hasher is not None else 0},
             "timings": dict(clock.stages), "driver_call_seconds": _driver_seconds(drv, c.calls0), "files": files}
        if c.migration_id:
            m["migration"] = {"id": c.migration_id, "nonce": opts.nonce}
        c.manifest = image.write_manifest(c.image_dir, m, opts.sign_key)
        clock.stop("manifest")
        c.journal_data["checkpointed"] = {"manifest_id": m["id"], "image_bytes": m["sizes"]["image_bytes"],
                                          "timings": dict(clock.stages)}

    def remove_manifest(c):
        try:
            os.unlink(os.path.join(c.image_dir, image.MANIFEST))
        except OSError:
            pass

    ctx.pid_map = {}
    ctx.calls0 = len(drv.calls) if drv else 0
    steps = [Step("image_dir", make_dir, discard_dir, phase="planned")]
    if opts.quiesce_signal or opts.quiesce_command:
        steps.append(Step("quiesce", ask_to_quiesce))
    steps.append(Step("freeze", begin_freeze, phase="freezing"))
    engine_cuda = bool(ctx.cuda_pids) and not backend.owns_cuda_stage  # (else the runtime's dump does it)
    if engine_cuda:
        steps += [Step("cuda_lock", lock, unlock, partial=True),
                  Step("cuda_checkpoint", checkpoint_gpu, restore_gpu, partial=True)]
    steps.append(Step("runtime_dump", dump, undump, phase="frozen"))
    if ctx.after == "running" and engine_cuda:
        steps.append(Step("cuda_resume_source", resume_gpu_now))
    steps.append(Step("manifest", write_manifest, remove_manifest, phase="checkpointed"))
    return steps


def checkpoint(target, image_dir, backend=None, journal=None, sender=None, migration_id=None, **options):
    """Checkpoint the workload ``target`` (a pid, or a container for a container backend) into
    ``image_dir``. Returns a result dict.

    Afterwards the workload exits (default), runs on (``leave_running``), or stays stopped with its GPU
    memory in host RAM (``leave_stopped``: a migration's source, released or resumed later). ``options``:
    see CheckpointOptions. ``journal``: the migration's source journal, held for the whole checkpoint.
    ``sender`` (a transfer.Sender) sends the image to the target while it is written, then delivers
    it: the result's ``push``. A failed push never fails the checkpoint."""
    opts = CheckpointOptions(**options)
    image_dir = os.path.abspath(image_dir)
    progress = StageProgress(opts.progress_file, CHECKPOINT_STAGES, image_dir)
    try:
        with _NoHangup(), hugepages.HugePages(opts.host_huge_pages and not opts.check_mode,
                                              settle_stale=not opts.check_mode) as thp:
            if journal is None:
                res = _checkpoint(target, image_dir, opts, backend or ProcessBackend(), None, sender, migration_id,
                                  progress)
            else:
                with journal.hold(wait=opts.journal_wait, purpose="the checkpoint of %s" % target):
                    res = _checkpoint(target, image_dir, opts, backend or ProcessBackend(), journal, sender,
                                      migration_id or journal.id, progress)
        if thp.report is not None:
            res["huge_pages"] = thp.report
        return res
    finally:
        progress.close()


def _checkpoint(target, image_dir, opts, backend, journal, sender, migration_id, progress):
    after = opts.after
    result = {"changed": False, "image_dir": image_dir, "pid": target, "leave_running": after == "running",
              "leave_stopped": after == "stopped"}
    if journal is not None:
        doc = journal.read()
        if doc:
            result.update(msg="migration %s was already checkpointed on this host (phase %s); nothing to do"
                          % (journal.id, doc.get("phase")), journal_phase=doc.get("phase"), nonce=doc.get("nonce"))
            if doc.get("nonce") == opts.nonce and doc.get("phase") not in ("rolled_back", "rollback_failed"):
                return result
            raise InvalidTarget(result["msg"].replace("; nothing to do", "") + "; settle it with recover.yml before "
                                "starting it again", stage="preflight")
        journal.check_fence("plan")
    elif image.has_manifest(image_dir):  # idempotence: a complete image of this same target is already there
        m = image.load_manifest(image_dir)
        if str(m.get("target", {}).get("workload", m.get("target", {}).get("root_pid"))) == str(target):
            result.update(msg="image of %s already exists in %s (taken %s); nothing to do"
                          % (target, image_dir, m.get("created")), pids=m["target"]["pids"],
                          cuda_pids=m["target"]["cuda_pids"], manifest_id=m.get("id"))
            return result
    if journal is not None and not opts.nonce:
        opts.nonce = uuid.uuid4().hex
    ctx = plan_checkpoint(target, image_dir, opts, backend)
    ctx.migration_id = migration_id
    result.update(pids=ctx.pids, cuda_pids=ctx.cuda_pids, gpu_stage=ctx.gpu_stage, nonce=opts.nonce)
    if opts.check_mode:
        result.update(changed=True, msg="would checkpoint %d process(es), %d on the GPU, into %s"
                      % (len(ctx.pids), len(ctx.cuda_pids), image_dir))
        return result

    clock = _Clock(progress)
    push_report = None
    if sender is not None and journal is not None:
        sender.fence = lambda: journal.check_fence("push")
    if sender is not None:
        try:  # the streams open before anything is frozen: their handshakes cost no downtime
            sender.start()
        except GpuCkptError as exc:
            push_report, sender = {"pushed": False, "error": "the push could not start: %s" % exc.msg}, None
    try:
        run_steps(_checkpoint_steps(ctx, clock, sender), ctx, journal)
    except GpuCkptError:
        if sender is not None:
            sender.abort()
        raise
    finally:
        if ctx.hasher is not None:
            ctx.hasher.stop()
    if sender is not None:
        push_report = _deliver(sender, ctx, journal, clock)
    if push_report is not None:
        result["push"] = push_report
    if ctx.quiesce is not None:
        result["quiesce"] = ctx.quiesce
    result.update(changed=True, manifest_id=ctx.manifest["id"], timings=dict(clock.stages), frozen_at=ctx.frozen_at,
                  driver_call_seconds=ctx.manifest["driver_call_seconds"],
                  image_bytes=ctx.manifest["sizes"]["image_bytes"],
                  msg="checkpointed %d process(es) (%d on the GPU) into %s%s"
                  % (len(ctx.pids), len(ctx.cuda_pids), image_dir,
                     {"running": "; workload left running", "stopped": "; workload left stopped"}.get(after, "")))
    return result


def _deliver(sender, ctx, journal, clock):
    """The push's last part: the rest of the image, then the manifest. The source's journal says
    'delivering' before the manifest goes: from then on the target may hold a complete image, and
    only the migration's settlement may resume the source (see migration.rollback_source)."""
    def before_deliver():
        if journal is not None:
            journal.check_fence("deliver")
            journal.transition("delivering")
    sender.before_deliver = before_deliver
    report = {"pushed": False}
    try:
        report.update(sender.finish(ctx.image_dir), pushed=True)
        if journal is not None:
            journal.transition("delivered")
    except (GpuCkptError, OSError) as exc:
        sender.abort()
        report.update(sender.report(), error=getattr(exc, "msg", str(exc)))
        if isinstance(exc, Fenced):
            report["fenced"] = True
    clock.stop("push")
    return report


# ---- restore ----------------------------------------------------------------------------------------
def wait_for_delivery(journal, timeout, libcuda_path=None, poll=0.02):
    """Wait, without the journal's lock, until this migration's image has been delivered here (the
    target journal's phase is received: its manifest landed, its nonce checked) while the driver loads
    (cuInit takes about 0.4 s on an H200). A migration starts its target's restore this way BEFORE the
    source is frozen, so that the restore begins the moment the image is complete. Raises
    TransactionError when the migration was settled meanwhile (rolled back) and ImageError after
    ``timeout`` seconds. Returns the seconds waited."""
    start = time.monotonic()
    warm = threading.Thread(target=cuda.load, args=(libcuda_path,), name="gpuckpt-cuinit")
    warm.daemon = True
    warm.start()
    while True:
        phase = journal.phase
        if phase in ("received", "restore_failed", "restoring", "restored", "committed"):
            break
        if phase in ("cleaned", None):
            raise TransactionError("migration %s was rolled back while this host waited for its image (journal %s); "
                                   "nothing was restored" % (journal.id, phase or "absent"), stage="wait")
        if time.monotonic() - start > timeout:
            raise ImageError("no complete image of migration %s arrived within %s s; nothing was restored"
                             % (journal.id, timeout), stage="wait", hint="see the source's checkpoint and transfer")
        time.sleep(poll)
    warm.join()
    return time.monotonic() - start


def _validate(manifest, new_pids, cuda_pids, drv):
    """Compare the restored tree with the dumped one. Returns notes; raises on what is a failure: the
    root or a CUDA process that does not run. A process that was a zombie or stopped when it was dumped
    may be so again, and one the workload itself ended or stopped since is noted, not failed."""
    old = manifest["target"]["pids"]
    states = manifest["target"].get("states") or {}
    mapping = dict(zip(old, new_pids)) if len(old) == len(new_pids) else {}
    notes = []
    for o in old:
        n = mapping.get(o, o)
        was = states.get(str(o))
        now = (procfs.read_stat(n) or {}).get("state")
        if now is None or now in DEAD:
            if was in DEAD:
                continue
            if o == old[0]:
                raise GpuCkptError("restored root pid %s %s" % (n, "exited" if now is None else "is a zombie"),
                                   stage="validate", pid=n)
            notes.append("pid %s (was %s) %s after the restore" % (n, o, "exited" if now is None else "is a zombie"))
        elif now in STOPPED and was not in STOPPED:
            notes.append("pid %s (was %s) is stopped after the restore" % (n, o))
    for p in cuda_pids:
        state = drv.cuda_state(p) if drv is not None else None
        if state != "running":
            raise GpuCkptError("CUDA pid %d is %s after unlock" % (p, state or "gone"), stage="validate", pid=p)
    return notes


def _restore_from(image_dir, manifest, backend, drv, gpu_pairs, clock, validate_wait=0.0, parallel=False,
                  on_restored=None, probe=None):
    """Runtime restore, CUDA restore of all pids, the user's ``probe`` ((argv, timeout) run inside the
    workload), then unlock of all, then validation. ``on_restored`` (new pids) is called right
    after the runtime restore. Kills what it brought up on failure."""
    work = image.state_dir(image_dir)
    new_pids = []
    try:
        new_pids = backend.restore(image_dir, work, manifest)
        clock.stop("runtime_restore")
        if on_restored is not None:
            on_restored(new_pids)
        cuda_pids = backend.map_pids(manifest, new_pids)
        if cuda_pids is None:
            cuda_pids = _map_pids(manifest, new_pids)
        by_runtime = backend.owns_cuda_stage  # its restore brought the GPU memory back and unlocked
        if not by_runtime:
            # the user's map for every process; else the runtime's (a pod's new container was given other
            # GPUs by the device plugin), else none: the driver puts each GPU back where it was
            placed = {p: gpu_pairs or backend.gpu_pairs_for(p) for p in cuda_pids}
            clock.gpu_pairs = {str(p): pairs for p, pairs in placed.items() if pairs}
            _each(cuda_pids, lambda p: drv.restore(p, placed[p]), parallel)
        clock.stop("cuda_restore")
        if probe:
            # Its GPU memory is back but its CUDA processes are still locked: a failing probe is rolled
            # back before the restored copy made progress of its own (no work done twice).
            clock.probe = _probe(backend, new_pids[0], probe[0], probe[1])
            clock.stop("probe")
        for p in ([] if by_runtime else cuda_pids):
            drv.unlock(p)
        clock.stop("cuda_unlock")
        clock.resumed_at = time.time()  # the workload runs again from here: the end of its downtime
        if validate_wait:
            time.sleep(validate_wait)
        clock.notes = _validate(manifest, new_pids, cuda_pids, drv)
        clock.stop("validate")
        return new_pids, cuda_pids
    except Exception:
        if new_pids:
            backend.kill(new_pids)
        raise


def _probe(backend, root_pid, argv, timeout):
    """The user's check that the restored workload really works (``nvidia-smi``, a health endpoint),
    run inside it; a failure is a failed restore (what was brought up is stopped, and a migration rolls
    back to its source)."""
    res = backend.probe(root_pid, argv, timeout)
    out = {"cmd": list(argv), "rc": res.rc, "seconds": round(res.seconds, 3),
           "stdout": res.stdout[-2000:], "stderr": res.stderr[-2000:]}
    if res.rc != 0:
        raise GpuCkptError("the probe %s exited with rc=%d inside the restored workload (root pid %d)"
                           % (" ".join(argv), res.rc, root_pid), stage="probe", pid=root_pid, cmd=list(argv),
                           rc=res.rc, stdout=out["stdout"], stderr=out["stderr"],
                           hint="the probe runs in the workload's namespaces, root and environment, like an exec")
    return out


def _map_pids(manifest, new_pids):
    """Host pids of the restored CUDA processes. CRIU restores the same pids; runtimes with pid
    namespaces give new host pids in the same tree order."""
    old = manifest["target"]["pids"]
    if len(old) == len(new_pids):
        mapping = dict(zip(old, new_pids))
        return [mapping[p] for p in manifest["target"]["cuda_pids"]]
    return list(manifest["target"]["cuda_pids"])


def gpu_pairs_for(gpu_map, visible):
    """Complete a user's {old: new} UUID map into pairs naming every visible GPU (driver rule)."""
    if not gpu_map:
        return None
    norm = {cuda.format_uuid(cuda.parse_uuid(k)): cuda.format_uuid(cuda.parse_uuid(v)) for k, v in gpu_map.items()}
    unknown = [u for u in list(norm) + list(norm.values()) if visible and u not in visible]
    if unknown:
        raise InvalidTarget("gpu_map names %s, which is not a GPU visible here (%s)" % (unknown[0], ", ".join(visible)),
                            stage="preflight")
    free_new = [u for u in visible if u not in norm.values()]
    pairs = []
    for old in visible:
        new = norm.get(old) or free_new.pop(0)
        pairs.append((old, new))
    return pairs


class RestoreOptions(object):
    def __init__(self, gpu_map=None, force=False, libcuda_path=None, check_mode=False, sign_key=None, verify=True,
                 validate_wait=0.5, pid_wait=10.0, parallel=True, progress_file=None, wait_for_image=0.0,
                 journal_wait=60.0, probe_command=None, probe_timeout=60.0, host_huge_pages=False):
        self.gpu_map, self.force, self.libcuda_path, self.check_mode = gpu_map, force, libcuda_path, check_mode
        self.sign_key, self.verify, self.validate_wait, self.pid_wait = sign_key, verify, validate_wait, pid_wait
        self.parallel, self.progress_file, self.wait_for_image = parallel, progress_file, wait_for_image
        self.journal_wait = journal_wait
        self.probe = (list(probe_command), probe_timeout) if probe_command else None
        self.host_huge_pages = bool(host_huge_pages)


def restore(image_dir, backend=None, journal=None, **options):
    """Restore the workload of ``image_dir``. ``journal``: the migration's target journal: the restore
    then waits (``wait_for_image`` seconds) for this migration's image to be delivered, and runs as the
    journal's transition received -> restoring -> restored under its lock."""
    opts = RestoreOptions(**options)
    image_dir = os.path.abspath(image_dir)
    progress = StageProgress(opts.progress_file, RESTORE_STAGES)
    progress.start()
    try:
        with _NoHangup():
            waited = None
            if journal is not None and opts.wait_for_image and not opts.check_mode:
                waited = wait_for_delivery(journal, opts.wait_for_image, opts.libcuda_path)
            # (the image is waited for first: huge pages matter from the runtime's restore on)
            with hugepages.HugePages(opts.host_huge_pages and not opts.check_mode,
                                     settle_stale=not opts.check_mode) as thp:
                if journal is None:
                    res = _restore(image_dir, opts, backend, None, progress)
                else:
                    with journal.hold(wait=opts.journal_wait, purpose="the restore of %s" % image_dir):
                        res = _restore(image_dir, opts, backend, journal, progress)
            if thp.report is not None:
                res["huge_pages"] = thp.report
            if waited is not None and res.get("timings") is not None:
                res["timings"] = dict(res["timings"], wait_for_image=round(waited, 6))
            return res
    finally:
        progress.close()


def _journal_gate(journal, image_dir, manifest, opts):
    """In a migration: restore only this migration's delivered image, from the directory it created
    here. Returns a result when the restore already happened (nothing to do)."""
    doc = journal.read() or {}
    phase = doc.get("phase")
    if phase in ("restored", "committed"):
        alive = [p for p, ident in (doc.get("identities") or {}).items() if same_process(ident)]
        if len(alive) == len(doc.get("pids") or []):
            return {"changed": False, "image_dir": image_dir, "pids": doc.get("pids"), "cuda_pids": doc.get("cuda_pids"),
                    "manifest_id": manifest.get("id"), "msg": "migration %s is already restored here and runs; nothing to do"
                    % journal.id}
        raise TransactionError("migration %s was restored here, and that copy has since exited; settle the migration "
                               "(recover.yml)" % journal.id, stage="preflight")
    if phase not in ("received", "restore_failed"):
        raise TransactionError("migration %s has no delivered image here (journal phase %s); nothing was restored"
                               % (journal.id, phase or "absent"), stage="preflight",
                               hint="the image arrives through the migration's transfer")
    if os.path.abspath(doc.get("image_dir") or "") != image_dir:
        raise InvalidTarget("migration %s received its image in %s, not %s" % (journal.id, doc.get("image_dir"), image_dir),
                            stage="preflight")
    from ..core.fsutil import same_dir
    if not same_dir(image_dir, doc.get("image_dir_identity")):
        raise InvalidTarget("%s is no longer the directory migration %s created here; nothing was restored"
                            % (image_dir, journal.id), stage="preflight")
    if (manifest.get("migration") or {}).get("nonce") != doc.get("nonce"):
        raise ImageError("the image in %s is not this migration's checkpoint (its nonce differs); nothing was restored"
                         % image_dir, stage="verify")
    return None


def _restore_preflight(backend, needs_driver, libcuda_path):
    backend.preflight(full=False)  # `criu check` is for checkpoint/facts; here it would add downtime
    return backend.load_cuda(libcuda_path) if needs_driver else (None, None)


def _restore(image_dir, opts, backend, journal, progress):
    manifest = image.load_manifest(image_dir)
    backend = backend or ProcessBackend()
    target = manifest["target"]
    result = {"changed": False, "image_dir": image_dir, "manifest_id": manifest.get("id")}
    if journal is not None:
        done = _journal_gate(journal, image_dir, manifest, opts)
        if done is not None:
            return done
    else:
        mark = image.read_restored_mark(image_dir)
        if mark and mark.get("manifest_id") == manifest.get("id"):
            if all(procfs.alive(p) for p in mark["pids"]):
                result.update(pids=mark["pids"], cuda_pids=mark.get("cuda_pids", []),
                              msg="already restored at %s and running (pids %s); nothing to do"
                              % (mark.get("restored"), mark["pids"]))
                return result
            if not opts.force:
                raise InvalidTarget("this image was restored at %s and that workload has since exited; restoring it "
                                    "again would resume from the old state" % mark.get("restored"), stage="preflight",
                                    hint="set force=true to restore it again")

    clock = _Clock(progress)
    clock.start()
    # zombies of a just-dumped tree (CRIU restores the same pids; a runtime without CRIU needs none free)
    left = procfs.wait_gone(_host_pids_restored(manifest), opts.pid_wait) if backend.uses_criu else []
    if left and backend.name == "process":
        p = left[0]
        raise InvalidTarget("pid %d, which the image needs, is in use by %s (%s): the original workload may still "
                            "run (leave_running?); refusing to start a second copy"
                            % (p, (procfs.read_stat(p) or {}).get("comm"), procfs.cmdline(p)[:80]),
                            stage="preflight", pid=p, hint="stop that process, or restore on another host")
    clock.stop("wait_pids_free")
    # The runtime's checks and the driver's load (cuInit: about 0.4 s on an H200) run beside the
    # checksum verification instead of after it: both are downtime in a migration.
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            loading = pool.submit(_restore_preflight, backend, bool(target["cuda_pids"]), opts.libcuda_path)
            verify_seconds = image.verify(image_dir, manifest, opts.sign_key) if opts.verify else None
            clock.stop("verify")
            drv, problem = loading.result()
    except ImageError as exc:
        if journal is not None:
            journal.transition("restore_failed", error=str(exc), bad_files=exc.details.get("bad_files"))
        raise
    if target["cuda_pids"] and drv is None:
        raise DriverUnavailable("the image holds %d CUDA process(es) but this host's driver cannot restore "
                                "them: %s" % (len(target["cuda_pids"]), problem.msg), stage="preflight",
                                hint=problem.hint)
    pairs = gpu_pairs_for(opts.gpu_map, drv.device_uuids() if drv else [])
    if opts.gpu_map and drv is None:
        raise InvalidTarget("gpu_map given but the image holds no CUDA process", stage="preflight")
    if opts.check_mode:
        result.update(changed=True, pids=target["pids"], cuda_pids=target["cuda_pids"],
                      msg="would restore %d process(es) from %s" % (len(target["pids"]), image_dir))
        return result
    calls0 = len(drv.calls) if drv else 0
    clock.stop("preflight")
    backend.bind(manifest)
    if journal is not None:
        journal.transition("restoring", manifest_id=manifest.get("id"), owner=process_identity(os.getpid()),
                           container=getattr(backend, "container", None), pids=[], identities={},
                           restore_pod=getattr(backend, "restore_pod", None))

    def on_restored(new_pids):  # before any unlock: a recovery must always know what this restore brought up
        if journal is not None:
            journal.record(pids=new_pids, identities=identities(new_pids),
                           container=getattr(backend, "container", None))

    try:
        new_pids, cuda_pids = _restore_from(image_dir, manifest, backend, drv, pairs, clock, opts.validate_wait,
                                            opts.parallel, on_restored, opts.probe)
    except Exception as exc:  # noqa: BLE001
        stage = getattr(exc, "stage", None) or "restore"
        err = TransactionError("restore failed at stage %s%s: %s; what was brought up was stopped, the image is "
                               "untouched" % (stage, " for pid %s" % exc.pid if getattr(exc, "pid", None) else "",
                                              getattr(exc, "msg", exc)),
                               stage=stage, pid=getattr(exc, "pid", None), rolled_back=True,
                               hint=getattr(exc, "hint", None), **_error_fields(exc))
        if journal is not None:
            journal.transition("restore_failed", error=err.msg, pids=[], identities={})
        raise err
    if journal is not None:
        journal.transition("restored", pids=new_pids, cuda_pids=cuda_pids, identities=identities(new_pids),
                           resumed_at=clock.resumed_at)
    else:
        image.write_restored_mark(image_dir, {"manifest_id": manifest.get("id"), "restored": _now(),
                                              "pids": new_pids, "cuda_pids": cuda_pids, "host": socket.gethostname()})
    result.update(changed=True, pids=new_pids, cuda_pids=cuda_pids, timings=dict(clock.stages),
                  resumed_at=clock.resumed_at, validation_notes=getattr(clock, "notes", []),
                  probe=getattr(clock, "probe", None),
                  verify_seconds=verify_seconds, driver_call_seconds=_driver_seconds(drv, calls0),
                  gpu_pairs=pairs or getattr(clock, "gpu_pairs", None) or None,
                  msg="restored %d process(es) (%d on the GPU) from %s"
                  % (len(new_pids), len(cuda_pids), image_dir))
    return result


def _host_pids_restored(manifest):
    """The dumped pids that CRIU brings back under the same number in the host's pid namespace, which must be
    free first. A container's processes in a pid namespace of their own (recorded as runtime.ns_pids, or per
    container of a pod) come back in a new one: an unrelated host process that holds the same number must not
    cost a restore its 10 s wait (downtime)."""
    rt = manifest.get("runtime") or {}
    inside = dict(rt.get("ns_pids") or {})
    for rec in rt.get("containers") or []:
        inside.update(rec.get("ns_pids") or {})
    out = []
    for p in manifest["target"]["pids"]:
        ns = inside.get(str(p))
        if ns is None or int(ns) == int(p):
            out.append(p)
    return out


# ---- a held source: resume (roll back) or release (commit) ------------------------------------------
def _mine(target):
    """The pids of a checkpointed tree that are still those processes (by identity)."""
    idents = target.get("identities") or {}
    return [p for p in target["pids"] if same_process(idents.get(str(p)))]


def resume_stopped(manifest, backend=None, drv=None, libcuda_path=None):
    """Roll a stopped source back to running: SIGCONT to what was not stopped before the checkpoint
    (the driver's restore thread must run), then CUDA restore and unlock. Idempotent; returns
    (changed, pids that run)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    mine = _mine(target)
    if not mine:
        raise TransactionError("none of the source's processes %s exists any more; restore from the image instead"
                               % target["pids"], stage="resume-source")
    states = target.get("states") or {}
    changed = backend.is_held(mine)
    backend.resume([p for p in mine if states.get(str(p)) not in STOPPED])
    # (a sandbox's CUDA pids are its own, not host pids: they live while the sandbox does)
    cuda_pids = list(target["cuda_pids"]) if backend.cuda_in_sandbox else [p for p in target["cuda_pids"] if p in mine]
    if cuda_pids:
        if drv is None:
            drv, problem = backend.load_cuda(libcuda_path)
            if drv is None:
                raise problem
        for p in cuda_pids:
            if drv.cuda_state(p) == "checkpointed":
                drv.restore(p)
                changed = True
        for p in cuda_pids:
            if drv.cuda_state(p) == "locked":
                drv.unlock(p)
                changed = True
        bad = [p for p in cuda_pids if drv.cuda_state(p) != "running"]
        if bad:
            raise TransactionError("source pid %d is %s after resume" % (bad[0], drv.cuda_state(bad[0])),
                                   stage="resume-source", pid=bad[0])
    return changed, mine


def release_stopped(manifest, backend=None):
    """Commit: kill the source's held processes (only those that are still the same processes)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    mine = _mine(target)
    states = target.get("states") or {}
    running = [] if backend.is_held(mine) else \
        [p for p in mine if (procfs.read_stat(p) or {}).get("state") not in STOPPED + DEAD
         and states.get(str(p)) not in STOPPED] or []
    if running:
        raise TransactionError("source pid %d runs again (it is not stopped): refusing to kill it; the migration "
                               "was rolled back or resumed by hand" % running[0], stage="release-source",
                               pid=running[0])
    if mine:
        backend.kill(mine)
    return bool(mine), mine
