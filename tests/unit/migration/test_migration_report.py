"""migration/report.py: a migration's summary lines and its outcome, from its module calls' results."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.filter.migration_outcome import migration_outcome
from ansible_collections.gpuckpt.fleet.plugins.filter.migration_summary import migration_summary
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import report

CKPT = {"frozen_at": 100.0, "image_bytes": 4000, "push": {"pushed": False},
        "timings": {"cuda_lock": 0.0012, "cuda_checkpoint": 1.5, "runtime_dump": 2.0, "checksum": 0.25}}
RESTORE = {"resumed_at": 103.456, "pids": [11, 12],
           "timings": {"verify": 0.5, "runtime_restore": 1.0, "cuda_restore": 0.75, "cuda_unlock": 0.002}}
SYNC = {"bytes_transferred": 2048, "seconds": 2.0, "attempts": 1}


def test_the_summary_lines():
    lines = migration_summary(CKPT, RESTORE, sync=SYNC, migration_id="m-1", workload="pid 7", source="a", target="b")
    assert lines == [
        "Migration m-1: pid 7 moved from a to b (pids there [11, 12])",
        "Downtime (frozen on the source until running on the target): 3.46 s",
        "Checkpoint: lock 0.001 s, GPU->RAM 1.50 s, CRIU dump 2.00 s, checksums 0.25 s",
        "Transfer: 2.00 KB in 2.00 s (1 attempt(s))",
        "Restore: verify 0.50 s, CRIU restore 1.00 s, RAM->GPU 0.75 s, unlock 0.002 s",
    ]


def test_a_pod_and_a_push_are_said():
    ckpt = dict(CKPT, push={"pushed": True, "bytes": 1024, "streams": 2, "bytes_sent_during_dump": 512},
                timings=dict(CKPT["timings"], push=0.5))
    lines = report.summary(ckpt, RESTORE, {}, "m-1", "pod ns/p", "a", "b", pod={"namespace": "ns", "name": "p"},
                           target_pod="p-1", human=lambda n: "%dB" % n)
    assert lines[0].endswith(", where it runs as pod ns/p-1")
    assert lines[3] == ("Transfer: 1024B pushed over 2 ssh stream(s) while the image was written, 512B of it during "
                        "the dump; 0.50 s after the manifest")


def test_a_push_that_failed_is_said_after_the_transfer():
    ckpt = dict(CKPT, push={"pushed": False, "error": "cut"})
    assert report.summary(ckpt, RESTORE, SYNC, "m", "w", "a", "b")[3].endswith(
        "(1 attempt(s)) after the push during the dump failed: cut")


def test_a_move_that_committed():
    out = migration_outcome("m-1", source="a", target="b", committed=True, ckpt=CKPT, restore=RESTORE, sync=SYNC,
                            target_says="committed")
    assert out == {"migration_id": "m-1", "status": "moved", "where": "b", "downtime_s": 3.46, "image_bytes": 4000,
                   "settled": True, "held": False, "rewind": "", "transfer_bytes_s": 1024.0, "reason": ""}


def test_a_move_that_stayed_and_one_that_never_began():
    out = report.outcome("m-1", "a", "b", committed=False, target_says="cleaned", target_answered=False, held=True)
    assert (out["status"], out["where"], out["reason"], out["settled"], out["held"]) == ("stayed", "a", "cleaned",
                                                                                         False, True)
    assert out["downtime_s"] is None and out["transfer_bytes_s"] is None
    none = report.outcome("m-1", "a", "b")
    assert none["status"] == "none" and none["reason"] == "no migration with this id had begun"


def test_throughput_of_a_push_during_the_dump():
    ckpt = dict(CKPT, push={"pushed": True}, timings={"runtime_dump": 3.0, "push": 1.0})
    assert report.throughput(ckpt, {"skipped": True}) == 1000.0
    assert report.throughput(dict(ckpt, image_bytes=0), {}) is None
    assert report.throughput(CKPT, {"bytes_transferred": 0, "seconds": 1}) is None


def test_the_ending_after_a_failure_on_the_way():
    rolled = report.after_failure("m-1", "hosta", "hostb", "boom (task: Stage 1/3)", committed="False")
    assert rolled == {"fails": True, "msg": "Migration m-1 failed and was rolled back; the workload runs on hosta. "
                                            "Cause: boom (task: Stage 1/3)"}
    rewound = report.after_failure("m-1", "hosta", "hostb", "boom", committed=False, rewind="the job was rolled back")
    assert "runs on hosta; the job was rolled back. Cause: boom" in rewound["msg"]
    # a held source: its settlement's error says what holds it and what to run
    assert report.after_failure("m-1", "hosta", "hostb", "HELD on hosta", held=True) == {"fails": True,
                                                                                         "msg": "HELD on hosta"}
    not_released = report.after_failure("m-1", "hosta", "hostb", "kill failed", committed=True,
                                        released={"failed": True}, source_pod_deleted={"skipped": True})
    assert not_released["fails"] and "its stopped source on hosta was not released (kill failed)" in not_released["msg"]
    pod_kept = report.after_failure("m-1", "hosta", "hostb", "api", committed="True", source_pod_deleted={"failed": True})
    assert pod_kept["fails"] and "Run recover.yml to release it" in pod_kept["msg"]
    on_the_way = report.after_failure("m-1", "hosta", "hostb", "summary failed", committed=True, released={})
    assert on_the_way == {"fails": False,
                          "msg": "Migration m-1 committed: the workload runs on hostb. On the way: summary failed"}


SKIPPED = {"skipped": True, "changed": False}
RESUMED = {"changed": True, "journal": {"phase": "rolled_back", "image_removed": "/img/m-1"}}
LOST = {"lost": True, "known": True, "ran_s": 12.5,
        "note": "its copy on b was brought up at X (how) and no longer runs: the only state left is the source's"}


def settle(**given):
    return report.after_settlement("m-1", "a", "b", **given)


def test_after_the_settlement_a_commit_and_a_clean_rollback():
    assert settle(committed=True, target_answered=True, resumed=SKIPPED, source_after=SKIPPED) == {
        "held": False, "held_msg": "", "rewind": "", "msg": "Migration m-1: committed: the workload runs on b"}
    out = settle(target_answered=True, resumed=RESUMED, source_after=SKIPPED, lost={"lost": False})
    assert out["msg"] == "Migration m-1: rolled back: the workload runs on a; its image /img/m-1 was removed"
    assert not out["held"] and out["rewind"] == ""


def test_a_source_whose_copy_was_lost_is_held_until_a_rewind_is_accepted():
    held = settle(target_answered=True, resumed=SKIPPED, lost=LOST,
                  source_after={"journal": {"exists": True, "phase": "stopped"}})
    assert held["held"] and held["msg"] == held["held_msg"]
    assert "HELD on a, not rewound" in held["msg"] and "gpuckpt_accept_rewind=true" in held["msg"]
    assert "ansible-playbook gpuckpt.fleet.recover -e source=a -e target=b -e migration_id=m-1" in held["msg"]
    accepted = settle(target_answered=True, resumed=RESUMED, lost=LOST, source_after=SKIPPED)
    assert not accepted["held"]
    assert accepted["rewind"] == ("the job was rolled back to its freeze on a (gpuckpt_accept_rewind): its copy on b "
                                  "was brought up at X (how) and no longer runs, for 12.5 s at most; what it did "
                                  "there is done again")
    assert accepted["msg"].endswith("; " + accepted["rewind"] + "; its image /img/m-1 was removed")


def test_a_target_that_cannot_be_asked_holds_the_source_unless_declared_lost():
    held = settle(target_says="unreachable", resumed=SKIPPED,
                  source_after={"journal": {"exists": True, "phase": "stopped"}})
    assert held["held"] and "b could not be asked (unreachable)" in held["msg"] and "gpuckpt_target_lost" in held["msg"]
    declared = settle(target_says="unreachable", resumed=RESUMED, source_after=SKIPPED, target_lost="yes")
    assert not declared["held"] and declared["rewind"].startswith("b was declared lost")
    assert "(b could not be asked: unreachable; run recover.yml once it answers, to clean it)" in declared["msg"]


def test_a_rollback_that_failed_holds_the_source_with_its_words_and_a_done_one_does_not():
    failed = {"failed": True, "msg": "runc restore failed"}
    held = settle(target_answered=True, resumed=failed, source_after={"journal": {"exists": True, "phase": "stopped"}})
    assert held["held"] and held["msg"] == ("Migration m-1: the workload is HELD on a: runc restore failed. Run "
                                            "ansible-playbook gpuckpt.fleet.recover -e source=a -e target=b "
                                            "-e migration_id=m-1")
    for phase in ("resumed", "rolled_back", "committed"):
        assert not settle(target_answered=True, resumed=failed,
                          source_after={"journal": {"exists": True, "phase": phase}})["held"]
    assert not settle(target_answered=True, resumed=failed, source_after={"journal": {"exists": False}})["held"]
