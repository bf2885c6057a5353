#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_drain_mark
short_description: Write or take away a node's drain mark, where it is read
version_added: "0.5.0"
description:
  - A node's drain mark is C(drain.json) in its journal directory (plugins/module_utils/fleet/drain_mark.py). While it
    is there the node is draining - the planners place nothing on it (M(gpuckpt.fleet.cuda_process_facts) reports it
    as C(drain)) - and it names the moves a drain has begun, so that a re-run after a killed drain settles them first.
    playbooks/drain.yml writes it with this module, and takes it away with O(state=absent) (C(undrain)).
  - O(state=present) writes the mark whole under a new name and renames it (the journal directory is made, mode 0700,
    when missing). Its C(started) is the earlier mark's, else now; O(pending) and O(k8s_node), when not given, are
    the earlier mark's. O(mark) writes a mark given whole instead (one read before, put back).
  - O(throughput) writes the link throughput the moves showed (C(throughput.json)) beside it, the same way.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  journal_dir:
    description: The node's journal directory.
    type: path
    default: /var/lib/gpuckpt/journal
  state:
    description: V(present) writes the mark, V(absent) takes it away.
    type: str
    choices: [present, absent]
    default: present
  drain_id:
    description: The drain's id (required to write a mark, unless O(mark) is given).
    type: str
  pending:
    description: The moves the drain has begun and not settled (their migration ids and hosts).
    type: list
    elements: raw
  empty:
    description: Whether the node runs no GPU workload any more.
    type: bool
    default: false
  k8s_node:
    description: The Kubernetes node the drain cordoned (C(undrain) takes its cordon back).
    type: str
  keep_fields:
    description: Keep the earlier mark's other fields too (the first mark of a drain, before anything is planned).
    type: bool
    default: false
  mark:
    description: A mark to write as it is (with O(state=present)), such as the one read before a drain that stopped.
    type: dict
  throughput:
    description: The link throughput each target showed (C(throughput.json)), written beside the mark.
    type: dict
requirements:
  - "Write access to the journal directory (root on a GPU node)."
attributes:
  check_mode:
    support: full
    details: Reports the mark it would write, and writes nothing.
  diff_mode:
    support: none
  platform:
    platforms: posix
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
"""

EXAMPLES = r"""
- name: Mark the node draining before anything is planned
  gpuckpt.fleet.gpu_drain_mark:
    drain_id: drain-gpu-node-1-20250101T000000
    keep_fields: true

- name: The node takes work again
  gpuckpt.fleet.gpu_drain_mark:
    state: absent
"""

RETURN = r"""
before:
  description: The mark that was there (none when the node was not draining).
  returned: always
  type: dict
mark:
  description: The mark there now (none after O(state=absent)).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import drain_mark


def main():
    module = AnsibleModule(argument_spec=dict(
        journal_dir=dict(type="path", default="/var/lib/gpuckpt/journal"),
        state=dict(type="str", choices=["present", "absent"], default="present"),
        drain_id=dict(type="str"),
        pending=dict(type="list", elements="raw"),
        empty=dict(type="bool", default=False),
        k8s_node=dict(type="str"),
        keep_fields=dict(type="bool", default=False),
        mark=dict(type="dict"),
        throughput=dict(type="dict"),
    ), required_if=[("state", "present", ("drain_id", "mark"), True)], supports_check_mode=True)
    p = module.params
    before = drain_mark.read(p["journal_dir"])
    if p["state"] == "absent":
        changed = before is not None
        if changed and not module.check_mode:
            drain_mark.remove(p["journal_dir"])
        module.exit_json(changed=changed, before=before, mark=None)
    mark = p["mark"] if p["mark"] is not None else drain_mark.marked(
        before or {}, p["drain_id"], pending=p["pending"], empty=p["empty"], k8s_node=p["k8s_node"],
        keep_all=p["keep_fields"])
    if not module.check_mode:
        try:
            drain_mark.write(p["journal_dir"], mark, p["throughput"])
        except OSError as e:
            module.fail_json(msg="cannot write the drain mark in %s: %s" % (p["journal_dir"], e), before=before)
    module.exit_json(changed=True, before=before, mark=mark)


if __name__ == "__main__":
    main()
