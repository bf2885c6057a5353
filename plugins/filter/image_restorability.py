# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The images of a protected job on its replicas, and whether each can be restored on a host."""
from __future__ import annotations

DOCUMENTATION = r"""
name: image_restorability
short_description: List a protected job's images on its replicas and say whether each can be restored on a host
version_added: "0.6.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.RESTORABILITY
description:
  - A thin wrapper over the collection's restorability checks (C(module_utils/fleet/restorability.py)), the list
    made by C(module_utils/fleet/failover.py). Each image stands in for the source of a migration, with what its
    manifest recorded, and the migration's own planner (the one behind migrate.yml's preflight) checks it against
    the host's facts.
  - The checks are the image itself (complete, verified on its replica), the driver's checkpoint API, the driver
    and CUDA API versions, GPU model, count and free memory, CRIU (4.x, C(criu check), not older than the CRIU
    that wrote the image), the kernel, the runtime, free disk for the copy, host RAM for the restore, the pids
    (a bare process is restored with its own pids) and the host's drain mark.
  - Unknown is never counted as zero. An image does not record its workload's GPU memory, only its whole size. Where
    the whole image fits the free memory of each GPU it lands on, the GPU memory check passes. Otherwise the check
    is V(unknown), and it refuses unless O(allow_unknown) names C(gpu_memory).
  - Returns C(record) (the replicas' newest record of the job - owner and epoch), C(images) (newest first, each with
    C(id), C(replica), C(checkpoint_at), C(bytes), C(verified), C(epoch), C(progress) and, with O(host_facts),
    C(restorable), C(reasons) and C(checks)), C(lines) (the list for people) and C(unread_replicas).
options:
  _input:
    description:
      - Each replica's gpu_replica result (C(state=list)) by inventory name, as registered. A result that failed,
        or a replica that could not be reached, is named in C(unread_replicas) with the reason.
      - Or a list of images as gpu_replica lists them.
    type: raw
    required: true
  host_facts:
    description:
      - The host's cuda_process_facts result (as registered, or its C(ansible_facts['gpuckpt'])), gathered with
        C(check_pids) (the images' pids) and C(paths) (O(target_path)). Without it, the images are only listed.
    type: raw
  host:
    description: The host's inventory name, for the reasons.
    type: str
  job:
    description: The job's name, for the list's heading.
    type: str
    default: job
  target_path:
    description: The host's image root, whose free disk the image's copy needs.
    type: str
  allow_unknown:
    description:
      - Names of checks whose unknown status does not refuse (image, checkpoint_api, driver_version, cuda_api_version,
        gpu_model, gpu_count, gpu_memory, criu, kernel, runtime, disk, host_ram, pids, not_draining).
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Can each image of train-7 be restored on gpu-node-9?
  ansible.builtin.debug:
    msg: >-
      {{ (dict(['replica-1'] | zip([hostvars['replica-1'].gpuckpt_replica_list]))
          | gpuckpt.fleet.image_restorability(host_facts=hostvars['gpu-node-9'].gpuckpt_host_facts, host='gpu-node-9',
                                             job='train-7', target_path='/var/lib/gpuckpt/images')).lines }}
"""

RETURN = r"""
_value:
  description: The list (see the description).
  type: dict
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import failover, restorability


def _listings(given):
    if isinstance(given, (list, tuple)):
        return {"-": {"record": None, "images": list(given)}}
    if not isinstance(given, dict):
        raise AnsibleFilterError("image_restorability: give each replica's gpu_replica result by name, or a list of images")
    return {str(name): restorability.listing_of(result) for name, result in given.items()}


def image_restorability(listings, host_facts=None, host=None, job="job", target_path=None, allow_unknown=None,
                        allow_driver_mismatch=False, same_kernel=False):
    """The job's images, and whether each can be restored on ``host`` (see DOCUMENTATION)."""
    try:
        opts = restorability.options(allow_unknown=allow_unknown or (), allow_driver_mismatch=bool(allow_driver_mismatch),
                                     target_path=target_path, same_kernel=bool(same_kernel))
    except ValueError as exc:
        raise AnsibleFilterError("image_restorability: %s" % exc)
    facts = restorability.facts_of(host_facts) if host_facts is not None else None
    return failover.report_images(_listings(listings), facts, host, opts, job)


class FilterModule(object):
    def filters(self):
        return {"image_restorability": image_restorability}
