#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_replica
short_description: List, verify and fail over a protected job's images in a replica store
version_added: "0.6.0"
description:
  - Runs on a replica host, which keeps the images of a protected job (see the role gpuckpt.fleet.protect) under
    C(<root>/<job>/), one directory per image, and the job's record there (C(job.json)), with its epoch, its owner
    (the node that runs it) and its history. On a failover target it records that the host now owns the job
    (O(state=adopt)).
  - C(list) returns the job's record and its images, newest first, each with its checkpoint time, its size, whether
    it is verified, the job's progress at that checkpoint when the job reports one, and the facts a restore needs
    to be judged (the source's driver, CUDA, CRIU, kernel, GPUs, runtime, pids). It writes nothing.
  - C(verify) reads every byte of one image again against its manifest. An image that no longer verifies is marked
    corrupt in its C(.gpuckpt/replica.json), so that a failover skips it. An image whose push was cut before its
    commit has no C(replica.json) and is never taken as verified.
  - C(failover) hands the job from O(lost_node) to O(target). It refuses first, reading no image, when O(lost_node)
    does not own the job (it was already failed over), or when O(target) owns it. Then it verifies the candidates
    in order, marks the corrupt ones, and takes the first that verifies. Only then it raises the job's epoch by one
    and names O(target) as the owner. From then on the replica refuses every push of the lost node's copy, which
    carries the older epoch.
  - C(fence) changes the job's record on this replica as C(failover) does, refused as it is, without an image. The
    epoch is raised by one and O(target) named as the owner. Run it on each other replica of the job after a failover,
    so that every replica refuses the lost node's pushes and takes the new owner's.
  - C(adopt) records, on the failover target, in C(<journal_dir>/protect-<job>.json), that this host runs the job
    from O(epoch) on. It refuses when that file already names an epoch as high or higher.
  - C(reprotect) is the operator's re-protect of the job on O(node) at O(epoch) (the role gpuckpt.fleet.protect runs
    it with the highest epoch the job's replicas record). It creates the job's record when there is none, or raises
    its epoch to O(epoch) when O(node) owns the job (a replica that missed a failover while the job came back to its
    node). It refuses a record that names another owner (only a failover moves the owner) or a higher epoch. A job's
    epoch moves only by C(failover), C(fence) and C(reprotect); a push or a commit at a higher epoch than the
    record's is refused, never adopted.
  - C(handover) records that a migration (migrate.yml, drain.yml) moved the job from O(node) to O(target), both up.
    The epoch is raised by one and O(target) named as the owner, so that O(node)'s pushes are refused from then on.
    It leaves a record that a move from O(node) already handed to O(target) (a re-run), and refuses one of a third
    owner and one that names O(target) since anything else (a failover, so the workload moved was not the job's copy).
    A replica with no record of the job gets none.
  - The image's signature is not checked here; C(gpuckpt.fleet.gpu_restore) checks it, with the key, before a
    restore.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  root:
    description:
      - The replica store's root on this host (the role's C(gpuckpt_protect_replica_root)).
      - Required for every O(state) except C(adopt).
    type: path
  job:
    description: The protected job's name (1 to 64 letters, digits, C(.), C(_) or C(-)).
    type: str
    required: true
  state:
    description: What to do (see the description).
    type: str
    choices: [list, verify, failover, fence, adopt, reprotect, handover]
    default: list
  image_id:
    description:
      - For C(verify), the image to verify.
      - For C(fence) and C(adopt), the image the job was restored from (recorded).
    type: str
  lost_node:
    description:
      - For C(failover) and C(fence), the inventory name of the node that is lost (the job's owner in the record).
      - For C(adopt), the node the job came from (recorded).
    type: str
  target:
    description:
      - For C(failover) and C(fence), the inventory name of the host that takes the job over.
      - For C(handover), the host a migration moved the job to.
      - For C(adopt), the name recorded as the owner when O(node) is not given.
    type: str
  node:
    description:
      - For C(adopt), this host's inventory name, recorded as the owner. Defaults to O(target), then to the host's
        own name.
      - For C(reprotect), the inventory name of the node that runs the job (its owner). Required.
      - For C(handover), the node a migration moved the job from (its owner until then). Required.
    type: str
  candidates:
    description:
      - For C(failover), the image ids to try, in order of preference (usually the newest restorable one first).
      - Default is every verified image of the job, newest first.
    type: list
    elements: str
  reason:
    description: For C(failover), C(fence), C(reprotect) and C(handover), why, recorded in the job's history.
    type: str
  epoch:
    description:
      - For C(adopt), the job's epoch after the failover (RV(epoch) of C(failover)).
      - For C(reprotect), the job's epoch as the node protects it (the highest its replicas record).
    type: int
  journal_dir:
    description: For C(adopt), the journal directory of this host.
    type: path
    default: /var/lib/gpuckpt/journal
attributes:
  check_mode:
    details: C(list) reads only. C(verify) and C(failover) read the images and report what they would do, and mark
      nothing. C(failover) raises no epoch. C(fence), C(adopt) and C(reprotect) report what they would record.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
notes:
  - Failing over twice, or onto the host that already owns the job, is refused.
  - Nothing outside C(<root>/<job>/) is touched, no symlink is followed, and an image directory is removed (by
    retention, at a commit) only when a receiver created it for that image.
"""

EXAMPLES = r"""
- name: The images of job train-1 on this replica
  gpuckpt.fleet.gpu_replica:
    root: /var/lib/gpuckpt/replicas
    job: train-1
  register: replica

- name: Check one image again, byte for byte
  gpuckpt.fleet.gpu_replica:
    root: /var/lib/gpuckpt/replicas
    job: train-1
    state: verify
    image_id: "{{ replica.images[0].id }}"

- name: Fail train-1 over from gpu-node-1 to gpu-node-2 with the newest image that verifies
  gpuckpt.fleet.gpu_replica:
    root: /var/lib/gpuckpt/replicas
    job: train-1
    state: failover
    lost_node: gpu-node-1
    target: gpu-node-2
    reason: "gpu-node-1 powered off by its BMC"
  register: moved

- name: On the job's other replicas, fence gpu-node-1's copy too
  gpuckpt.fleet.gpu_replica:
    root: /var/lib/gpuckpt/replicas
    job: train-1
    state: fence
    lost_node: gpu-node-1
    target: gpu-node-2
    image_id: "{{ moved.image_id }}"

- name: On gpu-node-2, record that it runs train-1 now
  gpuckpt.fleet.gpu_replica:
    job: train-1
    state: adopt
    epoch: "{{ moved.epoch }}"
    lost_node: gpu-node-1
    node: gpu-node-2
    image_id: "{{ moved.image_id }}"

- name: train-1 came back to gpu-node-1 at epoch 3; this replica, which missed a failover, records it
  gpuckpt.fleet.gpu_replica:
    root: /var/lib/gpuckpt/replicas
    job: train-1
    state: reprotect
    node: gpu-node-1
    epoch: 3
    reason: "protected again on gpu-node-1"
"""

RETURN = r"""
record:
  description:
    - The job's record on this replica (null when there is none) after the action.
    - C(epoch) (int), C(owner) (the node that runs the job), C(history) (each C(adopted), C(failover) or
      C(reprotected) with C(epoch), C(owner), C(from), C(at), C(image_id) and C(reason)).
  returned: for list, verify, failover, fence and reprotect
  type: dict
  sample: {"job": "train-1", "epoch": 2, "owner": "gpu-node-2", "history": []}
images:
  description:
    - The job's images on this replica, newest first. Each has C(id), C(path), C(checkpoint_at) (ISO 8601, UTC),
      C(created), C(bytes), C(verified), C(corrupt) (why a later verification failed, or null), C(committed),
      C(complete) (its manifest is there), C(epoch) and C(node) (of the push), C(progress) and C(stall_s) (what the
      node reported at its commit), and C(facts) (from its manifest, for a restorability check; null while incomplete).
  returned: for list, verify, failover, fence and reprotect
  type: list
  elements: dict
verified:
  description: For C(verify), whether the image verified.
  returned: for verify
  type: bool
reason:
  description: For C(verify), why the image did not verify (null when it did).
  returned: for verify
  type: str
image_id:
  description: For C(failover), the image the job was handed over with.
  returned: for failover
  type: str
image_path:
  description: For C(failover), that image's directory on this host.
  returned: for failover
  type: str
epoch:
  description:
    - For C(failover), the job's new epoch (null in check mode).
    - For C(fence), the job's epoch on this replica afterwards (in check mode, what it would be).
    - For C(adopt), the epoch recorded.
    - For C(reprotect), the job's epoch on this replica afterwards (in check mode, what it would be).
  returned: for failover, fence, adopt, reprotect and handover
  type: int
skipped_images:
  description: For C(failover), the candidates that did not verify, each with C(id) and C(reason), in the order tried.
  returned: for failover
  type: list
  elements: dict
adopted:
  description: For C(adopt), what was recorded (C(job), C(epoch), C(owner), C(from), C(image_id), C(at)).
  returned: for adopt
  type: dict
"""

import platform

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica_images, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import check_path_arg
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import run_module


def replica_step(p, check_mode):
    """The module's result for its state (see the documentation)."""
    if p["state"] == "adopt":
        owner = p["node"] or p["target"] or platform.node()
        doc = replica_owner.adopt(p["journal_dir"], p["job"], p["epoch"], owner, p["lost_node"], p["image_id"],
                                  write=not check_mode)
        return dict(changed=not check_mode, adopted=doc, epoch=doc["epoch"],
                    msg="%s runs job %s from epoch %s on" % (owner, p["job"], doc["epoch"]))
    out, changed = {}, False
    if p["state"] == "verify":
        ok, why, changed = replica_images.reverify(p["root"], p["job"], p["image_id"], write=not check_mode)
        out.update(verified=ok, reason=why, msg="image %s %s" % (p["image_id"], "verifies" if ok else "does not verify: %s" % why))
    elif p["state"] == "failover":
        res = replica_owner.failover_verified(p["root"], p["job"], p["lost_node"], p["target"], p["candidates"],
                                              p["reason"], write=not check_mode)
        changed = not check_mode
        out.update(image_id=res["image_id"], image_path=res["image_path"], epoch=res["epoch"],
                   skipped_images=res["skipped"],
                   msg="job %s %s from %s to %s with image %s (%d skipped)" % (
                       p["job"], "would fail over" if check_mode else "failed over", p["lost_node"], p["target"],
                       res["image_id"], len(res["skipped"])))
    elif p["state"] == "reprotect":
        res = replica_owner.reprotect(p["root"], p["job"], p["epoch"], p["node"], p["reason"], write=not check_mode)
        changed = res["changed"]
        out.update(epoch=res["record"]["epoch"], msg="job %s on this replica: %s at epoch %s%s" % (
            p["job"], p["node"], res["record"]["epoch"], "" if changed else " already"))
    elif p["state"] == "handover":
        res = replica_owner.handover(p["root"], p["job"], p["node"], p["target"], p["reason"], write=not check_mode)
        changed = res["changed"]
        record = res["record"]
        out.update(epoch=record["epoch"] if record else None, msg=(
            "job %s has no record on this replica" % p["job"] if record is None else
            "job %s on this replica: %s at epoch %s%s" % (p["job"], record["owner"], record["epoch"],
                                                          "" if changed else " already")))
    elif p["state"] == "fence":
        record = replica_owner.failover(p["root"], p["job"], p["lost_node"], p["target"], p["image_id"], p["reason"],
                                        write=not check_mode)
        changed = not check_mode
        out.update(epoch=record["epoch"], msg="job %s on this replica: %s at epoch %s; %s is fenced" % (
            p["job"], p["target"], record["epoch"], p["lost_node"]))
    listed = replica_images.list_images(p["root"], p["job"])
    out.setdefault("msg", "%d image(s) of job %s, %d verified" % (len(listed["images"]), p["job"],
                                                                  sum(1 for i in listed["images"] if i["verified"])))
    return dict(out, changed=changed, record=listed["record"], images=listed["images"])


def main():
    module = AnsibleModule(argument_spec=dict(
        root=dict(type="path"),
        job=dict(type="str", required=True),
        state=dict(type="str", default="list",
                   choices=["list", "verify", "failover", "fence", "adopt", "reprotect", "handover"]),
        image_id=dict(type="str"),
        lost_node=dict(type="str"),
        target=dict(type="str"),
        node=dict(type="str"),
        candidates=dict(type="list", elements="str"),
        reason=dict(type="str"),
        epoch=dict(type="int"),
        journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
    ), required_if=[("state", "list", ["root"]), ("state", "verify", ["root", "image_id"]),
                    ("state", "failover", ["root", "lost_node", "target"]), ("state", "fence", ["root", "lost_node", "target"]),
                    ("state", "adopt", ["epoch"]), ("state", "reprotect", ["root", "node", "epoch"]),
                    ("state", "handover", ["root", "node", "target"])],
        supports_check_mode=True)
    p = module.params
    check_path_arg(module, "root", p["root"])
    check_path_arg(module, "journal_dir", p["journal_dir"])
    run_module(module, replica_step, p, module.check_mode)


if __name__ == "__main__":
    main()
