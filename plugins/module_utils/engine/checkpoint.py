# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The checkpoint, stage 1 (the driver's) and stage 2 (the runtime's), importable without Ansible.

plan (preflight, touches nothing: plan.py) -> image dir -> (quiesce) -> lock every CUDA pid ->
checkpoint every CUDA pid (VRAM -> host RAM) -> runtime dump (RAM + CPU state -> image dir) ->
checksums + manifest -> (a migration) deliver the image to the target (delivery.py)

Each step carries its undo, and any failure undoes the steps done, newest first, so the workload runs
on (steps.py). In a migration each step is a transition of the source's journal, under its lock, and
a recovery's fence stops the steps at the next one; delivering the image to the target is the last
step and has no undo: from there on only the migration's settlement decides (migration/transaction.py).
"""
from __future__ import annotations

import os
import time
import uuid

from ..transfer import chunk_hasher
from ..core import hugepages
from ..core import image
from ..core import memdir
from ..core import procfs
from ..core.errors import GpuCkptError, InvalidTarget
from ..core.journal import process_identity, same_process
from ..core.progress import StageProgress
from ..cuda import nccl
from ..cuda import processes as gpu_procs
from ..runtimes.process import ProcessBackend
from . import cooperative, in_memory, ports, quiesce
from .delivery import deliver
from .plan import CheckpointOptions, plan_checkpoint
from .restore import restore_from
from .steps import STOPPED, Clock, NoHangup, PartlyDone, Step, driver_seconds, driver_seconds_by_pid, each, now_iso, \
    run_steps

COLLECTION_VERSION = "0.1.0"
CHECKPOINT_STAGES = ("cuda_lock", "cuda_checkpoint", "runtime_dump", "checksum", "manifest", "push")


class _Steps(object):
    """The checkpoint's steps over one plan (``ctx``), each with its undo (see the module doc)."""

    def __init__(self, ctx, clock, sender):
        self.ctx, self.clock, self.sender = ctx, clock, sender
        self.drv, self.opts, self.backend = ctx.drv, ctx.opts, ctx.backend

    def make_dir(self, c):
        memory = None
        if self.opts.image_in_memory:  # checked before the directory is made: a refusal touches nothing
            if os.path.lexists(c.image_dir):
                raise InvalidTarget("image_in_memory needs a new image_dir, and %s exists; nothing was frozen"
                                    % c.image_dir, stage="preflight", hint="give a path that does not exist yet")
            memory = in_memory.plan(c.pids, c.cuda_pids, self.opts.image_memory_bytes)
        c.made = image.prepare_dir(c.image_dir)
        if memory is not None:
            in_memory.mount(c.image_dir, c.made, memory["size_bytes"], memory["tmpfs_huge"])
            c.in_memory = memory
        c.work = image.state_dir(c.image_dir)
        c.journal_data["planned"] = {
            "pids": c.pids, "cuda_pids": c.cuda_pids, "identities": c.identities, "states": c.states,
            "image_dir": c.image_dir, "image_dir_identity": c.made["identity"], "image_dir_created": c.made["created"],
            "after": c.after, "nonce": self.opts.nonce, "runtime": self.backend.name, "container": self.backend.container,
            "pod": self.backend.pod, "owner": process_identity(os.getpid()), "image_in_memory": memory,
            "cooperative": c.coop}

    def discard_dir(self, c):
        if not c.keep_image:
            image.discard(c.image_dir, c.made)

    def ask_to_quiesce(self, c):
        """The workload gives back what it need not keep (see quiesce.py); it runs on meanwhile."""
        opts = self.opts
        if opts.quiesce_signal:
            c.quiesce = quiesce.by_signal(c.cuda_pids or [c.root], opts.quiesce_signal[0], opts.quiesce_signal[1],
                                          opts.quiesce_timeout)
        elif opts.quiesce_command:
            c.quiesce = quiesce.by_command(self.backend, c.root, opts.quiesce_command, opts.quiesce_timeout)

    def ask_cooperative(self, c):
        """Every rank to one step boundary, its communicators released, acknowledged (cooperative.py); then judged
        again from /proc before anything is frozen."""
        opts = self.opts
        c.quiesce = cooperative.ask(c.coop["pids"], opts.quiesce_signal[0], opts.quiesce_signal[1],
                                    opts.quiesce_timeout, opts.quiesce_lease, c.coop["request"])
        cooperative.check_released(c.quiesce, nccl.live_communicators)

    def resume_cooperative(self, c):
        """Tell every rank to resume (the checkpoint's end with the job running, or its undo); once."""
        if c.quiesce is not None and c.coop is not None and not c.coop.get("resumed"):
            pids = [c.pid_map.get(p, p) for p in c.coop["pids"]]
            c.coop["resumed"] = cooperative.resume(pids, c.coop["request"])
            c.quiesce["resumed"] = c.coop["resumed"]

    def begin_freeze(self, c):
        c.frozen_at = time.time()
        c.journal_data["freezing"] = {"frozen_at": c.frozen_at}
        self.clock.start()

    def lock(self, c):
        lock_ms = int(self.opts.lock_timeout * 1000)
        for p in c.cuda_pids:  # one after another: each is fast, and the order is the freeze order
            if c.quiesce is not None and c.coop is not None:
                cooperative.check_alive(c.quiesce, p)
            self.drv.lock(p, lock_ms)
            c.locked.append(p)
        self.clock.stop("cuda_lock")

    def _here(self, c, p):
        """Whether the checkpointed pid ``p`` still needs its undo: the same process (a rank a cooperative job lost,
        or that its launcher killed, needs nothing unlocked), or the copy an undump brought back. A pid this host
        cannot judge (a sandbox's own pids; one with no identity recorded) is undone as it always was."""
        if p in c.pid_map or self.backend.capabilities.cuda_in_sandbox:
            return True
        ident = c.identities.get(str(p))
        return ident is None or same_process(ident) is not None

    def unlock(self, c):
        for p in c.locked:
            if self._here(c, p):
                self.drv.unlock(c.pid_map.get(p, p))

    def checkpoint_gpu(self, c):
        try:
            c.checkpointed.extend(each(c.cuda_pids, self.drv.checkpoint, self.opts.parallel))
        except PartlyDone as exc:
            c.checkpointed.extend(exc.done)
            raise exc.error
        self.clock.stop("cuda_checkpoint")

    def restore_gpu(self, c):
        for p in c.checkpointed:
            if self._here(c, p):
                self.drv.restore(c.pid_map.get(p, p))

    def dump(self, c):
        sender = self.sender
        pushed = None
        if sender is not None:  # the page files' completed pieces go while the dump writes them, and the push
            pushed = sender.take_checksums()  # hashes what it reads to send (one reading of the image, not two)
            sender.watch(c.image_dir)
        c.hasher = chunk_hasher.ChunkHasher(c.image_dir, pushed=pushed).follow()  # (else hashed here as it is written)
        c.listen_ports = ports.at_dump(self.backend, c.pids)  # (after the quiesce: what CRIU will bind again)
        try:
            c.runtime_info = self.backend.dump(c.root, c.image_dir, c.work, c.after)
        except GpuCkptError as exc:
            in_memory.explain_full(exc, c.image_dir, c.in_memory)
            raise
        self.clock.stop("runtime_dump")
        if sender is not None:
            sender.complete(c.image_dir)  # the rest goes while the checksums are taken

    def undump(self, c):
        """Put back what the dump left: thaw a held tree, or bring an exited one back from its image."""
        backend = self.backend
        if c.hasher is not None:
            c.hasher.stop()
        if c.after == "stopped":
            backend.resume([p for p in c.pids if c.states.get(str(p)) not in STOPPED])
        elif c.after == "exit":
            if backend.capabilities.restores_host_pids:
                procfs.wait_gone(c.pids, 10)  # PID 1 may take a second to reap the dumped tree
            ports.wait_time_wait_gone(c.listen_ports)  # (CRIU binds its listening ports again here)
            own_image = {"target": {"pids": c.pids, "cuda_pids": [], "states": c.states}, "runtime": c.runtime_info}
            unreported = Clock()  # (the rollback's stages are not the checkpoint's: timed apart, never reported)
            unreported.start()
            try:
                new_pids = restore_from(c.image_dir, own_image, backend, None, None, unreported).pids
            except Exception:
                c.keep_image = True  # the workload lives only in this image now
                raise
            c.pid_map = dict(zip(c.pids, new_pids)) if len(new_pids) == len(c.pids) else {}

    def resume_gpu_now(self, c):
        """leave_running: the image is on disk; give the GPU back to the source at once, then hash."""
        self.restore_gpu(c)
        self.unlock(c)
        c.checkpointed, c.locked = [], []
        self.clock.stop("cuda_resume_source")

    def write_manifest(self, c):
        clock = self.clock
        files = c.hasher.checksums() if c.hasher is not None else image.checksum_files(c.image_dir)
        clock.stop("checksum")
        m = _manifest(c, files, clock, c.listen_ports)
        c.manifest = image.write_manifest(c.image_dir, m, self.opts.sign_key)
        clock.stop("manifest")
        c.journal_data["checkpointed"] = {"manifest_id": m["id"], "image_bytes": m["sizes"]["image_bytes"],
                                          "timings": dict(clock.stages)}

    def remove_manifest(self, c):
        try:
            os.unlink(os.path.join(c.image_dir, image.MANIFEST))
        except OSError:
            pass

    def all(self):
        """The steps, in order, for this plan."""
        ctx, opts = self.ctx, self.opts
        steps = [Step("image_dir", self.make_dir, self.discard_dir, phase="planned")]
        if opts.cooperative:  # (a rank that fails to answer has been told to resume: the undo covers what follows)
            steps.append(Step("quiesce", self.ask_cooperative, self.resume_cooperative))
        elif opts.quiesce_signal or opts.quiesce_command:
            steps.append(Step("quiesce", self.ask_to_quiesce))
        steps.append(Step("freeze", self.begin_freeze, phase="freezing"))
        # (a runtime that owns the CUDA stage runs it in its own dump)
        engine_cuda = bool(ctx.cuda_pids) and not self.backend.capabilities.owns_cuda_stage
        if engine_cuda:
            steps += [Step("cuda_lock", self.lock, self.unlock, partial=True),
                      Step("cuda_checkpoint", self.checkpoint_gpu, self.restore_gpu, partial=True)]
        steps.append(Step("runtime_dump", self.dump, self.undump, phase="frozen"))
        if ctx.after == "running" and engine_cuda:
            steps.append(Step("cuda_resume_source", self.resume_gpu_now))
        if ctx.after == "running" and opts.cooperative:
            steps.append(Step("cooperative_resume", self.resume_cooperative))
        steps.append(Step("manifest", self.write_manifest, self.remove_manifest, phase="checkpointed"))
        return steps


def _manifest(c, files, clock, listen_ports=()):
    """The image's manifest: what was checkpointed, where, how, and every file's checksum. ``listen_ports``: the
    TCP ports the tree listened on in the checkpointer's network namespace (a restore there waits for them)."""
    host = dict(c.host)
    host.update(c.runtime_facts)
    m = {"id": c.opts.image_id or str(uuid.uuid4()), "created": now_iso(), "tool": "gpuckpt.fleet", "tool_version": COLLECTION_VERSION,
         "host": host, "runtime": c.runtime_info,
         "target": {"workload": str(c.target), "root_pid": c.root, "pids": c.pids, "cuda_pids": c.cuda_pids,
                    "identities": c.identities, "states": c.states, "after": c.after,
                    "gpus": c.cuda_gpus, "tcp_listen_ports": list(listen_ports),
                    "processes": [gpu_procs.process_info(p) for p in c.pids] if c.after == "running" else
                    [{"pid": p} for p in c.pids]},
         "cooperative": cooperative.record_of(c.quiesce),
         "gpu_stage": c.gpu_stage, "leave_running": c.after == "running", "leave_stopped": c.after == "stopped",
         "frozen_at": c.frozen_at,
         "sizes": {"image_bytes": sum(f["size"] for f in files.values()), "files": len(files),
                   "hashed_during_dump": c.hasher.hashed_early() if c.hasher is not None else 0},
         "timings": dict(clock.stages), "driver_call_seconds": driver_seconds(c.drv, c.calls0),
         "driver_call_seconds_by_pid": driver_seconds_by_pid(c.drv, c.calls0), "files": files}
    if c.migration_id:
        m["migration"] = {"id": c.migration_id, "nonce": c.opts.nonce}
    return m


def checkpoint(target, image_dir, backend=None, journal=None, sender=None, **options):
    """Checkpoint the workload ``target`` (a pid, or a container for a container backend) into
    ``image_dir``. Returns a result dict.

    Afterwards the workload exits (default), runs on (``leave_running``), or stays stopped with its GPU
    memory in host RAM (``leave_stopped``: a migration's source, released or resumed later). ``options``:
    see CheckpointOptions. ``journal``: the migration's source journal, held for the whole checkpoint.
    ``sender`` (a transfer.Sender, built with push_hooks(journal)) sends the image to the target while
    it is written, then delivers it: the result's ``push``. A failed push never fails the checkpoint."""
    opts = CheckpointOptions(**options)
    image_dir = os.path.abspath(image_dir)
    progress = StageProgress(opts.progress_file, CHECKPOINT_STAGES, image_dir)
    try:
        with NoHangup(), hugepages.HugePages(opts.host_huge_pages and not opts.check_mode,
                                             settle_stale=not opts.check_mode) as thp:
            if journal is None:
                res = _checkpoint(target, image_dir, opts, backend or ProcessBackend(), None, sender, progress)
            else:
                with journal.hold(wait=opts.journal_wait, purpose="the checkpoint of %s" % target):
                    res = _checkpoint(target, image_dir, opts, backend or ProcessBackend(), journal, sender,
                                      progress)
        if thp.report is not None:
            res["huge_pages"] = thp.report
        return res
    finally:
        progress.close()


def _already_checkpointed(target, image_dir, opts, journal, result):
    """Idempotence: the result when this checkpoint was already taken (nothing to do), else None.
    Refuses a migration that began here before and was not settled."""
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
    elif image.has_manifest(image_dir):  # a complete image of this same target is already there
        m = image.load_manifest(image_dir)
        if str(m.get("target", {}).get("workload", m.get("target", {}).get("root_pid"))) == str(target):
            result.update(msg="image of %s already exists in %s (taken %s); nothing to do"
                          % (target, image_dir, m.get("created")), pids=m["target"]["pids"],
                          cuda_pids=m["target"]["cuda_pids"], manifest_id=m.get("id"))
            return result
    return None


def _tmpfs_usage(image_dir):
    try:
        return {"used_bytes": memdir.usage(image_dir)["used_bytes"], "tmpfs_huge_mounted": memdir.huge_of(image_dir)}
    except OSError:
        return {}


def push_hooks(journal):
    """The hooks of a checkpoint's push, for the transfer.Sender that its caller builds (``fence`` and
    ``before_deliver``): in a migration a recovery's fence stops the push, and the source's journal
    (held by the checkpoint) says 'delivering' before the manifest goes: from then on the target may
    hold a complete image, and only the migration's settlement may resume the source (see
    delivery.deliver). Both None outside a migration."""
    if journal is None:
        return {"fence": None, "before_deliver": None}

    def fence():
        journal.check_fence("push")

    def before_deliver():
        journal.check_fence("deliver")
        journal.transition("delivering")

    return {"fence": fence, "before_deliver": before_deliver}


def _start_push(sender, journal):
    """(sender, None), or (None, the push's report) when its streams cannot open. The streams open
    before anything is frozen: their handshakes cost no downtime."""
    if sender is None:
        return None, None
    if journal is not None and (sender.fence is None or sender.before_deliver is None):
        raise InvalidTarget("the push of migration %s was built without the journal's hooks (push_hooks); "
                            "nothing was frozen" % journal.id, stage="preflight")
    try:
        sender.start()
    except GpuCkptError as exc:
        return None, {"pushed": False, "error": "the push could not start: %s" % exc.msg}
    return sender, None


def _checkpoint(target, image_dir, opts, backend, journal, sender, progress):
    after = opts.after
    result = {"changed": False, "image_dir": image_dir, "pid": target, "leave_running": after == "running",
              "leave_stopped": after == "stopped"}
    if _already_checkpointed(target, image_dir, opts, journal, result) is not None:
        return result
    if journal is not None and not opts.nonce:
        opts.nonce = uuid.uuid4().hex
    ctx = plan_checkpoint(target, image_dir, opts, backend, migration_id=journal.id if journal is not None else None)
    result.update(pids=ctx.pids, cuda_pids=ctx.cuda_pids, gpu_stage=ctx.gpu_stage, nonce=opts.nonce)
    if ctx.warnings:
        result["warnings"] = list(ctx.warnings)
    if opts.check_mode:
        result.update(changed=True, msg="would checkpoint %d process(es), %d on the GPU, into %s"
                      % (len(ctx.pids), len(ctx.cuda_pids), image_dir))
        return result

    clock = Clock(progress)
    sender, push_report = _start_push(sender, journal)
    try:
        run_steps(_Steps(ctx, clock, sender).all(), ctx, journal)
    except GpuCkptError:
        if sender is not None:
            sender.abort()
        raise
    finally:
        if ctx.hasher is not None:
            ctx.hasher.stop()
    if sender is not None:
        push_report = deliver(sender, ctx.image_dir, journal, clock)
    if push_report is not None:
        result["push"] = push_report
    if ctx.quiesce is not None:
        result["quiesce"] = ctx.quiesce
    if ctx.in_memory is not None:
        result["image_in_memory"] = dict(ctx.in_memory, **_tmpfs_usage(image_dir))
    result.update(changed=True, manifest_id=ctx.manifest["id"], timings=dict(clock.stages), frozen_at=ctx.frozen_at,
                  driver_call_seconds=ctx.manifest["driver_call_seconds"],
                  driver_call_seconds_by_pid=ctx.manifest.get("driver_call_seconds_by_pid"),
                  image_bytes=ctx.manifest["sizes"]["image_bytes"],
                  msg="checkpointed %d process(es) (%d on the GPU) into %s%s"
                  % (len(ctx.pids), len(ctx.cuda_pids), image_dir,
                     {"running": "; workload left running", "stopped": "; workload left stopped"}.get(after, "")))
    return result
