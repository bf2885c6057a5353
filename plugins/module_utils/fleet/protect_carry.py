# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A protected job that a migration moves takes its protection along (issue 43, 7).

A job drained or migrated off its node while its replicas still named that node as its owner was protected
nowhere: its timer stayed on the old node (checkpointing a pid that was no longer the job), and a failover of the
old node restored an older image while the job ran on (two copies). So once a migration has committed (the
target runs the workload), finish_or_roll_back.yml carries it (playbooks/tasks/carry_protection.yml):

1. ``carry_plan`` on the source: whether the migrated workload (the source journal's root process, by its
   identity: never a bare pid, see find_job; or its container) is one of the source's protected jobs (not one
   fenced here), and what the target needs to protect it (the role's job spec, the
   replicas, the source's systemd);
2. each replica's record handed to the target (replica/replica_owner.handover: owner the target, epoch + 1), so that
   a copy left on the source is fenced and a failover of the source is refused;
3. the job's pid file written on the target from the migration's restored root pid (``write_pid_file``);
4. the job's timer and config removed on the source (the role's absent.yml);
5. the job protected on the target (the role, in the playbook's last play), with the replicas that are not the
   target itself.

Every step can run again: a re-run (recover.yml) finds the record handed over, the pid file written, the config
gone.
"""
from __future__ import annotations

import os

from ..core.errors import GpuCkptError, InvalidTarget
from ..core.journal import Journal
from . import protect_history as hist
from .protect import ENGINE_OPTIONS
from .protect_fence import fence_state, identity_is_the_job
from .protect_job import job_names, load_config, read_pid

# What of a job's checkpoint options is the job's own, carried to the target: the rest of its config's "checkpoint"
# is the source host's runtime options (runc_root, criu_path...), which the role takes from the target's inventory.
CARRIED_OPTIONS = tuple(k for k in ENGINE_OPTIONS if k != "libcuda_path")


def _migrated_workload(journal_dir, migration_id):
    """(root pid, its identity, container) of what migration ``migration_id`` checkpointed on this host, from its
    source journal."""
    doc = Journal(journal_dir, migration_id, "source").read() or {}  # (none: nothing of it to carry)
    pids = doc.get("pids") or []
    pid = int(pids[0]) if pids else None
    ident = (doc.get("identities") or {}).get(str(pid)) if pid is not None else None
    return pid, ident, doc.get("container")


def find_job(protect_dir, pid=None, container=None, ident=None):
    """(the config of the protected job whose workload is ``pid`` or ``container``, or None; why each other job
    that named it was passed over).

    A pid is never matched bare: pids are reused (a job that ended, or that was failed over, leaves a pid file
    naming a pid that a later workload may get; the loopback tests start every workload at the same pid), so the
    process ``ident`` (its identity, as the migration's journal recorded it before it moved it away) must be the
    job's by the runner's own rule (protect_fence.identity_is_the_job: the identity the job's last checkpoint
    recorded, else a start no later than the pid file was written). A job fenced on this host is passed over too:
    its copy here was stopped, the job runs elsewhere. Raises InvalidTarget when two jobs claim the workload."""
    found, passed = [], []
    for name in job_names(protect_dir):
        try:
            cfg = load_config(protect_dir, name)
        except GpuCkptError:
            continue
        if container:
            if cfg.get("container") != container:
                continue
        elif pid is None or not cfg.get("pid_file") or read_pid(cfg["pid_file"]) != pid:
            continue
        folder = hist.state_dir(protect_dir, cfg["job"])
        fenced = fence_state(cfg, folder)
        if fenced:
            passed.append("job %s: fenced on this host since %s (%s)" % (cfg["job"], fenced.get("at"),
                                                                         fenced.get("reason")))
            continue
        if not container:
            if not ident:
                passed.append("job %s: its pid file names pid %d, but the migration recorded no identity of it"
                              % (cfg["job"], pid))
                continue
            if not identity_is_the_job(ident, cfg["pid_file"], hist.read_state(folder, hist.IDENTITY)):
                passed.append("job %s: its pid file names pid %d, but the process moved is not the job's (another "
                              "process that got its pid)" % (cfg["job"], pid))
                continue
        found.append(cfg)
    if len(found) > 1:
        raise InvalidTarget("the migrated workload (%s) is claimed by jobs %s: protect it again where it runs"
                            % (container or "pid %s" % pid, ", ".join(c["job"] for c in found)), stage="preflight")
    return (found[0] if found else None), passed


def job_spec(cfg):
    """The role's job spec (gpuckpt_protected_jobs' entry) of a job's config, without the source host's runtime
    options."""
    spec = {"name": cfg["job"], "interval": cfg.get("interval_s"), "keep": cfg.get("keep")}
    if cfg.get("pid_file"):
        spec["pid_file"] = cfg["pid_file"]
    else:
        spec.update(container=cfg["container"], runtime=cfg["runtime"])
    for key in ("progress_file", "progress_key"):
        if cfg.get(key):
            spec[key] = cfg[key]
    own = {k: v for k, v in (cfg.get("checkpoint") or {}).items() if k in CARRIED_OPTIONS and v is not None}
    if own:
        spec["checkpoint"] = own
    return {k: v for k, v in spec.items() if v is not None}


def carry_plan(protect_dir, journal_dir, migration_id, target):
    """What carrying the protection of migration ``migration_id``'s workload to ``target`` takes (see the module doc):
    {"job" (None when the workload is no protected job here), "carry", "why", "spec", "replicas" (every replica of
    the job: each is told the new owner), "passed_over" (why each job that named the workload is not it),
    "target_replicas" (those the target pushes to: all but itself),
    "systemd" (whether this host runs the job's timer under systemd)}."""
    pid, ident, container = _migrated_workload(journal_dir, migration_id)
    cfg, passed = find_job(protect_dir, pid=pid, container=container, ident=ident)
    out = {"job": None, "carry": False, "why": None, "spec": None, "replicas": [], "target_replicas": [],
           "passed_over": passed, "systemd": os.path.isdir("/run/systemd/system")}
    if cfg is None:
        return dict(out, why="the migrated workload is no protected job of this host"
                             + ("" if not passed else " (passed over: %s)" % "; ".join(passed)))
    names = [r["name"] for r in cfg["replicas"]]
    out.update(job=cfg["job"], replicas=names, target_replicas=[n for n in names if n != target])
    if cfg.get("pod"):
        return dict(out, why="job %s is a pod: its protection is not carried by a migration yet; protect it again "
                             "where it runs now (protect.yml)" % cfg["job"])
    if not out["target_replicas"]:
        return dict(out, why="job %s's only replica is %s, where it runs now: give it another replica and protect it "
                             "there (protect.yml)" % (cfg["job"], target))
    return dict(out, carry=True, spec=job_spec(cfg))


def write_pid_file(pid_file, journal_dir, migration_id):
    """Write the root pid that migration ``migration_id`` restored on this host into ``pid_file`` (atomically; a
    symlink there is replaced, never followed). Returns (changed, pid)."""
    doc = Journal(journal_dir, migration_id, "target").read() or {}
    pids = doc.get("pids") or []
    if doc.get("phase") not in ("restored", "committed") or not pids:
        raise InvalidTarget("migration %s has restored nothing on this host (phase %s): no pid file written"
                            % (migration_id, doc.get("phase")), stage="preflight")
    pid = int(pids[0])
    if not os.path.isabs(pid_file):
        raise InvalidTarget("pid_file %r must be an absolute path" % (pid_file,), stage="preflight")
    if not os.path.islink(pid_file) and read_pid(pid_file) == pid:
        # (the same pid again, as CRIU restores a bare tree; still written now: the runner takes a pid file for the
        # job's only while it is younger than the job's process, which the restore started anew)
        os.utime(pid_file)
        return False, pid
    parent = os.path.dirname(pid_file)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, ".%s.gpuckpt-%d" % (os.path.basename(pid_file), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, b"%d\n" % pid)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, pid_file)
    return True, pid
