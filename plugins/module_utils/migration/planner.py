# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Can this workload move from this source to this target? Facts in, a plan with reasons out.

Pure: no I/O, no Ansible, the standard library only. The inputs are the plain dicts that
``cuda_process_facts`` returns (``engine/facts.py``): the workload is the source's ``tree``, each host its
``ansible_facts['gpuckpt']``. migrate.yml's preflight (the ``migration_preflight`` filter) calls it for its
one target; a drain calls it for each (workload, target) pair and gets the reasons of every target it did
not choose.

Each check is ``ok``, ``fails`` or ``unknown``, with its reason. Unknown is never counted as zero: a GPU
memory that nothing could read once sized a 25.6 GB image at 1.3 GiB, the disk check passed and CRIU hit
ENOSPC 16 GB into the dump. So a check whose facts are missing is unknown, and an unknown check refuses the
move unless the caller accepts it by its name (``allow_unknown``, e.g. ``["gpu_memory", "disk"]``). Where a
known part of a figure already decides (the host RSS alone does not fit the disk), the check fails.
"""
from __future__ import annotations

import math
from collections import namedtuple

from ..core import memdir

OK, FAILS, UNKNOWN = "ok", "fails", "unknown"
GIB = 2.0**30
MIB = 2**20
IMAGE_MARGIN = 1.10

# The names a caller may accept unknown (allow_unknown), in the order of the checks.
CHECK_NAMES = ("workload", "checkpoint_api", "driver_version", "cuda_api_version", "cuda_running", "gpu_model",
               "gpu_count", "gpu_memory", "criu", "disk", "host_ram", "source_ram", "pids", "not_draining")

Check = namedtuple("Check", "name label source target status reason")
Check.__doc__ = """One check: ``name`` (stable, what allow_unknown names), ``label`` (for people), what the source
and target have (text), ``status`` (ok, fails, unknown) and ``reason`` (why it is not ok, and what to do)."""

Plan = namedtuple("Plan", "ok checks image_estimate_bytes failed unknown allowed")
Plan.__doc__ = """A move's verdict: ``ok`` (no check fails, every unknown one accepted by name), the ``checks``,
the image's estimated size (None: unknown), and the names of the checks that fail, are unknown, and are
unknown but accepted."""

Options = namedtuple("Options", "source_path target_path allow_unknown allow_driver_mismatch check_gpus "
                                "same_pid_space container margin gpu_map image_in_memory "
                                "target_image_in_memory")
DEFAULTS = {"source_path": None, "target_path": None, "allow_unknown": (), "allow_driver_mismatch": False,
            "check_gpus": True, "same_pid_space": False, "container": False, "margin": IMAGE_MARGIN, "gpu_map": None,
            "image_in_memory": False, "target_image_in_memory": False}


def options(**given):
    """The planner's options, from keywords (a dict's ``**``), the rest their defaults:
    - ``source_path``, ``target_path``: the image roots whose free disk counts (keys of each host's ``disk``);
    - ``allow_unknown``: names of checks (CHECK_NAMES) whose unknown status does not refuse the move;
    - ``allow_driver_mismatch``: accept other driver and CUDA API versions on the target;
    - ``check_gpus``: compare GPU models, count and free memory (off when a GPU map decides the GPUs);
    - ``same_pid_space``: the two hosts are one pid space (the workload's own pids are in use there);
    - ``container``: the workload keeps its pids in its own pid namespace (no pid check);
    - ``margin``: the image estimate's factor over host RSS + GPU memory;
    - ``gpu_map``: {source GPU UUID: target GPU UUID}, where the restore puts each GPU's memory;
    - ``image_in_memory``: the source keeps its image in memory (engine/in_memory.py), not on its disk;
    - ``target_image_in_memory``: the target keeps it in memory (in_memory.target_plan), not on its disk."""
    wrong = set(given) - set(DEFAULTS)
    if wrong:
        raise ValueError("unknown planner options: %s" % ", ".join(sorted(wrong)))
    opts = dict(DEFAULTS, **given)
    bad = [n for n in opts["allow_unknown"] or () if n not in CHECK_NAMES]
    if bad:
        raise ValueError("allow_unknown names no check: %s (the checks: %s)" % (", ".join(bad), ", ".join(CHECK_NAMES)))
    opts["allow_unknown"] = tuple(opts["allow_unknown"] or ())
    return Options(**opts)


def gib(n):
    return "%.1f GiB" % (n / GIB) if n is not None else "?"


def _host(facts, side):
    return ((facts.get("host") or {}).get("hostname")) or "the %s" % side


def _check(name, label, source, target, ok, reason=None):
    """A check that is known: ok, or fails for ``reason``."""
    return Check(name, label, str(source), str(target), OK if ok else FAILS, None if ok else reason)


def _unknown(name, label, source, target, reason):
    return Check(name, label, str(source), str(target), UNKNOWN, reason)


def _readers_hint(host):
    return "install nvidia-ml-py (NVML) or nvidia-smi on %s" % host


# -- the image -------------------------------------------------------------------------------------------

def image_estimate(tree, margin=IMAGE_MARGIN):
    """The image's size: host RSS + GPU memory of the tree, times ``margin``; None when either is unknown."""
    rss, gpu = tree.get("rss_bytes"), tree.get("gpu_bytes")
    if rss is None or gpu is None:
        return None
    return int((rss + gpu) * margin)


def _image_floor(tree, margin):
    """What the image needs at least, from what is known (the RSS alone when the GPU memory is unknown)."""
    return int(((tree.get("rss_bytes") or 0) + (tree.get("gpu_bytes") or 0)) * margin)


def _why_size_unknown(tree, source):
    if tree.get("rss_bytes") is None:
        return "the workload's memory is not known (no tree in the source's facts)"
    return "the workload's GPU memory is not known: %s; %s" % (
        tree.get("gpu_memory_unknown_reason") or "no reading", _readers_hint(_host(source, "source")))


# -- the checks ------------------------------------------------------------------------------------------

def _workload(tree, source, target, opts):
    label = "workload pid %s on source" % tree.get("root")
    if not tree:
        return [_check("workload", label, "-", "-", False, "the source's facts hold no tree (gather them with tree_of)")]
    return [_check("workload", label, "%d process(es)" % len(tree.get("pids") or []), "-", tree.get("exists"),
                   "no process %s on %s" % (tree.get("root"), _host(source, "source")))]


def _checkpoint_api(tree, source, target, opts):
    sd, td = source.get("driver") or {}, target.get("driver") or {}
    lacking = ["%s (%s)" % (_host(f, side), d.get("reason") or "driver older than 570")
               for side, f, d in (("source", source, sd), ("target", target, td)) if not d.get("checkpoint_api")]
    return [_check("checkpoint_api", "driver checkpoint API (570+)", sd.get("checkpoint_api"), td.get("checkpoint_api"),
                   not lacking, "no checkpoint API on " + ", ".join(lacking))]


def _same_version(name, label, key, source, target, opts):
    """Driver or CUDA API version: the same on both hosts, unless a mismatch is allowed."""
    sv, tv = (source.get("driver") or {}).get(key), (target.get("driver") or {}).get(key)
    if opts.allow_driver_mismatch:
        return _check(name, label + " (mismatch allowed)", sv, tv, True)
    missing = [_host(f, side) for side, f, v in (("source", source, sv), ("target", target, tv)) if v is None]
    if missing:
        return _unknown(name, label, sv, tv, "the %s of %s is not known" % (label, " and ".join(missing)))
    return _check(name, label, sv, tv, sv == tv, "%s on the source, %s on the target" % (sv, tv))


def _versions(tree, source, target, opts):
    return [_same_version("driver_version", "driver version", "driver_version", source, target, opts),
            _same_version("cuda_api_version", "CUDA API version", "api_version", source, target, opts)]


def _cuda_running(tree, source, target, opts):
    states = tree.get("cuda_states") or {}
    busy = sorted("%s %s" % (pid, s) for pid, s in states.items() if s != "running")
    return [_check("cuda_running", "CUDA processes running (not locked)", ",".join(sorted(set(states.values()))), "-",
                   not busy, "not running: " + ", ".join(busy))]


def gpu_list(facts):
    """A host's GPUs, or None when nothing could list them (neither NVML nor nvidia-smi answered)."""
    gpus = facts.get("gpus") or []
    return gpus if gpus or facts.get("gpu_source") is not None else None


def _gpu_model(sg, tg, source, target):
    label = "GPU model"
    snames, tnames = {g.get("name") for g in sg}, {g.get("name") for g in tg}
    if None in snames | tnames:
        return _unknown("gpu_model", label, "?", "?", "a GPU without its model name")
    return _check("gpu_model", label, ",".join(sorted(snames)) or "-", ",".join(sorted(tnames)) or "-",
                  snames <= tnames, "%s has no %s" % (_host(target, "target"), ", ".join(sorted(snames - tnames))))


def _gpu_count(sg, tg, source, target):
    return _check("gpu_count", "GPU count", len(sg), len(tg), len(tg) >= len(sg),
                  "%s has %d GPU(s), the source %d" % (_host(target, "target"), len(tg), len(sg)))


def gpu_needs(tree):
    """The workload's GPU memory per source GPU: [(source GPU UUID, bytes)], the UUID None when only the
    total is known (its placement is then unknown); None when its GPU memory is unknown."""
    by_gpu = tree.get("gpu_bytes_by_gpu")
    if by_gpu is not None:
        return sorted((uuid, n) for uuid, n in by_gpu.items() if n)
    total = tree.get("gpu_bytes")
    if total is None:
        return None
    return [(None, total)] if total else []


def landing_gpus(uuid, sg, tg, gpu_map=None):
    """The target GPUs the memory of source GPU ``uuid`` may land on: the one the GPU map names, else the one
    at its place (the driver restores each GPU's memory onto the GPU of the same index, cuda/devices.py),
    else, where its place is not known, any of them (so it must fit each)."""
    if uuid is not None and uuid in (gpu_map or {}):
        return [g for g in tg if g.get("uuid") == gpu_map[uuid]]
    index = {g.get("uuid"): g.get("index") for g in sg}.get(uuid) if uuid is not None else None
    placed = [g for g in tg if index is not None and g.get("index") == index]
    return placed or list(tg)


def _gpu_shortfalls(needs, sg, tg, opts):
    """(what does not fit, what is not known), each a list of texts, for each (source GPU, need)."""
    short, unread = [], []
    for uuid, need in needs:
        where = landing_gpus(uuid, sg, tg, opts.gpu_map)
        if not where and uuid in (opts.gpu_map or {}):
            short.append("GPU %s (mapped from %s) is not on the target" % (opts.gpu_map[uuid], uuid))
        elif not where:
            short.append("the target has no GPU for the workload's %s" % gib(need))
        for g in where:
            free = g.get("memory_free_mib")
            name = "GPU %s (%s)" % (g.get("index"), g.get("uuid"))
            if free is None:
                unread.append("%s reports no free memory" % name)
            elif free * MIB < need:
                short.append("%s has %s free, the workload needs %s there" % (name, gib(free * MIB), gib(need)))
    return short, unread


def _gpu_memory(tree, sg, tg, source, target, opts, unlisted=None):
    """The workload's memory of each source GPU against the free memory of the target GPU it lands on (not
    the target's sum: two GPUs with 10 GiB free each do not hold one process's 15 GiB). ``unlisted``: why
    the GPUs are not known, when they are not."""
    label = "free GPU memory on target"
    needs = gpu_needs(tree)
    if needs is None:
        return _unknown("gpu_memory", label, "?", "-", _why_size_unknown(tree, source))
    most = gib(max([n for unused, n in needs] or [0])) + " max/GPU"
    if not needs:
        return _check("gpu_memory", label, most, "-", True)
    if unlisted:
        return _unknown("gpu_memory", label, most, "?", unlisted)
    short, unread = _gpu_shortfalls(needs, sg, tg, opts)
    free = [g.get("memory_free_mib") for g in tg]
    shown = gib(min(free) * MIB) + " min/GPU" if free and None not in free else "?"
    if short:
        return _check("gpu_memory", label, most, shown, False, "; ".join(short))
    if unread:
        return _unknown("gpu_memory", label, most, shown, "; ".join(unread) + "; " + _readers_hint(_host(target, "target")))
    return _check("gpu_memory", label, most, shown, True)


def _gpus(tree, source, target, opts):
    if not opts.check_gpus:
        return []
    sg, tg = gpu_list(source), gpu_list(target)
    unlisted = [_host(f, side) for side, f, g in (("source", source, sg), ("target", target, tg)) if g is None]
    if unlisted:
        why = "nothing lists the GPUs of %s: %s" % (" and ".join(unlisted), _readers_hint(" and ".join(unlisted)))
        return [_unknown("gpu_model", "GPU model", "?", "?", why), _unknown("gpu_count", "GPU count", "?", "?", why),
                _gpu_memory(tree, [], [], source, target, opts, unlisted=why)]
    return [_gpu_model(sg, tg, source, target), _gpu_count(sg, tg, source, target),
            _gpu_memory(tree, sg, tg, source, target, opts)]


def _criu(tree, source, target, opts):
    out = []
    for side, facts in (("source", source), ("target", target)):
        c = facts.get("criu") or {}
        version = c.get("version", "missing")
        why = c.get("error") or ("CRIU %s is older than 4.0" % version if not c.get("supported")
                                 else "criu check failed: %s" % (c.get("check_output") or "").strip()[-300:])
        out.append(_check("criu", "CRIU 4.x and criu check on %s" % side, version if side == "source" else "",
                          version if side == "target" else "", c.get("supported") and c.get("check_ok", True),
                          "%s: %s" % (_host(facts, side), why)))
    return out


def _room_for_image(name, label, have, tree, source, opts):
    """``have``: [(host, bytes free or None)]: fails where the known part of the image does not fit,
    unknown where the image's size or a host's room is not known."""
    need, floor = image_estimate(tree, opts.margin), _image_floor(tree, opts.margin)
    shown = [gib(n) if n is not None else "?" for unused, n in have]
    short = ["%s has %s, the image needs %s%s" % (h, gib(n), "" if need is not None else "at least ", gib(floor))
             for h, n in have if n is not None and n < floor]
    if short:
        return _check(name, label, shown[0], shown[-1], False, "; ".join(short))
    unread = [h for h, n in have if n is None]
    if unread:
        return _unknown(name, label, shown[0], shown[-1], "not reported by %s" % " and ".join(unread))
    if need is None:
        return _unknown(name, label, shown[0], shown[-1], _why_size_unknown(tree, source))
    return _check(name, label, shown[0], shown[-1], True)  # known, the floor is the estimate: it fits


def _disk(tree, source, target, opts):
    def free(facts, path):
        return ((facts.get("disk") or {}).get(path) or {}).get("free_bytes")
    label = "free disk for the image (~%s)" % gib(image_estimate(tree, opts.margin))
    roots = [] if opts.image_in_memory else [("%s:%s" % (_host(source, "source"), opts.source_path),
                                              free(source, opts.source_path))]
    if not opts.target_image_in_memory:
        roots.append(("%s:%s" % (_host(target, "target"), opts.target_path), free(target, opts.target_path)))
    if not roots:
        return [_check("disk", label, "in memory", "in memory", True)]
    check = _room_for_image("disk", label, roots, tree, source, opts)
    check = check._replace(source="in memory") if opts.image_in_memory else check
    return [check._replace(target="in memory") if opts.target_image_in_memory else check]


def _host_ram(tree, source, target, opts):
    """The restore brings the process's memory and its GPU memory into the target's host RAM first; with the
    target's image in memory, that RAM holds the image too, and a reserve (in_memory.target_plan checks it again)."""
    if opts.target_image_in_memory:
        return [_target_ram(tree, source, target, opts)]
    avail = (target.get("memory") or {}).get("available_bytes")
    check = _room_for_image("host_ram", "host RAM for the restore (MemAvailable)",
                            [(_host(target, "target"), avail)], tree, source, opts)
    return [check._replace(source="-")]


def _target_ram(tree, source, target, opts):
    label = "host RAM on the target for the restore and the image in memory (MemAvailable)"
    mem = target.get("memory") or {}
    avail, total = mem.get("available_bytes"), mem.get("total_bytes")
    need = image_estimate(tree, opts.margin)
    if need is None:
        return _unknown("host_ram", label, "-", gib(avail), _why_size_unknown(tree, source))
    if avail is None or total is None:
        return _unknown("host_ram", label, "-", "?", "not reported by %s" % _host(target, "target"))
    need = 2 * need + memdir.reserve_bytes(total)
    why = ("%s has %s available, the restore with the image in memory needs %s (the image, the restored job's memory and "
           "a reserve); leave gpuckpt_target_image_in_memory off" % (_host(target, "target"), gib(avail), gib(need)))
    return _check("host_ram", label, "-", gib(avail), avail >= need, why)


def _source_ram(tree, source, target, opts):
    """With the image in memory, the source holds it on top of the job, whose host RAM grows by its GPU
    memory in stage 1, and a reserve (engine/in_memory.py checks the same again before the freeze)."""
    if not opts.image_in_memory:
        return []
    label = "host RAM on the source for the image in memory (MemAvailable)"
    mem = source.get("memory") or {}
    avail, total = mem.get("available_bytes"), mem.get("total_bytes")
    need, gpu = image_estimate(tree, opts.margin), tree.get("gpu_bytes")
    if need is None:
        return [_unknown("source_ram", label, gib(avail), "-", _why_size_unknown(tree, source))]
    if avail is None or total is None:
        return [_unknown("source_ram", label, "?", "-", "not reported by %s" % _host(source, "source"))]
    need += gpu + memdir.reserve_bytes(total)  # (gpu is known here: the estimate is)
    return [_check("source_ram", label, gib(avail), "-", avail >= need,
                   "%s has %s available, the image in memory needs %s with the GPU memory stage 1 brings into host RAM "
                   "and a reserve; leave gpuckpt_image_in_memory off" % (_host(source, "source"), gib(avail), gib(need)))]


def _pids(tree, source, target, opts):
    pids = tree.get("pids") or []
    label = "workload pids free on target"
    if opts.container:
        return [_check("pids", label, "in its own pid namespace", "not needed", True)]
    shown = ",".join(map(str, pids))
    if pids and "pids_in_use" not in target:
        return [_unknown("pids", label, shown, "?", "the target's facts were gathered without check_pids")]
    taken = target.get("pids_in_use") or []
    if opts.same_pid_space:
        # One pid space (one kernel seen as two hosts): the pids in use are the workload's own, and the
        # checkpoint frees them. Anything else holding them would be a real conflict.
        others = [p for p in taken if p not in pids]
        return [_check("pids", label + " (same pid space)", shown,
                       "in use: " + ",".join(map(str, others)) if others else "freed by the checkpoint", not others,
                       "pid(s) %s are in use on %s" % (",".join(map(str, others)), _host(target, "target")))]
    return [_check("pids", label, shown, "in use: " + ",".join(map(str, taken)) if taken else "free", not taken,
                   "pid(s) %s are in use on %s" % (",".join(map(str, taken)), _host(target, "target")))]


def _not_draining(tree, source, target, opts):
    """A draining host (its drain mark, cuda_process_facts' ``drain``) takes no work: it is being emptied."""
    mark = target.get("drain")
    return [_check("not_draining", "target not draining", "-", "draining since %s" % mark.get("started") if mark else "no",
                   not mark, "%s is draining (since %s; drain.yml -e undrain=true makes it take work again)"
                   % (_host(target, "target"), (mark or {}).get("started")))]


ALWAYS = (_workload,)
ON_GPU = (_checkpoint_api, _versions, _cuda_running, _gpus)
HOSTS = (_criu, _disk, _host_ram, _source_ram, _pids, _not_draining)


def check_target(workload, source_facts, target_facts, opts):
    """Every check of moving ``workload`` (the source's ``tree``) from the host of ``source_facts`` to the
    host of ``target_facts``, in order; the GPU checks only for a workload with CUDA processes."""
    tree = workload or {}
    steps = ALWAYS + (ON_GPU if tree.get("cuda_pids") else ()) + HOSTS
    return _saying_bound([c for step in steps for c in step(tree, source_facts or {}, target_facts or {}, opts)], tree)


SIZED_BY_GPU_MEMORY = ("gpu_memory", "disk", "host_ram", "source_ram")


def _saying_bound(checks, tree):
    """Where the tree's GPU memory is a bound (facts.used_memory_bound: a GPU's used memory, every process
    listed there the tree's), each check sized by it says so in its reason."""
    bound = tree.get("gpu_memory_bound")
    if not bound:
        return checks
    return [c._replace(reason="%s (the GPU memory is %s)" % (c.reason, bound) if c.reason else "the GPU memory is %s"
                       % bound) if c.name in SIZED_BY_GPU_MEMORY else c for c in checks]


def verdict(checks, opts, estimate=None):
    """The Plan of these checks: refused by any that fails, or is unknown and not accepted by name."""
    failed = [c.name for c in checks if c.status == FAILS]
    unknown = [c.name for c in checks if c.status == UNKNOWN]
    allowed = [n for n in unknown if n in opts.allow_unknown]
    return Plan(not failed and len(allowed) == len(unknown), checks, estimate, failed, unknown, allowed)


def plan_move(workload, source_facts, target_facts, opts):
    """Can ``workload`` move from source to target? A Plan with every check and its reason."""
    checks = check_target(workload, source_facts, target_facts, opts)
    return verdict(checks, opts, image_estimate(workload or {}, opts.margin))


# -- the options -----------------------------------------------------------------------------------------

# Each number a playbook takes, and the least it may be: a negative timeout once passed the argument spec,
# the job was frozen, CRIU was killed at once and the job rolled back. Checked before anything is frozen.
POSITIVE, NOT_NEGATIVE, AT_LEAST_ONE = "positive", "not_negative", "at_least_one"
OPTION_RULES = {
    "gpuckpt_runtime_timeout": NOT_NEGATIVE, "gpuckpt_image_wait": POSITIVE, "gpuckpt_lock_timeout": POSITIVE,
    "gpuckpt_settle_wait": POSITIVE, "gpuckpt_host_timeout": POSITIVE, "gpuckpt_probe_timeout": POSITIVE,
    "gpuckpt_quiesce_timeout": NOT_NEGATIVE, "gpuckpt_transfer_bwlimit": NOT_NEGATIVE,
    "gpuckpt_transfer_streams": NOT_NEGATIVE, "gpuckpt_transfer_io_timeout": POSITIVE,
    "gpuckpt_pod_restore_wait": POSITIVE, "gpuckpt_pod_grace_period": NOT_NEGATIVE, "gpuckpt_pod_stop_wait": POSITIVE,
    "pid": POSITIVE, "drain_parallel": AT_LEAST_ONE, "deadline": POSITIVE, "gpuckpt_drain_move_overhead": NOT_NEGATIVE,
}
_RULE_TEXT = {POSITIVE: "a number above 0", NOT_NEGATIVE: "a number of 0 or more (0: no limit)",
              AT_LEAST_ONE: "a whole number of 1 or more"}


def _breaks(rule, n):
    """Whether the number ``n`` breaks ``rule``; NaN and the infinities break every rule."""
    if not math.isfinite(n):
        return True
    return ((rule == POSITIVE and n <= 0) or (rule == NOT_NEGATIVE and n < 0)
            or (rule == AT_LEAST_ONE and (n < 1 or n != int(n))))


def option_errors(values):
    """What is wrong with the options ``values`` ({name: value as given}), each a line naming the option;
    [] when nothing is. Options without a rule are not looked at (the argument spec checks their types)."""
    errors = []
    for name in sorted(values):
        rule = OPTION_RULES.get(name)
        if rule is None or values[name] is None:
            continue
        try:
            n = float(values[name])
        except (TypeError, ValueError):
            n = float("nan")  # not a number: it breaks every rule
        if _breaks(rule, n):
            errors.append("%s=%r must be %s" % (name, values[name], _RULE_TEXT[rule]))
    return errors
