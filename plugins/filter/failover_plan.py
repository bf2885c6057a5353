# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The plan of failing a protected job over from a lost node: which image, from which replica, onto which host."""
from __future__ import annotations

DOCUMENTATION = r"""
name: failover_plan
short_description: Choose the image and the host that a protected job of a lost node fails over to
version_added: "0.6.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.RESTORABILITY
description:
  - A thin wrapper over the collection's failover plan (C(module_utils/fleet/failover.py)). It checks each image
    of the job against each host with the restorability checks (C(module_utils/fleet/restorability.py), the
    migration's own planner; see M(gpuckpt.fleet.image_restorability#filter)). Among the hosts that can restore it,
    the drain's placement (C(module_utils/fleet/placement.py)) chooses as a drain chooses a target.
  - The image is the newest one that is complete, verified on its replica and restorable on the host - the highest
    epoch first, then the latest checkpoint. An image of an older epoch is never taken for a newer one. Each image
    passed over is in C(skipped), with the reason (corrupt, not verified, restorable on no host and why).
  - Refused (C(ok) false, C(refused) says why) when the target is the lost node, when the replicas' record of the job
    names another owner than the lost node (it was failed over already) or names the target (it owns the job
    already), when no replica could be read, and when no image can be restored.
  - Returns C(ok), C(refused), C(job), C(lost_node), C(target), C(replica) (the replica that sends the image),
    C(image) (C(id), C(path), C(checkpoint_at), C(checkpoint_ts) in seconds since the epoch, C(bytes), C(epoch),
    C(progress), C(runtime), C(container)), C(candidates) (the image ids, in order, that gpu_replica may fall back to
    on that replica when one does not verify again), C(others) (for each other replica read, the image ids its own
    record's failover may take), C(images) (every image by id), C(gpu_map), C(skipped), C(hosts) (why each other host
    was not chosen), C(record) and C(epoch) (the job's newest record and its epoch before this failover), C(checks)
    (the chosen host's checks), C(unread_replicas) and C(lines) (the plan for people).
options:
  _input:
    description:
      - Each replica's gpu_replica result (C(state=list)) by inventory name, as registered. A result that failed,
        or a replica that could not be reached, is named in C(unread_replicas) with the reason.
    type: dict
    required: true
  hosts:
    description:
      - Each host the job may fail over to, by inventory name - its cuda_process_facts result (as registered, or its
        C(ansible_facts['gpuckpt'])), gathered with C(check_pids) (the images' pids) and C(paths) (its image root).
        A result that failed, or a host that could not be reached, is no target, and the plan says why.
    type: dict
    required: true
  job:
    description: The protected job's name.
    type: str
    required: true
  lost_node:
    description: The inventory name of the node the job was lost with; never a target.
    type: str
    required: true
  target:
    description: The host to fail over to. Without it, the host is chosen among O(hosts).
    type: str
  target_paths:
    description: Each host's image root, by inventory name, whose free disk the image's copy needs.
    type: dict
  allow_unknown:
    description: Names of checks whose unknown status does not refuse (as in M(gpuckpt.fleet.image_restorability#filter)).
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Plan the failover of train-7 from gpu-node-7
  ansible.builtin.set_fact:
    plan: >-
      {{ {'replica-1': hostvars['replica-1'].gpuckpt_replica_list}
         | gpuckpt.fleet.failover_plan(hosts={'gpu-node-9': hostvars['gpu-node-9'].gpuckpt_failover_facts},
                                       job='train-7', lost_node='gpu-node-7',
                                       target_paths={'gpu-node-9': '/var/lib/gpuckpt/images'}) }}
    # plan.ok, plan.image.id, plan.target, plan.lines
"""

RETURN = r"""
_value:
  description: The plan (see the description).
  type: dict
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import failover, restorability


def failover_plan(listings, hosts, job, lost_node, target=None, target_paths=None, allow_unknown=None,
                  allow_driver_mismatch=False, same_kernel=False):
    """The failover's plan (see DOCUMENTATION)."""
    if not isinstance(listings, dict) or not isinstance(hosts, dict):
        raise AnsibleFilterError("failover_plan: give each replica's gpu_replica result and each host's facts by name")
    try:
        opts = restorability.options(allow_unknown=allow_unknown or (), target_paths=dict(target_paths or {}),
                                     allow_driver_mismatch=bool(allow_driver_mismatch), same_kernel=bool(same_kernel))
    except ValueError as exc:
        raise AnsibleFilterError("failover_plan: %s" % exc)
    replicas = {str(name): restorability.listing_of(result) for name, result in listings.items()}
    facts = {str(name): restorability.facts_of(result) for name, result in hosts.items()}
    return failover.plan_failover(replicas, facts, str(job), str(lost_node), target or None, opts)


class FilterModule(object):
    def filters(self):
        return {"failover_plan": failover_plan}
