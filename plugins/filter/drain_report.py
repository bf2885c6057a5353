# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The end of a drain: where each workload runs now, or why it stayed."""
from __future__ import annotations

DOCUMENTATION = r"""
name: drain_report
short_description: The table at the end of a drain, and whether the node is empty
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.DRAIN_PLAN_INPUT
description:
  - Returns C(lines) (each workload, where it runs now and its downtime beside the plan's estimate, or why it stayed),
    C(empty) (every planned move moved, and no workload stayed or was left out), C(pending) (the moves that are not
    settled, for the node's drain mark, as a re-run settles them first) and C(throughput) (O(throughput) updated with
    what each move showed, by target).
options:
  outcomes:
    description: Each move's outcome by migration id (status V(moved) or V(stayed), where, reason, downtime_s, took_s, image_bytes).
    type: dict
    required: true
  node:
    description: The node's inventory name.
    type: str
    required: true
  throughput:
    description: The throughput recorded before, by target (each with C(bytes_s) and C(measured_at)).
    type: dict
  now:
    description: The time to record the throughput at.
    type: str
"""

EXAMPLES = r"""
- name: Report
  ansible.builtin.debug:
    msg: "{{ (plan | gpuckpt.fleet.drain_report(outcomes, node='gpu-node-7')).lines }}"
"""

RETURN = r"""
_value:
  description: C(lines) and C(empty).
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import report


def drain_report(plan, outcomes, node, throughput=None, now=None):
    outcomes = {o.get("migration_id", k): o for k, o in (outcomes or {}).items() if isinstance(o, dict)}
    return {"lines": report.report_lines(node, plan, outcomes),
            "empty": report.node_empty(plan, outcomes, plan.get("left_out") or []),
            "pending": (plan.get("pending_before") or []) + report.unsettled(
                [report.move_record(m) for m in plan.get("moves") or []], outcomes),
            "throughput": report.throughput_update(throughput, plan, outcomes, now)}


class FilterModule(object):
    def filters(self):
        return {"drain_report": drain_report}
