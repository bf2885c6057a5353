"""The journal's rules and the migration's settlement, on this host alone (no runtime: the processes are
plain children of the test). The whole transaction runs in tests/integration/test_migrate*.py."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import fsutil
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import transaction as migration
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget, TransactionError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import (Fenced, Journal, JournalBusy, alive_pids,
                                                                                 identities, same_process)


def _journal(tmp_path, role="target", mid="m1"):
    return Journal(str(tmp_path / "journal"), mid, role)


def test_transitions_follow_the_table_under_the_lock(tmp_path):
    j = _journal(tmp_path)
    with pytest.raises(RuntimeError):
        j.transition("receiving")  # never without the lock
    with j.hold(wait=1):
        j.transition("receiving", image_dir="/x")
        with pytest.raises(TransactionError, match="cannot go from receiving to restored"):
            j.transition("restored")
        j.transition("cleaned")
        with pytest.raises(TransactionError, match="it is finished"):
            j.transition("received")
    doc = j.read()
    assert [h["phase"] for h in doc["history"]] == ["receiving", "cleaned"] and doc["image_dir"] == "/x"
    assert oct(os.stat(j.path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(j.dir).st_mode & 0o777) == "0o700"


def test_a_held_lock_makes_a_bounded_wait_that_names_its_holder(tmp_path):
    j = _journal(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path[:0] = %r\n"
        "from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal\n"
        "j = Journal(%r, 'm1', 'target'); j.acquire(purpose='the restore of x'); print('held', flush=True); time.sleep(30)"
    ) % (sys.path, j.dir)], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"held"
    t0 = time.monotonic()
    with pytest.raises(JournalBusy, match=r"held by the restore of x \(pid %d\)" % holder.pid):
        j.acquire(wait=0.5)
    assert time.monotonic() - t0 < 3
    holder.kill()  # the kernel releases the lock of a process that dies
    holder.wait()
    with j.hold(wait=2):
        pass


def test_a_fence_stops_the_next_step(tmp_path):
    j = _journal(tmp_path, role="source")
    j.check_fence("dump")
    j.fence("a recovery")
    with pytest.raises(Fenced, match="fenced by a recovery before dump"):
        j.check_fence("dump")


def test_identity_tells_a_reused_pid_from_the_process_we_recorded():
    p = subprocess.Popen(["sleep", "30"])
    ident = identities([p.pid])
    assert alive_pids(ident) == [p.pid]
    p.kill()
    p.wait()
    assert alive_pids(ident) == []
    # The same pid number with another start time (what a reused pid looks like) is not ours.
    me = identities([os.getpid()])[str(os.getpid())]
    assert same_process(dict(me, starttime=me["starttime"] + 1)) is None
    assert same_process(dict(me, boot_id="another-boot")) is None
    assert same_process(me) is not None


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 1 MiB (tmpfs), filled up by the test."""
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "gpuckpt-test-full", str(d)], check=True)
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_full_disk_still_takes_one_more_journal_entry(small_disk):
    j = Journal(str(small_disk / "journal"), "m1", "source")
    with j.hold(wait=1):
        j.transition("planned", pids=list(range(100)))
    with open(small_disk / "filler", "wb") as fh:  # the image fills the disk
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with j.hold(wait=1):
        j.transition("rolled_back", error="the disk is full")  # a rollback still records what it did
    assert j.phase == "rolled_back"


def test_begin_creates_the_target_path_and_refuses_one_that_exists(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "old").mkdir()
    (root / "old" / "manifest.json").write_text("{}")  # another job's complete image
    with pytest.raises(InvalidTarget, match="exists already.*a complete image"):
        migration.begin_target(_journal(tmp_path, mid="old"), str(root / "old"))
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidTarget, match="a symlink"):
        migration.begin_target(_journal(tmp_path, mid="link"), str(root / "link"))
    j = _journal(tmp_path)
    changed, doc = migration.begin_target(j, str(root / "m1"))
    assert changed and doc["phase"] == "receiving" and len(doc["nonce"]) == 32
    assert oct(os.stat(root / "m1").st_mode & 0o777) == "0o700"
    assert migration.begin_target(j, str(root / "m1")) == (False, j.read())  # idempotent
    # A settlement before anything began leaves a tombstone: a late start of a dead controller fails.
    j2 = _journal(tmp_path, mid="m2")
    assert migration.settle_target(j2)["decision"] == "rollback"
    with pytest.raises(TransactionError, match="started on this host before"):
        migration.begin_target(j2, str(root / "m2"))
    assert not (root / "m2").exists()


def _restored_target(tmp_path, procs):
    j = _journal(tmp_path)
    migration.begin_target(j, str(tmp_path / "images" / "m1"))
    with j.hold(wait=1):
        j.transition("received")
        j.transition("restoring")
        j.transition("restored", pids=[p.pid for p in procs], identities=identities([p.pid for p in procs]))
    return j


def test_settle_commits_a_target_that_runs_and_rolls_back_one_whose_copy_died(tmp_path):
    p = subprocess.Popen(["sleep", "30"])
    try:
        j = _restored_target(tmp_path, [p])
        with pytest.raises(TransactionError, match="runs on this host"):
            migration.settle_target(j, mode="rollback")  # never throw away a copy that ran
        res = migration.settle_target(j)
        assert res["decision"] == "commit" and j.phase == "committed"
        assert not (tmp_path / "images" / "m1").exists()
        assert migration.settle_target(j)["changed"] is False
    finally:
        p.kill()
    p.wait()
    q = subprocess.Popen(["sleep", "30"])
    j = _restored_target(tmp_path / "second", [q])
    q.kill()
    q.wait()
    res = migration.settle_target(j)
    assert res["decision"] == "rollback" and j.phase == "cleaned"


def test_settle_waits_for_a_running_restore_and_cleans_up_after_a_dead_one(tmp_path):
    j = _journal(tmp_path)
    migration.begin_target(j, str(tmp_path / "images" / "m1"))
    # What a restore brought up before its module died: not a child of ours (it was CRIU's).
    victim = int(subprocess.run(["sh", "-c", "setsid sleep 30 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE,
                                check=True).stdout)
    ident = identities([victim])
    with j.hold(wait=1):
        j.transition("received")
        j.transition("restoring", pids=[victim], identities=ident)
    # While a restore holds the lock, the settlement waits for it (bounded).
    j.acquire()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("res", migration.settle_target(_journal(tmp_path), wait=10)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), "the settlement must wait for the restore"
    j.release()  # the restore's module dies: its lock goes, its phase still says restoring
    t.join(20)
    assert box["res"]["decision"] == "rollback" and ident and alive_pids(ident) == []
    assert not (tmp_path / "images" / "m1").exists()


def test_the_source_follows_the_target(tmp_path):
    j = _journal(tmp_path, role="source")
    with j.hold(wait=1):
        j.transition("planned", pids=[], identities={}, after="stopped")
        j.transition("freezing")
        j.transition("frozen")
        j.transition("checkpointed")
        j.transition("delivering")
    with pytest.raises(TransactionError, match="the target has not committed"):
        migration.commit_source(j, target_phase="cleaned")
    with pytest.raises(TransactionError, match="may have reached the target"):
        migration.rollback_source(j, target_phase=None)
    assert j.phase == "delivering" and j.fenced()
    with pytest.raises(GpuCkptError, match="processes are gone"):  # proven clean, but nothing to bring back here
        migration.rollback_source(j, target_phase="cleaned")


def test_remove_tree_removes_only_what_we_created(tmp_path):
    d = tmp_path / "mine"
    ident = fsutil.create_private_dir(str(d))
    (d / "f").write_text("x")
    os.rename(d, tmp_path / "moved")
    (tmp_path / "mine").mkdir()  # someone else's directory now stands at the path
    (tmp_path / "mine" / "theirs").write_text("keep")
    assert fsutil.remove_tree(str(d), ident) is False
    assert (tmp_path / "mine" / "theirs").read_text() == "keep"
    assert fsutil.remove_tree(str(tmp_path / "moved"), ident) is True


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_begin_keeps_the_targets_image_in_memory_and_the_settlement_unmounts_it(tmp_path, monkeypatch):
    """gpu_migration begin's image_in_memory (issue 32): a tmpfs of the image's own on the new directory, sized from
    the expected size; its root's identity is the one recorded, so the settlement's removal unmounts it. A host
    whose RAM cannot hold the image twice and a reserve is refused with nothing made."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import memdir
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import in_memory
    root = tmp_path / "images"
    root.mkdir()
    avail = {"bytes": 8 * 2**30}
    monkeypatch.setattr(in_memory.procfs, "meminfo", lambda: {"total_bytes": 16 * 2**30, "available_bytes": avail["bytes"]})
    j = _journal(tmp_path)
    changed, doc = migration.begin_target(j, str(root / "m1"), image_memory_bytes=64 * 2**20)
    assert changed and memdir.is_image_mount(str(root / "m1"))
    assert doc["image_in_memory"]["size_bytes"] == int(64 * 2**20 * 1.2) + in_memory.OTHER_IMAGES
    assert memdir.usage(str(root / "m1"))["size_bytes"] >= doc["image_in_memory"]["size_bytes"]
    assert migration.begin_target(j, str(root / "m1"), image_memory_bytes=64 * 2**20) == (False, j.read())
    (root / "m1" / "pages-1.img").write_bytes(b"p" * 4096)
    assert migration.settle_target(j)["decision"] == "rollback"
    assert not (root / "m1").exists() and not memdir.is_image_mount(str(root / "m1"))

    avail["bytes"] = 2**30 + 100 * 2**20  # less than twice 64 MiB and a 1 GiB reserve
    with pytest.raises(InvalidTarget, match="restored job's memory.*nothing was frozen"):
        migration.begin_target(_journal(tmp_path, mid="m3"), str(root / "m3"), image_memory_bytes=64 * 2**20)
    assert not (root / "m3").exists() and _journal(tmp_path, mid="m3").read() is None
    with pytest.raises(InvalidTarget, match="size is unknown"):
        migration.begin_target(_journal(tmp_path, mid="m4"), str(root / "m4"), image_memory_bytes=0)
