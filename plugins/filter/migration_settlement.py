# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the source does once a migration is settled, and where the workload runs."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_settlement
short_description: What the source does once a migration is settled, and where the workload runs
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.MIGRATION_HOSTS
description:
  - A thin wrapper over C(after_settlement) of plugins/module_utils/migration/report.py.
  - The source is held (stopped since its freeze) when it did not resume and its journal says its migration is not
    over - a copy on the target may have run and be gone (resuming would rewind the job), or the target could not be
    asked after the image may have reached it (resuming could start a second copy). The message says what to run.
options:
  _input:
    description: The migration's id.
    type: str
    required: true
  committed:
    description: Whether the target's settlement committed.
    type: bool
    default: false
  target_answered:
    description: Whether the target answered its settlement.
    type: bool
    default: false
  target_says:
    description: The target's phase, or why it did not answer.
    type: str
    default: ""
  lost:
    description: The P(gpuckpt.fleet.lost_copy#filter) filter's record of the target's copy.
    type: dict
  resumed:
    description: The result of the source's rollback (gpu_migration C(action=rollback)), maybe skipped.
    type: dict
  source_after:
    description: The result of reading the source's journal when it did not resume, maybe skipped.
    type: dict
  target_lost:
    description: Whether the operator declared the target lost (gpuckpt_target_lost).
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Where the workload runs once settled
  ansible.builtin.debug:
    msg: "{{ ('m-42' | gpuckpt.fleet.migration_settlement(source='a', target='b', committed=true)).msg }}"
"""

RETURN = r"""
_value:
  description: C(held), C(held_msg) (why, and what to run), C(rewind) (what an accepted resume undid) and C(msg).
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.report import after_settlement


def migration_settlement(migration_id, source=None, target=None, committed=False, target_answered=False,
                         target_says="", lost=None, resumed=None, source_after=None, target_lost=False):
    return after_settlement(migration_id, source, target, committed=committed, target_answered=target_answered,
                            target_says=target_says, lost=lost, resumed=resumed, source_after=source_after,
                            target_lost=target_lost)


class FilterModule(object):
    def filters(self):
        return {"migration_settlement": migration_settlement}
