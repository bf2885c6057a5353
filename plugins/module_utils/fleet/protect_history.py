# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a protected job's runner keeps on its node and tells from it (pure, but for the files it reads and
writes in the job's state directory): the history of its checkpoints, the job's stall per checkpoint and what
it costs at an interval, how long a checkpoint now is expected to take, the job's own progress, and the
summary that ``gpuckpt-protect status``, gpu_protect and the facts show.

The state of job J lives in ``<protect_dir>/state/J/``: ``history.jsonl`` (one JSON line per attempt),
``replicas.json`` (the images each replica held verified after its last commit), ``identity.json`` (the job's
root process as the last checkpoint saw it: what a fence checks before it kills) and ``fenced.json``.
"""
from __future__ import annotations

import json
import os

from ..core.fsutil import atomic_write, read_json

HISTORY = "history.jsonl"
REPLICAS = "replicas.json"
IDENTITY = "identity.json"
FENCED = "fenced.json"
# The checkpoint's stages during which the job does not run: from the CUDA lock (the clock starts when the
# freeze begins) to the GPU's unlock after the dump. The checksums, the manifest and the push come after it and
# the job runs meanwhile. A job without CUDA processes stalls for the runtime's dump alone (CRIU freezes the
# tree for it and lets it run on: leave_running).
STALL_STAGES = ("cuda_lock", "cuda_checkpoint", "runtime_dump", "cuda_resume_source")
OVERHEAD_INTERVALS = (300, 900, 3600)
EXPECTED_FROM = 5  # a checkpoint now is expected to take as long as the longest of the last 5 that succeeded
KEEP_LINES = 1000  # history.jsonl is cut back to its newest lines when it grows past twice as many


def state_dir(protect_dir, job):
    return os.path.join(protect_dir, "state", job)


def stall_seconds(timings):
    """The job's stall in one checkpoint, from the engine result's ``timings`` (STALL_STAGES summed), or None
    when no such stage was timed."""
    found = [float(timings[s]) for s in STALL_STAGES if s in (timings or {})]
    return round(sum(found), 6) if found else None


def read_history(folder, last=None):
    """The attempts recorded in ``folder``'s history, oldest first (the ``last`` ones only, when given). A line
    that cannot be read (a write cut by a crash) is passed over."""
    try:
        with open(os.path.join(folder, HISTORY), "rb") as fh:
            raw = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    out = []
    for line in raw:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out[len(out) - int(last):] if last and len(out) > int(last) else out


def append_history(folder, line):
    """Append one attempt (a dict) to the history; cut it back to its newest KEEP_LINES lines past twice that."""
    path = os.path.join(folder, HISTORY)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(line, sort_keys=True, default=str) + "\n").encode("utf-8"))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > 2 * KEEP_LINES * 200:  # (about 200 bytes a line: counting lines is needed only past this)
        lines = read_history(folder)
        if len(lines) > 2 * KEEP_LINES:
            atomic_write(path, "".join(json.dumps(d, sort_keys=True, default=str) + "\n" for d in lines[-KEEP_LINES:]))


def read_state(folder, name):
    doc = read_json(os.path.join(folder, name))
    return doc if isinstance(doc, dict) else None


def write_state(folder, name, doc):
    atomic_write(os.path.join(folder, name), doc)


def ok_runs(history):
    return [h for h in history if h.get("result") == "ok"]


def expected_seconds(history):
    """How long a checkpoint now is expected to take: the longest duration of the last EXPECTED_FROM that
    succeeded, or None without one."""
    durations = [h["duration_s"] for h in ok_runs(history)[-EXPECTED_FROM:] if h.get("duration_s") is not None]
    return max(durations) if durations else None


def expectation(history, within):
    """What ``now`` says before it starts: {"expected_s", "within_s", "expected_to_finish"} (null when nothing
    is known: no checkpoint succeeded yet, or no time was given)."""
    expected = expected_seconds(history)
    finish = None if expected is None or within is None else expected <= float(within)
    return {"expected_s": expected, "within_s": within, "expected_to_finish": finish}


def stall_summary(history):
    """The stall of the successful checkpoints: the last, the largest and the mean, over how many."""
    stalls = [h["stall_s"] for h in ok_runs(history) if h.get("stall_s") is not None]
    if not stalls:
        return {"last": None, "max": None, "mean": None, "runs": 0}
    return {"last": stalls[-1], "max": max(stalls), "mean": round(sum(stalls) / len(stalls), 6), "runs": len(stalls)}


def overhead(stall, interval_s):
    """What checkpoints cost the job at one every ``interval_s`` seconds: the share of its time stalled
    (stall_s / interval_s), from the mean and the largest stall measured."""
    rows = []
    for interval in [int(interval_s)] + [i for i in OVERHEAD_INTERVALS if i != int(interval_s)]:
        mean, worst = stall.get("mean"), stall.get("max")
        rows.append({"interval_s": interval, "configured": interval == int(interval_s),
                     "fraction": None if mean is None else round(mean / interval, 8),
                     "worst_fraction": None if worst is None else round(worst / interval, 8),
                     "percent": None if mean is None else round(100.0 * mean / interval, 4)})
    return rows


def read_progress(path, key=None):
    """The job's own progress, as it reports it in ``path``: the value at ``key`` (dots go down into objects)
    of its JSON, or the file's text (a number when it reads as one) without a key. None when unread."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 20).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if key:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        for part in str(key).split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text[:200]


def workload_of(config):
    """The job's workload in words: its pid file, its container and runtime, or its pod."""
    if config.get("pid_file"):
        return "pid file %s" % config["pid_file"]
    if config.get("pod"):
        return "pod %s/%s" % (config.get("namespace") or "default", config["pod"])
    return "%s container %s" % (config.get("runtime"), config.get("container"))


def summary(config, folder, fenced, running, last=5):
    """A job's status: its configuration in short, its last runs, its stall and overhead, the images each
    replica held verified at its last commit, whether a checkpoint runs now and whether it is fenced."""
    history = read_history(folder)
    stall = stall_summary(history)
    ok = ok_runs(history)
    return {"job": config.get("job"), "node": config.get("node"), "workload": workload_of(config),
            "interval_s": config.get("interval_s"), "keep": config.get("keep"), "epoch": config.get("epoch"),
            "replicas": [r.get("name") for r in config.get("replicas") or []],
            "fenced": fenced, "running": running,
            "last_runs": history[-last:], "last_ok": ok[-1] if ok else None, "attempts": len(history),
            "stall_s": stall, "overhead": overhead(stall, config.get("interval_s") or 900),
            "expected_s": expected_seconds(history),
            "verified_images": (read_state(folder, REPLICAS) or {})}
