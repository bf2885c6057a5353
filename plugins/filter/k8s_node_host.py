# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The inventory host that is a given Kubernetes node."""
from __future__ import annotations

DOCUMENTATION = r"""
name: k8s_node_host
short_description: The inventory host that is a Kubernetes node
version_added: "0.3.0"
description:
  - The host of O(hosts) whose variable C(gpuckpt_k8s_node_name) is the node's name; else the host named as the node
    (when it sets no C(gpuckpt_k8s_node_name) of its own).
  - Fails, naming the node, when no host or more than one host is that node.
options:
  _input:
    description: The node's name, as Kubernetes knows it (C(pod.node) of P(gpuckpt.fleet.gpu_pod_info#module)).
    type: str
    required: true
  hostvars:
    description: C(hostvars).
    type: dict
    required: true
  hosts:
    description: The hosts to look among, C(groups['all']) say.
    type: list
    elements: str
    required: true
"""

EXAMPLES = r"""
- name: The inventory host of the pod's node
  ansible.builtin.set_fact:
    source: "{{ pod.pod.node | gpuckpt.fleet.k8s_node_host(hostvars, groups['all']) }}"
"""

RETURN = r"""
_value:
  description: The inventory host's name.
  type: str
"""

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.pods import inventory_host_for_node


def k8s_node_host(node, hostvars, hosts):
    try:
        return inventory_host_for_node(node, hostvars, list(hosts))
    except ValueError as exc:
        raise AnsibleFilterError(str(exc))


class FilterModule(object):
    def filters(self):
        return {"k8s_node_host": k8s_node_host}
