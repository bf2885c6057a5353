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


# -- the end of a drain, read from the hosts ----------------------------------------------------------------
#
# Nothing here is taken from the plan or from what a move said of itself: where each workload runs is what the
# hosts show at the end (issue 43, 3). ``seen`` of a move: its journals as gpu_migration's status read them at
# the end, {"source": journal or None, "target": journal or None, "target_error": why the target could not be
# asked, or ""}; ``node_after``: the node's workloads as cuda_process_facts (workloads: true) found them again at
# the end, or None when the node could not be asked.

SOURCE_DONE = ("committed", "resumed", "rolled_back")  # a source journal whose migration is over
NOT_FROZEN = (None, "planned")  # a source journal whose checkpoint never froze anything


def describe_key(key):
    """A workload named only by its key (a drain mark's record): ``process:4242`` -> ``pid 4242``."""
    runtime, _sep, ident = str(key).partition(":")
    if runtime == "process":
        return "pid %s" % ident
    if runtime == "k8s_pod":
        return "pod %s" % ident
    return "container %s (%s)" % (ident.split("/")[-1], runtime)


def _runs(journal):
    return bool(journal) and bool(journal.get("exists", True)) and bool(journal.get("running_pids"))


def _identity_keys(identities):
    return {(int(i.get("pid") or 0), i.get("starttime"), i.get("boot_id")) for i in (identities or {}).values()
            if isinstance(i, dict)}


def _copies_seen(seen):
    """The identities of every copy a move committed and that runs on its target: on hosts that share one pid
    space (two "hosts" on one kernel), the node sees those processes too, and they are no workload of the node."""
    out = set()
    for s in (seen or {}).values():
        tgt = (s or {}).get("target") or {}
        if tgt.get("phase") == "committed":
            out |= _identity_keys(tgt.get("identities"))
    return out


def _held_line(what, node, out, seen, by=""):
    src = (seen or {}).get("source") or {}
    how = "stopped" if src.get("stopped_pids") else "exited, its image on %s is the way back" % node
    return "  HELD    %s on %s (%s since its freeze%s): %s" % (what, node, how, by,
                                                               (out or {}).get("reason") or "not settled")


def move_state(seen, key, node_keys):
    """Where a move's workload is, as the hosts show it: moved (its target committed and runs it), held (the
    source's migration is not over: stopped, or exited with its image), on_node (the node runs it), unseen (the
    source was released and the target could not be asked), gone (the source was released and the target does not
    run it: lost), ended (never frozen, or given back, and the node no longer runs it: it ended on its own)."""
    seen = seen or {}
    src, tgt = seen.get("source") or {}, seen.get("target") or {}
    if tgt.get("phase") == "committed" and _runs(tgt):
        return "moved"
    if src.get("exists") and src.get("phase") not in SOURCE_DONE + NOT_FROZEN:
        return "held"
    if key in node_keys:
        return "on_node"
    if src.get("phase") == "committed":
        return "unseen" if seen.get("target_error") else "gone"
    return "ended"


class _DrainEnd:
    """The lines of a drain's end as they are gathered: what each move or stay left where, what keeps the node from
    being empty (``held``: a move's source still holds it there), what is lost (``gone``), and which of the node's
    workloads a line has spoken of (``accounted``)."""

    def __init__(self, node, outcomes, seen, found):
        self.node, self.outcomes, self.seen = node, outcomes, seen
        self.node_keys = {w["key"]: w for w in found}
        self.lines = ["Drain of %s (where each workload runs, as the hosts showed it at the end):" % node]
        self.held, self.gone, self.accounted = {}, [], set()

    def earlier_move(self, record):
        """A move of an earlier drain that this run settled first."""
        mid = record["migration_id"]
        out, s = self.outcomes.get(mid) or {}, self.seen.get(mid)
        if s is None:
            return  # not settled by this run (its target is not in the inventory): the node's mark keeps it
        key = record["workload"]
        what = describe(self.node_keys[key]) if key in self.node_keys else describe_key(key)
        by = "move %s of an earlier drain" % mid
        state, tgt = move_state(s, key, self.node_keys), (s.get("target") or {})
        if state == "moved":
            self.accounted.add(key)
            self.lines.append("  MOVED   %s -> %s (%s): runs there (pids %s)" % (
                what, record["target"], by, ",".join(map(str, tgt.get("running_pids") or []))))
        elif state == "held":
            self.held[key] = what
            self.lines.append(_held_line(what, self.node, out, s, "; " + by))
        elif state in ("on_node", "ended"):  # given back (or never frozen): the plan has it again, if it runs
            given_back = (s.get("source") or {}).get("phase") in ("resumed", "rolled_back")
            self.lines.append("  SETTLED %s (%s): %s%s" % (
                what, by, "rolled back to %s" % self.node if given_back else "it had not begun",
                "; " + out["rewind"] if out.get("rewind") else ""))
        elif state == "unseen":
            self.lines.append("  UNSEEN  %s (%s): %s could not be asked at the end (%s)" % (
                what, by, record["target"], s.get("target_error")))
        elif state == "gone":
            self.gone.append(what)
            self.lines.append("  GONE    %s (%s): runs neither on %s nor on %s (%s)" % (
                what, by, self.node, record["target"],
                out.get("reason") or "its settlement said %s" % (out.get("status") or "nothing")))

    def move(self, m):
        """A move of this drain's plan."""
        mid, key, what, target = m["migration_id"], m["workload"]["key"], describe(m["workload"]), m["target"]
        out, s = self.outcomes.get(mid) or {}, self.seen.get(mid) or {}
        state, tgt = move_state(s, key, self.node_keys), (s.get("target") or {})
        self.accounted.add(key)
        said = out.get("reason") or out.get("status") or "the move did not report"
        if state == "moved":
            est = (m.get("estimate") or {}).get("duration_s")
            self.lines.append("  MOVED   %s -> %s: downtime %s, move took %s (estimated %s), image %s (estimated %s); runs "
                              "there (pids %s)" % (
                                  what, target, _secs(out.get("downtime_s")), _secs(out.get("took_s")), _secs(est),
                                  gib(out.get("image_bytes")) if out.get("image_bytes") is not None else "?",
                                  gib(m.get("image_estimate_bytes")), ",".join(map(str, tgt.get("running_pids") or []))))
        elif state == "held":
            self.held[key] = what
            self.lines.append(_held_line(what, self.node, out, s))
        elif state == "on_node":
            self.lines.append("  STAYED  %s on %s: %s" % (what, self.node, said))
        elif state == "unseen":
            self.lines.append("  UNSEEN  %s: not on %s, and %s could not be asked at the end (%s)" % (
                what, self.node, target, s.get("target_error")))
        elif state == "ended":
            self.lines.append("  ENDED   %s: no longer runs on %s, and its move had not frozen it, or gave it back (%s)" % (
                what, self.node, said))
        else:
            self.gone.append(what)
            self.lines.append("  GONE    %s: runs neither on %s nor on %s (%s)" % (
                what, self.node, target, out.get("reason") or "its move said %s" % (out.get("status") or "nothing")))

    def stay(self, st):
        """A workload the plan left on the node, with its reason."""
        key, what = st["workload"]["key"], describe(st["workload"])
        self.accounted.add(key)
        if key in self.held:
            return  # (a move of an earlier drain holds it: its line says what settles it)
        if key in self.node_keys:
            self.lines.append("  STAYED  %s on %s: %s" % (what, self.node, st["reason"]))
        else:
            self.lines.append("  ENDED   %s: no longer runs on %s (it was to stay: %s)" % (what, self.node, st["reason"]))

    def left_out(self, w):
        """A workload the plan did not consider (the drain's options left it out)."""
        self.accounted.add(w["key"])
        if w["key"] in self.node_keys:
            self.lines.append("  LEFT    %s on %s: %s" % (describe(w), self.node, w.get("reason")))

    def unplanned(self, w):
        """A workload the node runs that no line has spoken of: it started after the plan."""
        if w["key"] not in self.accounted and w["key"] not in self.held:
            self.lines.append("  STILL   %s on %s: not in this drain's plan (it started after the plan)" % (describe(w), self.node))


def end_state(node, plan, outcomes, seen, node_after, earlier=None):
    """The end of a drain as the hosts show it. ``outcomes`` and ``seen``: by migration id, for this drain's moves
    and for those of an earlier drain settled first (``earlier``: their drain mark records, each with its
    ``workload`` key and ``target``). Returns {"lines", "empty", "still": what keeps the node from being empty,
    "held", "gone"}. The node is empty only when it could be asked and runs no GPU workload (a copy that a move
    committed and that the node sees only because both share one pid space is not the node's), and no move's
    source is held there."""
    outcomes, seen = outcomes or {}, seen or {}
    copies = _copies_seen(seen)
    found = [] if node_after is None else [
        w for w in node_after if not (_identity_keys(w.get("identities")) & copies)]
    end = _DrainEnd(node, outcomes, seen, found)
    for record in earlier or []:
        end.earlier_move(record)
    for m in plan["moves"]:
        end.move(m)
    for st in plan.get("stays") or []:
        end.stay(st)
    for w in plan.get("left_out") or []:
        end.left_out(w)
    for w in found:
        end.unplanned(w)
    if node_after is None:
        end.lines.append("  ?       %s could not be asked at the end: whether it is empty is not known" % node)
    still = [describe(w) for w in found] + [what for key, what in end.held.items() if key not in end.node_keys]
    return {"lines": end.lines, "empty": node_after is not None and not still, "still": still,
            "held": list(end.held.values()), "gone": end.gone}
