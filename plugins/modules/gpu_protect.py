#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_protect
short_description: A node's protected jobs - their checkpoints, a checkpoint now, and the fence of a failed-over copy
version_added: "0.6.0"
description:
  - Runs on a node where the role gpuckpt.fleet.protect protects jobs. Each job is checkpointed every interval with
    the job left running, and each image is pushed to the job's replica hosts while it is written. The role installs
    a timer per job that does this. This module reads and acts on the same jobs.
  - Every state first runs the fence check of each job. It asks the job's replicas whether this node still owns
    the job. When a replica says the job was failed over to another host (its epoch was raised), the copy on this
    node is stale. Its whole process tree (a pid file's job) or its container is stopped, its timer disabled, and
    C(fenced.json) written in the job's state. From then on every command on the job says so and does nothing else.
    A replica that does not answer is no fence.
  - C(status) returns each job's last checkpoints, the job's stall per checkpoint (from the CUDA lock to the unlock
    after the dump), what that stall costs at the job's interval and at 5, 15 and 60 minutes, the images each
    replica held verified after its last commit, and whether it is fenced.
  - C(checkpoint_now) checkpoints one job at once, outside its schedule (a spot instance's notice, a GPU reporting
    Xid errors). It returns, from the job's recorded checkpoints, how long it was expected to take and whether
    that fits in O(within). Then it returns whether it did. A checkpoint of the job that is already running is
    waited for, up to O(within) seconds.
  - C(fence_check) runs the fence check alone (recover.yml and drain.yml run it on the node first).
  - C(give_back) gives back what a checkpoint run that died (its tree SIGKILLed, an OOM kill, systemd's stop
    timeout) left frozen - the driver's restore and unlock, the runtime's resume, its partial image removed. Every
    other state does this first too, and so does gpuckpt.fleet.cuda_process_facts.
  - C(carry_plan) and C(pid_file) carry a protected job's protection along when a migration moves it (the playbooks'
    C(tasks/carry_protection.yml)). C(carry_plan), on the source, says whether migration O(migration_id)'s workload
    is a protected job of this host and what the target needs to protect it. C(pid_file), on the target, writes the
    migration's restored root pid into O(pid_file).
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  state:
    description: What to do (see the description).
    type: str
    choices: [status, checkpoint_now, fence_check, give_back, carry_plan, pid_file]
    default: status
  protect_dir:
    description: Where the role wrote the jobs' configs (its C(gpuckpt_protect_dir)).
    type: path
    default: /etc/gpuckpt/protect
  job:
    description:
      - The protected job. Required for C(checkpoint_now).
      - Default, for C(status) and C(fence_check), is every job configured in O(protect_dir).
    type: str
  within:
    description:
      - For C(checkpoint_now), the seconds left before the node goes (a spot notice's 30 to 120 s).
      - The result says whether the checkpoint was expected to finish within it, and whether it did.
      - A positive, finite number; zero, a negative number, C(nan) or C(inf) is refused before anything runs.
    type: float
  migration_id:
    description: For C(carry_plan) and C(pid_file), the migration that moved the job (its journals on this host).
    type: str
  journal_dir:
    description: For C(carry_plan) and C(pid_file), where this host keeps the migrations' journals.
    type: path
    default: /var/lib/gpuckpt/journal
  target:
    description: For C(carry_plan), the inventory name of the host the migration moved the workload to.
    type: str
  pid_file:
    description: For C(pid_file), the job's pid file on this host (C(pid_file) in the C(spec) of RV(carry)).
    type: path
notes:
  - The job's config carries the environment its checkpoints run with (the C(gpuckpt_environment) of the node), which
    this module applies before it loads the driver.
requirements:
  - "Root on the node, ssh from the node to the replicas (the node's root key, as the role's timer uses it)."
attributes:
  check_mode:
    support: full
    details: >-
      It asks the replicas and reports. It stops no fenced copy (RV(fence) says what it would stop) and takes no
      checkpoint (RV(expected) says what it would expect).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
seealso:
  - module: gpuckpt.fleet.gpu_replica
"""

EXAMPLES = r"""
- name: How are the protected jobs of this node doing?
  gpuckpt.fleet.gpu_protect:
    state: status
  register: protected

- name: A spot notice came with 90 s left - checkpoint the job now
  gpuckpt.fleet.gpu_protect:
    state: checkpoint_now
    job: train-llama
    within: 90

- name: Stop a copy that was failed over elsewhere, before anything else runs here
  gpuckpt.fleet.gpu_protect:
    state: fence_check
    protect_dir: /etc/gpuckpt/protect
"""

RETURN = r"""
fence:
  description:
    - The fence check of each job - C(job), C(fenced), and when fenced C(reason) (the replica's words, with the
      job's epoch there), C(replica), C(replica_epoch), C(owner), C(stopped) (the pids stopped, or what was found),
      C(timer), C(already) (fenced before this run).
    - C(unreachable) names the replicas that did not answer (no fence).
  returned: always
  type: list
  elements: dict
fenced:
  description: The jobs that are fenced on this node.
  returned: always
  type: list
  elements: str
jobs:
  description:
    - For C(status), each job's summary - C(workload), C(interval_s), C(keep), C(epoch), C(replicas),
      C(last_runs) (the history lines of its last 5 attempts), C(last_ok), C(stall_s) (C(last), C(max), C(mean),
      C(runs)), C(overhead) (per interval - C(interval_s), C(configured), C(fraction) of the job's time stalled at
      the mean stall, C(worst_fraction) at the largest, C(percent)), C(expected_s), C(verified_images) (per replica,
      as its last commit said), C(running), C(fenced).
  returned: when O(state=status)
  type: list
  elements: dict
expected:
  description:
    - For C(checkpoint_now), what was expected before it started - C(expected_s) (the longest of the job's last 5
      successful checkpoints, null without one), C(within_s), C(expected_to_finish) (null when unknown).
  returned: when O(state=checkpoint_now)
  type: dict
given_back:
  description:
    - For C(give_back), per job - C(job), C(changed), C(given_back) (per record of a dead run - C(id), C(phase),
      C(changed), C(given_back) (the pids that run again), C(msg), or C(error)), C(failed) (the records that could not
      be given back, tried again by the next operation).
  returned: when O(state=give_back)
  type: list
  elements: dict
carry:
  description:
    - For C(carry_plan) - C(job) (null when the workload is no protected job here), C(carry) (whether its protection
      can follow it), C(why) (when not), C(spec) (the job as the role gpuckpt.fleet.protect takes it), C(replicas)
      (each is told the new owner), C(target_replicas) (those the target pushes to), C(passed_over) (why each job
      whose pid file names the workload's pid, or that is fenced here, is not it; a pid is matched by the process's
      identity, never bare), C(systemd).
  returned: when O(state=carry_plan)
  type: dict
pid:
  description: For C(pid_file), the root pid written.
  returned: when O(state=pid_file)
  type: int
checkpoint:
  description:
    - For C(checkpoint_now), the attempt as the job's history records it - C(result) (ok, failed, skipped, fenced),
      C(reason), C(image_id), C(stall_s), C(duration_s), C(bytes), C(replicas) (per replica, C(verified) or why
      not), C(retention) (per replica, the images C(kept) and C(removed)), C(progress) (C(before) and C(after), the
      job's own), C(finished_within).
  returned: when O(state=checkpoint_now) and not in check mode
  type: dict
"""

import math

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect, protect_carry, protect_history


def checkpoint_now(p, check_mode):
    """C(checkpoint_now): the expectation, then (not in check mode) the checkpoint. (failed, the result)."""
    expected = []
    if check_mode:
        cfg = protect.load_config(p["protect_dir"], p["job"])
        folder = protect_history.state_dir(p["protect_dir"], p["job"])
        fence = protect.check_fence(cfg, folder, act=False)
        exp = dict(protect_history.expectation(protect_history.read_history(folder), p["within"]), job=p["job"])
        return False, dict(changed=False, fence=[fence], fenced=[p["job"]] if fence["fenced"] else [], expected=exp,
                           msg="check mode: would checkpoint job %s now" % p["job"])
    line, code = protect.run(p["protect_dir"], p["job"], trigger="now", within=p["within"], announce=expected.append)
    fenced = line.get("result") == "fenced"
    out = dict(changed=line.get("result") in ("ok", "failed") or fenced, checkpoint=line,
               expected=expected[0] if expected else None, fence=[line] if fenced else [],
               fenced=[p["job"]] if fenced else [])
    if code != protect.EXIT_OK:
        out["msg"] = "checkpoint of job %s: %s: %s" % (p["job"], line.get("result"), line.get("reason"))
        return True, out
    why = " (%s)" % line["reason"] if line.get("reason") else ""
    out["msg"] = "checkpoint of job %s: %s%s" % (p["job"], line.get("result"), why)
    return False, out


def _give_back(p, act):
    done = protect.give_back_all(p["protect_dir"], p["job"], act=act)
    failed = [d for d in done if d.get("failed") or d.get("error")]
    out = dict(changed=any(d["changed"] for d in done), given_back=done,
               msg="; ".join(r.get("msg") or r.get("error") or "" for d in done for r in d["given_back"])
               or "nothing was left frozen here")
    return bool(failed), out


def _carry_plan(p, check_mode):
    del check_mode  # (reads only)
    carry = protect_carry.carry_plan(p["protect_dir"], p["journal_dir"], p["migration_id"], p["target"])
    return False, dict(changed=False, carry=carry,
                       msg=carry["why"] or "job %s's protection goes to %s" % (carry["job"], p["target"]))


def _pid_file(p, check_mode):
    changed, pid = (False, None) if check_mode else protect_carry.write_pid_file(
        p["pid_file"], p["journal_dir"], p["migration_id"])
    return False, dict(changed=changed, pid=pid, msg="%s names pid %s" % (p["pid_file"], pid))


def _status(p, act):
    jobs = protect.status_all(p["protect_dir"], p["job"], act=act)
    fence = [dict(j["fenced"], job=j["job"]) for j in jobs if j.get("fenced")]
    return False, dict(changed=any(f.get("changed") for f in fence), jobs=jobs, fence=fence,
                       fenced=[f["job"] for f in fence])


def _fence_check(p, act):
    fence = protect.fence_check_all(p["protect_dir"], p["job"], act=act)
    fenced = [f["job"] for f in fence if f.get("fenced")]
    return False, dict(changed=any(f.get("changed") for f in fence), fence=fence, fenced=fenced,
                       msg="fenced on this node: %s" % ", ".join(fenced) if fenced else "no job is fenced here")


# Each state: a function of the options and whether to act (check mode does not), returning (failed, result).
STATES = {
    "checkpoint_now": lambda p, act: checkpoint_now(p, not act),
    "give_back": _give_back,
    "carry_plan": lambda p, act: _carry_plan(p, not act),
    "pid_file": lambda p, act: _pid_file(p, not act),
    "status": _status,
    "fence_check": _fence_check,
}


def main():
    module = AnsibleModule(argument_spec=dict(
        state=dict(type="str", default="status", choices=["status", "checkpoint_now", "fence_check", "give_back", "carry_plan", "pid_file"]),
        protect_dir=dict(type="path", default=protect.DEFAULT_PROTECT_DIR),
        job=dict(type="str"),
        within=dict(type="float"),
        migration_id=dict(type="str"),
        journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
        target=dict(type="str"),
        pid_file=dict(type="path"),
    ), required_if=[("state", "checkpoint_now", ("job",)), ("state", "carry_plan", ("migration_id", "target")),
                    ("state", "pid_file", ("migration_id", "pid_file"))], supports_check_mode=True)
    p = module.params
    if p["within"] is not None and not (math.isfinite(p["within"]) and p["within"] > 0):
        module.fail_json(msg="within must be a positive number of seconds (a spot notice's 30 to 120, say), not %s; "
                             "nothing was checkpointed" % p["within"], stage="preflight")
    try:
        failed, out = STATES[p["state"]](p, not module.check_mode)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    if failed:
        module.fail_json(**out)
    module.exit_json(**out)


if __name__ == "__main__":
    main()
