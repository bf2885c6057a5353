#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_migration
short_description: Start, settle, commit or roll back a migration on one host, from its journal
version_added: "0.1.0"
description:
  - Each host of a migration keeps a journal of its phase (see gpuckpt.fleet.migrate). Every action reads it under
    its lock and moves it on only as its rules allow, so that exactly one copy of the workload ends up running and
    no copy that ran is thrown away.
  - The target decides. C(settle) on the target commits when the restore there ended well and those very processes
    still run (checked by pid, start time and boot), and rolls back otherwise. It waits for a restore that is still
    running there (O(wait)). Then the source follows the target's word (O(target_phase)).
  - Nothing is removed that the migration did not create (directories are checked by device and inode), and
    processes are killed only when they are still the ones recorded.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  migration_id:
    description: The migration's id.
    type: str
    required: true
  role:
    description: This host's part in the migration.
    type: str
    choices: [source, target]
    required: true
  action:
    description:
      - C(status) reports the journal and which of its processes run now (by identity).
      - C(begin) (target) creates the directory the image will arrive in (new, mode 0700; an existing path is refused)
        and records it with a fresh nonce, returned as C(journal.nonce), which the source's checkpoint must carry.
      - C(settle) (target) decides the migration and carries out the target's half. It commits when the restore here
        ended well and its processes still run; otherwise it kills what a restore brought up (by identity), stops the
        transfer's receivers, removes the image directory the migration created, and marks the journal C(cleaned), so that
        nothing of this migration can start here afterwards. It returns C(decision) (commit or rollback) and C(phase).
      - C(commit) on the target is C(settle) that refuses to roll back; on the source it releases the held source
        (kills it, by identity). The source needs O(target_phase=committed).
      - C(rollback) on the target is C(settle) that refuses to commit (it fails when the workload runs here). On the
        source it resumes the workload, or restores it from its own image when it exited, once the target is shown
        not to run it (O(target_phase=cleaned)), or when the image never left the source, or with O(target_lost).
        It first fences the source, so a checkpoint of a controller that died stops at its next step. Once the source
        runs, its image of this migration is removed unless O(keep_image_on_rollback).
      - C(plan) (source) reads the journal as C(status) does and returns the migration's C(plan), changing nothing
        (see RETURN). An id that left a journal on either host (this one, or the target's O(target_journal)) is
        settled, and the workload named now (O(pid), O(container), O(pod)) is checked against it. A new migration
        names its runtime, resolves its root pid through the runtime's backend, and decides whether the source is
        held stopped or exits, from the backend's capabilities and the two hosts (O(target_host)).
    type: str
    choices: [status, begin, settle, commit, rollback, plan]
    default: status
  pid:
    description: For C(plan), the root pid of the workload (a bare process tree).
    type: int
  container:
    description: For C(plan), the container of the workload (with O(runtime)).
    type: str
  runtime:
    description: For C(plan), the runtime of O(container).
    type: str
    choices: [process, runc, podman, docker, containerd, runsc, k8s_pod]
  pod:
    description: For C(plan), the Kubernetes pod of the workload (C(namespace/name)).
    type: str
  move_pod:
    description: For C(plan) of a pod migration, the pod as C(gpuckpt.fleet.gpu_pod_info) described it.
    type: dict
  target_journal:
    description: For C(plan), the target's journal of this migration, as this module's C(status) read it there.
    type: dict
  target_host:
    description: For C(plan), the target's C(host) (boot id, pid and network namespaces), as this module returns it.
    type: dict
  target_name:
    description: For C(plan), the target's name, as the reasons say it.
    type: str
  target_pod_name:
    description: For C(plan) of a pod migration, the name of the pod its copy runs in (by default made from the id).
    type: str
  settle_only:
    description: For C(plan), only settle a migration of this id that left journals; plan no new one.
    type: bool
    default: false
  journal_dir:
    description: Directory of the journals.
    type: path
    default: /var/lib/gpuckpt/journal
  image_dir:
    description: For C(begin), the directory the image will arrive in (it must not exist).
    type: path
  image_in_memory:
    description:
      - For C(begin), keep the image in memory on this target, off its disk, as C(gpuckpt.fleet.gpu_checkpoint)'s
        O(gpuckpt.fleet.gpu_checkpoint#module:image_in_memory) does on the source. A tmpfs of the image's own, sized
        O(image_memory_bytes) times 1.2 plus 256 MiB (a cap, not memory taken), is mounted on the new directory, and
        the settlement's removal of the directory unmounts it.
      - Refused, before anything is made or frozen, where this host's MemAvailable does not hold the image, the restored
        job's copy of its memory (its size again) and a reserve (5 % of its RAM, at least 1 GiB).
      - An image that outgrows the tmpfs fails its transfer (the target's "disk" is full), and the migration rolls back.
    type: bool
    default: false
  image_memory_bytes:
    description: With O(image_in_memory), the image's expected size in bytes (by default O(image_estimate_bytes)).
    type: int
  image_estimate_bytes:
    description: With O(image_in_memory), the preflight's estimate of the image's size, used when O(image_memory_bytes) is not given.
    type: int
  remove_image:
    description: On commit, remove this host's image directory (only the one this migration created).
    type: bool
    default: false
  keep_image_on_rollback:
    description:
      - For the source's C(rollback), keep this host's image of the migration once the source runs again. By default
        it is removed then, as it is no way back any more (a next try checkpoints anew), and only after the source is
        shown running; the journal names it (C(journal.image_removed)), or names the image kept (C(journal.image_kept)).
    type: bool
    default: false
  target_phase:
    description: For the source's C(commit) and C(rollback), the target's phase as its C(settle) reported it.
    type: str
  target_lost:
    description:
      - For the source's C(rollback), the operator's word that the target is gone for good (its copy will never run).
        Without it, a source whose image may have reached a target that cannot be asked stays held.
    type: bool
    default: false
  abandon_pod_restore:
    description:
      - For the target's C(settle) and C(rollback) of a pod migration, the caller's word that the migration's target pod
        does not exist (the playbooks ask the API server). The target's restore, which waits for that pod's
        containers, then gives up at once instead of after its restore_wait (the restore claims of its
        containers are marked failed), and the migration rolls back.
      - Nothing that was restored is touched.
    type: bool
    default: false
  wait:
    description: Seconds to wait for the journal's lock, held by a step still running (a restore, a checkpoint).
    type: float
    default: 1800
  runtime_timeout:
    description:
      - Seconds that a source rollback's restore from its own image (a source that exited) may take. When it takes
        longer, it is killed with its CRIU and the rollback fails, keeping the image. V(0) sets no limit.
    type: float
    default: 0
requirements:
  - "Root on the managed host."
attributes:
  check_mode:
    support: partial
    details: It reports the journal as it is (C(status)) for every action, and changes nothing.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.actiongroup_gpu
notes:
  - C(status) supports check mode; the other actions change nothing in check mode and report the journal.
"""

EXAMPLES = r"""
- name: Where does migration m-42 stand on the source?
  gpuckpt.fleet.gpu_migration:
    migration_id: m-42
    role: source
  register: src_status

- name: Plan a migration of pid 4242 (the target's journal and host read there first)
  gpuckpt.fleet.gpu_migration:
    migration_id: m-43
    role: source
    action: plan
    pid: 4242
    target_journal: "{{ dst_status.journal }}"
    target_host: "{{ dst_status.host }}"
  register: planned

- name: Settle it on the target (commit if the target runs it, else clean the target)
  gpuckpt.fleet.gpu_migration:
    migration_id: m-42
    role: target
    action: settle
  register: settled

- name: Then the source follows
  gpuckpt.fleet.gpu_migration:
    migration_id: m-42
    role: source
    action: "{{ 'commit' if settled.decision == 'commit' else 'rollback' }}"
    target_phase: "{{ settled.phase }}"
"""

RETURN = r"""
huge_pages:
  description: With C(note), when this run put back the host's transparent huge pages setting that a killed
    checkpoint or restore (O(gpuckpt.fleet.gpu_checkpoint#module:host_huge_pages)) had left changed.
  returned: when it did
  type: dict
journal:
  description: The journal as read (phase, history, pids, image_dir...), with alive_pids, stopped_pids and running_pids.
  returned: always
  type: dict
host:
  description: This host's C(boot_id), C(pid_namespace) and C(net_namespace) (the plan compares the two hosts').
  returned: always
  type: dict
plan:
  description:
    - For C(plan), the migration's plan (plugins/module_utils/migration/plan.py). C(settle) (a journal exists), C(new)
      (a new migration is to be made), C(id_reuse) (why the workload named is not the one the id was used for, or
      empty), C(pod_ref), C(target_pod) and C(restore_token) (a pod migration).
    - For a new migration, C(runtime), C(root_pid), C(workload) (in words), C(error) (why the workload was not
      found, or empty), C(hold_stopped), C(exit_reason), C(one_pid_space), C(restores_host_pids), and C(calls) with
      the arguments of the source's facts (C(source_facts)) and of the checkpoint (C(checkpoint)).
  returned: for plan
  type: dict
decision:
  description: For C(settle), C(commit) or C(rollback).
  returned: for settle, commit and rollback on the target
  type: str
phase:
  description: This host's phase after the action.
  returned: always
  type: str
msg:
  description: What was done.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration.transaction import RESTORE_WAIT
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import (
    RUNTIME_ARGS, WORKLOAD_ARGS, check_path_arg)
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import migration_step, run_module


def main():
    module = AnsibleModule(argument_spec=dict(
        migration_id=dict(type="str", required=True),
        role=dict(type="str", required=True, choices=["source", "target"]),
        action=dict(type="str", default="status", choices=["status", "begin", "settle", "commit", "rollback", "plan"]),
        journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
        image_dir=dict(type="path"),
        image_in_memory=dict(type="bool", default=False),
        image_memory_bytes=dict(type="int"),
        image_estimate_bytes=dict(type="int"),
        remove_image=dict(type="bool", default=False),
        keep_image_on_rollback=dict(type="bool", default=False),
        target_phase=dict(type="str"),
        target_lost=dict(type="bool", default=False),
        wait=dict(type="float", default=RESTORE_WAIT),
        abandon_pod_restore=dict(type="bool", default=False),
        libcuda_path=dict(type="path"),
        runtime_timeout=dict(type="float", default=0),
        move_pod=dict(type="dict"),
        target_journal=dict(type="dict"),
        target_host=dict(type="dict"),
        target_name=dict(type="str"),
        target_pod_name=dict(type="str"),
        settle_only=dict(type="bool", default=False),
        **dict(WORKLOAD_ARGS, **RUNTIME_ARGS)
    ), supports_check_mode=True)
    check_path_arg(module, "image_dir", module.params["image_dir"])
    # The size given, else the preflight's estimate (a size of 0 is none: begin refuses it, nothing made)
    params = dict(module.params, image_memory_bytes=module.params["image_memory_bytes"] or module.params["image_estimate_bytes"])
    run_module(module, migration_step, params, module.check_mode)


if __name__ == "__main__":
    main()
