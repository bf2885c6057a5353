# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""How a migration ended after a failure on its way."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_ending
short_description: How a migration ended after a failure on its way, once settled
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.MIGRATION_HOSTS
description:
  - A thin wrapper over C(after_failure) of plugins/module_utils/migration/report.py.
  - Rolled back (the workload runs on the source), its source held, committed with its source not released, or
    committed all the same (the error was on the way).
options:
  _input:
    description: The migration's id.
    type: str
    required: true
  error:
    description: The error, with the task it failed in.
    type: str
    required: true
  committed:
    description: Whether the settlement committed.
    type: bool
    default: false
  held:
    description: Whether the source is held (its settlement failed, saying what holds it).
    type: bool
    default: false
  rewind:
    description: What a rollback an operator accepted undid.
    type: str
    default: ""
  released:
    description: The result of the source's release (gpu_migration C(action=commit)).
    type: dict
  source_pod_deleted:
    description: The result of a pod migration's deletion of its source pod.
    type: dict
"""

EXAMPLES = r"""
- name: Migration failed and was rolled back (else its source is held, or not released)
  vars:
    ending: "{{ 'm-42' | gpuckpt.fleet.migration_ending(source='a', target='b', error='boom', committed=false) }}"
  ansible.builtin.fail:
    msg: "{{ ending.msg }}"
  when: ending.fails
"""

RETURN = r"""
_value:
  description: C(fails) (the migration's task fails) and C(msg).
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.report import after_failure


def migration_ending(migration_id, source=None, target=None, error=None, committed=False, held=False, rewind="",
                     released=None, source_pod_deleted=None):
    return after_failure(migration_id, source, target, error, committed=committed, held=held, rewind=rewind,
                         released=released, source_pod_deleted=source_pod_deleted)


class FilterModule(object):
    def filters(self):
        return {"migration_ending": migration_ending}
