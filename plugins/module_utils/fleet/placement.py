# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where does each workload of a draining node go? Host facts in, a placement plan with reasons out.

Pure: no I/O, no Ansible, the standard library only. Every (workload, target) pair is checked by the
migration's own planner (``migration/planner.py``: GPU model and driver, free memory on each GPU the workload
lands on, disk for the image, host RAM, pids, CRIU), plus what a drain adds: the target is not draining
itself, and it runs the workload's runtime. Workloads are placed hardest first (most GPU memory, then the
largest image), each on the feasible target with the fewest moves planned so far and then the most free GPU
memory, and what it takes there (GPU memory per GPU, disk, host RAM) is reserved before the next one is
placed, so two workloads never count on the same free memory.

With a deadline (a maintenance window, a spot notice), each move's duration is estimated from its image
size and the throughput measured from the node to its target (``throughput``: bytes/s per target), plus a
fixed overhead per move; moves run ``parallel`` at a time, in batches, shortest first so that the most
workloads leave in time. A move whose batch would end after the deadline is not started: its workload stays
running where it is, named with the reason. A throughput that was never measured makes the estimate
unknown, and an unknown estimate refuses like every unknown check unless ``deadline`` is allowed by name.
"""
from __future__ import annotations

import hashlib
import re

from ..migration import planner

OVERHEAD_S = 30.0  # what a move costs besides moving its image: Ansible's tasks, the restore, the settlement


def _free_gpu_mib(facts):
    return sum(g.get("memory_free_mib") or 0 for g in facts.get("gpus") or [])


def _less(d, key, n):
    """A copy of ``d`` with ``n`` taken from its ``key`` (not below 0) where that is known."""
    out = dict(d or {})
    if out.get(key) is not None:
        out[key] = max(0, out[key] - n)
    return out


def _reserve(facts, workload, node, plan, target_path, gpu_map=None):
    """The target's facts with what this move takes there reserved."""
    out = dict(facts)
    sg, tg = planner.gpu_list(node) or [], [dict(g) for g in (planner.gpu_list(facts) or [])]
    for uuid, need in planner.gpu_needs(workload["tree"]) or []:
        for g in planner.landing_gpus(uuid, sg, tg, gpu_map):
            g.update(_less(g, "memory_free_mib", need // planner.MIB))
    out["gpus"] = tg
    size = plan.image_estimate_bytes or 0
    out["disk"] = dict(facts.get("disk") or {})
    if out["disk"].get(target_path):
        out["disk"][target_path] = _less(out["disk"][target_path], "free_bytes", size)
    out["memory"] = _less(facts.get("memory"), "available_bytes", size)
    if isinstance(facts.get("k8s_node"), dict) and workload.get("gpus_by_resource"):
        free = dict(facts["k8s_node"].get("gpus_free") or {})
        for resource, n in workload["gpus_by_resource"].items():
            free[resource] = max(0, free.get(resource, 0) - n)
        out["k8s_node"] = dict(facts["k8s_node"], gpus_free=free)
    return out


def _not_draining(name, facts):
    mark = facts.get("drain")
    return planner.Check("not_draining", "target not draining", "-", "draining" if mark else "no",
                         planner.FAILS if mark else planner.OK,
                         "%s is draining itself (since %s)" % (name, mark.get("started")) if mark else None)


def _runtime_check(runtime, name, facts):
    """The target runs the workload's runtime (a pod's: containerd, under the kubelet)."""
    needed = "containerd" if runtime == "k8s_pod" else runtime
    present = facts.get("runtimes_present")
    status = planner.UNKNOWN if present is None else planner.OK if needed in present else planner.FAILS
    return planner.Check("runtime", "%s on target" % needed, needed, ",".join(present or []) or "?", status,
                         None if status == planner.OK else
                         "%s does not report its runtimes" % name if present is None else "%s has no %s" % (name, needed))


def _k8s_node_check(workload, name, facts):
    """A pod lands on the target's Kubernetes node: known to the API server, Ready, not cordoned, with the GPUs
    the pod asks for free there (its allocatable count less what the pods bound to it ask)."""
    node = facts.get("k8s_node")
    if not isinstance(node, dict):
        return planner.Check("k8s_node", "Kubernetes node", "Ready, schedulable", "?", planner.FAILS,
                             "%s is no Kubernetes node the API server answered for (%s)" % (name, node or "not asked"))
    short = ["%s %d free, pod needs %d" % (r, (node.get("gpus_free") or {}).get(r, 0), n)
             for r, n in sorted((workload.get("gpus_by_resource") or {}).items())
             if n and (node.get("gpus_free") or {}).get(r, 0) < n]
    why = ("node %s is not Ready" % node["name"] if not node.get("ready") else
           "node %s is cordoned" % node["name"] if node.get("unschedulable") else
           "node %s: %s" % (node["name"], "; ".join(short)) if short else None)
    return planner.Check("k8s_node", "Kubernetes node", "Ready, schedulable, GPUs free", node["name"],
                         planner.FAILS if why else planner.OK, why)


def _drain_checks(workload, name, facts):
    """What a drain checks beyond the migration's planner: the target has the workload's runtime, and a pod's
    Kubernetes node can take it."""
    if workload["runtime"] == "process":
        return []
    checks = [_runtime_check(workload["runtime"], name, facts)]
    if workload["kind"] == "pod":
        checks.append(_k8s_node_check(workload, name, facts))
    return checks


def _why(plan):
    """The reasons a plan refuses, in a line."""
    return "; ".join("%s: %s" % (c.label, c.reason) for c in plan.checks
                     if c.status == planner.FAILS or (c.status == planner.UNKNOWN and c.name not in plan.allowed))


def _one_pid_space(node, facts):
    """Whether the node and the target are one kernel and one pid namespace (one machine seen as two hosts), as
    migrate.yml's preflight decides it: the workload's own pids are then the ones in use on the target."""
    a, b = node.get("host") or {}, facts.get("host") or {}
    return bool(a.get("boot_id")) and a.get("boot_id") == b.get("boot_id") and a.get("pid_namespace") == b.get("pid_namespace")


def _own_pids_only(workload, facts):
    """The target's facts as migrate.yml's preflight has them: a drain asks the target about the pids of every bare
    process of the node at once, and only this workload's own pids are its concern."""
    if "pids_in_use" not in facts:
        return facts
    own = set(workload["tree"].get("pids") or [])
    return dict(facts, pids_in_use=[p for p in facts["pids_in_use"] if p in own])


def _fits_in_place(needs, sg, tg):
    """Whether each GPU's memory fits the free memory of the target GPU at its place (the restore's default)."""
    for uuid, need in needs:
        for g in planner.landing_gpus(uuid, sg, tg):
            if g.get("memory_free_mib") is None or g["memory_free_mib"] * planner.MIB < need:
                return False
    return True


def choose_gpu_map(workload, node, facts):
    """{source GPU UUID: target GPU UUID} that puts a bare process's GPU memory on target GPUs of the same model with
    room for it, one target GPU per source GPU, where the GPUs at its places have not the room; None when the places
    do, when nothing could fit, or when the map is not the drain's to choose: a container's GPUs are its device
    nodes, mapped place by place by its runtime, and a pod's are the device plugin's."""
    by_gpu = workload["tree"].get("gpu_bytes_by_gpu")
    sg, tg = planner.gpu_list(node) or [], planner.gpu_list(facts) or []
    if workload["kind"] != "process" or not by_gpu or not sg or not tg:
        return None
    needs = sorted(by_gpu.items(), key=lambda kv: (-kv[1], kv[0]))
    if _fits_in_place([(u, n) for u, n in needs if n], sg, tg):
        return None
    model = {g.get("uuid"): g.get("name") for g in sg}
    index = {g.get("uuid"): g.get("index") for g in sg}
    taken, out = set(), {}
    for uuid, need in needs:
        room = [g for g in tg if g.get("uuid") not in taken and g.get("name") == model.get(uuid)
                and g.get("memory_free_mib") is not None and g["memory_free_mib"] * planner.MIB >= need]
        if not room:
            return None
        best = min(room, key=lambda g: (g.get("index") != index.get(uuid), -g["memory_free_mib"], g.get("index")))
        taken.add(best.get("uuid"))
        out[uuid] = best.get("uuid")
    return out


def check_pair(workload, node, name, facts, source_path, target_path, allow_unknown=(), allow_driver_mismatch=False,
               margin=planner.IMAGE_MARGIN, gpu_map=None):
    """The Plan of moving ``workload`` from ``node`` (its facts) to the target ``name`` (``facts``).
    ``allow_unknown`` may also name the drain's own checks (``runtime``, ``deadline``)."""
    # The migration's planner refuses names that are not its checks; the verdict takes the drain's too.
    opts = planner.options(source_path=source_path, target_path=target_path,
                           allow_unknown=[n for n in allow_unknown or () if n in planner.CHECK_NAMES],
                           allow_driver_mismatch=allow_driver_mismatch, container=workload["kind"] != "process",
                           same_pid_space=_one_pid_space(node, facts), margin=margin, gpu_map=gpu_map)
    checks = planner.check_target(workload["tree"], node, _own_pids_only(workload, facts), opts) + _drain_checks(workload, name, facts)
    return planner.verdict(checks, opts._replace(allow_unknown=tuple(allow_unknown or ())),
                           planner.image_estimate(workload["tree"], margin))


def _difficulty(workload):
    tree = workload["tree"]
    return (-(tree.get("gpu_bytes") or 0), -(planner.image_estimate(tree) or 0), workload["key"])


def migration_id(prefix, workload):
    """A migration id for this workload's move: ``prefix`` and its key, in the journal's alphabet (at most 128
    characters: a longer one is cut and ends with a digest of the whole, so that two keys cut alike differ)."""
    whole = prefix + "-" + re.sub(r"[^A-Za-z0-9._-]+", "-", workload["key"])
    if len(whole) <= 128:
        return whole
    return whole[:119] + "-" + hashlib.sha256(whole.encode("utf-8")).hexdigest()[:8]


def _targets_for(w, node, targets, facts, source_path, target_paths, allow_unknown, allow_driver_mismatch, margin):
    """({target: its Plan} for each target ``w`` fits on, {target: why not} for each other one)."""
    rejected = {n: "no facts: %s" % f for n, f in targets.items() if not isinstance(f, dict)}
    fits = {}
    maps = {}
    for n in sorted(facts):
        maps[n] = choose_gpu_map(w, node, facts[n])
        plan = check_pair(w, node, n, facts[n], source_path, target_paths.get(n), allow_unknown,
                          allow_driver_mismatch, margin, maps[n])
        if plan.ok:
            fits[n] = plan
        else:
            rejected[n] = _why(plan)
    return fits, rejected, maps


def _landing_uuids(w, node, target_facts, gpu_map=None):
    """The UUIDs of the target's GPUs that the workload's GPU memory lands on."""
    tg = planner.gpu_list(target_facts) or []
    return sorted({g.get("uuid") for uuid, unused in planner.gpu_needs(w["tree"]) or []
                   for g in planner.landing_gpus(uuid, planner.gpu_list(node) or [], tg, gpu_map)})


def place(node, workloads, targets, source_path, target_paths, allow_unknown=(), allow_driver_mismatch=False,
          margin=planner.IMAGE_MARGIN, throughput=None):
    """(moves, stays): each move ``{"workload", "target", "gpus", "image_estimate_bytes", "rejected"}``;
    each stay ``{"workload", "reason", "rejected"}``. ``targets``: {name: facts, or a text saying why there
    are none (unreachable)}; ``rejected``: {target: why not there} for every target not chosen."""
    facts = {n: f for n, f in targets.items() if isinstance(f, dict)}
    planned = {n: 0 for n in facts}
    why_best = ("a faster link, fewer moves planned there, or more free GPU memory" if throughput
                else "fewer moves planned there, or more free GPU memory")
    moves, stays = [], []
    for w in sorted(workloads, key=_difficulty):
        if w.get("refused"):  # a pod the API server says cannot move, wherever it would go
            stays.append({"workload": w, "reason": w["refused"], "rejected": {}})
            continue
        fits, rejected, maps = _targets_for(w, node, targets, facts, source_path, target_paths, allow_unknown,
                                            allow_driver_mismatch, margin)
        if not fits:
            stays.append({"workload": w, "reason": "fits on no target", "rejected": rejected})
            continue
        # With throughputs known (a deadline), the target the image reaches soonest first.
        best = min(fits, key=lambda n: (_transfer_s(fits[n].image_estimate_bytes, (throughput or {}).get(n)),
                                        planned[n], -_free_gpu_mib(facts[n]), n))
        rejected.update({n: "fits too; %s was chosen (%s)" % (best, why_best) for n in fits if n != best})
        moves.append({"workload": w, "target": best, "gpus": _landing_uuids(w, node, facts[best], maps[best]),
                      "gpu_map": maps[best], "image_estimate_bytes": fits[best].image_estimate_bytes, "rejected": rejected})
        facts[best] = _reserve(facts[best], w, node, fits[best], target_paths.get(best), maps[best])
        planned[best] += 1
    return moves, stays


def _rate(value):
    """A throughput as given (bytes/s) or as the node's record keeps it ({"bytes_s", "measured_at"})."""
    return value.get("bytes_s") if isinstance(value, dict) else value


def _transfer_s(size, rate):
    rate = _rate(rate)
    return float("inf") if not rate or size is None else size / float(rate)


def estimate(move, throughput, overhead=OVERHEAD_S):
    """The move's estimated seconds: ``transfer_s`` (its image over the measured throughput to its target)
    and ``duration_s`` (that plus the fixed overhead); None each when the throughput or the size is unknown."""
    rate, size = _rate((throughput or {}).get(move["target"])), move["image_estimate_bytes"]
    if not rate or size is None:
        return {"transfer_s": None, "duration_s": None, "throughput_bytes_s": rate}
    transfer = size / float(rate)
    return {"transfer_s": round(transfer, 2), "duration_s": round(transfer + overhead, 2), "throughput_bytes_s": rate}


_UNKNOWN_DURATION = ("its duration is not known (no throughput measured from the node to %s, or the image size is "
                     "unknown); allow it with gpuckpt_allow_unknown=[deadline]")


def _batches(order, parallel, room=None):
    """``order`` cut into the batches that run together: at most ``parallel`` moves, whose images the node writes
    at once into its image root, so together they must fit its free disk there (``room``: bytes, None when unknown;
    each move alone was checked against it when placed)."""
    out, batch, used = [], [], 0
    for m in order:
        size = m["image_estimate_bytes"] or 0
        if batch and (len(batch) >= parallel or (room is not None and used + size > room)):
            out.append(batch)
            batch, used = [], 0
        batch.append(m)
        used += size
    return out + ([batch] if batch else [])


def _in_batches(order, parallel, deadline, room=None):
    """(the moves of ``order`` that end by the deadline, run in batches (``_batches``), each with its ``batch`` and
    ``finish_s``; the others, each with its reason). A batch takes as long as its longest move."""
    run, late, clock = [], [], 0.0
    for group in _batches(order, parallel, room):
        in_time = []
        for b in group:
            took = b["estimate"]["duration_s"]
            if took is None or clock + took <= deadline:
                in_time.append(b)
            else:
                late.append(dict(b, reason="estimated to end %.0f s after the drain began, past the deadline of %.0f s"
                                           % (clock + took, deadline)))
        batch = len({x["batch"] for x in run})
        for b in in_time:
            took = b["estimate"]["duration_s"]
            b["batch"], b["estimate"]["finish_s"] = batch, None if took is None else round(clock + took, 2)
        run += in_time
        clock += max([b["estimate"]["duration_s"] or 0.0 for b in in_time] or [0.0])
    return run, late


def schedule(moves, parallel=1, deadline=None, throughput=None, overhead=OVERHEAD_S, allow_unknown=(), room=None):
    """(moves in the order they run, each with its ``estimate`` and ``batch``; moves that would not finish
    by the deadline, each with its reason). Without a deadline the moves run in placement order. A batch holds at
    most ``parallel`` moves whose images fit the node's free disk together (``room``)."""
    parallel = max(1, int(parallel))
    for m in moves:
        m["estimate"] = estimate(m, throughput, overhead)
    if deadline is None:
        for i, batch in enumerate(_batches(moves, parallel, room)):
            for m in batch:
                m["batch"] = i
        return moves, []
    unknown = [m for m in moves if m["estimate"]["duration_s"] is None]
    known = sorted((m for m in moves if m["estimate"]["duration_s"] is not None),
                   key=lambda m: (m["estimate"]["duration_s"], m["workload"]["key"]))
    late = []
    if "deadline" not in allow_unknown:
        late, unknown = [dict(m, reason=_UNKNOWN_DURATION % m["target"]) for m in unknown], []
    run, past = _in_batches(known + unknown, parallel, deadline, room)
    return run, late + past


def plan_drain(node, workloads, targets, source_path, target_paths, id_prefix, parallel=1, deadline=None,
               throughput=None, overhead=OVERHEAD_S, allow_unknown=(), allow_driver_mismatch=False,
               margin=planner.IMAGE_MARGIN):
    """The whole plan: ``moves`` (in order, each with its migration id, target, GPUs, image estimate,
    estimate and batch) and ``stays`` (each workload that is not moved, with its reason), every
    ``rejected`` target with its reason."""
    placed, stays = place(node, workloads, targets, source_path, target_paths, allow_unknown, allow_driver_mismatch,
                          margin, throughput if deadline is not None else None)
    room = (((node.get("disk") or {}).get(source_path)) or {}).get("free_bytes")
    moves, late = schedule(placed, parallel, deadline, throughput, overhead, allow_unknown, room)
    sizes = []
    for m in moves:
        m["migration_id"] = migration_id(id_prefix, m["workload"])
        if m["batch"] >= len(sizes):
            sizes.append(0)
        sizes[m["batch"]] += 1
    # drain.yml runs the moves with Ansible's serial set to these sizes, so that its batches are the plan's.
    return {"moves": moves, "stays": stays + late, "batch_sizes": sizes}
