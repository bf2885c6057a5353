# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The default name of a pod migration's target pod."""
from __future__ import annotations

DOCUMENTATION = r"""
name: k8s_target_pod_name
short_description: The name of the pod a pod migration restores into
version_added: "0.3.0"
description:
  - The source pod's name and a short digest of the migration's id, within 63 characters (the pod's hostname).
  - The source pod is held under its own name until its copy runs, so the copy needs another name; the same
    migration id always gives the same name, so a rerun or recover.yml finds the pod the migration made.
options:
  _input:
    description: The source pod's name.
    type: str
    required: true
  migration_id:
    description: The migration's id.
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Name the target pod
  ansible.builtin.set_fact:
    target_pod: "{{ 'gpu-test-pod' | gpuckpt.fleet.k8s_target_pod_name('m-42') }}"
"""

RETURN = r"""
_value:
  description: The target pod's name, such as C(gpu-test-pod-3fa2c1).
  type: str
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.pods import target_pod_name


def k8s_target_pod_name(name, migration_id):
    return target_pod_name(str(name), str(migration_id))


class FilterModule(object):
    def filters(self):
        return {"k8s_target_pod_name": k8s_target_pod_name}
