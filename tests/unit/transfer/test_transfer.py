"""The one transfer path (module_utils/transfer/transfer.py and receiver.py) on this host's own files.

TEST DOUBLE: ``ssh`` is replaced by a script that runs the remote command here with sh (no second host
is needed for what these tests check: how pieces are cut, written, resumed, repaired, fenced, and what
the receiver refuses). It can be told to break a stream after some bytes, as a cut link does. The
real ssh path runs in tests/integration between two loopback sshd hosts.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import threading
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import transaction as migration
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import receiver, streams, targets, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal

FAKE_SSH = r'''#!%(py)s
import os, subprocess, sys
cmd = sys.argv[-1]
with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
    fh.write(" ".join(sys.argv[1:-1]) + "\n")
cut = os.environ.get("FAKE_SSH_CUT")
if cut and not os.path.exists(cut):
    open(cut, "w").close()
    proc = subprocess.Popen(["sh", "-c", cmd], stdin=subprocess.PIPE)
    left = int(os.environ.get("FAKE_SSH_CUT_BYTES", 3 * 2**20))
    while left > 0:  # some bytes get through, then the link dies
        b = os.read(0, min(left, 1 << 16))
        if not b:
            break
        proc.stdin.write(b)
        proc.stdin.flush()
        left -= len(b)
    proc.stdin.close()
    proc.wait()
    sys.exit(255)
sys.exit(subprocess.call(["sh", "-c", cmd]))
'''


@pytest.fixture
def small_chunks(monkeypatch):
    """1 MiB chunks instead of 64 MiB, so that small files have many."""
    for mod in (image, transfer):
        monkeypatch.setattr(mod, "CHUNK", 2**20)


def _image(tmp_path, sizes, name="src"):
    src = tmp_path / name
    image.prepare_dir(str(src))
    for rel, size in sizes.items():
        os.makedirs(os.path.dirname(str(src / rel)), exist_ok=True)
        with open(src / rel, "wb") as fh:
            fh.write(os.urandom(size))
    m = image.write_manifest(str(src), {"id": "img-1", "files": image.checksum_files(str(src)),
                                        "migration": {"id": "m1", "nonce": "n0nce0001"}})
    return src, m


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _target(io_timeout=30):
    return targets.Target("hostb", io_timeout=io_timeout, python=sys.executable)


def test_an_image_arrives_whole_over_several_streams_private_and_verified(tmp_path, fake_ssh, small_chunks):
    src, m = _image(tmp_path, {"pages-1.img": 9 * 2**20 + 123, "pages-2.img": 5 * 2**20, "core-1.img": 1000,
                               "gpuckpt/sub.img": 10})
    dest = tmp_path / "dest"
    res = transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, streams=3)
    assert res["attempts"] == 1 and res["bytes_total"] == image.image_bytes(m)
    for rel in m["files"]:
        assert _digest(dest / rel) == _digest(src / rel)
        assert stat.S_IMODE(os.stat(dest / rel).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o700
    assert image.load_manifest(str(dest))["id"] == "img-1"
    # The receipts stand for the files: verify reads none of them again.
    assert set(image.receipts(str(dest), m["files"])) == set(m["files"])
    image.verify(str(dest))
    # Three streams were used.
    assert len(open(fake_ssh).readlines()) == 3


def test_a_second_run_sends_only_the_manifest_and_a_cut_stream_is_resumed(tmp_path, fake_ssh, small_chunks, monkeypatch):
    src, m = _image(tmp_path, {"pages-1.img": 8 * 2**20})
    dest = tmp_path / "dest"
    monkeypatch.setenv("FAKE_SSH_CUT", str(tmp_path / "cut-once"))
    res = transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, streams=1,
                              retry_delay=0.1)
    assert res["attempts"] == 2, res
    assert 0 < res["bytes_already_there"] < 8 * 2**20, res  # the cut attempt's whole chunks were kept
    assert _digest(dest / "pages-1.img") == _digest(src / "pages-1.img")
    image.verify(str(dest))
    again = transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, streams=2)
    assert again["bytes_already_there"] == 8 * 2**20
    assert again["bytes_transferred"] == os.path.getsize(src / "manifest.json")


def test_a_changed_byte_with_its_times_put_back_is_found_and_only_its_chunk_is_sent_again(tmp_path, fake_ssh,
                                                                                          small_chunks):
    src, m = _image(tmp_path, {"pages-1.img": 6 * 2**20})
    dest = tmp_path / "dest"
    transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, streams=2)
    f = dest / "pages-1.img"
    st = os.stat(f)
    with open(f, "r+b") as fh:  # an adversary flips one byte and puts the times back
        fh.seek(3 * 2**20 + 7)
        b = fh.read(1)
        fh.seek(3 * 2**20 + 7)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_mtime_ns == st.st_mtime_ns and os.stat(f).st_size == st.st_size
    assert "pages-1.img" not in image.receipts(str(dest), m["files"]), "the receipt must not stand for a changed file"
    with pytest.raises(GpuCkptError) as exc:
        image.verify(str(dest))
    assert exc.value.details["bad_chunks"] == {"pages-1.img": [3]}
    repair = transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, streams=2)
    assert repair["bytes_transferred"] == 2**20 + os.path.getsize(src / "manifest.json")
    image.verify(str(dest))


def test_the_receiver_refuses_to_write_through_symlinks_or_into_what_is_not_its_image(tmp_path, fake_ssh):
    src, m = _image(tmp_path, {"pages-1.img": 4096})
    victim = tmp_path / "victim"
    victim.write_text("root-only\n")
    # A destination that holds something else (another image, someone's files) is refused.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(GpuCkptError, match="holds something other"):
        transfer.send_image(str(src), _target(), str(other), receiver={"image_id": "img-1"}, retries=0)
    assert (other / "notes.txt").read_text() == "mine" and not (other / "pages-1.img").exists()
    # A symlink as the destination is refused.
    link = tmp_path / "link"
    link.symlink_to(other)
    with pytest.raises(GpuCkptError, match="not a directory"):
        transfer.send_image(str(src), _target(), str(link), receiver={"image_id": "img-1"}, retries=0)
    # A symlink planted in place of an image file, or of the state dir, is never written through.
    dest = tmp_path / "dest"
    image.prepare_dir(str(dest))
    os.mkdir(dest / ".gpuckpt", 0o700)
    json.dump({"image_id": "img-1"}, open(dest / ".gpuckpt" / "transfer.json", "w"))
    (dest / "pages-1.img").symlink_to(victim)
    with pytest.raises(GpuCkptError, match="symlink"):
        transfer.send_image(str(src), _target(), str(dest), receiver={"image_id": "img-1"}, retries=0)
    assert victim.read_text() == "root-only\n"


def _migration_target(tmp_path):
    jdir = str(tmp_path / "journal-b")
    j = Journal(jdir, "m1", "target")
    dest = str(tmp_path / "images-b" / "m1")
    changed, doc = migration.begin_target(j, dest)
    assert changed and stat.S_IMODE(os.stat(dest).st_mode) == 0o700
    return j, dest, {"migration_id": "m1", "journal_dir": jdir, "nonce": doc["nonce"]}


def test_in_a_migration_the_image_lands_only_with_its_nonce_and_only_while_receiving(tmp_path, fake_ssh):
    src, m = _image(tmp_path, {"pages-1.img": 4096})
    j, dest, receiver = _migration_target(tmp_path)
    # The manifest says nonce n0nce0001; the target expects its own: refused, nothing lands.
    with pytest.raises(GpuCkptError, match="nonce"):
        transfer.send_image(str(src), _target(), dest, receiver=receiver, retries=0)
    assert not image.has_manifest(dest) and j.phase == "receiving"
    m["migration"]["nonce"] = receiver["nonce"]
    image.write_manifest(str(src), m)
    transfer.send_image(str(src), _target(), dest, receiver=receiver)
    assert j.phase == "received" and image.has_manifest(dest)
    # Once the migration is settled (cleaned), no receiver starts there again.
    res = migration.settle_target(j)
    assert res["decision"] == "rollback" and not os.path.exists(dest) and j.phase == "cleaned"
    with pytest.raises(GpuCkptError, match="not receiving"):
        transfer.send_image(str(src), _target(), dest, receiver=receiver, retries=0)
    assert not os.path.exists(dest)


def test_a_settlement_stops_a_transfer_that_is_still_running(tmp_path, fake_ssh, small_chunks):
    """A straggler (the transfer of a controller that died) is killed by the settlement, and its writes
    cannot recreate what the settlement removed."""
    src, m = _image(tmp_path, {"pages-1.img": 40 * 2**20})
    j, dest, receiver = _migration_target(tmp_path)
    m["migration"]["nonce"] = receiver["nonce"]
    image.write_manifest(str(src), m)
    box = {}

    def send():
        try:
            transfer.send_image(str(src), _target(), dest, receiver=receiver, bwlimit_kbps=4096, retries=0)
        except GpuCkptError as exc:
            box["error"] = exc

    t = threading.Thread(target=send)
    t.start()
    deadline = time.monotonic() + 20
    while not (j.read() or {}).get("receivers") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    res = migration.settle_target(j)
    t.join(30)
    assert not t.is_alive() and "error" in box, "the transfer must fail once the target is settled"
    assert res["decision"] == "rollback" and j.phase == "cleaned"
    time.sleep(1)
    assert not os.path.exists(dest), "nothing may write into the target after the settlement"


def test_bad_target_values_are_refused_before_anything_runs():
    for bad in ("-oProxyCommand=x", "host;rm", "a b", ""):
        with pytest.raises(GpuCkptError, match="host"):
            targets.Target(bad)
    with pytest.raises(GpuCkptError, match="user"):
        targets.Target("hostb", user="-l")
    with pytest.raises(GpuCkptError, match="python"):
        targets.Target("hostb", python="python3; id")
    t = targets.Target("[fd00::2]")
    assert t.host == "fd00::2" and t.ssh()[-1] == "fd00::2" and t.ssh()[-2] == "--"


def test_the_receiver_program_carries_the_receiver_and_the_store_not_the_sender():
    """The modules receiver.py imports (core/bundle.py follows them), none of the sender's side."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import bundle
    carried = set(bundle.bundled_sources("from %s import main\n" % receiver.__name__))
    mu = bundle.PACKAGE + "."
    assert {mu + "transfer.receiver", mu + "transfer.block_writer", mu + "replica.replica", mu + "replica.replica_images",
            mu + "core.journal", mu + "core.image"} <= carried
    sender_side = ("transfer.transfer", "transfer.streams", "transfer.targets", "runtimes", "engine", "cuda")
    assert not {m for m in carried if m.startswith(tuple(mu + s for s in sender_side))}
    assert streams.receiver_program().decode().rstrip().endswith("sys.exit(main())")


def test_automatic_streams_are_a_quarter_of_the_cores():
    assert transfer.auto_streams(2) == 1 and transfer.auto_streams(16) == 4 and transfer.auto_streams(128) == 8


def test_progress_files_are_replaced_never_written_through(tmp_path):
    """A progress file lives in a world-writable dir (/tmp, so the controller can read it without
    become): a symlink planted at its name, or at any name a writer could predict beside it, is
    replaced by a rename, never written through; stale files of others are left alone."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.progress import StageProgress
    victim = tmp_path / "root-only"
    victim.write_text("secret\n")
    os.chmod(victim, 0o600)
    path = tmp_path / ".gpuckpt-progress-abc.json"
    path.symlink_to(victim)
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old writer's temporary names
        (tmp_path / (".gpuckpt-progress-abc.json.%d.tmp" % pid)).symlink_to(victim)
    stale = tmp_path / ".gpuckpt-progress-someone-elses.json"
    stale.write_text("{}")
    os.chown(stale, 65534, 65534)
    os.utime(stale, (1, 1))
    p = StageProgress(str(path), ["a"])
    p.start()
    p.close()
    assert victim.read_text() == "secret\n"
    assert not path.exists() and stale.exists(), "only its own file is removed"


def _push_while_written(tmp_path, sizes, streams=2, **sender_kw):
    """A checkpoint's push as engine/checkpoint.py runs it: the streams open, the push watches the image
    while its page files grow (in odd sizes, as a dump appends), then the dump ends and the checksums come
    from ChunkHasher with the push's digests. Returns (src, dest, checksums, hasher, sender)."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import chunk_hasher
    src, dest = tmp_path / "src", tmp_path / "dest"
    image.prepare_dir(str(src))
    sender = transfer.Sender(_target(), str(dest), streams=streams, receiver={"image_id": "img-p"}, **sender_kw).start()
    pushed = sender.take_checksums()
    sender.watch(str(src))
    hasher = chunk_hasher.ChunkHasher(str(src), pushed=pushed).follow()
    try:
        for rel, size in sizes.items():
            with open(src / rel, "wb") as fh:
                left = size
                while left:
                    n = min(left, 300001)
                    fh.write(os.urandom(n))
                    fh.flush()
                    left -= n
                    time.sleep(0.002)
        sender.complete(str(src))
        final = hasher.checksums()
    finally:
        hasher.stop()
    return src, dest, final, hasher, sender


def test_the_push_hashes_what_it_sends_and_the_checkpoint_reads_no_chunk_twice(tmp_path, fake_ssh, small_chunks,
                                                                               monkeypatch):
    """Issue 32: a pushed image is read once on the source, by the push, which hashes each chunk on its way;
    the checksums are those of the finished files, and the target's receipts match them."""
    hashed_here = []
    real = image._hash_range
    monkeypatch.setattr(image, "_hash_range", lambda fd, off, n: hashed_here.append(n) or real(fd, off, n))
    sizes = {"pages-1.img": 5 * 2**20 + 4321, "pages-2.img": 2 * 2**20, "core-1.img": 700, "pages-3.img": 0}
    src, dest, final, hasher, sender = _push_while_written(tmp_path, sizes)
    assert [n for n in hashed_here if n] == [], "no chunk of the image was read again for its checksum"
    assert final == image.checksum_files(str(src)), "the push's digests are the finished files' checksums"
    assert hasher.hashed_early() == sum(sizes.values())
    image.write_manifest(str(src), {"id": "img-p", "files": final})
    sender.finish(str(src))
    assert set(image.receipts(str(dest), final)) == {rel for rel, size in sizes.items() if size}
    image.verify(str(dest))
    for rel in sizes:
        assert _digest(dest / rel) == _digest(src / rel)


def test_a_push_that_breaks_leaves_its_chunks_to_be_hashed_here(tmp_path, fake_ssh, small_chunks, monkeypatch):
    """A stream cut during the dump: the chunks it did not send are hashed by the checkpoint itself, the
    checksums are still the files', and nothing waits for a digest that will never come."""
    monkeypatch.setenv("FAKE_SSH_CUT", str(tmp_path / "cut-once"))
    monkeypatch.setenv("FAKE_SSH_CUT_BYTES", str(2 * 2**20))
    src, dest, final, hasher, sender = _push_while_written(tmp_path, {"pages-1.img": 6 * 2**20 + 1}, streams=1)
    assert final == image.checksum_files(str(src))
    assert hasher.hashed_early() < 6 * 2**20 + 1
    with pytest.raises(GpuCkptError):
        sender.finish(str(src))
    sender.abort()
