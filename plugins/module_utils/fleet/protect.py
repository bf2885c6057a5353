# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A protected job on its node: checkpointed every interval with the job left running, each image pushed to
the job's replica hosts while it is written, and counted once a replica holds it complete and verified. What
the role gpuckpt.fleet.protect installs and its timer runs (``gpuckpt-protect``, fleet/protect_cli.py); the
module gpu_protect and cuda_process_facts call it too. Importable without Ansible.

Job J is configured in ``<protect_dir>/J.json`` (written by the role, 0600); its state is in
``<protect_dir>/state/J/`` (protect_history.py). Every command first asks the job's replicas whether this
node still owns the job (the fence check): when a replica says the job was failed over (its epoch was raised
for another owner), the copy here is stale: it is stopped, its timer disabled, ``fenced.json`` written, and
from then on every command says so and does nothing else. A replica that does not answer is no fence.

A checkpoint (``run``): one at a time per job (a lock; a run that finds it held is skipped, not stacked);
the engine's checkpoint with leave_running, its image pushed to the first replica while CRIU writes it, then
that replica's commit (it verifies every checksum and applies the retention), then the other replicas
(send_image, commit). The local copy of the image goes once a replica verified it. A failed checkpoint
leaves the job running (the engine's undo) and every replica's earlier images as they were.

Whoever holds the job frozen can die (its tree SIGKILLed, an OOM kill, systemd stopping the unit past its
timeout): each checkpoint keeps a record while it runs (``state/J/hold/protect-<image id>.source.json``, a
journal with its holder's flock: engine/give_back.py), and every command here, cuda_process_facts (so drain and
migrate) and ``gpuckpt-protect give-back`` first give back what a dead run left: the driver's restore and unlock,
the runtime's resume, the partial image removed. SIGTERM (systemd's stop) fences the record: the checkpoint stops
at its next step and undoes what it did, and the unit's ExecStopPost gives back whatever a kill left.
"""
from __future__ import annotations

import fcntl
import os
import signal
import stat
import time
import uuid

from ..transfer import transfer
from ..core.errors import GpuCkptError, InvalidTarget
from ..core.fsutil import identity, remove_tree
from ..core.journal import Journal, process_identity
from ..core.wait import flock_within
from ..engine import checkpoint as engine_checkpoint
from ..engine import give_back as engine_give_back
from ..engine.steps import now_iso
from . import protect_history as hist
from .protect_fence import check_fence, is_the_job
from .protect_job import (DEFAULT_PROTECT_DIR, apply_environment, job_names, load_config, replica_call, replica_dest,
                          replica_ref, replica_target, state_folder, target_and_backend)
from ..runtimes import registry

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_FENCED = 0, 1, 2, 3
# The options of the engine's checkpoint that a job's config may give under "checkpoint"; the rest of it are the
# runtime backend's options (criu_path, runc_root, ...: see runtimes/registry.py).
ENGINE_OPTIONS = ("lock_timeout", "libcuda_path", "parallel", "host_huge_pages", "quiesce_signal",
                  "quiesce_command", "quiesce_timeout", "quiesce_mode", "quiesce_lease")


class JobLock(object):
    """One checkpoint of a job at a time: flock on ``state/<job>/lock``, which names its holder's pid."""

    def __init__(self, folder):
        self.path, self.fd = os.path.join(folder, "lock"), None

    def acquire(self, wait=0.0):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            taken = flock_within(fd, max(0.0, float(wait or 0)), "job lock %s" % self.path, on_timeout="return")
        except OSError:
            taken = False
        if not taken:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return True

    def holder(self):
        try:
            with open(self.path) as fh:
                return fh.read(32).strip() or None
        except OSError:
            return None

    def held_elsewhere(self):
        if not self.acquire(0):
            return True
        self.release()
        return False

    def release(self):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _engine_options(cfg):
    given = cfg.get("checkpoint") or {}
    opts = {k: given[k] for k in ENGINE_OPTIONS if given.get(k) is not None}
    if cfg.get("sign_key_file"):
        with open(cfg["sign_key_file"]) as fh:
            opts["sign_key"] = fh.read().strip()
    return opts


def _receiver(cfg, rep, image_id):
    return {"image_id": image_id, "replica": replica_ref(cfg, rep)}


# -- what a run holds, and giving it back ------------------------------------------------------------------

RECORD_PREFIX = "protect-"


def hold_dir(folder):
    """Where the job's runs keep their records while they hold it (engine/give_back.py)."""
    return os.path.join(folder, "hold")


def backend_of(cfg):
    """The runtime backend of the job (the process backend for a pid file)."""
    kind = "process" if cfg.get("pid_file") else "k8s_pod" if cfg.get("pod") else cfg["runtime"]
    return registry.make(kind, dict(cfg.get("checkpoint") or {}))


def give_back_job(cfg, folder, act=True):
    """Give back what a run of this job that died left frozen (each record of ``hold/`` whose holder is gone).
    Returns a list, one dict per record (engine/give_back.give_back's, or its ``error``); without ``act``, the
    records found and nothing done. A give-back that changed something is written to the job's history."""
    rdir = hold_dir(folder)
    found = engine_give_back.records(rdir, RECORD_PREFIX)
    if not found or not act:
        return [{"id": rid, "changed": False, "would_give_back": True} for rid in found]
    apply_environment(cfg)
    backend, libcuda = backend_of(cfg), (cfg.get("checkpoint") or {}).get("libcuda_path")
    out = []
    for rid in found:
        try:
            res = engine_give_back.give_back(rdir, rid, backend, libcuda_path=libcuda)
        except GpuCkptError as exc:  # the record stays: the next operation tries again
            res = {"id": rid, "changed": False, "error": exc.msg}
        out.append(res)
        if res.get("changed") or res.get("error"):
            hist.append_history(folder, {"at": now_iso(), "job": cfg["job"], "epoch": cfg["epoch"],
                                         "result": "given_back" if res.get("changed") else "give_back_failed",
                                         "image_id": rid[len(RECORD_PREFIX):], "phase": res.get("phase"),
                                         "reason": res.get("msg") or res.get("error"),
                                         "pids": res.get("given_back")})
    return out


class _StopOnTerm(object):
    """SIGTERM or SIGINT while a checkpoint holds the job (systemd stopping the unit, an operator's kill): the
    record is fenced, so the checkpoint stops at its next step and undoes what it did (the job runs on) rather than
    die between the lock and the unlock. A step under way (a dump) ends first: the unit's TimeoutStopSec gives it
    time, and its ExecStopPost gives back whatever a SIGKILL after that left."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, record):
        self.record, self.requested, self.old = record, None, {}

    def _handler(self, signum, unused_frame):
        self.requested = signal.Signals(signum).name
        try:
            self.record.fence("the runner got %s: the checkpoint stops and gives the job back" % self.requested)
        except Exception:  # noqa: BLE001 - a handler must not raise into the step it interrupted
            pass

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self.old[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread: the caller's own handling stays
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def _checkpoint(cfg, folder, image_id, image_dir, record):
    """The engine's checkpoint (leave_running), pushed to the first replica while it is written, under ``record``
    (a journal in hold/: what it holds, for a give-back should this process die)."""
    target, backend = target_and_backend(cfg)
    if cfg.get("pid_file") and not is_the_job(target, cfg["pid_file"], hist.read_state(folder, hist.IDENTITY)):
        raise InvalidTarget("pid %d of %s started after the pid file was written: it is not job %s's process"
                            % (target, cfg["pid_file"], cfg["job"]), stage="preflight")
    first = cfg["replicas"][0]
    sender = transfer.Sender(replica_target(first), replica_dest(first, cfg["job"], image_id),
                             streams=int(cfg.get("streams") or 0), receiver=_receiver(cfg, first, image_id),
                             **engine_checkpoint.push_hooks(record))
    return engine_checkpoint.checkpoint(target, image_dir, backend=backend, journal=record, sender=sender,
                                        leave_running=True, image_id=image_id, **_engine_options(cfg))


def _to_replica(cfg, index, rep, image_dir, image_id, push, meta):
    """Make replica ``rep`` hold the image and commit it there (verify, retention). Returns the commit's reply."""
    if index > 0 or not push.get("pushed"):  # (the first replica's push while CRIU wrote failed: send it again whole)
        transfer.send_image(image_dir, replica_target(rep), replica_dest(rep, cfg["job"], image_id),
                            receiver=_receiver(cfg, rep, image_id), streams=int(cfg.get("streams") or 0), retries=2)
    return replica_call(replica_target(rep), dict(replica_ref(cfg, rep), replica_op="commit", image_id=image_id,
                                                  keep=cfg["keep"], meta=meta), timeout=600)


def _deliver(cfg, folder, image_dir, image_id, push, meta, line):
    known = hist.read_state(folder, hist.REPLICAS) or {}
    for index, rep in enumerate(cfg["replicas"]):
        name = rep["name"]
        try:
            reply = _to_replica(cfg, index, rep, image_dir, image_id, push, meta)
        except (GpuCkptError, OSError) as exc:
            fenced = (getattr(exc, "details", None) or {}).get("fenced")
            line["replicas"][name] = "%s: %s" % ("fenced" if fenced else "failed", getattr(exc, "msg", None) or exc)
            continue
        if reply.get("fenced"):
            line["replicas"][name] = "fenced: %s" % reply.get("error")
        elif reply.get("verified"):
            line["replicas"][name] = "verified"
            line["retention"][name] = {"kept": reply.get("kept"), "removed": reply.get("removed")}
            known[name] = {"at": now_iso(), "images": reply.get("kept") or [image_id]}
        else:
            line["replicas"][name] = "not verified: %s" % (reply.get("error") or reply)
    hist.write_state(folder, hist.REPLICAS, known)


def _clean_local(cfg, keep=None):
    """Remove this job's local images but ``keep`` (the newest one when no replica verified it)."""
    folder = os.path.join(cfg["image_root"], cfg["job"])
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        st = os.lstat(path)
        if name != keep and stat.S_ISDIR(st.st_mode):
            remove_tree(path, identity(st))


def _iso(epoch_s):
    if epoch_s is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(float(epoch_s)))


def attempt(cfg, folder, trigger):
    """One checkpoint of the job, pushed and committed. Returns its history line (result ok or failed)."""
    started, image_id = time.monotonic(), str(uuid.uuid4())
    image_dir = os.path.join(cfg["image_root"], cfg["job"], image_id)
    progress = {"before": hist.read_progress(cfg.get("progress_file"), cfg.get("progress_key")), "after": None}
    line = {"at": now_iso(), "job": cfg["job"], "image_id": image_id, "trigger": trigger, "epoch": cfg["epoch"],
            "result": "failed", "reason": None, "stall_s": None, "duration_s": None, "bytes": None, "replicas": {},
            "retention": {}, "progress": progress}
    record = Journal(hold_dir(folder), RECORD_PREFIX + image_id, "source")
    try:
        with _StopOnTerm(record) as stop:
            try:
                res = _checkpoint(cfg, folder, image_id, image_dir, record)
            finally:
                engine_give_back.finish_record(record)
    except (GpuCkptError, OSError) as exc:  # the engine undid what it did: the job runs on, the replicas' images too
        progress["after"] = hist.read_progress(cfg.get("progress_file"), cfg.get("progress_key"))
        line.update(reason=getattr(exc, "msg", None) or str(exc), stage=getattr(exc, "stage", None),
                    duration_s=round(time.monotonic() - started, 3))
        return line
    if stop.requested:  # the job runs (the checkpoint ended, or was undone); the replicas wait for the next run
        _clean_local(cfg)
        line.update(reason="the runner got %s: it stopped before the replicas' commits; the job runs on"
                    % stop.requested, duration_s=round(time.monotonic() - started, 3))
        return line
    progress["after"] = hist.read_progress(cfg.get("progress_file"), cfg.get("progress_key"))
    line.update(stall_s=hist.stall_seconds(res.get("timings")), timings=res.get("timings"),
                bytes=res.get("image_bytes"), checkpoint_at=_iso(res.get("frozen_at")))
    if res.get("pids"):
        hist.write_state(folder, hist.IDENTITY, process_identity(res["pids"][0]) or {})
    meta = {"progress": progress, "stall_s": line["stall_s"], "checkpoint_at": res.get("frozen_at")}
    _deliver(cfg, folder, image_dir, image_id, res.get("push") or {}, meta, line)
    verified = [n for n, said in line["replicas"].items() if said == "verified"]
    if verified:
        line["result"] = "ok"
        _clean_local(cfg)
    else:
        line["reason"] = "no replica holds image %s verified; it is kept on this node in %s" % (image_id, image_dir)
        _clean_local(cfg, keep=image_id)
    line["duration_s"] = round(time.monotonic() - started, 3)
    return line


# -- the commands ------------------------------------------------------------------------------------------------

def run(protect_dir, job, trigger="timer", within=None, announce=None):
    """``gpuckpt-protect run`` (trigger timer) and ``now``: the fence check, then one checkpoint unless one runs.
    ``now`` first hands ``announce`` what it expects (protect_history.expectation: before the fence check, which
    waits for a replica that does not answer) and waits for a checkpoint in flight up to ``within`` seconds.
    Returns (the history line, the exit status)."""
    cfg = load_config(protect_dir, job)
    apply_environment(cfg)
    folder = state_folder(protect_dir, job)
    given_back = give_back_job(cfg, folder)  # before anything else: a dead run's frozen job runs again
    expect = None
    if trigger == "now":
        expect = hist.expectation(hist.read_history(folder), within)
        if announce is not None:
            announce(dict(expect, job=job))
    fence = check_fence(cfg, folder, act=True, trigger=trigger)
    if fence["fenced"]:
        give_back_job(cfg, folder)  # (its copy was stopped: what a dead run recorded of it goes)
        return dict(fence, result="fenced", trigger=trigger, given_back=given_back), EXIT_FENCED
    lock = JobLock(folder)
    if not lock.acquire(wait=(within or cfg.get("interval_s") or 0) if trigger == "now" else 0):
        line = {"at": now_iso(), "job": job, "result": "skipped", "trigger": trigger, "epoch": cfg["epoch"],
                "reason": "a checkpoint of job %s is still running (pid %s): this one is skipped, not stacked"
                % (job, lock.holder())}
    else:
        try:
            line = attempt(cfg, folder, trigger)
        finally:
            lock.release()
    if line["result"] == "failed" and any(str(s).startswith("fenced") or "epoch" in str(s)
                                          for s in line.get("replicas", {}).values()):
        fence = check_fence(cfg, folder, act=True, trigger=trigger)  # a failover raced this checkpoint
        if fence["fenced"]:
            _clean_local(cfg)  # the image of a stale copy is of no use to anyone
            return dict(fence, result="fenced", trigger=trigger, image_id=line.get("image_id")), EXIT_FENCED
    if given_back:
        line["given_back"] = given_back
    if expect is not None:
        line.update(expected_s=expect["expected_s"], within_s=within,
                    finished_within=None if within is None else (line["result"] == "ok"
                                                                 and line["duration_s"] <= float(within)))
    hist.append_history(folder, line)
    return line, EXIT_OK if line["result"] in ("ok", "skipped") else EXIT_FAILED


def jobs_of(protect_dir=DEFAULT_PROTECT_DIR, job=None):
    return [job] if job else job_names(protect_dir)


def fence_check_all(protect_dir=DEFAULT_PROTECT_DIR, job=None, act=True):
    """The fence check of each job (or of ``job``): a list of check_fence's results; a job whose config cannot be
    read is reported with its error."""
    out = []
    for name in jobs_of(protect_dir, job):
        try:
            cfg = load_config(protect_dir, name)
            folder = state_folder(protect_dir, name) if act else hist.state_dir(protect_dir, name)
            given_back = give_back_job(cfg, folder, act=act)  # a dead run's frozen job first
            doc = check_fence(cfg, folder, act=act)
            if given_back:
                doc = dict(doc, given_back=given_back,
                           changed=doc.get("changed") or any(g.get("changed") for g in given_back))
            out.append(doc)
        except GpuCkptError as exc:
            out.append({"job": name, "fenced": False, "changed": False, "error": exc.msg})
    return out


def give_back_all(protect_dir=DEFAULT_PROTECT_DIR, job=None, act=True):
    """``gpuckpt-protect give-back``: what dead runs left frozen, given back, for each job (or ``job``): a list of
    {"job", "given_back": [give_back_job's dicts], "changed"} (or the job's ``error``)."""
    out = []
    for name in jobs_of(protect_dir, job):
        try:
            cfg = load_config(protect_dir, name)
            folder = state_folder(protect_dir, name) if act else hist.state_dir(protect_dir, name)
            done = give_back_job(cfg, folder, act=act)
            out.append({"job": name, "given_back": done, "changed": any(d.get("changed") for d in done),
                        "failed": [d for d in done if d.get("error")]})
        except GpuCkptError as exc:
            out.append({"job": name, "given_back": [], "changed": False, "error": exc.msg})
    return out


def status_all(protect_dir=DEFAULT_PROTECT_DIR, job=None, act=True):
    """Each job's summary (protect_history.summary), after its fence check."""
    out = []
    for name in jobs_of(protect_dir, job):
        try:
            cfg = load_config(protect_dir, name)
        except GpuCkptError as exc:
            out.append({"job": name, "error": exc.msg})
            continue
        folder = hist.state_dir(protect_dir, name)
        if act:
            give_back_job(cfg, state_folder(protect_dir, name))  # (recorded in the history the summary reads)
        fence = check_fence(cfg, state_folder(protect_dir, name) if act else folder, act=act)
        running = os.path.isdir(folder) and JobLock(folder).held_elsewhere()
        out.append(hist.summary(cfg, folder, fence if fence["fenced"] else None, running))
    return out
