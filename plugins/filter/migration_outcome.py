# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where the workload runs after a migration, as a drain reads it."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_outcome
short_description: Where the workload runs after a migration, its downtime, image size and the link's throughput
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.MIGRATION_HOSTS
description:
  - A thin wrapper over C(outcome) of plugins/module_utils/migration/report.py. C(status) is C(moved), C(stayed)
    (settled either way) or C(none) (no migration with this id had begun).
options:
  _input:
    description: The migration's id.
    type: str
    required: true
  committed:
    description: Whether the target committed; none when the migration was not settled.
    type: bool
  ckpt:
    description: The result of C(gpuckpt.fleet.gpu_checkpoint).
    type: dict
  restore:
    description: The result of C(gpuckpt.fleet.gpu_restore).
    type: dict
  sync:
    description: The result of C(gpuckpt.fleet.gpu_image_sync).
    type: dict
  target_says:
    description: The target's word (its phase, or why it could not be asked).
    type: str
  target_answered:
    description: Whether the target answered its settlement.
    type: bool
    default: true
  held:
    description: Whether the source is held.
    type: bool
    default: false
  rewind:
    description: What an accepted rewind undid.
    type: str
"""

EXAMPLES = r"""
- name: Record where the workload runs
  ansible.builtin.set_fact:
    outcome: "{{ 'm-42' | gpuckpt.fleet.migration_outcome(source='a', target='b', committed=true) }}"
"""

RETURN = r"""
_value:
  description: migration_id, status, where, downtime_s, image_bytes, settled, held, rewind, transfer_bytes_s, reason.
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.report import outcome


def migration_outcome(migration_id, source=None, target=None, committed=None, ckpt=None, restore=None, sync=None,
                      target_says=None, target_answered=True, held=False, rewind=""):
    return outcome(migration_id, source, target, committed=committed, ckpt=ckpt or {}, restore=restore or {},
                   sync=sync or {}, target_says=target_says, target_answered=target_answered, held=held, rewind=rewind)


class FilterModule(object):
    def filters(self):
        return {"migration_outcome": migration_outcome}
