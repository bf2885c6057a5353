"""The replica store (module_utils/replica/replica.py) and the module over it (gpu_replica), on this host's files:
who owns a job (epochs, fencing), what counts as verified, retention, failover and what it refuses, and the
target's adoption. The receiver's side of a push into the store is in test_receiver_replica.py."""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica, replica_images, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, ImageError, InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.modules import gpu_replica

JOB = "train-1"


def _root(tmp_path):
    root = tmp_path / "replicas"
    root.mkdir(mode=0o700)
    return root


def push(root, image_id, at, job=JOB, size=3000, manifest=True, just_now=False):
    """An image as a receiver leaves it in the store: its files, its transfer mark, and (``manifest``) its manifest;
    its directory last changed at ``at`` (checkpoint time), unless ``just_now``."""
    path = root / job / image_id
    path.mkdir(mode=0o700, parents=True)
    (path / ".gpuckpt").mkdir(mode=0o700)
    (path / ".gpuckpt" / "transfer.json").write_text(json.dumps({"image_id": image_id, "replica": {"epoch": 1,
                                                                                                   "node": "node-a"}}))
    (path / "pages-1.img").write_bytes(os.urandom(size))
    (path / "core-1.img").write_bytes(b"core")
    if manifest:
        image.write_manifest(str(path), {"id": image_id, "frozen_at": at, "created": "2025-01-01T00:00:00+00:00",
                                         "files": image.checksum_files(str(path)), "host": {"driver_version": "550.1"},
                                         "runtime": {"backend": "process"}, "gpu_stage": "driver",
                                         "target": {"pids": [10, 11], "cuda_pids": [11], "gpus": [], "workload": "10"}})
    if not just_now:
        os.utime(path, (at, at))
    return path


def _flip_first_byte(path):
    """Corrupt a file for sure: its random first byte inverted (writing a zero left it whole one time in 256)."""
    with open(path, "r+b") as fh:
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))


def committed(root, image_id, at, keep=3, epoch=1, node="node-a", **meta):
    push(root, image_id, at)
    return replica_images.commit(str(root), JOB, image_id, epoch, node, keep, meta)


def _mark(path):
    return json.loads((path / ".gpuckpt" / "replica.json").read_text())


def test_job_names_and_image_ids_are_one_safe_path_component():
    for bad in ("", "a/b", "..", ".", ".hidden", "-x", "a" * 65, None, 3):
        with pytest.raises(InvalidTarget):
            replica.check_job(bad)
    for bad in ("", "../x", "..", "a/b", ".lock", "job.json", "x" * 129):
        with pytest.raises(InvalidTarget):
            replica.check_image_id(bad)
    assert replica.check_job("train-1.v2_a") and replica.check_image_id("0b6f2a7e-1c2d-4e5f-8a9b-123456789abc")


def test_the_first_push_makes_its_node_the_owner_and_a_fenced_copy_is_refused(tmp_path):
    root = _root(tmp_path)
    record = replica.check_push(str(root), JOB, 1, "node-a")
    assert record["owner"] == "node-a" and record["epoch"] == 1 and record["history"][0]["event"] == "adopted"
    assert os.stat(root / JOB).st_mode & 0o777 == 0o700
    assert replica.check_push(str(root), JOB, 1, "node-a")["epoch"] == 1  # the owner again
    for epoch, node in ((1, "node-b"), (2, "node-b")):  # another node, at the same epoch or a higher one
        with pytest.raises(replica.StaleEpoch, match="belongs to node-a at epoch 1"):
            replica.check_push(str(root), JOB, epoch, node)
    # Its owner at a higher epoch (read from another replica): a push never raises it (issue 43); the operator's
    # re-protect does, and records it.
    with pytest.raises(replica.EpochAhead, match="ahead of this replica's record"):
        replica.check_push(str(root), JOB, 3, "node-a")
    assert replica_images.list_images(str(root), JOB)["record"]["epoch"] == 1
    record = replica_owner.reprotect(str(root), JOB, 3, "node-a")["record"]
    assert record["epoch"] == 3 and record["history"][-1]["event"] == "reprotected"
    assert replica.check_push(str(root), JOB, 3, "node-a")["epoch"] == 3
    with pytest.raises(replica.StaleEpoch) as err:
        replica.check_push(str(root), JOB, 2, "node-a")
    assert err.value.fenced and err.value.details == {"fenced": True, "epoch": 3, "owner": "node-a"}
    for bad in (0, -1, "1", True, None):
        with pytest.raises(InvalidTarget):
            replica.check_push(str(root), JOB, bad, "node-a")


def test_a_fence_check_writes_nothing_and_says_who_owns_the_job(tmp_path):
    root = _root(tmp_path)
    assert replica.check(str(root), JOB, 1, "node-a") == {"epoch": None, "owner": None, "fenced": False,
                                                          "reason": "no record of job %s on this replica" % JOB}
    assert not (root / JOB).exists()
    replica.check_push(str(root), JOB, 1, "node-a")
    replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-1", "lost")
    before = (root / JOB / "job.json").read_text()
    said = replica.check(str(root), JOB, 1, "node-a")
    assert said["fenced"] and said["epoch"] == 2 and said["owner"] == "node-b"
    assert said["reason"] == "job %s was failed over to node-b at epoch 2; the copy on node-a (epoch 1) is fenced" % JOB
    assert replica.check(str(root), JOB, 2, "node-b")["fenced"] is False
    assert (root / JOB / "job.json").read_text() == before


def test_a_commit_verifies_records_and_keeps_the_newest_n(tmp_path):
    root = _root(tmp_path)
    for i in range(5):
        res = committed(root, "img-%d" % i, 1000 + i, keep=3, progress={"step": i * 10}, stall_s=0.5)
        assert res["verified"] and res["image_id"] == "img-%d" % i
    assert res["kept"] == ["img-4", "img-3", "img-2"] and res["removed"] == ["img-1"]
    assert sorted(os.listdir(root / JOB)) == [".lock", "img-2", "img-3", "img-4", "job.json"]
    mark = _mark(root / JOB / "img-4")
    assert mark["verified"] and mark["epoch"] == 1 and mark["node"] == "node-a" and mark["bytes"] == 3004
    assert mark["progress"] == {"step": 40} and mark["stall_s"] == 0.5 and mark["corrupt"] is None
    assert mark["checkpoint_at"] == "1970-01-01T00:16:44+00:00"
    listed = replica_images.list_images(str(root), JOB)
    assert [i["id"] for i in listed["images"]] == ["img-4", "img-3", "img-2"] and listed["record"]["owner"] == "node-a"
    first = listed["images"][0]
    assert first["verified"] and first["complete"] and first["committed"] and first["progress"] == {"step": 40}
    assert first["facts"] == {"host": {"driver_version": "550.1"}, "runtime": {"backend": "process"},
                              "target": {"pids": [10, 11], "cuda_pids": [11], "gpus": [], "workload": "10"},
                              "gpu_stage": "driver", "image_bytes": 3004}
    assert first["path"] == str(root / JOB / "img-4") and first["created"] == "2025-01-01T00:00:00+00:00"


def test_retention_removes_failed_pushes_older_than_the_newest_verified_only(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000, keep=1)
    cut_old = push(root, "cut-old", 1001, manifest=False)       # a push cut before its manifest
    uncommitted = push(root, "uncommitted", 1002)                # complete, its commit never came
    mine = root / JOB / "notes"                                   # a directory no receiver made
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    (root / JOB / "link").symlink_to(root / JOB / "img-1")
    newer = push(root, "cut-new", 5000, manifest=False)
    res = committed(root, "img-2", 2000, keep=1)
    assert res["kept"] == ["img-2"] and sorted(res["removed"]) == ["cut-old", "img-1", "uncommitted"]
    assert not cut_old.exists() and not uncommitted.exists() and newer.exists()  # a newer push may still be coming
    assert (mine / "keep.txt").exists() and (root / JOB / "link").is_symlink()


def test_retention_never_removes_the_only_verified_image_nor_the_one_just_committed(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-new", 2000, keep=1)
    res = committed(root, "img-late", 1000, keep=1)  # committed after a newer one: kept all the same
    assert res["kept"] == ["img-new", "img-late"] and res["removed"] == []
    # The newest verified one turns out corrupt: the one verified image left is kept whatever keep says.
    _flip_first_byte(root / JOB / "img-new" / "pages-1.img")
    assert replica_images.verify_image(str(root), JOB, "img-new") is False
    res = committed(root, "img-3", 3000, keep=1)
    assert res["kept"] == ["img-3"] and sorted(res["removed"]) == ["img-late", "img-new"]
    assert [i["id"] for i in replica_images.list_images(str(root), JOB)["images"]] == ["img-3"]


def test_an_image_that_does_not_verify_is_refused_marked_and_nothing_is_removed(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000, keep=1)
    bad = push(root, "img-2", 2000)
    _flip_first_byte(bad / "pages-1.img")
    with pytest.raises(ImageError, match="checksum mismatch"):
        replica_images.commit(str(root), JOB, "img-2", 1, "node-a", 1, {})
    assert (root / JOB / "img-1").exists() and not _mark(bad)["verified"] and "checksum" in _mark(bad)["corrupt"]
    listed = {i["id"]: i for i in replica_images.list_images(str(root), JOB)["images"]}
    assert listed["img-1"]["verified"] and not listed["img-2"]["verified"] and listed["img-2"]["corrupt"]
    incomplete = push(root, "img-3", 3000, manifest=False)
    with pytest.raises(ImageError, match="incomplete"):
        replica_images.commit(str(root), JOB, "img-3", 1, "node-a", 1, {})
    assert incomplete.exists()
    with pytest.raises(ImageError, match="not on this replica"):
        replica_images.commit(str(root), JOB, "img-9", 1, "node-a", 1, {})
    with pytest.raises(InvalidTarget):
        replica_images.commit(str(root), JOB, "../img-1", 1, "node-a", 1, {})


def test_an_image_without_replica_json_is_unverified_and_never_failed_over_to(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000)
    push(root, "img-2", 2000)  # its push ended, the commit never came (the node died in between)
    listed = replica_images.list_images(str(root), JOB)["images"]
    assert [(i["id"], i["verified"], i["committed"], i["complete"]) for i in listed] == [
        ("img-2", False, False, True), ("img-1", True, True, True)]
    assert listed[0]["epoch"] == 1 and listed[0]["node"] == "node-a"  # from the receiver's mark
    ok, why, unused = replica_images.reverify(str(root), JOB, "img-2")
    assert not ok and "never committed" in why
    res = replica_owner.failover_verified(str(root), JOB, "node-a", "node-b", ["img-2", "img-1"])
    assert res["image_id"] == "img-1" and res["skipped"][0]["id"] == "img-2"


def test_failover_raises_the_epoch_once_and_refuses_what_would_leave_two_copies(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000)
    with pytest.raises(replica.FailoverRefused, match="is the job's owner"):
        replica_owner.failover(str(root), JOB, "node-a", "node-a", "img-1")
    with pytest.raises(replica.FailoverRefused, match="not the job's owner"):
        replica_owner.failover(str(root), JOB, "node-x", "node-b", "img-1")
    record = replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-1", "BMC power-off")
    assert record["epoch"] == 2 and record["owner"] == "node-b"
    assert {k: record["history"][-1][k] for k in ("event", "epoch", "owner", "from", "image_id", "reason")} == {
        "event": "failover", "epoch": 2, "owner": "node-b", "from": "node-a", "image_id": "img-1", "reason": "BMC power-off"}
    with pytest.raises(replica.FailoverRefused, match="runs on node-b since epoch 2: it was already failed over"):
        replica_owner.failover(str(root), JOB, "node-a", "node-c", "img-1")
    with pytest.raises(replica.FailoverRefused, match="target node-b"):
        replica_owner.failover(str(root), JOB, "node-b", "node-b", "img-1")
    # The lost node's copy, back: its pushes and commits are refused; the new owner's are taken.
    push(root, "img-2", 2000)
    with pytest.raises(replica.StaleEpoch, match="failed over to node-b at epoch 2"):
        replica_images.commit(str(root), JOB, "img-2", 1, "node-a", 3, {})
    assert not (root / JOB / "img-2" / ".gpuckpt" / "replica.json").exists()
    assert replica_images.commit(str(root), JOB, "img-2", 2, "node-b", 3, {})["verified"]
    with pytest.raises(replica.FailoverRefused, match="no record"):
        replica_owner.failover(str(root), "other-job", "node-a", "node-b", "img-1")


def test_failover_skips_a_corrupt_image_for_the_previous_verified_one(tmp_path):
    root = _root(tmp_path)
    for i, at in enumerate((1000, 2000, 3000)):
        committed(root, "img-%d" % i, at)
    _flip_first_byte(root / JOB / "img-2" / "pages-1.img")  # bit rot after the commit
    # Check mode: what it would do, nothing marked, no epoch raised.
    res = replica_owner.failover_verified(str(root), JOB, "node-a", "node-b", write=False)
    assert res["image_id"] == "img-1" and res["epoch"] is None and res["skipped"][0]["id"] == "img-2"
    assert _mark(root / JOB / "img-2")["verified"] and replica_images.list_images(str(root), JOB)["record"]["epoch"] == 1
    res = replica_owner.failover_verified(str(root), JOB, "node-a", "node-b", reason="Xid 79")
    assert res["image_id"] == "img-1" and res["epoch"] == 2 and res["image_path"] == str(root / JOB / "img-1")
    assert res["skipped"] == [{"id": "img-2", "reason": res["skipped"][0]["reason"]}]
    assert "checksum mismatch" in res["skipped"][0]["reason"]
    assert _mark(root / JOB / "img-2")["verified"] is False and "checksum" in _mark(root / JOB / "img-2")["corrupt"]
    assert res["record"]["owner"] == "node-b" and res["record"]["history"][-1]["image_id"] == "img-1"


def test_a_refused_failover_reads_no_image_and_one_without_a_good_image_raises_no_epoch(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000)
    _flip_first_byte(root / JOB / "img-1" / "pages-1.img")
    with pytest.raises(replica.FailoverRefused):
        replica_owner.failover_verified(str(root), JOB, "node-a", "node-a")
    assert _mark(root / JOB / "img-1")["verified"]  # refused before it read anything
    with pytest.raises(ImageError, match="the epoch was not raised") as err:
        replica_owner.failover_verified(str(root), JOB, "node-a", "node-b")
    assert err.value.details["skipped"][0]["id"] == "img-1"
    assert replica_images.list_images(str(root), JOB)["record"]["epoch"] == 1


def test_a_job_directory_that_is_a_symlink_is_refused_and_never_written_through(tmp_path):
    root = _root(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / JOB).symlink_to(elsewhere)
    for call in (lambda: replica.check_push(str(root), JOB, 1, "node-a"),
                 lambda: replica_images.list_images(str(root), JOB),
                 lambda: replica_images.commit(str(root), JOB, "img-1", 1, "node-a", 1, {}),
                 lambda: replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-1")):
        with pytest.raises(InvalidTarget, match="symlink"):
            call()
    assert os.listdir(elsewhere) == []
    (root / JOB).unlink()
    os.mkdir(root / JOB, 0o777)
    os.chmod(root / JOB, 0o777)
    with pytest.raises(InvalidTarget, match="others can write"):
        replica.check_push(str(root), JOB, 1, "node-a")


def test_a_damaged_record_is_not_guessed_at(tmp_path):
    root = _root(tmp_path)
    replica.check_push(str(root), JOB, 1, "node-a")
    (root / JOB / "job.json").write_text("{not json")
    with pytest.raises(GpuCkptError, match="unreadable"):
        replica.check_push(str(root), JOB, 1, "node-a")


def test_commits_of_one_job_wait_for_each_other(tmp_path):
    root = _root(tmp_path)
    committed(root, "img-1", 1000, keep=1)
    push(root, "img-2", 2000)
    fd = os.open(str(root / JOB / ".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another commit (or a failover) holds the job
    results = []
    worker = threading.Thread(target=lambda: results.append(replica_images.commit(str(root), JOB, "img-2", 1, "node-a", 1, {})))
    worker.start()
    time.sleep(0.5)
    assert worker.is_alive() and not (root / JOB / "img-2" / ".gpuckpt" / "replica.json").exists()
    os.close(fd)
    worker.join(10)
    assert results and results[0]["removed"] == ["img-1"]


def test_concurrent_commits_of_two_images_leave_a_consistent_store(tmp_path):
    root = _root(tmp_path)
    for i in range(4):
        push(root, "img-%d" % i, 1000 + i, just_now=True)  # each delivered a moment ago, its commit on the way
    errors, threads = [], []
    for i in range(4):
        def run(i=i):
            try:
                replica_images.commit(str(root), JOB, "img-%d" % i, 1, "node-a", 2, {})
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    listed = replica_images.list_images(str(root), JOB)["images"]
    assert all(i["verified"] for i in listed) and "img-3" in [i["id"] for i in listed] and len(listed) >= 2


def test_a_push_delivered_a_moment_ago_is_not_taken_for_a_failed_one(tmp_path):
    root = _root(tmp_path)
    waiting = push(root, "img-1", 1000, just_now=True)  # delivered, its commit not yet run
    res = committed(root, "img-2", 2000, keep=1)
    assert res["removed"] == [] and waiting.exists()
    os.utime(waiting, (time.time() - replica_images.RETAIN_GRACE - 1,) * 2)
    assert committed(root, "img-3", 3000, keep=1)["removed"] == ["img-2", "img-1"]


def test_the_target_adopts_a_job_once_per_epoch(tmp_path):
    journal = tmp_path / "journal"
    doc = replica_owner.adopt(str(journal), JOB, 2, "node-b", "node-a", "img-1", write=False)
    assert doc["epoch"] == 2 and not journal.exists()
    doc = replica_owner.adopt(str(journal), JOB, 2, "node-b", "node-a", "img-1")
    saved = json.loads((journal / ("protect-%s.json" % JOB)).read_text())
    assert saved == doc and saved["owner"] == "node-b" and saved["from"] == "node-a"
    assert os.stat(journal / ("protect-%s.json" % JOB)).st_mode & 0o777 == 0o600
    for epoch in (1, 2):
        with pytest.raises(replica.FailoverRefused, match="already records job"):
            replica_owner.adopt(str(journal), JOB, epoch, "node-b")
    assert replica_owner.adopt(str(journal), JOB, 3, "node-b")["epoch"] == 3


# -- the module ---------------------------------------------------------------------------------------
def _run(capsys, check_mode=False, **args):
    if check_mode:
        args["_ansible_check_mode"] = True
    with patch_module_args(args), pytest.raises(SystemExit):
        gpu_replica.main()
    return json.loads(capsys.readouterr().out)


def test_the_module_lists_verifies_fails_over_and_adopts(tmp_path, capsys):
    root = _root(tmp_path)
    committed(root, "img-1", 1000, progress={"step": 7})
    committed(root, "img-2", 2000)
    res = _run(capsys, True, root=str(root), job=JOB)
    assert not res["changed"] and [i["id"] for i in res["images"]] == ["img-2", "img-1"]
    assert res["record"]["epoch"] == 1 and res["images"][1]["progress"] == {"step": 7}
    res = _run(capsys, root=str(root), job=JOB, state="verify", image_id="img-2")
    assert res["verified"] and not res["changed"] and res["reason"] is None
    _flip_first_byte(root / JOB / "img-2" / "pages-1.img")
    res = _run(capsys, True, root=str(root), job=JOB, state="failover", lost_node="node-a", target="node-b")
    assert not res["changed"] and res["image_id"] == "img-1" and res["epoch"] is None and res["record"]["epoch"] == 1
    res = _run(capsys, root=str(root), job=JOB, state="failover", lost_node="node-a", target="node-b",
               candidates=["img-2", "img-1"], reason="spot reclaim")
    assert res["changed"] and res["image_id"] == "img-1" and res["epoch"] == 2 and res["skipped_images"][0]["id"] == "img-2"
    assert res["image_path"] == str(root / JOB / "img-1") and res["record"]["owner"] == "node-b"
    res = _run(capsys, root=str(root), job=JOB, state="failover", lost_node="node-a", target="node-c")
    assert res["failed"] and "already failed over" in res["msg"]
    # Another replica of the job, which does not hold the chosen image: fenced too, once.
    other = tmp_path / "replica-2"
    other.mkdir(mode=0o700)
    replica.check_push(str(other), JOB, 1, "node-a")
    res = _run(capsys, True, root=str(other), job=JOB, state="fence", lost_node="node-a", target="node-b")
    assert not res["changed"] and res["epoch"] == 2 and res["record"]["epoch"] == 1
    res = _run(capsys, root=str(other), job=JOB, state="fence", lost_node="node-a", target="node-b", image_id="img-1")
    assert res["changed"] and res["epoch"] == 2 and res["record"]["owner"] == "node-b"
    assert replica.check(str(other), JOB, 1, "node-a")["fenced"]
    res = _run(capsys, root=str(other), job=JOB, state="fence", lost_node="node-a", target="node-b")
    assert res["failed"] and "already failed over" in res["msg"]
    res = _run(capsys, job=JOB, state="adopt", epoch=2, lost_node="node-a", node="node-b", image_id="img-1",
               journal_dir=str(tmp_path / "journal"))
    assert res["changed"] and res["adopted"]["owner"] == "node-b" and res["epoch"] == 2
    res = _run(capsys, job=JOB, state="adopt", epoch=2, node="node-b", journal_dir=str(tmp_path / "journal"))
    assert res["failed"] and "already records" in res["msg"]
    res = _run(capsys, root="relative/path", job=JOB)
    assert res["failed"] and "absolute path" in res["msg"]
    res = _run(capsys, job=JOB, state="verify", image_id="img-1")
    assert res["failed"] and "root" in res["msg"]
