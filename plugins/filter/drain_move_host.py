# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The inventory host that stands for one move of a drain."""
from __future__ import annotations

DOCUMENTATION = r"""
name: drain_move_host
short_description: The arguments of ansible.builtin.add_host for one move of a drain
version_added: "0.4.0"
description:
  - drain.yml runs each move as a host of its own, named by its migration id, so that moves run side by side
    (C(serial)) and each fails or succeeds alone. Every task of a move runs on the node (delegated) or on its
    target. The move's host is put in the node's groups and given the node's C(gpuckpt_*) and connection
    variables, so that what migrate.yml reads in the source's context (transfer ssh options, timeouts) reads the
    same in the move's.
  - The drain's own facts on the node (C(gpuckpt_drain_*), C(gpuckpt_mark_*), C(gpuckpt_throughput*)) are not copied.
options:
  _input:
    description: The node's variables (C(hostvars[node])).
    type: dict
    required: true
  name:
    description: The move's host name (its migration id).
    type: str
    required: true
  group:
    description: The group of the drain's moves.
    type: str
    required: true
  workload:
    description: The workload (from gpuckpt.fleet.drain_plan) - its pid, its pod, or its container, runtime and containerd namespace.
    type: dict
  source:
    description: The node's inventory name.
    type: str
  target:
    description: The target's inventory name.
    type: str
  migration_id:
    description: The move's migration id.
    type: str
  gpuckpt_settle_only:
    description: Only settle the migration of this id (a move an earlier drain began).
    type: bool
"""

EXAMPLES = r"""
- name: One move
  ansible.builtin.add_host: >-
    {{ hostvars['gpu-node-7'] | gpuckpt.fleet.drain_move_host('m-1', group='moves', source='gpu-node-7',
         target='gpu-node-8', migration_id='m-1', workload={'kind': 'process', 'pid': 4242}) }}
"""

RETURN = r"""
_value:
  description: The arguments of add_host.
  type: dict
"""

import re

# Connection variables of the node that the move's host keeps (it is never connected to itself: each of its
# tasks is delegated to the node or to the target, but a task that was not would reach the node).
_CONNECTION = re.compile(r"^ansible_(host|port|user|connection|python_interpreter|ssh_common_args|ssh_private_key_file"
                         r"|become|become_user|become_method)\Z")
# Also left out: the secrets. add_host shows the vars it was given (-v, an AWX job's log); the moves read a signing
# key and the API server's credentials from the node's own hostvars instead.
_DRAIN_OWN = re.compile(r"^gpuckpt_(drain_|mark_|throughput|move_|sign_key$|k8s_auth$)")


def drain_move_host(node_vars, name, group, workload=None, **extra):
    out = {k: v for k, v in (node_vars or {}).items()
           if (k.startswith("gpuckpt_") and not _DRAIN_OWN.match(k)) or _CONNECTION.match(k)}
    out.update(name=name, groups=[group] + [g for g in node_vars.get("group_names") or [] if g != group])
    if workload:
        if workload.get("kind") == "process":
            out["pid"] = workload["pid"]
        elif workload.get("kind") == "pod":
            out["pod"] = workload["pod"]
        else:
            out.update(container=workload["container"], runtime=workload["runtime"])
            if workload.get("namespace"):
                out["containerd_namespace"] = workload["namespace"]
    out.update({k: v for k, v in extra.items() if v is not None})  # an unset one stays undefined for the move
    return out


class FilterModule(object):
    def filters(self):
        return {"drain_move_host": drain_move_host}
