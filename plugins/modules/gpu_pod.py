#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_pod
short_description: Create the pod a GPU pod is restored into on its target node, or delete a migration's pod
version_added: "0.3.0"
description:
  - The API server's half of a pod migration (playbooks/migrate.yml with C(-e pod=...)), run on the controller
    (delegate it to localhost) with the C(kubernetes) Python client.
  - O(state=present) creates the target pod - the source pod's recorded spec (M(gpuckpt.fleet.gpu_pod_info)'s
    C(pod)) under O(name), bound to O(target_node), run by the restore runtime class O(runtime_class), and carrying
    the restore request (O(image_dir) on that node and O(restore_token)) in its annotation C(gpuckpt.fleet/restore)
    and the migration's id in C(gpuckpt.fleet/migration-id). The node's runtime handler C(gpuckpt-restore-runtime)
    then restores each container inside it (docs/kubernetes.md). A rerun finds its own pod and changes nothing; a
    pod of that name that this migration did not create is refused.
  - O(state=absent) deletes a pod, only that very pod - the pod of O(uid) (the source pod, at the migration's
    commit), or the pod of that name that carries O(migration_id)'s annotation (the target pod, at a rollback) -
    with its uid as the API's precondition, so that a pod made since under the same name is never deleted.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  state:
    description: Whether the pod is to exist (created for a restore) or not (deleted).
    type: str
    choices: [present, absent]
    default: present
  namespace:
    description: The pod's namespace.
    type: str
    default: default
  name:
    description: The pod's name.
    type: str
    required: true
  from_pod:
    description:
      - O(state=present) - the source pod as M(gpuckpt.fleet.gpu_pod_info) returned it (its C(pod)); the new pod is
        its C(spec) under O(name) in its namespace.
    type: dict
  target_node:
    description: O(state=present) - the node the pod is bound to (C(spec.nodeName); the scheduler is not asked).
    type: str
  image_dir:
    description: O(state=present) - the checkpoint's directory on O(target_node), which its runtime handler restores from.
    type: path
  restore_token:
    description:
      - O(state=present) - the secret the node's restore ticket was made for (M(gpuckpt.fleet.gpu_restore)'s
        O(gpuckpt.fleet.gpu_restore#module:restore_token)); the handler restores only into a pod that gives it.
    type: str
  runtime_class:
    description:
      - O(state=present) - the RuntimeClass whose handler is C(gpuckpt-restore-runtime) on the target node
        (installed by the role gpuckpt.fleet.nvidia_container_runtime).
    type: str
    default: gpuckpt-restore
  migration_id:
    description:
      - The migration the pod belongs to. O(state=present) writes it into the pod's annotation
        C(gpuckpt.fleet/migration-id); O(state=absent) without O(uid) deletes the pod only when it carries it.
    type: str
  uid:
    description: O(state=absent) - delete the pod only while it is the pod of this uid.
    type: str
  grace_period:
    description:
      - O(state=absent) - seconds the kubelet gives the pod's containers between SIGTERM and SIGKILL. A held
        (paused) source cannot act on SIGTERM, so the migration gives 1; the pod's own by default.
    type: int
  wait:
    description:
      - Wait until the pod runs with every container running (O(state=present)), or until it is gone from the API
        server, its containers stopped by its node's kubelet (O(state=absent)).
    type: bool
    default: false
  wait_timeout:
    description: Seconds O(wait) waits before the task fails, saying what the pod waits in.
    type: float
    default: 600
notes:
  - "The RBAC it needs: create, get and delete on pods in the pod's namespace (docs/kubernetes.md)."
attributes:
  check_mode:
    support: none
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.k8s_auth
"""

EXAMPLES = r"""
- name: Create the pod that gpu-test-pod is restored into on gpu-node-2
  gpuckpt.fleet.gpu_pod:
    namespace: default
    name: gpu-test-pod-3fa2c1
    from_pod: "{{ pod_info.pod }}"
    target_node: gpu-node-2
    image_dir: /var/lib/gpuckpt/images/m-42
    restore_token: "{{ token }}"
    migration_id: m-42
  delegate_to: localhost

- name: Delete the source pod once its copy runs (only that very pod)
  gpuckpt.fleet.gpu_pod:
    state: absent
    namespace: default
    name: gpu-test-pod
    uid: "{{ pod_info.pod.uid }}"
    grace_period: 1
    wait: true
  delegate_to: localhost
"""

RETURN = r"""
pod:
  description: The pod's namespace, name, uid, node and phase (after the wait, when O(wait)); null when it is gone.
  returned: always
  type: dict
  sample: {"namespace": "default", "name": "gpu-test-pod-3fa2c1", "uid": "2c5e...", "node": "gpu-node-2",
           "phase": "Running"}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import pods as k8s_pods
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import api_client, auth_args, find_pod
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.waits import wait_pod_gone, wait_pod_running


def _brief(pod):
    if not pod:
        return None
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    return {"namespace": meta.get("namespace"), "name": meta.get("name"), "uid": meta.get("uid"),
            "node": spec.get("nodeName"), "phase": (pod.get("status") or {}).get("phase")}


def present(api, p):
    for need in ("from_pod", "target_node", "image_dir", "restore_token"):
        if not p[need]:
            raise InvalidTarget("state=present needs %s" % need, stage="preflight")
    source = p["from_pod"]
    if p["namespace"] != source.get("namespace"):
        raise InvalidTarget("the target pod is created in the source pod's namespace %s, not %s"
                            % (source.get("namespace"), p["namespace"]), stage="preflight")
    if p["name"] == source.get("name"):
        raise InvalidTarget("the target pod needs a name other than the source's (%s): the source is held "
                            "under it until the target runs" % p["name"], stage="preflight")
    pod = k8s_pods.target_pod(source, p["target_node"], p["name"], p["image_dir"], p["restore_token"],
                              p["runtime_class"], migration_id=p["migration_id"])
    changed, made = k8s_pods.create_pod(api, pod)
    if p["wait"]:
        made = wait_pod_running(api, p["namespace"], p["name"], p["wait_timeout"])
    return changed, made


def absent(api, p):
    if p["uid"]:
        there = find_pod(api, p["namespace"], p["name"])
        changed = k8s_pods.delete_pod(api, p["namespace"], p["name"], p["uid"], p["grace_period"]) \
            if there is not None and (there.get("metadata") or {}).get("uid") == p["uid"] else False
        uid = p["uid"]
    elif p["migration_id"]:
        changed, uid = k8s_pods.delete_migration_pod(api, p["namespace"], p["name"], p["migration_id"],
                                                     p["grace_period"])
    else:
        raise InvalidTarget("state=absent needs uid or migration_id: only that very pod is deleted",
                            stage="preflight")
    if p["wait"] and uid:
        wait_pod_gone(api, p["namespace"], p["name"], uid, p["wait_timeout"])
    there = find_pod(api, p["namespace"], p["name"])
    return changed, there if there is not None and (there.get("metadata") or {}).get("uid") == uid else None


def main():
    module = AnsibleModule(argument_spec=dict(
        state=dict(type="str", choices=["present", "absent"], default="present"),
        namespace=dict(type="str", default="default"),
        name=dict(type="str", required=True),
        from_pod=dict(type="dict"),
        target_node=dict(type="str"),
        image_dir=dict(type="path"),
        restore_token=dict(type="str", no_log=True),
        runtime_class=dict(type="str", default=k8s_pods.DEFAULT_RESTORE_RUNTIME_CLASS),
        migration_id=dict(type="str"),
        uid=dict(type="str"),
        grace_period=dict(type="int"),
        wait=dict(type="bool", default=False),
        wait_timeout=dict(type="float", default=600.0),
        **auth_args()
    ), supports_check_mode=False)
    p = module.params
    try:
        api = api_client(p)
        changed, pod = (present if p["state"] == "present" else absent)(api, p)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    module.exit_json(changed=changed, pod=_brief(pod))


if __name__ == "__main__":
    main()
