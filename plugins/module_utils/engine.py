# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The two-stage transaction, importable without Ansible.

checkpoint: lock every CUDA pid -> checkpoint every CUDA pid (VRAM -> host RAM)
            -> runtime dump (RAM + CPU state -> image dir) -> checksums + manifest
restore:    verify image -> runtime restore -> CUDA restore every pid -> unlock every pid -> validate

Rules: lock all before checkpointing any, restore all before unlocking any; any failure after the
first lock rolls back (restore + unlock) so the workload runs on; a failed restore kills what it
brought up and leaves the image untouched. Every result carries per-stage timings and the time
spent inside the driver's own calls, so overhead is visible.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from . import discovery, image
from . import driver as cuda
from .errors import DriverUnavailable, GpuCkptError, InvalidTarget, TransactionError
from .progress import StageProgress
from .runtimes.base import network_lock_problem
from .runtimes.process import ProcessBackend

COLLECTION_VERSION = "0.1.0"


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


CHECKPOINT_STAGES = ("cuda_lock", "cuda_checkpoint", "runtime_dump", "checksum", "manifest", "push")
RESTORE_STAGES = ("wait_pids_free", "verify", "preflight", "runtime_restore", "cuda_restore", "cuda_unlock",
                  "validate")


class _Clock(object):
    """Per-stage wall time, in seconds; tells ``progress`` (a StageProgress, or None) as stages end."""

    def __init__(self, progress=None):
        self.stages = {}
        self._t = None
        self.progress = progress

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
    gpus, source = discovery.gpus()
    facts = {"hostname": socket.gethostname(), "kernel": os.uname().release, "arch": os.uname().machine,
             "driver_version": discovery.driver_version() or (gpus[0]["driver_version"] if gpus else None),
             "cuda_api_version": cuda.api_version_string(drv.api_version) if drv else None,
             "gpus": gpus, "gpu_source": source,
             "cuda_device_uuids": drv.device_uuids() if drv else []}
    return facts


def _error_fields(exc):
    if isinstance(exc, GpuCkptError):
        return {k: getattr(exc, k) for k in ("cmd", "rc", "stdout", "stderr", "driver_error")}
    return {}


def _rollback(drv, checkpointed, locked):
    """Bring the source back: restore every checkpointed pid, then unlock every locked one.
    Returns (ok, [problems])."""
    problems = []
    for p in checkpointed:
        try:
            drv.restore(p)
        except GpuCkptError as exc:
            problems.append(str(exc))
    for p in locked:
        try:
            drv.unlock(p)
        except GpuCkptError as exc:
            problems.append(str(exc))
    return not problems, problems


def _find_cuda_pids(drv, pids, driver_problem):
    """CUDA pids among ``pids`` with their driver state; refuse when a GPU user can't be handled."""
    if drv is None:
        holders = [p for p in pids if discovery.nvidia_fds(p)]
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
    strays = [p for p in pids if p not in states and discovery.nvidia_fds(p)]
    if strays:
        p = strays[0]
        raise InvalidTarget("pid %d (%s) holds %s but the driver does not report it as a CUDA process; its GPU state "
                            "cannot be checkpointed" % (p, (discovery.read_stat(p) or {}).get("comm"),
                                                        ", ".join(discovery.nvidia_fds(p))),
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


class _NullJournal(object):
    def write(self, phase, **data):
        pass

    def cancelled(self):
        return False


def wait_for_image(image_dir, timeout, journal=None, libcuda_path=None, poll=0.02):
    """Wait until a complete image is in ``image_dir``: its manifest, which a push or a transfer
    writes last (as a rename). A migration starts its target's restore this way BEFORE the source is
    frozen, so that the restore begins the moment the image is complete, with the driver already
    loaded (cuInit takes about 0.4 s on an H200), instead of after Ansible has moved on to the next
    task: all of that would be downtime. Raises TransactionError when the migration's journal is
    cancelled (a rollback) and ImageError after ``timeout`` seconds. Returns the seconds waited."""
    import threading
    from .errors import ImageError
    journal = journal or _NullJournal()
    start = time.monotonic()
    warm = threading.Thread(target=cuda.load, args=(libcuda_path,), name="gpuckpt-cuinit")
    warm.daemon = True
    warm.start()
    while not image.has_manifest(image_dir):
        if journal.cancelled():
            raise TransactionError("the migration was rolled back while this host waited for the image; nothing "
                                   "was restored", stage="wait")
        if time.monotonic() - start > timeout:
            raise ImageError("no complete image arrived in %s within %s s; nothing was restored" % (image_dir, timeout),
                             stage="wait", hint="see the source's checkpoint and transfer")
        time.sleep(poll)
    warm.join()
    return time.monotonic() - start


def _identities(pids):
    """(comm, starttime) per pid: who a pid was, so we never signal a reused pid."""
    out = {}
    for p in pids:
        st = discovery.read_stat(p) or {}
        out[str(p)] = {"comm": st.get("comm"), "starttime": st.get("starttime")}
    return out


def _same_process(pid, ident):
    st = discovery.read_stat(pid)
    return bool(st) and ident is not None and st["starttime"] == ident.get("starttime")


def _each(pids, fn, parallel):
    """fn(pid) for every pid, in order, or on one thread per pid (the driver call releases the GIL).
    Parallel is the default: for 3 processes of 2 GiB on an H200 the driver's checkpoint took 1.8 s in
    parallel against 5.0 s one after another, restore 1.0 s against 2.2 s (docs/benchmarks).
    Returns the pids done; raises the first error after every call has returned."""
    if not parallel or len(pids) < 2:
        done = []
        for p in pids:
            try:
                fn(p)
            except Exception as exc:
                exc.done = done  # the rollback must undo exactly these
                raise
            done.append(p)
        return done
    from concurrent.futures import ThreadPoolExecutor
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


def checkpoint(pid, image_dir, leave_running=False, lock_timeout=30.0, backend=None, libcuda_path=None,
               check_mode=False, sign_key=None, leave_stopped=False, journal=None, parallel=True,
               progress_file=None, pusher=None):
    """Checkpoint the process tree of ``pid`` into ``image_dir``. Returns a result dict.

    Afterwards the tree exits (default), runs on (``leave_running``), or stays stopped with its GPU
    memory in host RAM (``leave_stopped``: a migration's source, released or resumed later).
    ``pusher`` (a transfer.Pusher) sends the image to another host while it is written; its report
    is the result's ``push``. A failed push never fails the checkpoint."""
    if leave_running and leave_stopped:
        raise InvalidTarget("leave_running and leave_stopped exclude each other", stage="preflight")
    progress = StageProgress(progress_file, CHECKPOINT_STAGES, os.path.abspath(image_dir))
    try:
        with _NoHangup():
            return _checkpoint(pid, image_dir, leave_running, lock_timeout, backend, libcuda_path, check_mode,
                               sign_key, leave_stopped, journal or _NullJournal(), parallel, progress, pusher)
    finally:
        progress.close()


def _start_push(pusher):
    """Open the push's streams before anything is frozen; a push that cannot start is reported, not raised."""
    if pusher is None:
        return None, None
    try:
        return pusher.start(), None
    except (OSError, GpuCkptError) as exc:
        return None, {"pushed": False, "error": "the push could not start: %s" % exc}


def _checkpoint(pid, image_dir, leave_running, lock_timeout, backend, libcuda_path, check_mode, sign_key,
                leave_stopped, journal, parallel, progress=None, pusher=None):
    image_dir = os.path.abspath(image_dir)
    backend = backend or ProcessBackend()
    after = "running" if leave_running else "stopped" if leave_stopped else "exit"
    result = {"changed": False, "image_dir": image_dir, "pid": pid, "leave_running": leave_running,
              "leave_stopped": leave_stopped}

    # Idempotence: a complete image of this same target is already there.
    if os.path.isdir(image_dir) and image.has_manifest(image_dir):
        m = image.load_manifest(image_dir)
        if str(m.get("target", {}).get("workload", m.get("target", {}).get("root_pid"))) == str(pid):
            result.update(msg="image of pid %s already exists in %s (taken %s); nothing to do"
                          % (pid, image_dir, m.get("created")), pids=m["target"]["pids"],
                          cuda_pids=m["target"]["cuda_pids"], manifest_id=m.get("id"))
            return result

    root, pids = backend.resolve(pid)
    if leave_stopped and not getattr(backend, "can_hold_stopped", True):
        raise InvalidTarget("the %s runtime cannot hold a workload stopped after its checkpoint; nothing was frozen"
                            % backend.name, stage="preflight",
                            hint="checkpoint it without leave_stopped; its image is the way back")
    runtime_facts = backend.preflight()
    net_problem = network_lock_problem(root, getattr(backend, "extra", ()))
    if net_problem:
        raise InvalidTarget(net_problem + "; nothing was frozen", stage="preflight", pid=root,
                            hint="install iptables (the gpuckpt.fleet.criu role does), or run the workload "
                                 "on the host's network")
    if os.path.isdir(image_dir) and os.listdir(image_dir):
        image.prepare_dir(image_dir)  # raises the not-empty error, touching nothing
    drv, driver_problem = cuda.load(libcuda_path)
    cuda_pids, states = _find_cuda_pids(drv, pids, driver_problem)
    for p in cuda_pids:
        features = discovery.unsupported_features(p)
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
    if cuda_pids:
        gpu_stage = "done"
    elif drv is None:
        gpu_stage = "skipped: no CUDA driver on this host (%s); CPU-only workload" % driver_problem.msg
    else:
        gpu_stage = "skipped: no process of the tree is a CUDA process"
    result.update(pids=pids, cuda_pids=cuda_pids, gpu_stage=gpu_stage)
    if check_mode:
        result.update(changed=True, msg="would checkpoint %d process(es), %d on the GPU, into %s"
                      % (len(pids), len(cuda_pids), image_dir))
        return result

    created = image.prepare_dir(image_dir)
    work = image.state_dir(image_dir)
    identities = _identities(pids)
    pusher, push_report = _start_push(pusher)
    journal.write("freezing", pids=pids, cuda_pids=cuda_pids, identities=identities, image_dir=image_dir,
                  after=after, frozen_at=time.time())
    clock = _Clock(progress)
    calls0 = len(drv.calls) if drv else 0
    locked, checkpointed = [], []
    lock_ms = int(lock_timeout * 1000)
    frozen_at = time.time()
    try:
        clock.start()
        for p in cuda_pids:  # locks stay sequential: each one is fast, and the order is the freeze order
            drv.lock(p, lock_ms)
            locked.append(p)
        clock.stop("cuda_lock")
        try:
            checkpointed.extend(_each(cuda_pids, drv.checkpoint if cuda_pids else None, parallel))
        except Exception as exc:
            checkpointed.extend(getattr(exc, "done", []))
            raise
        clock.stop("cuda_checkpoint")
        if pusher:
            pusher.watch(image_dir)  # sends the page files' completed pieces while the dump writes them
        runtime_info = backend.dump(root, image_dir, work, after)
        clock.stop("runtime_dump")
        if pusher:
            pusher.complete(image_dir)  # the rest goes while the checksums are taken
    except Exception as exc:  # noqa: BLE001 - any failure after the first lock rolls back
        if pusher:
            pusher.abort()
        ok, problems = _rollback(drv, checkpointed, locked) if drv else (True, [])
        image.discard(image_dir, created)
        journal.write("rolled_back" if ok else "rollback_failed", error=str(exc))
        stage = getattr(exc, "stage", None) or "checkpoint"
        where = " for pid %s" % exc.pid if getattr(exc, "pid", None) else ""
        state = ("the workload was rolled back and runs on" if ok else
                 "ROLLBACK INCOMPLETE, the workload may be frozen: " + "; ".join(problems))
        raise TransactionError("checkpoint failed at stage %s%s: %s; %s; no image was kept"
                               % (stage, where, getattr(exc, "msg", exc), state), stage=stage,
                               pid=getattr(exc, "pid", None), rolled_back=ok,
                               hint=getattr(exc, "hint", None), **_error_fields(exc))

    if leave_running:
        # The image is on disk; give the GPU back to the source at once, then hash.
        ok, problems = _rollback(drv, checkpointed, locked) if drv else (True, [])
        clock.stop("cuda_resume_source")
        if not ok:
            raise TransactionError("image written, but resuming the source failed: %s" % "; ".join(problems),
                                   stage="cuda-resume", rolled_back=False)
    journal.write("frozen" if after != "running" else "snapshotted", image_dir=image_dir)
    # Without leave_running CRIU has killed the tree. PID 1 may take a second to reap it; a restore
    # on this host waits for that itself, so the checkpoint does not.
    try:
        files = image.checksum_files(image_dir)
        clock.stop("checksum")
        host = host_facts(drv)
        host.update(runtime_facts)
        manifest = {
            "id": str(uuid.uuid4()), "created": _now(), "tool": "gpuckpt.fleet", "tool_version": COLLECTION_VERSION,
            "host": host, "runtime": runtime_info,
            "target": {"workload": str(pid), "root_pid": root, "pids": pids, "cuda_pids": cuda_pids, "identities": identities,
                       "after": after,
                       "processes": [discovery.process_info(p) for p in pids] if leave_running else
                       [{"pid": p} for p in pids]},
            "gpu_stage": gpu_stage, "leave_running": leave_running, "leave_stopped": leave_stopped,
            "frozen_at": frozen_at,
            "sizes": {"image_bytes": sum(f["size"] for f in files.values()), "files": len(files)},
            "timings": dict(clock.stages), "driver_call_seconds": _driver_seconds(drv, calls0),
            "files": files,
        }
        image.write_manifest(image_dir, manifest, sign_key)
        clock.stop("manifest")
    except Exception as exc:  # noqa: BLE001
        if pusher:
            pusher.abort()
        # When the tree exited, the workload now lives only in this image: bring it back.
        if after == "stopped":
            resume_stopped({"target": {"pids": pids, "cuda_pids": cuda_pids, "identities": identities}},
                           backend, drv)
            back = "the workload was resumed"
        elif after == "exit":
            try:
                _restore_from(image_dir, {"target": {"pids": pids, "cuda_pids": cuda_pids},
                                          "runtime": runtime_info}, backend, drv, None, _Clock())
                back = "the workload was restored from the unfinished image and runs on"
            except Exception as exc2:  # noqa: BLE001
                back = "RESTORING THE WORKLOAD FAILED (%s); its image is kept in %s" % (exc2, image_dir)
                raise TransactionError("writing the manifest failed: %s; %s" % (exc, back), stage="manifest")
        else:
            back = "the workload runs on"
        image.discard(image_dir, created)
        journal.write("rolled_back", error=str(exc))
        raise TransactionError("writing the image manifest failed: %s; %s" % (exc, back), stage="manifest",
                               rolled_back=True)
    journal.write("checkpointed", manifest_id=manifest["id"], image_bytes=manifest["sizes"]["image_bytes"],
                  timings=dict(clock.stages))
    if pusher:
        push_report = pusher.finish(image_dir)
        clock.stop("push")
    if push_report is not None:
        result["push"] = push_report
    result.update(changed=True, manifest_id=manifest["id"], timings=dict(clock.stages), frozen_at=frozen_at,
                  driver_call_seconds=manifest["driver_call_seconds"], image_bytes=manifest["sizes"]["image_bytes"],
                  msg="checkpointed %d process(es) (%d on the GPU) into %s%s"
                  % (len(pids), len(cuda_pids), image_dir,
                     {"running": "; workload left running", "stopped": "; workload left stopped"}.get(after, "")))
    return result


def _restore_from(image_dir, manifest, backend, drv, gpu_pairs, clock, validate_wait=0.0, parallel=False):
    """Runtime restore, CUDA restore of all pids, then unlock of all. Kills what it brought up on failure."""
    work = image.state_dir(image_dir)
    new_pids = []
    try:
        new_pids = backend.restore(image_dir, work, manifest)
        clock.stop("runtime_restore")
        cuda_pids = backend.map_pids(manifest, new_pids)
        if cuda_pids is None:
            cuda_pids = _map_pids(manifest, new_pids)
        _each(cuda_pids, lambda p: drv.restore(p, gpu_pairs), parallel)
        clock.stop("cuda_restore")
        for p in cuda_pids:
            drv.unlock(p)
        clock.stop("cuda_unlock")
        clock.resumed_at = time.time()  # the workload runs again from here: the end of its downtime
        if validate_wait:
            time.sleep(validate_wait)
        dead = [p for p in new_pids if not discovery.alive(p)]
        stopped = [p for p in new_pids if (discovery.read_stat(p) or {}).get("state") in ("T", "t")]
        if dead or stopped:
            raise GpuCkptError("restored pid %s %s" % ((dead or stopped)[0], "exited" if dead else "is stopped"),
                               stage="validate", pid=(dead or stopped)[0])
        not_running = [p for p in cuda_pids if drv.cuda_state(p) != "running"]
        if not_running:
            raise GpuCkptError("CUDA pid %d is %s after unlock" % (not_running[0], drv.cuda_state(not_running[0])),
                               stage="validate", pid=not_running[0])
        clock.stop("validate")
        return new_pids, cuda_pids
    except Exception:
        if new_pids:
            backend.kill(new_pids)
        raise


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


def restore(image_dir, gpu_map=None, force=False, backend=None, libcuda_path=None, check_mode=False,
            sign_key=None, verify=True, validate_wait=0.5, pid_wait=10.0, journal=None, parallel=True,
            progress_file=None):
    progress = StageProgress(progress_file, RESTORE_STAGES)
    try:
        with _NoHangup():
            return _restore(image_dir, gpu_map, force, backend, libcuda_path, check_mode, sign_key, verify,
                            validate_wait, pid_wait, journal or _NullJournal(), parallel, progress)
    finally:
        progress.close()


def _restore_preflight(backend, needs_driver, libcuda_path):
    backend.preflight(full=False)  # `criu check` is for checkpoint/facts; here it would add downtime
    return cuda.load(libcuda_path) if needs_driver else (None, None)


def _restore(image_dir, gpu_map, force, backend, libcuda_path, check_mode, sign_key, verify, validate_wait,
             pid_wait, journal, parallel, progress=None):
    image_dir = os.path.abspath(image_dir)
    backend = backend or ProcessBackend()
    manifest = image.load_manifest(image_dir)
    target = manifest["target"]
    result = {"changed": False, "image_dir": image_dir, "manifest_id": manifest.get("id")}

    mark = image.read_restored_mark(image_dir)
    if mark and mark.get("manifest_id") == manifest.get("id"):
        if all(discovery.alive(p) for p in mark["pids"]):
            result.update(pids=mark["pids"], cuda_pids=mark.get("cuda_pids", []),
                          msg="already restored at %s and running (pids %s); nothing to do"
                          % (mark.get("restored"), mark["pids"]))
            return result
        if not force:
            raise InvalidTarget("this image was restored at %s and that workload has since exited; restoring it "
                                "again would resume from the old state" % mark.get("restored"), stage="preflight",
                                hint="set force=true to restore it again")

    clock = _Clock(progress)
    clock.start()
    left = discovery.wait_gone(target["pids"], pid_wait)  # zombies of a just-dumped tree
    if left and backend.name == "process":
        p = left[0]
        raise InvalidTarget("pid %d, which the image needs, is in use by %s (%s): the original workload may still "
                            "run (leave_running?); refusing to start a second copy"
                            % (p, (discovery.read_stat(p) or {}).get("comm"), discovery.cmdline(p)[:80]),
                            stage="preflight", pid=p, hint="stop that process, or restore on another host")
    clock.stop("wait_pids_free")
    # The runtime's checks and the driver's load (cuInit: about 0.4 s on an H200) run beside the
    # checksum verification instead of after it: both are downtime in a migration.
    with ThreadPoolExecutor(max_workers=1) as pool:
        loading = pool.submit(_restore_preflight, backend, bool(target["cuda_pids"]), libcuda_path)
        verify_seconds = image.verify(image_dir, manifest, sign_key) if verify else None
        clock.stop("verify")
        drv, problem = loading.result()
    if target["cuda_pids"]:
        if drv is None:
            raise DriverUnavailable("the image holds %d CUDA process(es) but this host's driver cannot restore "
                                    "them: %s" % (len(target["cuda_pids"]), problem.msg), stage="preflight",
                                    hint=problem.hint)
    pairs = gpu_pairs_for(gpu_map, drv.device_uuids() if drv else [])
    if gpu_map and drv is None:
        raise InvalidTarget("gpu_map given but the image holds no CUDA process", stage="preflight")
    if check_mode:
        result.update(changed=True, pids=target["pids"], cuda_pids=target["cuda_pids"],
                      msg="would restore %d process(es) from %s" % (len(target["pids"]), image_dir))
        return result
    calls0 = len(drv.calls) if drv else 0
    clock.stop("preflight")
    journal.write("restoring", manifest_id=manifest.get("id"))
    try:
        new_pids, cuda_pids = _restore_from(image_dir, manifest, backend, drv, pairs, clock, validate_wait,
                                            parallel)
        resumed_at = clock.resumed_at
    except Exception as exc:  # noqa: BLE001
        journal.write("restore_failed", error=str(exc))
        stage = getattr(exc, "stage", None) or "restore"
        raise TransactionError("restore failed at stage %s%s: %s; what was brought up was stopped, the image is "
                               "untouched" % (stage, " for pid %s" % exc.pid if getattr(exc, "pid", None) else "",
                                              getattr(exc, "msg", exc)),
                               stage=stage, pid=getattr(exc, "pid", None), rolled_back=True,
                               hint=getattr(exc, "hint", None), **_error_fields(exc))
    image.write_restored_mark(image_dir, {"manifest_id": manifest.get("id"), "restored": _now(),
                                          "pids": new_pids, "cuda_pids": cuda_pids, "host": socket.gethostname()})
    journal.write("restored", pids=new_pids, cuda_pids=cuda_pids, resumed_at=resumed_at)
    result.update(changed=True, pids=new_pids, cuda_pids=cuda_pids, timings=dict(clock.stages),
                  resumed_at=resumed_at,
                  verify_seconds=verify_seconds, driver_call_seconds=_driver_seconds(drv, calls0),
                  gpu_pairs=pairs, msg="restored %d process(es) (%d on the GPU) from %s"
                  % (len(new_pids), len(cuda_pids), image_dir))
    return result


def resume_stopped(manifest, backend=None, drv=None, libcuda_path=None):
    """Roll a stopped source back to running: SIGCONT (the driver's restore thread must run), then CUDA
    restore and unlock. Idempotent; returns (changed, pids that run)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    idents = target.get("identities") or {}
    mine = [p for p in target["pids"] if _same_process(p, idents.get(str(p)))]
    if not mine:
        raise TransactionError("none of the source's processes %s exists any more; restore from the image instead"
                               % target["pids"], stage="resume-source")
    changed = backend.is_held(mine)
    backend.resume(mine)
    cuda_pids = [p for p in target["cuda_pids"] if p in mine]
    if cuda_pids:
        if drv is None:
            drv, problem = cuda.load(libcuda_path)
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
    """Commit: kill the source's stopped processes (only those that are still the same processes)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    idents = target.get("identities") or {}
    mine = [p for p in target["pids"] if _same_process(p, idents.get(str(p)))]
    running = [] if backend.is_held(mine) else \
        [p for p in mine if (discovery.read_stat(p) or {}).get("state") not in ("T", "t", "Z")] or mine
    if running:
        raise TransactionError("source pid %d runs again (it is not stopped): refusing to kill it; the migration "
                               "was rolled back or resumed by hand" % running[0], stage="release-source",
                               pid=running[0])
    if mine:
        backend.kill(mine)
    return bool(mine), mine


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _rss_bytes(pid):
    text = _read("/proc/%d/status" % pid) or ""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _free_bytes(path):
    """Free bytes of the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def facts(pids=None, libcuda_path=None, criu_path=None, check_criu=True, paths=None, tree_of=None,
          check_pids=None):
    drv, problem = cuda.load(libcuda_path)
    out = {"host": {"hostname": socket.gethostname(), "kernel": os.uname().release,
                    "boot_id": _read("/proc/sys/kernel/random/boot_id"),
                    "pid_namespace": os.readlink("/proc/self/ns/pid"),
                    "net_namespace": discovery.net_namespace()}}
    if paths:
        out["disk"] = {p: {"free_bytes": _free_bytes(p)} for p in paths}
    if tree_of:
        st = discovery.read_stat(int(tree_of))
        if st is None:
            out["tree"] = {"root": int(tree_of), "exists": False, "pids": []}
        else:
            tpids = discovery.process_tree(int(tree_of))
            gpu_mem = discovery.gpu_memory_by_pid()
            cuda_pids = [p for p in tpids if drv.state_or_error(p) is not None] if drv else []
            out["tree"] = {"root": int(tree_of), "exists": True, "pids": tpids, "cuda_pids": cuda_pids,
                           "cuda_states": {str(p): drv.state_or_error(p) for p in cuda_pids} if drv else {},
                           "rss_bytes": sum(_rss_bytes(p) for p in tpids),
                           "net_namespace": discovery.net_namespace(int(tree_of)),
                           "bound_sockets": discovery.bound_sockets(tpids),
                           "gpu_bytes": sum(gpu_mem.get(p, 0) for p in tpids)}
    if check_pids:
        out["pids_in_use"] = [int(p) for p in check_pids if discovery.read_stat(int(p)) is not None]
    drv_info = {"available": drv is not None, "driver_version": discovery.driver_version()}
    if drv:
        drv_info.update(drv.info())
    else:
        drv_info.update(checkpoint_api=False, reason=problem.msg)
    gpus, source = discovery.gpus()
    if gpus and not drv_info["driver_version"]:
        drv_info["driver_version"] = gpus[0].get("driver_version")
    out["driver"] = drv_info
    out["gpus"] = gpus
    out["gpu_source"] = source
    out["cuda_device_uuids"] = drv.device_uuids() if drv else []
    if pids:
        candidates = [int(p) for p in pids]
    else:
        candidates = [p for p in discovery.all_pids() if discovery.nvidia_fds(p)]
        if drv:  # checkpointed processes hold no /dev/nvidia fd: ask the driver about the rest
            candidates = sorted(set(candidates) | {p for p in discovery.all_pids()
                                                   if p != os.getpid() and drv.state_or_error(p) is not None})
    procs = []
    for p in candidates:
        if discovery.read_stat(p) is None:
            procs.append({"pid": p, "exists": False})
            continue
        info = discovery.process_info(p, drv)
        info["exists"] = True
        procs.append(info)
    out["cuda_processes"] = procs
    criu = {"installed": False}
    try:
        from .criu import Criu
        c = Criu(criu_path)
        criu.update(installed=True, path=c.path, version=c.version())
        criu["supported"] = tuple(int(x) for x in criu["version"].split(".")[:2]) >= (4, 0)
        if check_criu:
            ok, text = c.check()
            criu.update(check_ok=ok, check_output=text)
    except GpuCkptError as exc:
        criu["error"] = exc.msg
    out["criu"] = criu
    out["ready"] = bool(criu.get("supported") and criu.get("check_ok", True) and
                        (drv is not None or not gpus))
    return out
