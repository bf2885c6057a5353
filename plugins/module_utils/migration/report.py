# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What one migration showed, from the results of its module calls: the summary's lines (downtime, each stage's
seconds, the transfer) and the outcome a drain reads (where the workload runs, its downtime, the image's size and
the link's throughput). Pure: the results in, plain values out (the ``migration_summary`` and ``migration_outcome``
filters)."""
from __future__ import annotations

import re


def _f(value):
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def as_bool(value):
    """A flag as Ansible's ``bool`` filter reads it (a string from ``-e name=yes``, or a boolean)."""
    if isinstance(value, str):
        return value.strip().lower() in ("y", "yes", "on", "1", "true", "t")
    return bool(value)


def downtime(ckpt, restore):
    """Seconds from the freeze on the source until the copy ran on the target; None when either is unknown."""
    if (restore or {}).get("resumed_at") is None or (ckpt or {}).get("frozen_at") is None:
        return None
    return _f(restore["resumed_at"]) - _f(ckpt["frozen_at"])


def throughput(ckpt, sync):
    """Bytes per second this move showed of the link to its target (a drain's deadline estimates from it): the
    transfer's bytes over its seconds, or, for a push during the dump, the image over the dump and the push's tail.
    None when it showed nothing."""
    ckpt, sync = ckpt or {}, sync or {}
    if _f(sync.get("seconds")) > 0 and int(sync.get("bytes_transferred") or 0) > 0:
        return round(_f(sync["bytes_transferred"]) / _f(sync["seconds"]), 0)
    timings = ckpt.get("timings") or {}
    spent = _f(timings.get("runtime_dump")) + _f(timings.get("push"))
    if as_bool((ckpt.get("push") or {}).get("pushed")) and int(ckpt.get("image_bytes") or 0) > 0 and spent > 0:
        return round(_f(ckpt["image_bytes"]) / spent, 0)
    return None


def _transfer_line(ckpt, sync, human):
    push = ckpt.get("push") or {}
    if as_bool(push.get("pushed")):
        return ("Transfer: %s pushed over %s ssh stream(s) while the image was written, %s of it during the dump; "
                "%.2f s after the manifest" % (human(push.get("bytes")), push.get("streams"),
                                               human(push.get("bytes_sent_during_dump")),
                                               _f((ckpt.get("timings") or {}).get("push"))))
    sent, seconds = human(sync.get("bytes_transferred") or 0), _f(sync.get("seconds"))
    line = "Transfer: %s in %.2f s (%s attempt(s))" % (sent, seconds, sync.get("attempts") or 0)
    if "error" in push:
        line += " after the push during the dump failed: %s" % push["error"]
    return line


def summary(ckpt, restore, sync, migration_id, workload, source, target, pod=None, target_pod=None, human=str):
    """The lines of a migration's summary. ``ckpt``, ``restore``, ``sync``: the results of gpu_checkpoint,
    gpu_restore and gpu_image_sync; ``pod``: a pod migration's source pod ({namespace, name}); ``human``: how a
    byte count is written (Ansible's human_readable)."""
    ckpt, restore, sync = ckpt or {}, restore or {}, sync or {}
    ck, rs = ckpt.get("timings") or {}, restore.get("timings") or {}
    where = (", where it runs as pod %s/%s" % (pod["namespace"], target_pod)) if pod else ""
    return [
        "Migration %s: %s moved from %s to %s (pids there %s)%s" % (migration_id, workload, source, target,
                                                                    restore.get("pids"), where),
        "Downtime (frozen on the source until running on the target): %.2f s" % (downtime(ckpt, restore) or 0.0),
        "Checkpoint: lock %.3f s, GPU->RAM %.2f s, CRIU dump %.2f s, checksums %.2f s" % (
            _f(ck.get("cuda_lock")), _f(ck.get("cuda_checkpoint")), _f(ck.get("runtime_dump")), _f(ck.get("checksum"))),
        _transfer_line(ckpt, sync, human),
        "Restore: verify %.2f s, CRIU restore %.2f s, RAM->GPU %.2f s, unlock %.3f s" % (
            _f(rs.get("verify")), _f(rs.get("runtime_restore")), _f(rs.get("cuda_restore")), _f(rs.get("cuda_unlock"))),
    ]


def outcome(migration_id, source, target, committed=None, ckpt=None, restore=None, sync=None, target_says=None,
            target_answered=True, held=False, rewind=""):
    """Where the workload runs after this migration (``gpuckpt_move_outcome``): status moved, stayed (settled
    either way) or none (no migration with this id had begun), its downtime and image size, whether it settled
    and is held, what an accepted rewind undid, the link's throughput, and why it stayed."""
    moved = committed is not None and as_bool(committed)
    wait = downtime(ckpt, restore)
    return {
        "migration_id": migration_id,
        "status": "moved" if moved else "stayed" if committed is not None else "none",
        "where": target if moved else source,
        "downtime_s": round(wait, 2) if wait is not None else None,
        "image_bytes": (ckpt or {}).get("image_bytes"),
        "settled": as_bool(target_answered) and not as_bool(held),
        "held": as_bool(held),
        "rewind": rewind or "",
        "transfer_bytes_s": throughput(ckpt, sync),
        "reason": "" if moved else (target_says if target_says is not None else "no migration with this id had begun"),
    }


def after_failure(migration_id, source, target, error, committed=False, held=False, rewind="", released=None,
                  source_pod_deleted=None):
    """How a migration ended after a failure on its way, once settled (migrate_one.yml's rescue): ``fails`` and
    ``msg``. Rolled back (the workload runs on the source, and what an accepted rewind undid), its source held (the
    settlement's error, which says what holds it and what to run), committed with its source not released (the
    release, or a pod's deletion, failed), or committed all the same (``fails`` false: the error was on the way)."""
    if not as_bool(committed):
        if as_bool(held):
            return {"fails": True, "msg": error}
        return {"fails": True, "msg": "Migration %s failed and was rolled back; the workload runs on %s%s. Cause: %s" % (
            migration_id, source, ("; " + rewind) if rewind else "", error)}
    if as_bool((released or {}).get("failed")) or as_bool((source_pod_deleted or {}).get("failed")):
        return {"fails": True, "msg": "Migration %s committed: the workload runs on %s; its stopped source on %s was not "
                                      "released (%s). Run recover.yml to release it." % (migration_id, target, source, error)}
    return {"fails": False, "msg": "Migration %s committed: the workload runs on %s. On the way: %s" % (
        migration_id, target, error)}


def _done(result):
    """A module result that ran and returned its journal (a skipped task, or a call that raised, has none)."""
    return isinstance(result, dict) and not result.get("skipped") and isinstance(result.get("journal"), dict)


def _journal_of(result):
    journal = result.get("journal") if isinstance(result, dict) else None
    return journal if isinstance(journal, dict) else {}


def after_settlement(migration_id, source, target, committed=False, target_answered=False, target_says="",
                     lost=None, resumed=None, source_after=None, target_lost=False):
    """What the source does once a migration is settled (finish_or_roll_back.yml), from the results of its calls:
    ``resumed`` (the source's rollback, maybe skipped), ``source_after`` (the source's journal read when it did not
    resume), ``lost`` (the lost_copy filter's record of the target's copy). Returns ``held`` (the source stays
    stopped: a resume could start a second copy or rewind the job), ``held_msg`` (why, and what to run), ``rewind``
    (what an accepted resume undid) and ``msg`` (where the workload runs now)."""
    lost = lost if isinstance(lost, dict) else {}
    committed, target_answered = as_bool(committed), as_bool(target_answered)
    did_resume = _done(resumed)
    after_journal = _journal_of(source_after)
    held = (not committed and not did_resume and bool(after_journal.get("exists"))
            and after_journal.get("phase", "") not in ("resumed", "rolled_back", "committed"))
    rewind = _rewind(source, target, lost, target_answered, as_bool(target_lost)) if did_resume else ""
    if held:
        held_msg = _held_msg(migration_id, source, target, lost, target_answered, target_says, resumed)
        return {"held": True, "held_msg": held_msg, "rewind": rewind, "msg": held_msg}
    return {"held": False, "held_msg": "", "rewind": rewind,
            "msg": _where(migration_id, source, target, committed, target_answered, target_says, rewind,
                          _journal_of(resumed) if did_resume else {})}


def _rewind(source, target, lost, target_answered, target_lost):
    """What a resume of the source undid: a copy of the target that ran and is gone (the operator accepted it), or
    a target declared lost that may have run one."""
    if lost.get("lost"):
        return "the job was rolled back to its freeze on %s (gpuckpt_accept_rewind): %s%s; what it did there is done " \
               "again" % (source, re.sub(r": the only state left.*$", "", lost.get("note") or ""),
                          ", for %s s at most" % lost["ran_s"] if lost.get("ran_s") is not None else "")
    if not target_answered and target_lost:
        return "%s was declared lost (gpuckpt_target_lost): if a copy of the job ran there before, what it did after " \
               "the freeze is done again" % target
    return ""


def _held_msg(migration_id, source, target, lost, target_answered, target_says, resumed):
    """Why the source stays held, and what to run."""
    command = "ansible-playbook gpuckpt.fleet.recover -e source=%s -e target=%s -e migration_id=%s" % (
        source, target, migration_id)
    if lost.get("lost"):
        return "Migration %s: the workload is HELD on %s, not rewound: %s. To accept that, run %s " \
               "-e gpuckpt_accept_rewind=true (or drain.yml again with it)" % (
                   migration_id, source, lost.get("note"), command)
    if not target_answered:
        return "Migration %s: the workload is HELD on %s (stopped since its freeze): %s could not be asked (%s) " \
               "after the image may have reached it, and resuming %s could start a second copy. Run %s (or " \
               "drain.yml again) once %s answers; if it is gone for good, run it with -e gpuckpt_target_lost=true" \
               % (migration_id, source, target, target_says, source, command, target)
    said = resumed.get("msg", "it was not resumed") if isinstance(resumed, dict) else "it was not resumed"
    return "Migration %s: the workload is HELD on %s: %s. Run %s" % (migration_id, source, said, command)


def _where(migration_id, source, target, committed, target_answered, target_says, rewind, journal):
    """Where the workload runs once settled, and what happened to the source's image of a rollback."""
    if committed:
        return "Migration %s: committed: the workload runs on %s" % (migration_id, target)
    return "Migration %s: rolled back: the workload runs on %s%s%s%s%s" % (
        migration_id, source,
        "" if target_answered else " (%s could not be asked: %s; run recover.yml once it answers, to clean it)" % (
            target, target_says),
        "; " + rewind if rewind else "",
        "; its image %s was removed" % journal["image_removed"] if journal.get("image_removed") else "",
        "; its image is kept in %s" % journal["image_kept"] if journal.get("image_kept") else "")
