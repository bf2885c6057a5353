# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A drain's plan and its outcome as lines for people (the play prints them; AWX shows them as they are)."""
from __future__ import annotations

from ..migration.planner import gib, image_estimate


def describe(workload):
    """A workload in a few words: ``container train-7 (runc)``, ``pod ml/trainer``, ``pid 4242 (python3)``."""
    if workload.get("kind") == "pod":
        return "pod %s" % workload.get("pod")
    if workload.get("kind") == "container":
        return "container %s (%s)" % (workload.get("container"), workload.get("runtime"))
    return "pid %s%s" % (workload.get("root_pid"), " (%s)" % workload["comm"] if workload.get("comm") else "")


def _size(workload, estimate=None):
    tree = workload.get("tree") or {}
    gpu, estimate = tree.get("gpu_bytes"), estimate if estimate is not None else image_estimate(tree)
    return "%s image, GPU %s" % (gib(estimate) if estimate is not None else "? GiB",
                                 gib(gpu) if gpu is not None else "UNKNOWN")


def _secs(n):
    return "?" if n is None else "%.0f s" % n


def plan_lines(node, plan):
    """The plan: each move (workload, size, target and GPUs, estimate), then each workload that stays and
    why, then why the other targets were not chosen."""
    lines = ["Drain of %s: %d workload(s) to move, %d to stay" % (node, len(plan["moves"]), len(plan["stays"]))]
    for m in plan["moves"]:
        est = m.get("estimate") or {}
        lines.append("  MOVE  %s [%s] -> %s%s (batch %s%s) id %s" % (
            describe(m["workload"]), _size(m["workload"], m.get("image_estimate_bytes")), m["target"],
            (" GPU " + ",".join(m["gpus"]) + (" (mapped)" if m.get("gpu_map") else "")) if m.get("gpus") else "", m.get("batch"),
            ", est. %s, ends by %s" % (_secs(est.get("duration_s")), _secs(est.get("finish_s")))
            if est.get("duration_s") is not None else "", m.get("migration_id")))
    for s in plan["stays"]:
        lines.append("  STAY  %s [%s]: %s" % (describe(s["workload"]), _size(s["workload"], s.get("image_estimate_bytes")),
                                              s["reason"]))
    for entry in plan["moves"] + plan["stays"]:
        for target, why in sorted((entry.get("rejected") or {}).items()):
            lines.append("        %s not on %s: %s" % (describe(entry["workload"]), target, why))
    return lines


def report_lines(node, plan, outcomes):
    """The end of a drain: each workload, where it runs now and its downtime (beside the plan's estimate),
    or why it stayed. ``outcomes``: {migration id: the move's outcome as the play recorded it}."""
    lines = ["Drain of %s:" % node]
    for m in plan["moves"]:
        out = outcomes.get(m["migration_id"]) or {
            "status": "not run", "where": node, "reason": "the move did not report (its host failed?)"}
        est = (m.get("estimate") or {}).get("duration_s")
        if out.get("status") == "moved":
            lines.append("  MOVED   %s -> %s: downtime %s, move took %s (estimated %s), image %s (estimated %s)" % (
                describe(m["workload"]), out.get("where"), _secs(out.get("downtime_s")), _secs(out.get("took_s")),
                _secs(est), gib(out.get("image_bytes")) if out.get("image_bytes") is not None else "?",
                gib(m.get("image_estimate_bytes"))))
        else:
            lines.append("  STAYED  %s on %s: %s" % (describe(m["workload"]), out.get("where") or node,
                                                     out.get("reason") or out.get("status")))
    for s in plan["stays"]:
        lines.append("  STAYED  %s on %s: %s" % (describe(s["workload"]), node, s["reason"]))
    return lines


def node_empty(plan, outcomes, left_out=()):
    """Whether the drain emptied the node: every planned move moved and nothing stayed or was left out."""
    return (not plan["stays"] and not list(left_out)
            and all((outcomes.get(m["migration_id"]) or {}).get("status") == "moved" for m in plan["moves"]))


# -- what the node's drain mark keeps between runs ------------------------------------------------------

def move_record(move):
    """What the drain mark keeps of a move: enough for a re-run to settle it (its id and target)."""
    return {"migration_id": move["migration_id"], "target": move["target"], "workload": move["workload"]["key"]}


def settled(outcome):
    """Whether a move's outcome is final: it moved, or it stayed with its target shown clean."""
    return bool(outcome) and outcome.get("status") in ("moved", "stayed", "none") and outcome.get("settled", True)


def unsettled(records, outcomes):
    """The records whose move has no final outcome (``outcomes``: {migration id: outcome})."""
    return [r for r in records if not settled((outcomes or {}).get(r["migration_id"]))]


def throughput_update(recorded, plan, outcomes, now=None):
    """The throughput from the node to each target ({target: {"bytes_s", "measured_at"}}), updated with what
    the moves of this drain showed (each outcome's ``transfer_bytes_s``; the latest move to a target wins)."""
    out = dict(recorded or {})
    for m in plan.get("moves") or []:
        rate = ((outcomes or {}).get(m["migration_id"]) or {}).get("transfer_bytes_s")
        if rate:
            out[m["target"]] = {"bytes_s": float(rate), "measured_at": now, "by": m["migration_id"]}
    return out
