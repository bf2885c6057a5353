#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_migration
short_description: Read and finish a migration's journal on one host (commit or roll back)
version_added: "0.1.0"
description:
  - Each host of a migration keeps a journal of its phase (see gpuckpt.fleet.migrate).
  - This module reads that journal and takes one idempotent step.
  - It is what migrate.yml and recover.yml use to make sure that exactly one copy of the workload
    ends up running.
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
      - C(status) reports the journal and which of its pids run now (stopped or running).
      - C(begin) starts this host's journal (target side, before the image arrives).
      - C(commit) on the source releases the stopped source (kills it); on the target it marks the restored workload as the one copy.
      - C(rollback) on the source resumes it (or restores it from its own image when it exited).
      - C(rollback) on the target kills what was restored there and removes the image copy. A restore of the
        migration still waiting there for its image (gpuckpt.fleet.gpu_restore O(gpuckpt.fleet.gpu_restore#module:wait_for_image))
        is stopped first; one that is restoring is waited for (up to 1800 s), then what it restored is killed.
    type: str
    choices: [status, begin, commit, rollback]
    default: status
  journal_dir:
    description: Directory of the journals.
    type: path
    default: /var/lib/gpuckpt/journal
  image_dir:
    description: This host's image directory for the migration (recorded by C(begin); removed by target rollback).
    type: path
  remove_image:
    description: On commit, remove this host's image directory.
    type: bool
    default: false
  wait:
    description: For C(status), seconds to wait for a phase still in flight (freezing, restoring) to settle.
    type: float
    default: 0
  libcuda_path:
    description: Path of libcuda.so.1 when the dynamic loader cannot find it.
    type: path
  runtime_timeout:
    description:
      - Seconds that a source rollback's restore from its own image (a source that exited) may take. When it takes
        longer, it is killed with its CRIU and the rollback fails, keeping the image. V(0) sets no limit.
    type: float
    default: 0
extends_documentation_fragment:
  - gpuckpt.fleet.common.runtime
notes:
  - C(status) supports check mode; the other actions report what they would do in check mode without doing it.
"""

EXAMPLES = r"""
- name: Where does migration m-42 stand on the source?
  gpuckpt.fleet.gpu_migration:
    migration_id: m-42
    role: source
  register: src_status

- name: Roll the source back
  gpuckpt.fleet.gpu_migration:
    migration_id: m-42
    role: source
    action: rollback
"""

RETURN = r"""
journal:
  description: The journal as read (phase, history, pids, image_dir...), with alive_pids, stopped_pids and running_pids.
  returned: always
  type: dict
msg:
  description: What was done.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils import migration
from ansible_collections.gpuckpt.fleet.plugins.module_utils.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import (
    RUNTIME_ARGS, backend_of_image, make_backend)


def main():
    module = AnsibleModule(argument_spec=dict(
        migration_id=dict(type="str", required=True),
        role=dict(type="str", required=True, choices=["source", "target"]),
        action=dict(type="str", default="status", choices=["status", "begin", "commit", "rollback"]),
        journal_dir=dict(type="path", default=migration.DEFAULT_JOURNAL_DIR),
        image_dir=dict(type="path"),
        remove_image=dict(type="bool", default=False),
        wait=dict(type="float", default=0),
        libcuda_path=dict(type="path"),
        runtime_timeout=dict(type="float", default=0),
        **RUNTIME_ARGS
    ), supports_check_mode=True)
    p = module.params
    try:
        journal = migration.Journal(p["journal_dir"], p["migration_id"], p["role"])
        action, role = p["action"], p["role"]
        if action == "status" or module.check_mode:
            st = migration.status(journal, wait=p["wait"])
            module.exit_json(changed=False, journal=st, msg="phase %s" % st.get("phase"))
        if action == "begin":
            doc = journal.read()
            if doc:
                module.exit_json(changed=False, journal=doc, msg="journal exists (phase %s)" % doc["phase"])
            doc = journal.write("receiving", image_dir=p["image_dir"])
            module.exit_json(changed=True, journal=doc, msg="journal started")
        # The runtime the workload was taken with is in its image's manifest.
        image_dir = (journal.read() or {}).get("image_dir") or p["image_dir"]
        backend = make_backend(backend_of_image(image_dir) if image_dir else "process", p)
        if role == "source" and action == "commit":
            changed, msg = migration.commit_source(journal, backend=backend, remove_image=p["remove_image"])
        elif role == "source":
            changed, msg = migration.rollback_source(journal, backend=backend, libcuda_path=p["libcuda_path"])
        elif action == "commit":
            changed, msg = migration.commit_target(journal, remove_image=p["remove_image"], image_dir=p["image_dir"])
        else:
            changed, msg = migration.rollback_target(journal, image_dir=p["image_dir"], backend=backend)
        module.exit_json(changed=changed, msg=msg, journal=migration.status(journal))
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())


if __name__ == "__main__":
    main()
