# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Is a migration id that has a journal being used for another workload?"""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_id_reuse
short_description: Why a migration id used before may not be used for the workload named now
version_added: "0.4.0"
description:
  - A thin wrapper over the migration room's C(id_reuse). A re-run with the same id and the same workload
    finishes or reports that migration; naming another workload (another pid, container or pod, or a pid that
    another process holds now) is refused, naming both, instead of being answered with the old result.
  - Returns the reason, or an empty string when the id may be used.
options:
  _input:
    description: The source's journal as gpuckpt.fleet.gpu_migration reads it (its C(journal)).
    type: dict
    required: true
  migration_id:
    description: The id.
    type: str
    required: true
  pid:
    description: The pid named now.
    type: int
  container:
    description: The container named now.
    type: str
  pod:
    description: The pod named now (C(namespace/name)).
    type: str
  target_journal:
    description: The target's journal of the same id (its copy's identities), as gpuckpt.fleet.gpu_migration reads it.
    type: dict
  pid_starttime:
    description: The start time (clock ticks after boot) of the process that has O(pid) now; none when no process has it.
    type: int
"""

EXAMPLES = r"""
- name: Refuse an id used for another workload
  ansible.builtin.assert:
    that: reuse | length == 0
    fail_msg: "{{ reuse }}"
  vars:
    reuse: "{{ src_status.journal | gpuckpt.fleet.migration_id_reuse('m-42', pid=4242) }}"
"""

RETURN = r"""
_value:
  description: The reason, or an empty string.
  type: str
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.id_reuse import id_reuse


def migration_id_reuse(journal, migration_id, pid=None, container=None, pod=None, pid_starttime=None, target_journal=None):
    now = {"starttime": int(pid_starttime)} if pid_starttime not in (None, "") else None
    return id_reuse(migration_id, journal or {}, pid=pid or None, container=container or None, pod=pod or None,
                    pid_now=now, target_journal=target_journal or None) or ""


class FilterModule(object):
    def filters(self):
        return {"migration_id_reuse": migration_id_reuse}
