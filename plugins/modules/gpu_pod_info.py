#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_pod_info
short_description: Find a Kubernetes GPU pod to move, its node and its containers, and refuse what cannot move
version_added: "0.3.0"
description:
  - Reads a pod from the Kubernetes API server with the C(kubernetes) Python client, on the controller (delegate it
    to localhost), and describes what a pod checkpoint needs - its node, each container's containerd id
    and GPU count, its resource claims, and the spec its copy on another node is created from.
  - Refuses, before anything is frozen, a pod that is not Running, a container that is not running, a runtime other
    than containerd, a pod that a controller owns (unless O(allow_owned)), and a O(gpu_count) other than the pod's
    (the driver restores each GPU of a checkpoint onto exactly one GPU).
  - With O(target_node), also checks that node - known, Ready, not the pod's own, and offering the pod's GPUs.
  - Map the pod's node to an inventory host with the P(gpuckpt.fleet.k8s_node_host#filter) filter.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  name:
    description: The pod's name.
    type: str
    required: true
    aliases: [pod]
  namespace:
    description: The pod's namespace.
    type: str
    default: default
  gpu_count:
    description:
      - The number of GPUs the pod is to be restored onto. Refused unless it is the number the pod holds now (the
        sum of its containers' O(gpu_resources)).
    type: int
  gpu_resources:
    description: The extended resources that count as GPUs.
    type: list
    elements: str
    default: [nvidia.com/gpu]
  target_node:
    description: The node the pod is to move to; checked as described above.
    type: str
  migration_id:
    description:
      - A pod migration's id. When the pod is not there (a rerun of a migration that committed and deleted it), the
        migration's target pod is looked for instead (named O(target_pod_name)) and returned as C(migration_pod),
        with C(pod) null, so that the rerun can settle the migration; without such a pod, the pod's absence fails.
    type: str
  target_pod_name:
    description: The name of O(migration_id)'s target pod; by default P(gpuckpt.fleet.k8s_target_pod_name#filter)'s.
    type: str
  missing_ok:
    description:
      - Return C(pod) null when there is no pod of that name (and no migration pod, see O(migration_id)), instead of
        failing. A failure to reach the API server still fails.
    type: bool
    default: false
  allow_owned:
    description:
      - Accept a pod that a controller (Job, ReplicaSet, StatefulSet, ...) owns. Only when that controller will not
        replace the pod once the migration deletes it (suspended, scaled down); otherwise two copies of the job run.
    type: bool
    default: false
notes:
  - Changes nothing; supports check mode.
  - "The RBAC it needs: get on pods in the pod's namespace, and get on nodes (a ClusterRole) when O(target_node) is set;
    see docs/kubernetes.md."
attributes:
  check_mode:
    support: full
    details: It only reads from the API server.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.k8s_auth
"""

EXAMPLES = r"""
- name: Find the pod and check that it can move to gpu-node-2 on 2 GPUs
  gpuckpt.fleet.gpu_pod_info:
    namespace: default
    name: gpu-test-pod
    target_node: gpu-node-2
    gpu_count: 2
    kubeconfig: ~/.kube/config
  delegate_to: localhost
  register: pod

- name: The inventory host that runs it
  ansible.builtin.set_fact:
    source: "{{ pod.pod.node | gpuckpt.fleet.k8s_node_host(hostvars, groups['all']) }}"
"""

RETURN = r"""
pod:
  description: The pod, described for its checkpoint.
  returned: success
  type: dict
  contains:
    namespace: {description: Its namespace., type: str, sample: default}
    name: {description: Its name., type: str, sample: gpu-test-pod}
    uid: {description: Its uid., type: str, sample: 6f1c0c51-1d0b-4a4c-9d55-0b3a2d1c9e10}
    node: {description: The node it runs on., type: str, sample: gpu-node-1}
    containers:
      description: Its containers, in the spec's order, with their containerd id, image, GPU count and restart count.
      type: list
      elements: dict
      sample: [{"name": "trainer", "id": "3b5d...", "image": "pytorch:24.08", "gpus": 2, "restart_count": 0}]
    gpu_count: {description: The GPUs its containers hold., type: int, sample: 2}
    gpus_by_resource: {description: 'Those GPUs by resource name.', type: dict, sample: {"nvidia.com/gpu": 2}}
    resource_claims: {description: Its dynamic resource claims (DRA) by name., type: list, elements: str, sample: []}
    ephemeral_containers_running: {description: Debug containers running in it (not checkpointed)., type: list,
                                   elements: str, sample: []}
    owner: {description: Its controller's owner reference when O(allow_owned) let it through., type: dict, sample: null}
    spec: {description: 'The pod its copy is created from, without its node and what the API server sets.', type: dict}
migration_pod:
  description: O(migration_id)'s target pod, when the pod itself is not there (see O(migration_id)).
  returned: when the pod is not there and O(migration_id)'s target pod is
  type: dict
  sample: {"namespace": "default", "name": "gpu-test-pod-3fa2c1", "uid": "2c5e...", "node": "gpu-node-2",
           "source_node": "gpu-node-1", "phase": "Running"}
target:
  description: The target node, when O(target_node) is set - name, ready, unschedulable, capacity, allocatable.
  returned: when O(target_node) is set
  type: dict
  sample: {"name": "gpu-node-2", "ready": true, "unschedulable": false, "allocatable": {"nvidia.com/gpu": "8"}}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import pods as k8s_pods
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import api_client, auth_args, find_pod, read_pod


def main():
    module = AnsibleModule(argument_spec=dict(
        name=dict(type="str", required=True, aliases=["pod"]),
        namespace=dict(type="str", default="default"),
        gpu_count=dict(type="int"),
        gpu_resources=dict(type="list", elements="str", default=list(k8s_pods.DEFAULT_GPU_RESOURCES)),
        target_node=dict(type="str"),
        allow_owned=dict(type="bool", default=False),
        migration_id=dict(type="str"),
        target_pod_name=dict(type="str"),
        missing_ok=dict(type="bool", default=False),
        **auth_args()
    ), supports_check_mode=True)
    p = module.params
    if p["gpu_count"] is not None and p["gpu_count"] < 1:
        module.fail_json(msg="gpu_count must be at least 1, got %d; nothing was frozen" % p["gpu_count"],
                         stage="preflight")
    try:
        api = api_client(p)
        found = find_pod(api, p["namespace"], p["name"])
        if found is None and p["migration_id"]:
            made = k8s_pods.migration_pod(api, p["namespace"], p["target_pod_name"] or k8s_pods.target_pod_name(
                p["name"], p["migration_id"]), p["migration_id"])
            if made:
                module.exit_json(changed=False, pod=None, migration_pod=made,
                                 msg="pod %s/%s is gone; migration %s's pod %s runs on node %s"
                                     % (p["namespace"], p["name"], p["migration_id"], made["name"], made["node"]))
        if found is None and p["missing_ok"]:
            module.exit_json(changed=False, pod=None, msg="there is no pod %s/%s" % (p["namespace"], p["name"]))
        described = k8s_pods.describe_pod(found or read_pod(api, p["namespace"], p["name"]),
                                          p["gpu_resources"], p["allow_owned"])
        k8s_pods.check_gpu_count(described, p["gpu_count"])
        result = {"changed": False, "pod": described}
        if p["target_node"]:
            result["target"] = k8s_pods.check_target_node(api, p["target_node"], described["node"])
            k8s_pods.check_target_gpus(described, result["target"])
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    module.exit_json(**result)


if __name__ == "__main__":
    main()
