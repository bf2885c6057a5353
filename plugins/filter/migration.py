# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters for migrate.yml: compare the two hosts before anything is frozen, and summarise timings."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_preflight
short_description: Compare a migration's source and target facts (cuda_process_facts) and list what differs
version_added: "0.1.0"
description:
  - Returns C(ok), C(rows) (check, source, target, ok) and C(table), a text table for people.
options:
  _input:
    description:
      - The source's C(ansible_facts['gpuckpt']).
      - Gathered with O(gpuckpt.fleet.cuda_process_facts#module:tree_of) and O(gpuckpt.fleet.cuda_process_facts#module:paths).
    type: dict
    required: true
  target:
    description: The target's C(ansible_facts['gpuckpt']), gathered with check_pids and paths.
    type: dict
    required: true
  source_path:
    description: The source's image directory.
    type: str
    required: true
  target_path:
    description: The target's image directory.
    type: str
    required: true
  allow_driver_mismatch:
    description: Accept different driver versions on the two hosts.
    type: bool
    default: false
  check_gpus:
    description: Compare GPU models, count and free memory.
    type: bool
    default: true
  same_pid_space:
    description: Source and target share one pid space, so the workload's own pids are expected in use on the target.
    type: bool
    default: false
  container:
    description: The workload is a container, which keeps its pids in its own pid namespace, so no pid check applies.
    type: bool
    default: false
"""


def _gib(n):
    return "%.1f GiB" % (n / 2.0**30) if n is not None else "-"


def _row(check, src, tgt, ok):
    return {"check": check, "source": str(src), "target": str(tgt), "ok": bool(ok)}


def migration_preflight(src, tgt, source_path, target_path, allow_driver_mismatch=False, check_gpus=True,
                        same_pid_space=False, margin=1.10, container=False):
    rows = []
    tree = src.get("tree") or {}
    rows.append(_row("workload pid %s on source" % tree.get("root"), "%d process(es)" % len(tree.get("pids") or []),
                     "-", tree.get("exists")))
    need = int(((tree.get("rss_bytes") or 0) + (tree.get("gpu_bytes") or 0)) * margin)
    on_gpu = bool(tree.get("cuda_pids"))
    sd, td = src.get("driver") or {}, tgt.get("driver") or {}
    if on_gpu:
        rows.append(_row("driver checkpoint API (570+)", sd.get("checkpoint_api"), td.get("checkpoint_api"),
                         sd.get("checkpoint_api") and td.get("checkpoint_api")))
        same = sd.get("driver_version") == td.get("driver_version")
        rows.append(_row("driver version" + (" (mismatch allowed)" if allow_driver_mismatch else ""),
                         sd.get("driver_version"), td.get("driver_version"), same or allow_driver_mismatch))
        rows.append(_row("CUDA API version", sd.get("api_version"), td.get("api_version"),
                         sd.get("api_version") == td.get("api_version") or allow_driver_mismatch))
        busy = [s for s in (tree.get("cuda_states") or {}).values() if s != "running"]
        rows.append(_row("CUDA processes running (not locked)", ",".join(sorted(set((tree.get("cuda_states") or {})
                                                                                    .values()))), "-", not busy))
        if check_gpus:
            sg, tg = src.get("gpus") or [], tgt.get("gpus") or []
            rows.append(_row("GPU model", ",".join(sorted({g["name"] for g in sg})) or "-",
                             ",".join(sorted({g["name"] for g in tg})) or "-",
                             {g["name"] for g in sg} <= {g["name"] for g in tg}))
            rows.append(_row("GPU count", len(sg), len(tg), len(tg) >= len(sg)))
            free = sum(g.get("memory_free_mib", 0) for g in tg) * 2**20
            rows.append(_row("free GPU memory on target", _gib(tree.get("gpu_bytes")), _gib(free),
                             free >= (tree.get("gpu_bytes") or 0)))
    for name, facts in (("source", src), ("target", tgt)):
        c = facts.get("criu") or {}
        ok = c.get("supported") and c.get("check_ok", True)
        rows.append(_row("CRIU 4.x and criu check on %s" % name, c.get("version", "missing") if name == "source" else "",
                         c.get("version", "missing") if name == "target" else "", ok))
    sfree = ((src.get("disk") or {}).get(source_path) or {}).get("free_bytes")
    tfree = ((tgt.get("disk") or {}).get(target_path) or {}).get("free_bytes")
    rows.append(_row("free disk for the image (~%s)" % _gib(need), _gib(sfree), _gib(tfree),
                     sfree is not None and tfree is not None and sfree >= need and tfree >= need))
    taken = tgt.get("pids_in_use") or []
    if container:
        rows.append(_row("workload pids free on target", "in its own pid namespace", "not needed", True))
    elif same_pid_space:
        # One pid space (one kernel seen as two hosts): the pids in use are the workload's own, and the
        # checkpoint frees them. Anything else holding them would be a real conflict.
        others = [p for p in taken if p not in (tree.get("pids") or [])]
        rows.append(_row("workload pids free on target (same pid space)", ",".join(map(str, tree.get("pids") or [])),
                         "in use: " + ",".join(map(str, others)) if others else "freed by the checkpoint", not others))
    else:
        rows.append(_row("workload pids free on target", ",".join(map(str, tree.get("pids") or [])),
                         "in use: " + ",".join(map(str, taken)) if taken else "free", not taken))
    width = max(len(r["check"]) for r in rows)
    lines = ["%-*s  %-22s  %-22s  %s" % (width, "check", "source", "target", "")]
    for r in rows:
        lines.append("%-*s  %-22s  %-22s  %s"
                     % (width, r["check"], r["source"][:22], r["target"][:22], "ok" if r["ok"] else "DIFFERS"))
    return {"ok": all(r["ok"] for r in rows), "rows": rows, "table": "\n".join(lines),
            "failed": [r["check"] for r in rows if not r["ok"]], "image_estimate_bytes": need}


class FilterModule(object):
    def filters(self):
        return {"migration_preflight": migration_preflight}
