# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The end of a drain: where each workload runs now, or why it stayed."""
from __future__ import annotations

DOCUMENTATION = r"""
name: drain_report
short_description: The table at the end of a drain, and whether the node is empty
version_added: "0.4.0"
description:
  - Returns C(lines) (each workload, where it runs now and its downtime beside the plan's estimate, or why it stayed)
    and C(empty) (every planned move moved, and no workload stayed or was left out).
options:
  _input:
    description: The plan (gpuckpt.fleet.drain_plan's result).
    type: dict
    required: true
  outcomes:
    description: Each move's outcome by migration id (status V(moved) or V(stayed), where, reason, downtime_s, took_s, image_bytes).
    type: dict
    required: true
  node:
    description: The node's inventory name.
    type: str
    required: true
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


def drain_report(plan, outcomes, node):
    return {"lines": report.report_lines(node, plan, outcomes or {}),
            "empty": report.node_empty(plan, outcomes or {}, plan.get("left_out") or [])}


class FilterModule(object):
    def filters(self):
        return {"drain_report": drain_report}
