#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_k8s_node
short_description: Read a Kubernetes node's GPU pods and free GPUs, and cordon or uncordon it for a drain
version_added: "0.5.0"
description:
  - Reads a node from the Kubernetes API server with the C(kubernetes) Python client, on the controller (delegate it
    to localhost) - whether it is Ready and cordoned, its allocatable GPUs of each O(gpu_resources) less what the
    pods bound to it ask for, and its GPU pods (those that ask for a GPU resource, or have a container among
    O(cuda_containers)), each with why it cannot move where that is so. playbooks/drain.yml plans a Kubernetes
    node's drain from it.
  - O(cordon=true) cordons the node (C(spec.unschedulable), as C(kubectl cordon)) and annotates it
    C(gpuckpt.fleet/cordoned-by) with O(cordoned_by); a node already cordoned is left as it is.
    O(cordon=false) uncordons only a node that carries that annotation - one cordoned by someone else stays
    cordoned, and the result says so.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  name:
    description: The node's name in the cluster.
    type: str
    required: true
  cordon:
    description:
      - V(true) cordons the node, V(false) takes back a cordon of this collection's; unset, the node is only read.
    type: bool
  cordoned_by:
    description: What the cordon annotation says did it (a drain's id).
    type: str
    default: gpuckpt.fleet
  gpu_resources:
    description: The extended resources that are GPUs.
    type: list
    elements: str
    default: [nvidia.com/gpu]
  cuda_containers:
    description:
      - containerd ids of containers on the node whose processes hold CUDA contexts (M(gpuckpt.fleet.cuda_process_facts)'
        C(gpu_containers)) - their pods are GPU pods even when they ask for no GPU resource.
    type: list
    elements: str
    default: []
notes:
  - "The RBAC it needs: get and patch on nodes, list on pods of every namespace (docs/kubernetes.md)."
attributes:
  check_mode:
    support: full
    details: Reads the node and its pods; a cordon or uncordon is reported as it would change, and not made.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.k8s_auth
"""

EXAMPLES = r"""
- name: The GPU pods of gpu-node-7 and its free GPUs
  gpuckpt.fleet.gpu_k8s_node:
    name: gpu-node-7
  delegate_to: localhost
  register: node7

- name: Cordon gpu-node-7 for its drain
  gpuckpt.fleet.gpu_k8s_node:
    name: gpu-node-7
    cordon: true
    cordoned_by: drain-gpu-node-7-20261125T140000
  delegate_to: localhost
"""

RETURN = r"""
node:
  description:
    - The node - name, ready, unschedulable, cordoned_by (the annotation, or null), and per GPU resource
      gpus_allocatable, gpus_requested (by the pods bound to it that have not ended) and gpus_free - after the change.
  returned: success
  type: dict
  sample: {"name": "gpu-node-7", "ready": true, "unschedulable": true, "cordoned_by": "drain-gpu-node-7-20261125T140000",
           "gpus_allocatable": {"nvidia.com/gpu": 8}, "gpus_requested": {"nvidia.com/gpu": 3},
           "gpus_free": {"nvidia.com/gpu": 5}}
gpu_pods:
  description:
    - The node's GPU pods - pod (namespace/name), namespace, name, uid, phase, gpus_by_resource, gpu_count,
      containers (containerd ids), owner (its controller, or null) and refused (why it cannot move, or null).
  returned: success
  type: list
  elements: dict
left_cordoned:
  description: Why O(cordon=false) left the node cordoned (cordoned by someone else), or null.
  returned: success
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import nodes as k8s_nodes
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import api_client, auth_args
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.pods import DEFAULT_GPU_RESOURCES


def main():
    module = AnsibleModule(argument_spec=dict(
        name=dict(type="str", required=True),
        cordon=dict(type="bool"),
        cordoned_by=dict(type="str", default="gpuckpt.fleet"),
        gpu_resources=dict(type="list", elements="str", default=list(DEFAULT_GPU_RESOURCES)),
        cuda_containers=dict(type="list", elements="str", default=[]),
        **auth_args()
    ), supports_check_mode=True)
    p = module.params
    try:
        api = api_client(p)
        node, pods = k8s_nodes.read(api, p["name"], p["gpu_resources"], p["cuda_containers"])
        patch = None if p["cordon"] is None else k8s_nodes.cordon_patch(node, p["cordon"], p["cordoned_by"])
        left = None
        if p["cordon"] is False and node["unschedulable"] and not node["cordoned_by"]:
            left = "node %s was cordoned by someone else (no %s annotation): it stays cordoned" % (
                p["name"], k8s_nodes.CORDONED_BY_ANNOTATION)
        if patch and not module.check_mode:
            k8s_nodes.patch_node(api, p["name"], patch)
            node, pods = k8s_nodes.read(api, p["name"], p["gpu_resources"], p["cuda_containers"])
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    module.exit_json(changed=patch is not None, node=node, gpu_pods=pods, left_cordoned=left)


if __name__ == "__main__":
    main()
