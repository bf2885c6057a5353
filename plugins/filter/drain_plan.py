# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The placement plan of a drain, from the facts of the node and of each target."""
from __future__ import annotations

DOCUMENTATION = r"""
name: drain_plan
short_description: Place each GPU workload of a draining node on a target that can hold it
version_added: "0.4.0"
description:
  - A thin wrapper over the collection's placement planner (C(module_utils/fleet/placement.py)), which checks
    every (workload, target) pair with the migration's planner (the one behind migrate.yml's preflight) and
    reserves on the chosen target what each move takes there before placing the next one.
  - Returns C(moves) (in the order they run, each with C(migration_id), C(target), C(gpus), C(image_estimate_bytes),
    C(estimate) and C(batch)), C(stays) (each workload that is not moved, with its C(reason)), C(left_out)
    (workloads that O(include) or O(exclude) leave out), C(pending) (see O(earlier)), C(lines) (the plan for people, with why each other
    target was not chosen) and C(workloads) (how many the node has).
options:
  _input:
    description: The node's C(ansible_facts['gpuckpt']), gathered with C(workloads=true) and the node's image root in C(paths).
    type: dict
    required: true
  targets:
    description:
      - Each target's cuda_process_facts result by inventory name (as registered, gathered with C(paths) and
        C(check_pids); or its C(ansible_facts['gpuckpt'])). A result that failed, or a host that could not be reached,
        is no target, and the plan says why.
    type: dict
    required: true
  earlier:
    description:
      - The moves an earlier drain of this node recorded as not settled (its mark's C(pending)), and C(settled), the
        outcomes of settling them now, by migration id. The plan's C(pending) is those still not settled and this
        plan's moves, which the node's mark keeps until they are.
    type: dict
  node:
    description: The node's inventory name.
    type: str
    required: true
  source_path:
    description: The node's image root.
    type: str
    required: true
  target_paths:
    description: Each target's image root, by inventory name.
    type: dict
    required: true
  id_prefix:
    description: The prefix of the migration ids of the moves (each id is the prefix and the workload's key).
    type: str
    required: true
  parallel:
    description: How many moves run at a time.
    type: int
    default: 1
  deadline:
    description: Seconds from now by which every move must have ended; moves estimated to end later stay.
    type: float
  throughput:
    description: Bytes per second measured from the node to each target, by inventory name.
    type: dict
  overhead:
    description: Seconds each move costs besides moving its image.
    type: float
    default: 30
  allow_unknown:
    description: Names of checks whose unknown status does not refuse a move (as in migrate.yml), and V(deadline).
    type: list
    elements: str
  allow_driver_mismatch:
    description: Accept other driver and CUDA API versions on a target.
    type: bool
    default: false
  include:
    description: Only the workloads one of these names (a runtime, a container id or name, or a pid of the workload).
    type: list
    elements: str
  exclude:
    description: Not the workloads one of these names.
    type: list
    elements: str
  k8s_pods:
    description:
      - A Kubernetes node - M(gpuckpt.fleet.gpu_k8s_node)'s result for the node (its C(gpu_pods)), which says what each
        of the node's pods asks and whether it can move. Without it, a pod found on the node stays, with the reason.
    type: raw
  k8s_nodes:
    description:
      - A Kubernetes node - M(gpuckpt.fleet.gpu_k8s_node)'s result for each target's node, by inventory name. A pod
        moves only to a target whose node is Ready, not cordoned and has its GPUs free.
    type: dict
  allow_owned:
    description: Move pods that a controller owns (once it will not replace them; see M(gpuckpt.fleet.gpu_pod_info)).
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Plan the drain
  ansible.builtin.set_fact:
    plan: >-
      {{ hostvars['gpu-node-7'].gpuckpt_drain_facts | gpuckpt.fleet.drain_plan(
           targets={'gpu-node-8': hostvars['gpu-node-8'].gpuckpt_drain_facts}, node='gpu-node-7',
           source_path='/var/lib/gpuckpt/images', target_paths={'gpu-node-8': '/var/lib/gpuckpt/images'},
           id_prefix='drain-gpu-node-7-20261125T140000') }}
    # plan.moves, plan.stays, plan.lines
"""

RETURN = r"""
_value:
  description: The plan (see the description).
  type: dict
"""

import re

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import placement, report, workloads as node_workloads
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import planner


def _target_facts(result):
    """A target's facts from its registered cuda_process_facts result, or why there are none."""
    if not isinstance(result, dict):
        return "not asked"
    if "ansible_facts" not in result and "host" in result:  # the facts themselves
        return result
    if result.get("unreachable"):
        return "unreachable: %s" % result.get("msg", "")
    if result.get("failed") or "gpuckpt" not in (result.get("ansible_facts") or {}):
        return "its facts failed: %s" % result.get("msg", "no facts")
    return result["ansible_facts"]["gpuckpt"]


def _k8s_read(result, key):
    """``key`` (gpu_pods, node) of a registered gpu_k8s_node result, or why there is none (a text)."""
    if not isinstance(result, dict) or result.get("skipped"):
        return None
    if result.get("failed") or key not in result:
        return "the API server refused or could not be reached: %s" % result.get("msg", "no answer")
    return result[key]


def _names(given):
    """A list option as names. ``-e exclude=[4242]`` and an AWX survey's text answer arrive as one string,
    which iterated would be its characters: its names are separated by commas, spaces or lines."""
    if given is None:
        return None
    if isinstance(given, str):
        return [n for n in (n.strip("'\"") for n in re.split(r"[\s,]+", given.strip().strip("[]"))) if n]
    return [str(n) for n in (given if isinstance(given, (list, tuple)) else [given])]


def _left_in_pods(node_facts, idle_pods):
    """What a drain leaves of Kubernetes' work, with why: a k8s.io container whose labels name no pod, and a pod that
    asks for GPUs but holds no CUDA context on the node."""
    out = [{"key": "containerd:%s/%s" % (c.get("namespace"), c.get("id")), "kind": "container", "runtime": "containerd",
            "container": c.get("id"), "namespace": c.get("namespace"), "root_pid": c.get("pid"), "tree": {},
            "reason": "a container of containerd's namespace k8s.io (the kubelet's) whose labels name no pod: "
                      "drain.yml moves Kubernetes pods whole, through the API server, and cannot name this one's"}
           for c in node_workloads.pod_containers(node_facts)]
    return out + [{"key": "k8s_pod:" + p["pod"], "kind": "pod", "runtime": "k8s_pod", "pod": p["pod"], "root_pid": None,
                   "tree": {}, "reason": "asks for %d GPU(s) but none of its containers holds a CUDA context on the node: "
                                         "nothing to checkpoint; evict or delete it yourself" % p["gpu_count"]}
                  for p in idle_pods]


def drain_plan(node_facts, targets, node, source_path, target_paths, id_prefix, parallel=1, deadline=None,
               throughput=None, overhead=placement.OVERHEAD_S, allow_unknown=None, allow_driver_mismatch=False,
               include=None, exclude=None, earlier=None, k8s_pods=None, k8s_nodes=None, allow_owned=False):
    """The plan of draining ``node`` (see DOCUMENTATION)."""
    if "workloads" not in (node_facts or {}):
        raise AnsibleFilterError("drain_plan: the node's facts hold no workloads (gather them with workloads=true)")
    allow = _names(allow_unknown) or []
    bad = [n for n in allow if n not in planner.CHECK_NAMES + ("deadline", "runtime")]
    if bad:
        raise AnsibleFilterError("drain_plan: allow_unknown names no check: %s" % ", ".join(bad))
    found, idle_pods = node_workloads.with_pods(node_facts["workloads"], _k8s_read(k8s_pods, "gpu_pods"), bool(allow_owned))
    chosen, left_out = node_workloads.select(found, _names(include), _names(exclude))
    targets = {name: _target_facts(result) for name, result in (targets or {}).items()}
    targets = {name: dict(f, k8s_node=_k8s_read((k8s_nodes or {}).get(name), "node")) if isinstance(f, dict) else f
               for name, f in targets.items()}
    plan = placement.plan_drain(node_facts, chosen, targets, source_path, dict(target_paths or {}),
                                id_prefix, parallel=int(parallel), deadline=None if deadline is None else float(deadline),
                                throughput=throughput or {}, overhead=float(overhead), allow_unknown=tuple(allow),
                                allow_driver_mismatch=bool(allow_driver_mismatch))
    left_out += _left_in_pods(node_facts, idle_pods)
    plan["left_out"] = left_out
    earlier = earlier or {}
    plan["pending_before"] = report.unsettled(earlier.get("pending") or [], earlier.get("settled") or {})
    plan["pending"] = plan["pending_before"] + [report.move_record(m) for m in plan["moves"]]
    plan["workloads"] = len(found)
    plan["lines"] = report.plan_lines(node, plan) + ["  LEFT  %s: %s" % (report.describe(w), w["reason"]) for w in left_out]
    return plan


class FilterModule(object):
    def filters(self):
        return {"drain_plan": drain_plan}
