# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The end of a drain as the hosts show it: where each workload runs, and whether the node is empty."""
from __future__ import annotations

DOCUMENTATION = r"""
name: drain_end
short_description: The end of a drain as read from the hosts, and whether the node is empty
version_added: "0.5.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.DRAIN_PLAN_INPUT
description:
  - Every end state comes from the hosts, read at the end of the drain, never from the plan or from what a move said
    of itself. A move's workload is C(MOVED) when its target's journal says committed and those processes run there,
    C(HELD) when its source's migration is not over (the workload stopped, or exited with its image, on the node),
    C(STAYED) when the node runs it, C(UNSEEN) when its target could not be asked, C(GONE) when it runs nowhere that
    could be seen. Every GPU workload the node runs that the plan did not name is C(STILL).
  - The node is C(empty) only when it could be asked, runs no GPU workload, and holds no move's source. A copy that a
    move committed, and that the node sees only because both share one pid space, is not the node's.
options:
  outcomes:
    description: What each move (and each earlier move settled first) said of itself, by migration id.
    type: dict
    required: true
  seen:
    description: >-
      By migration id, what the hosts showed at the end: C(source) and C(target), the journals as gpuckpt.fleet.gpu_migration
      read them (null when not read), and C(target_error), why the target could not be asked.
    type: dict
    required: true
  node_after:
    description: The node's workloads as gpuckpt.fleet.cuda_process_facts found them at the end (null when the node could not be asked).
    type: list
  node:
    description: The node's inventory name.
    type: str
    required: true
  earlier:
    description: The drain mark's records of the moves of an earlier drain that this run settled.
    type: list
"""

EXAMPLES = r"""
- name: Where each workload runs now
  ansible.builtin.debug:
    msg: "{{ (plan | gpuckpt.fleet.drain_end(outcomes, seen, node_after, node='gpu-node-7')).lines }}"
"""

RETURN = r"""
_value:
  description: C(lines), C(empty), C(still) (what keeps the node from being empty), C(held) and C(gone).
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import report


def drain_end(plan, outcomes, seen, node_after, node, earlier=None):
    outcomes = {o.get("migration_id", k): o for k, o in (outcomes or {}).items() if isinstance(o, dict)}
    return report.end_state(node, plan, outcomes, seen or {}, node_after, earlier or [])


class FilterModule(object):
    def filters(self):
        return {"drain_end": drain_end}
