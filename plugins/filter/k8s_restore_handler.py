# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The program of the node's runtime handler for pod restores, bundled where the role installs it."""
from __future__ import annotations

DOCUMENTATION = r"""
name: k8s_restore_handler
short_description: The runtime handler program through which a pod migration restores a pod's containers
version_added: "0.3.0"
description:
  - The runtime handler's own code (its input) joined with the collection's restore protocol and the core modules
    they use, as one Python program that needs only the standard library on the node.
  - The role P(gpuckpt.fleet.nvidia_container_runtime#role) installs its output as C(gpuckpt_restore_runtime.py), so
    the handler on a node speaks the restore protocol of the collection that installed it.
options:
  _input:
    description: The source of the handler's own code (the role's C(files/gpuckpt_restore_runtime.py)).
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Install the handler
  ansible.builtin.copy:
    content: "{{ lookup('ansible.builtin.file', 'gpuckpt_restore_runtime.py') | gpuckpt.fleet.k8s_restore_handler }}"
    dest: /usr/local/lib/gpuckpt/gpuckpt_restore_runtime.py
    mode: "0644"
"""

RETURN = r"""
_value:
  description: The handler's program, Python source.
  type: str
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program


def k8s_restore_handler(handler_source):
    return handler_program(str(handler_source))


class FilterModule(object):
    def filters(self):
        return {"k8s_restore_handler": k8s_restore_handler}
