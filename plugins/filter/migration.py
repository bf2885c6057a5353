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
  - A thin wrapper over the collection's migration planner (C(module_utils/migration/planner.py)), the one that
    a drain uses too.
  - Returns C(ok), C(rows) (check, source, target, ok, and C(status) V(ok), V(fails) or V(unknown) with its
    C(name) and C(reason)), C(table), a text table for people, C(failed) (the checks that refuse the move),
    C(unknown) (the names of the checks whose facts are missing), C(allowed_unknown) (those of them accepted
    by O(allow_unknown)) and C(image_estimate_bytes) (host RSS + GPU memory, +10%; null when unknown).
  - Unknown is never counted as zero. A check whose facts are missing (the workload's GPU memory where
    neither NVML nor nvidia-smi answered, a GPU that reports no free memory) is V(unknown), and C(ok) is
    false unless O(allow_unknown) names it. The table prints it as C(UNKNOWN), with its reason and what to do.
  - GPU memory is compared per GPU, the workload's memory on each of its GPUs against the free memory of the
    target GPU it lands on (the one at the same index, or the one O(gpu_map) names), not against the target's sum.
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
  margin:
    description: The image estimate's factor over the workload's host RSS and GPU memory.
    type: float
    default: 1.10
  allow_unknown:
    description:
      - The checks whose unknown status does not refuse the migration, by name (a comma-separated string, with or
        without brackets, is read as a list, as C(-e name=[a,b]) gives it).
      - V(gpu_memory) accepts a workload whose GPU memory could not be read; V(disk) and V(host_ram) an image
        of unknown size, or a host that did not report its free room.
    type: list
    elements: str
    default: []
    choices: [workload, checkpoint_api, driver_version, cuda_api_version, cuda_running, gpu_model, gpu_count,
              gpu_memory, criu, disk, host_ram, source_ram, pids, not_draining]
  gpu_map:
    description: Source GPU UUID to target GPU UUID, where the restore puts each GPU's memory (by default, the same index).
    type: dict
  image_in_memory:
    description:
      - The source keeps the image in memory (gpuckpt.fleet.gpu_checkpoint's O(gpuckpt.fleet.gpu_checkpoint#module:image_in_memory)),
        not on its disk. The disk check counts only the target. The V(source_ram) check adds the source's
        MemAvailable against three things. These are the image, the GPU memory that stage 1 brings into host
        RAM, and a reserve of 5 % of its RAM, at least 1 GiB.
    type: bool
    default: false
  target_image_in_memory:
    description:
      - The target keeps the image in memory (gpuckpt.fleet.gpu_migration's O(gpuckpt.fleet.gpu_migration#module:image_in_memory)),
        not on its disk. The disk check no longer counts the target. The V(host_ram) check asks the target's MemAvailable
        for the image twice (the image and the restored job's memory) and a reserve of 5 % of its RAM, at least 1 GiB.
    type: bool
    default: false
  migration_id:
    description: The migration's id, as the first line of C(lines) names it when the hosts do not fit.
    type: str
  headline:
    description: The first line of C(lines) when the hosts fit (tasks/migrate_one.yml gives the plan's, which says how the source waits).
    type: str
"""

EXAMPLES = r"""
- name: Compare the two hosts, accepting a GPU memory that could not be read
  ansible.builtin.set_fact:
    preflight: >-
      {{ src_facts | gpuckpt.fleet.migration_preflight(dst_facts, '/var/lib/gpuckpt/images',
                                                       '/var/lib/gpuckpt/images', allow_unknown=['gpu_memory']) }}
"""

RETURN = r"""
_value:
  description:
    - C(ok), C(rows), C(table), C(failed), C(unknown), C(allowed_unknown) and C(image_estimate_bytes).
    - C(lines), what a person reads, the table under its first line. That line is O(headline) when the hosts fit,
      else the checks that refuse the migration.
  type: dict
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import planner


def _status_text(row):
    if row["status"] == planner.UNKNOWN:
        return "UNKNOWN (allowed)" if row["ok"] else "UNKNOWN"
    return "ok" if row["ok"] else "DIFFERS"


def _advice(check, allowed):
    """What a person reads under a row that is not ok: why, and for an unknown one how to get past it."""
    if check.status == planner.UNKNOWN and not allowed:
        return "%s; or -e gpuckpt_allow_unknown=[%s]" % (check.reason, check.name)
    return check.reason


def _row(check, allowed):
    ok = check.status == planner.OK or (check.status == planner.UNKNOWN and allowed)
    return {"check": check.label, "source": check.source, "target": check.target, "ok": ok,
            "status": check.status, "name": check.name, "reason": _advice(check, allowed)}


def _table(rows):
    width = max(len(r["check"]) for r in rows)
    lines = ["%-*s  %-22s  %-22s  %s" % (width, "check", "source", "target", "")]
    for r in rows:
        lines.append("%-*s  %-22s  %-22s  %s"
                     % (width, r["check"], r["source"][:22], r["target"][:22], _status_text(r)))
        if r["reason"]:
            lines.append("%-*s  -> %s" % (width, "", r["reason"]))
    refused = [r["name"] for r in rows if r["status"] == planner.UNKNOWN and not r["ok"]]
    if len(refused) > 1:
        lines.append("to accept every unknown check: -e gpuckpt_allow_unknown=[%s]" % ",".join(refused))
    return "\n".join(lines)


def _check_names(given):
    """allow_unknown as a list of names; ``-e gpuckpt_allow_unknown=[gpu_memory,disk]`` arrives as a string."""
    if isinstance(given, str):
        given = [n.strip(" '\"") for n in given.strip().strip("[]").split(",")]
    return [n for n in given or () if n]


def migration_preflight(src, tgt, source_path, target_path, allow_driver_mismatch=False, check_gpus=True,
                        same_pid_space=False, margin=planner.IMAGE_MARGIN, container=False, allow_unknown=None,
                        gpu_map=None, image_in_memory=False, target_image_in_memory=False, migration_id=None,
                        headline=None):
    """The planner's verdict on moving the source's tree to the target, as rows and a table for people."""
    try:
        opts = planner.options(source_path=source_path, target_path=target_path, allow_unknown=_check_names(allow_unknown),
                               allow_driver_mismatch=bool(allow_driver_mismatch), check_gpus=bool(check_gpus),
                               same_pid_space=bool(same_pid_space), container=bool(container), margin=float(margin),
                               gpu_map=gpu_map or None, image_in_memory=bool(image_in_memory),
                               target_image_in_memory=bool(target_image_in_memory))
    except ValueError as exc:
        raise AnsibleFilterError("migration_preflight: %s" % exc)
    plan = planner.plan_move(src.get("tree"), src, tgt, opts)
    rows = [_row(c, c.name in plan.allowed) for c in plan.checks]
    failed, table = [r["check"] for r in rows if not r["ok"]], _table(rows)
    first = (headline or "Migration %s" % migration_id) if plan.ok else (
        "Preflight failed for migration %s: %s" % (migration_id, "; ".join(failed)))
    return {"ok": plan.ok, "rows": rows, "table": table, "lines": [first] + table.split("\n"), "failed": failed,
            "unknown": plan.unknown, "allowed_unknown": plan.allowed, "image_estimate_bytes": plan.image_estimate_bytes}


class FilterModule(object):
    def filters(self):
        return {"migration_preflight": migration_preflight}
