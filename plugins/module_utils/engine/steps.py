# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the checkpoint and the restore are made of: steps with their undo, the clock of their
stages, the driver's calls over many pids, and SIGHUP held off while they run.

A checkpoint is a plan and a list of steps, each carrying its undo. Any failure runs the undo of the
steps done, newest first, so the workload runs on: unlock what was locked, restore what was
checkpointed, thaw (or restore from the image) what was dumped, remove the partial image. Rules kept
by the order of the steps: lock all before checkpointing any, restore all before unlocking any. In a
migration each step is a transition of the source's journal, under its lock, and a recovery's fence
stops the steps at the next one (see checkpoint.py).
"""
from __future__ import annotations

import datetime
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from ..core.errors import GpuCkptError, InvalidTarget, TransactionError

STOPPED = ("T", "t")
DEAD = ("Z", "X")


def now_iso():
    """This moment in UTC, to the second, as manifests and restored marks record it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Clock(object):
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


def driver_seconds(drv, since):
    """Seconds spent in each kind of driver call (lock, checkpoint, restore, unlock) from call ``since`` on."""
    out = {}
    if drv is not None:
        for c in drv.calls[since:]:
            key = c["call"].replace("cuCheckpointProcess", "").lower()
            out[key] = round(out.get(key, 0.0) + c["seconds"], 6)
    return out


def driver_seconds_by_pid(drv, since):
    """The same per process: {pid: {lock, checkpoint, restore, unlock}} (each rank's own stage 1 in a job of many)."""
    out = {}
    if drv is not None:
        for c in drv.calls[since:]:
            if c.get("pid") is None:
                continue
            key = c["call"].replace("cuCheckpointProcess", "").lower()
            per = out.setdefault(str(c["pid"]), {})
            per[key] = round(per.get(key, 0.0) + c["seconds"], 6)
    return out


def describe_failure(exc):
    """(stage, pid, reason, hint) of any exception: a GpuCkptError's own, else None and the exception."""
    if isinstance(exc, GpuCkptError):
        return exc.stage, exc.pid, exc.msg, exc.hint
    return None, None, exc, None


def error_fields(exc):
    """The command and driver fields of a GpuCkptError, for the TransactionError that reports it."""
    if isinstance(exc, GpuCkptError):
        return {"cmd": exc.cmd, "rc": exc.rc, "stdout": exc.stdout, "stderr": exc.stderr,
                "driver_error": exc.driver_error, "details": exc.details}
    return {}


class NoHangup(object):
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


class PartlyDone(Exception):
    """A call over many pids failed: ``error`` is the first failure, ``done`` the pids it was done for
    (what an undo must cover, exactly)."""

    def __init__(self, error, done):
        super().__init__(str(error))
        self.error, self.done = error, list(done)


def each(pids, fn, parallel):
    """fn(pid) for every pid, in order, or on one thread per pid (the driver call releases the GIL).
    Parallel is the default: for 3 processes of 2 GiB on an H200 the driver's checkpoint took 1.8 s in
    parallel against 5.0 s one after another, restore 1.0 s against 2.2 s (docs/benchmarks).
    Returns the pids done; raises PartlyDone (the first error, the pids done) after every call."""
    if not parallel or len(pids) < 2:
        done = []
        for p in pids:
            try:
                fn(p)
            except Exception as exc:
                raise PartlyDone(exc, done)
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
        raise PartlyDone(first_error, done)
    return done


class Step(object):
    """One step of a transaction: ``do(ctx)``, and ``undo(ctx)`` that puts back what ``do`` changed.
    ``phase``: the journal phase to record once it is done. ``partial``: the undo also puts back a ``do``
    that failed half-way (it undoes what the context records as done: the pids locked so far...);
    otherwise a step that fails is left to its runtime (a failed dump thaws its tree itself)."""

    def __init__(self, name, do, undo=None, phase=None, partial=False):
        self.name, self.do, self.undo, self.phase, self.partial = name, do, undo, phase, partial


def _do_all(steps, ctx, journal):
    """Run the steps in order; returns (the steps to undo, the failure or None)."""
    done = []
    for step in steps:
        try:
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
        except Exception as exc:  # noqa: BLE001 - any failure is undone
            return done, exc
    return done, None


def _undo_all(done, ctx):
    """The undos of the steps ``done``, newest first; an undo that fails is reported and the others
    still run. Returns the problems."""
    problems = []
    for step in reversed(done):
        if step.undo is None:
            continue
        try:
            step.undo(ctx)
        except Exception as exc:  # noqa: BLE001 - report it, keep undoing the rest
            problems.append("undo of %s: %s" % (step.name, describe_failure(exc)[2]))
    return problems


def run_steps(steps, ctx, journal=None):
    """Run ``steps`` in order. A journal's fence is checked before each; on any failure the done steps'
    undos run newest first, and TransactionError says whether the workload was put back (an undo
    that fails is reported, and the others still run)."""
    done, failure = _do_all(steps, ctx, journal)
    if failure is None:
        return
    problems = _undo_all(done, ctx)
    ok = not problems
    if journal is not None:
        try:
            journal.transition("rolled_back" if ok else "rollback_failed", error=str(failure), problems=problems)
        except GpuCkptError:
            pass  # nothing was planned yet, or the journal cannot be written: the result says what happened
    if isinstance(failure, InvalidTarget) and not done:
        raise failure  # refused before anything was touched: the error says so itself
    stage, pid, reason, hint = describe_failure(failure)
    stage = stage or "checkpoint"
    where = " for pid %s" % pid if pid else ""
    state = ("the workload was rolled back and runs on" if ok else
             "ROLLBACK INCOMPLETE, the workload may be frozen: " + "; ".join(problems))
    kept = "; its image is kept in %s" % ctx.image_dir if ctx.keep_image else "; no image was kept"
    raise TransactionError("checkpoint failed at stage %s%s: %s; %s%s" % (stage, where, reason, state, kept),
                           stage=stage, pid=pid, rolled_back=ok, hint=hint, **error_fields(failure))
