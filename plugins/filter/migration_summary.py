# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The lines of a migration's summary."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_summary
short_description: The lines of a migration's summary (downtime, each stage's seconds, the transfer)
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.MIGRATION_HOSTS
description:
  - A thin wrapper over C(summary) of plugins/module_utils/migration/report.py.
options:
  _input:
    description: The result of C(gpuckpt.fleet.gpu_checkpoint).
    type: dict
    required: true
  restore:
    description: The result of C(gpuckpt.fleet.gpu_restore) on the target.
    type: dict
    required: true
  sync:
    description: The result of C(gpuckpt.fleet.gpu_image_sync), when it ran.
    type: dict
  migration_id:
    description: The migration's id.
    type: str
    required: true
  workload:
    description: The workload in words (the plan's C(workload)).
    type: str
    required: true
  pod:
    description: A pod migration's source pod (C(namespace), C(name)).
    type: dict
  target_pod:
    description: The pod its copy runs in.
    type: str
"""

EXAMPLES = r"""
- name: Summary
  ansible.builtin.debug:
    msg: "{{ ckpt | gpuckpt.fleet.migration_summary(restore, sync=sync, migration_id='m-42', workload='pid 4242',
             source='a', target='b') }}"
"""

RETURN = r"""
_value:
  description: The lines.
  type: list
  elements: str
"""

from ansible.module_utils.common.text.formatters import bytes_to_human

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.report import summary


def migration_summary(ckpt, restore, sync=None, migration_id=None, workload=None, source=None, target=None, pod=None,
                      target_pod=None):
    return summary(ckpt, restore, sync, migration_id, workload, source, target, pod=pod or None,
                   target_pod=target_pod, human=lambda n: bytes_to_human(float(n or 0)))


class FilterModule(object):
    def filters(self):
        return {"migration_summary": migration_summary}
