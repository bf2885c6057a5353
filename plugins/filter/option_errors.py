# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What is wrong with a playbook's numeric options, before anything is frozen."""
from __future__ import annotations

DOCUMENTATION = r"""
name: option_errors
short_description: Check the numbers migrate.yml and drain.yml take (timeouts, waits, streams, parallel moves)
version_added: "0.4.0"
description:
  - A thin wrapper over the migration planner's C(option_errors). Each timeout and wait must be above 0 (or 0 or
    more where 0 means no limit), C(drain_parallel) a whole number of 1 or more. Returns a list of lines, each
    naming an option, its value and what it must be; empty when all are right.
options:
  _input:
    description: The options as given, by name (variables that are not defined are left out).
    type: dict
    required: true
"""

EXAMPLES = r"""
- name: Check the numbers before anything is frozen
  ansible.builtin.assert:
    that: errors | length == 0
    fail_msg: "{{ errors }}"
  vars:
    errors: "{{ {'gpuckpt_runtime_timeout': -1} | gpuckpt.fleet.option_errors }}"
"""

RETURN = r"""
_value:
  description: The errors, one line each.
  type: list
  elements: str
"""

from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.planner import option_errors as check


def option_errors(values):
    return check(dict(values or {}))


class FilterModule(object):
    def filters(self):
        return {"option_errors": option_errors}
