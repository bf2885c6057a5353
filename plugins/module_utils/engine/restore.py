# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The restore, importable without Ansible.

verify image -> runtime restore -> CUDA restore every pid -> (probe) -> unlock every pid -> validate

Where the runtime's restore takes a gate, a big image's page files are verified beside the runtime's
restore, which holds the restored tree until they check out (verify_beside.py).

A restore in a migration moves the target's journal from received to restoring under its lock, and
records the restored processes' identities before it unlocks them, so a recovery always knows what a
restore brought up, even when that restore's module died. Validation compares the restored tree with
the dumped one: a process that was a zombie or stopped at the dump may be so again; a CUDA process
that does not run is a failure. A restore that fails kills what it brought up; the image is untouched.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

from ..core import hugepages
from ..core import image, image_signature
from ..core import procfs
from ..core.errors import DriverUnavailable, GpuCkptError, ImageError, InvalidTarget, TransactionError
from ..core.journal import identities, process_identity, same_process
from ..core.progress import StageProgress
from ..cuda import driver as cuda
from ..runtimes.process import ProcessBackend
from . import cooperative, ports, verify_beside
from .delivery import wait_for_delivery
from .steps import DEAD, STOPPED, Clock, NoHangup, PartlyDone, describe_failure, driver_seconds, driver_seconds_by_pid, \
    each, error_fields, now_iso

RESTORE_STAGES = ("wait_pids_free", "verify", "preflight", "runtime_restore", "cuda_restore", "probe",
                  "cuda_unlock", "validate")

# What restore_from brought up: its host pids (root first), its CUDA pids, the GPU pairs each CUDA process
# was restored onto ({pid: pairs}, None when none was moved), the probe's report, validation's notes, and
# when the workload ran again (the end of its downtime, time.time()).
RestoreOutcome = namedtuple("RestoreOutcome", "pids cuda_pids gpu_pairs probe notes resumed_at")


class RestoreOptions(object):
    """What a restore may be told; every option has a default."""

    def __init__(self, gpu_map=None, force=False, libcuda_path=None, check_mode=False, sign_key=None, verify=True,
                 validate_wait=0.5, pid_wait=10.0, parallel=True, progress_file=None, wait_for_image=0.0,
                 journal_wait=60.0, probe_command=None, probe_timeout=60.0, host_huge_pages=False,
                 allow_unverified_signature=False, verify_beside_bytes=verify_beside.MIN_BYTES):
        self.gpu_map, self.force, self.libcuda_path, self.check_mode = gpu_map, force, libcuda_path, check_mode
        self.sign_key, self.verify, self.validate_wait, self.pid_wait = sign_key, verify, validate_wait, pid_wait
        self.allow_unverified_signature = bool(allow_unverified_signature)
        self.parallel, self.progress_file, self.wait_for_image = parallel, progress_file, wait_for_image
        self.journal_wait = journal_wait
        self.probe = (list(probe_command), probe_timeout) if probe_command else None
        self.host_huge_pages = bool(host_huge_pages)
        self.verify_beside_bytes = verify_beside_bytes  # the least page data verified beside the restore


def restore(image_dir, backend=None, journal=None, make_backend=None, **options):
    """Restore the workload of ``image_dir``: its path, or the image.Image its caller opened (and
    closes). ``journal``: the migration's target journal: the restore then waits (``wait_for_image``
    seconds) for this migration's image to be delivered, and runs as the journal's transition
    received -> restoring -> restored under its lock. The runtime's backend: ``backend``, or the one
    ``make_backend(manifest)`` makes once the image is open (in a migration it may arrive only after
    the restore started), else a bare process tree's."""
    opts = RestoreOptions(**options)
    where = image_dir.path if isinstance(image_dir, image.Image) else os.path.abspath(image_dir)
    progress = StageProgress(opts.progress_file, RESTORE_STAGES)
    progress.start()
    try:
        with NoHangup():
            waited = None
            if journal is not None and opts.wait_for_image and not opts.check_mode:
                waited = wait_for_delivery(journal, opts.wait_for_image, opts.libcuda_path)
            held = contextlib.nullcontext() if journal is None else \
                journal.hold(wait=opts.journal_wait, purpose="the restore of %s" % where)
            # (the image is waited for first: huge pages matter from the runtime's restore on; it is
            # opened under the journal's lock, once its delivery is settled)
            with hugepages.HugePages(opts.host_huge_pages and not opts.check_mode,
                                     settle_stale=not opts.check_mode) as thp:
                with held, _opened(image_dir) as img:
                    res = _restore(img, opts, backend, journal, progress, make_backend)
            if thp.report is not None:
                res["huge_pages"] = thp.report
            if waited is not None and res.get("timings") is not None:
                res["timings"] = dict(res["timings"], wait_for_image=round(waited, 6))
            return res
    finally:
        progress.close()


def _opened(image_dir):
    """The image to restore: opened now from its path (and closed after), or the Image its caller opened."""
    if isinstance(image_dir, image.Image):
        return contextlib.nullcontext(image_dir)
    return image.Image.open(image_dir)


def _journal_gate(journal, img):
    """In a migration: restore only this migration's delivered image, from the directory it created
    here. Returns a result when the restore already happened (nothing to do)."""
    image_dir, manifest = img.path, img.manifest
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
    if not img.has_identity(doc.get("image_dir_identity")):
        raise InvalidTarget("%s is no longer the directory migration %s created here; nothing was restored"
                            % (image_dir, journal.id), stage="preflight")
    if (manifest.get("migration") or {}).get("nonce") != doc.get("nonce"):
        raise ImageError("the image in %s is not this migration's checkpoint (its nonce differs); nothing was restored"
                         % image_dir, stage="verify")
    return None


def _already_restored(img, opts, journal):
    """Idempotence: the result when this image's workload was already restored and runs (nothing to do),
    else None. Refuses to restore again an image whose restored copy has since exited, unless forced."""
    if journal is not None:
        return _journal_gate(journal, img)
    mark, manifest = img.restored_mark(), img.manifest
    if not mark or mark.get("manifest_id") != manifest.get("id"):
        return None
    if all(procfs.alive(p) for p in mark["pids"]):
        return {"changed": False, "image_dir": img.path, "manifest_id": manifest.get("id"), "pids": mark["pids"],
                "cuda_pids": mark.get("cuda_pids", []),
                "msg": "already restored at %s and running (pids %s); nothing to do" % (mark.get("restored"), mark["pids"])}
    if not opts.force:
        raise InvalidTarget("this image was restored at %s and that workload has since exited; restoring it "
                            "again would resume from the old state" % mark.get("restored"), stage="preflight",
                            hint="set force=true to restore it again")
    return None


def _wait_pids_free(manifest, backend, pid_wait):
    """Zombies of a just-dumped tree must be reaped first (CRIU restores the same pids; a runtime without
    CRIU needs none free). A runtime that brings the pids back in the host's own pid namespace refuses one
    that is still in use: the original workload may still run."""
    left = procfs.wait_gone(host_pids_restored(manifest), pid_wait) if backend.capabilities.uses_criu else []
    if left and backend.capabilities.restores_host_pids:
        p = left[0]
        raise InvalidTarget("pid %d, which the image needs, is in use by %s (%s): the original workload may still "
                            "run (leave_running?); refusing to start a second copy"
                            % (p, (procfs.read_stat(p) or {}).get("comm"), procfs.cmdline(p)[:80]),
                            stage="preflight", pid=p, hint="stop that process, or restore on another host")


def _wait_ports_free(manifest, backend, opts):
    """Before CRIU binds the tree's listening ports again in this network namespace: wait (bounded by the
    kernel's TIME_WAIT length and a margin) until no TIME_WAIT socket holds one of them (engine/ports.py).
    Returns the wait's report, or None when there was nothing to wait for."""
    if opts.check_mode or not backend.capabilities.uses_criu:
        return None
    return ports.wait_time_wait_gone(ports.listen_ports(manifest))


def _with_ports_wait(result, ports_wait):
    """The restore's result, saying how long it waited for its ports (``tcp_time_wait``) where it had to."""
    if ports_wait is not None:
        result["tcp_time_wait"] = ports_wait
        result["msg"] = "%s; %s" % (result.get("msg", ""), ports_wait["msg"])
        if not ports_wait["cleared"]:
            result.setdefault("warnings", []).append(ports_wait["msg"])
    return result


def _restore_preflight(backend, needs_driver, libcuda_path):
    backend.preflight(full=False)  # `criu check` is for checkpoint/facts; here it would add downtime
    return backend.load_cuda(libcuda_path) if needs_driver else (None, None)


def _verify_and_load(img, opts, backend, journal, clock, files=None):
    """The image's checksums (``files``: of only these), and beside them the runtime's checks and the
    driver's load (cuInit: about 0.4 s on an H200): both are downtime in a migration. Returns (verify
    seconds, driver or None)."""
    target = img.manifest["target"]
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            loading = pool.submit(_restore_preflight, backend, bool(target["cuda_pids"]), opts.libcuda_path)
            verify_seconds = img.verify(opts.sign_key, opts.allow_unverified_signature, files) if opts.verify else None
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
    return verify_seconds, drv


def _bring_up(img, backend, drv, pairs, clock, opts, journal, pages=None):
    """The restore proper, as the journal's transition to restoring and on; returns its RestoreOutcome.
    A failure is a TransactionError that says what was brought up was stopped, or the ImageError of
    ``pages`` (verify_beside.PagesBeside) that did not check out (what CRIU restored never ran)."""
    manifest = img.manifest
    backend.bind(manifest)
    if journal is not None:
        journal.transition("restoring", manifest_id=manifest.get("id"), owner=process_identity(os.getpid()),
                           container=backend.container, pids=[], identities={}, restore_pod=backend.restore_pod)

    def on_restored(new_pids):  # before any unlock: a recovery must always know what this restore brought up
        if journal is not None:
            journal.record(pids=new_pids, identities=identities(new_pids), container=backend.container)

    try:
        return restore_from(img.path, manifest, backend, drv, pairs, clock, opts.validate_wait, opts.parallel,
                            on_restored, opts.probe, work_dir=img.state_dir, pages=pages)
    except ImageError as exc:
        if journal is not None:
            journal.transition("restore_failed", error=str(exc), bad_files=exc.details.get("bad_files"), pids=[],
                               identities={})
        raise
    except Exception as exc:  # noqa: BLE001
        stage, pid, reason, hint = describe_failure(exc)
        stage = stage or "restore"
        err = TransactionError("restore failed at stage %s%s: %s; what was brought up was stopped, the image is "
                               "untouched" % (stage, " for pid %s" % pid if pid else "", reason),
                               stage=stage, pid=pid, rolled_back=True, hint=hint, **error_fields(exc))
        if journal is not None:
            journal.transition("restore_failed", error=err.msg, pids=[], identities={})
        raise err


def _signature_checked(img, opts):
    """The manifest's signature, checked first of all (it needs the manifest alone): a signed image is not
    restored, nor reported as already restored, without its key unless the user allowed it by name; with a
    key, an image without a signature or with another one is refused. Returns check_signature's verdict."""
    return image_signature.check_signature(img.manifest, opts.sign_key, opts.allow_unverified_signature, img.path)


def _signature_result(result, signature):
    """The restore's result, saying what became of the signature; a warning when it was not checked."""
    result["signature"] = signature
    if signature == "not_checked":
        result["msg"] = "%s; its manifest's signature was NOT checked (allow_unverified_signature)" % result["msg"]
        result["warnings"] = ["the image %s is signed, and its signature was not checked (no sign_key was given, "
                              "allow_unverified_signature is set)" % result["image_dir"]]
    return result


def _restore(img, opts, backend, journal, progress, make_backend=None):
    manifest = img.manifest
    signature = _signature_checked(img, opts)
    done = _already_restored(img, opts, journal)
    if done is not None:
        return _signature_result(done, signature)
    # (made once the image is known good to go on: an image restored already needs no runtime)
    backend = backend or (make_backend(manifest) if make_backend else ProcessBackend())
    clock = Clock(progress)
    clock.start()
    gate, pages = verify_beside.open_gate(img, opts, backend), None
    try:
        if gate is None:
            _wait_pids_free(manifest, backend, opts.pid_wait)
            ports_wait = _wait_ports_free(manifest, backend, opts)
            clock.stop("wait_pids_free")
            verify_seconds, drv = _verify_and_load(img, opts, backend, journal, clock)
        else:  # all but the pages now; the pages beside the wait for the pids and the runtime's restore
            rest = sorted(set(manifest.get("files") or {}) - set(verify_beside.page_files(manifest)))
            verify_seconds, drv = _verify_and_load(img, opts, backend, journal, clock, files=rest)
            pages = verify_beside.PagesBeside(img, opts, gate).start()
            _wait_pids_free(manifest, backend, opts.pid_wait)
            ports_wait = _wait_ports_free(manifest, backend, opts)
            clock.stop("wait_pids_free")
        try:
            result = _restore_checked(img, opts, backend, journal, clock, drv, pages, verify_seconds)
        except GpuCkptError as exc:
            if ports_wait is not None and not ports_wait["cleared"]:
                exc.msg = "%s (%s)" % (exc.msg, ports_wait["msg"])
            raise
        return _signature_result(_with_ports_wait(result, ports_wait), signature)
    finally:
        if pages is not None:
            pages.settle()
        elif gate is not None:
            gate.close()


def _restore_checked(img, opts, backend, journal, clock, drv, pages, verify_seconds):
    """The restore once the image (or all of it but ``pages``, checked beside it) is verified."""
    manifest, target = img.manifest, img.manifest["target"]
    result = {"changed": False, "image_dir": img.path, "manifest_id": manifest.get("id")}
    pairs = gpu_pairs_for(opts.gpu_map, drv.device_uuids() if drv else [])
    if opts.gpu_map and drv is None:
        raise InvalidTarget("gpu_map given but the image holds no CUDA process", stage="preflight")
    if opts.check_mode:
        result.update(changed=True, pids=target["pids"], cuda_pids=target["cuda_pids"],
                      msg="would restore %d process(es) from %s" % (len(target["pids"]), img.path))
        return result
    calls0 = len(drv.calls) if drv else 0
    clock.stop("preflight")
    outcome = _bring_up(img, backend, drv, pairs, clock, opts, journal, pages)
    if pages is not None:
        verify_seconds = (verify_seconds or 0.0) + pages.result()
    # (a cooperative job's ranks wait at their step boundary: the restore is done, they re-create their groups)
    coop_resumed = cooperative.resume_restored(manifest.get("cooperative"), target["pids"], outcome.pids)
    if journal is not None:
        journal.transition("restored", pids=outcome.pids, cuda_pids=outcome.cuda_pids,
                           identities=identities(outcome.pids), resumed_at=outcome.resumed_at)
    else:
        img.write_restored_mark({"manifest_id": manifest.get("id"), "restored": now_iso(),
                                 "pids": outcome.pids, "cuda_pids": outcome.cuda_pids, "host": socket.gethostname()})
    result.update(changed=True, pids=outcome.pids, cuda_pids=outcome.cuda_pids, timings=dict(clock.stages),
                  resumed_at=outcome.resumed_at, validation_notes=outcome.notes, probe=outcome.probe,
                  verify_seconds=verify_seconds, driver_call_seconds=driver_seconds(drv, calls0),
                  driver_call_seconds_by_pid=driver_seconds_by_pid(drv, calls0),
                  gpu_pairs=pairs or outcome.gpu_pairs or None, pages_verified_beside_restore=pages is not None,
                  cooperative_resumed=coop_resumed if manifest.get("cooperative") else None,
                  msg="restored %d process(es) (%d on the GPU) from %s"
                  % (len(outcome.pids), len(outcome.cuda_pids), img.path))
    return result


def host_pids_restored(manifest):
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


def _restore_gpu_memory(backend, drv, cuda_pids, gpu_pairs, parallel):
    """The driver's restore of every CUDA pid onto its GPUs: the user's map for every process; else the
    runtime's (a pod's new container was given other GPUs by the device plugin), else none: the driver
    puts each GPU back where it was. Returns {pid: pairs} of those moved."""
    placed = {p: gpu_pairs or backend.gpu_pairs_for(p) for p in cuda_pids}
    try:
        each(cuda_pids, lambda p: drv.restore(p, placed[p]), parallel)
    except PartlyDone as exc:
        raise exc.error
    return {str(p): pairs for p, pairs in placed.items() if pairs}


def restore_from(image_dir, manifest, backend, drv, gpu_pairs, clock, validate_wait=0.0, parallel=False,
                 on_restored=None, probe=None, work_dir=None, pages=None):
    """Runtime restore, CUDA restore of all pids, the user's ``probe`` ((argv, timeout) run inside the
    workload), then unlock of all, then validation. ``on_restored`` (new pids) is called right
    after the runtime restore. ``work_dir``: the image's state dir when its caller holds it open
    (image.Image.state_dir). ``pages``: the page files' check (verify_beside.PagesBeside), whose gate
    holds the runtime's restore. Kills what it brought up on failure. Returns a RestoreOutcome."""
    work = work_dir or image.state_dir(image_dir)
    new_pids = []
    try:
        try:
            new_pids = backend.restore(image_dir, work, manifest, **({"gate": pages.gate} if pages else {}))
        except Exception:
            if pages is not None:
                pages.result()  # pages that did not check out are why the gate failed the restore: say so
            raise
        if pages is not None:
            pages.result()
        clock.stop("runtime_restore")
        if on_restored is not None:
            on_restored(new_pids)
        cuda_pids = backend.map_pids(manifest, new_pids)
        if cuda_pids is None:
            cuda_pids = _map_pids(manifest, new_pids)
        by_runtime = backend.capabilities.owns_cuda_stage  # its restore brought the GPU memory back and unlocked
        moved = None
        if not by_runtime:
            moved = _restore_gpu_memory(backend, drv, cuda_pids, gpu_pairs, parallel)
            backend.after_gpu_restore()  # (still locked: what that restore made in a container's /dev goes)
        clock.stop("cuda_restore")
        report = None
        if probe:
            # Its GPU memory is back but its CUDA processes are still locked: a failing probe is rolled
            # back before the restored copy made progress of its own (no work done twice).
            report = _probe(backend, new_pids[0], probe[0], probe[1])
            clock.stop("probe")
        for p in ([] if by_runtime else cuda_pids):
            drv.unlock(p)
        clock.stop("cuda_unlock")
        resumed_at = time.time()  # the workload runs again from here: the end of its downtime
        if validate_wait:
            time.sleep(validate_wait)
        notes = _validate(manifest, new_pids, cuda_pids, drv)
        clock.stop("validate")
        return RestoreOutcome(new_pids, cuda_pids, moved or None, report, notes, resumed_at)
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
