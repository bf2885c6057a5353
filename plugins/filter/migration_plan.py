# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A migration's plan with the arguments of each later module call."""
from __future__ import annotations

DOCUMENTATION = r"""
name: migration_plan
short_description: A migration's plan with the arguments of each later module call, ready to pass
version_added: "0.4.0"
extends_documentation_fragment:
  - gpuckpt.fleet.common.MIGRATION_HOSTS
description:
  - A thin wrapper over C(with_calls) of plugins/module_utils/migration/plan.py, on the controller.
  - Adds to the plan that C(gpuckpt.fleet.gpu_migration) C(action=plan) made on the source what the play's options
    decide. These are the arguments of each later call (C(source_facts_args), C(target_facts_args),
    C(preflight_args), C(begin_args), C(restore_early_args), C(restore_attach_args), C(restore_now_args),
    C(restore_args), C(checkpoint_args), C(sync_args), C(target_pod_args)), the restore job's C(restore_async_s) and
    C(restore_early). It also adds the C(option_errors) and the C(refusal) of a new migration (empty when it may begin).
  - The target's arguments come from the inventory and the play, never from the source.
options:
  _input:
    description: The plan, as C(gpuckpt.fleet.gpu_migration) C(action=plan) returned it.
    type: dict
    required: true
  options:
    description:
      - The play's variables by name. These are C(gpuckpt_*), with the migration's names and directories
        (tasks/migration_vars.yml), and probe_command and quiesce_*.
    type: dict
    required: true
  source_vars:
    description: The source's inventory variables (its signing key, quiesce settings, protect_dir).
    type: dict
  target_vars:
    description: The target's inventory variables (its signing key, bundle, probe command, protect_dir).
    type: dict
"""

EXAMPLES = r"""
- name: Keep the plan, with the arguments of each later call
  vars:
    names: "{{ query('ansible.builtin.varnames', '^(gpuckpt_.*|probe_command|quiesce_.*)$') }}"
  ansible.builtin.set_fact:
    plan: >-
      {{ planned.plan | gpuckpt.fleet.migration_plan(dict(names | zip(query('ansible.builtin.vars', *names))),
           source='a', target='b', source_vars=hostvars['a'], target_vars=hostvars['b']) }}
"""

RETURN = r"""
_value:
  description: The plan, with the arguments of each later call.
  type: dict
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.plan import with_calls


def migration_plan(plan, options, source=None, target=None, source_vars=None, target_vars=None):
    return with_calls(plan, options, source, target, source_vars=source_vars, target_vars=target_vars)


class FilterModule(object):
    def filters(self):
        return {"migration_plan": migration_plan}
