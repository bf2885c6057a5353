"""The parallel range streams of module_utils/transfer.py, on this host's own files and dd.

TEST DOUBLE: ``ssh`` is replaced by a script that runs the remote command here with sh (no second
host is needed for what these tests check: how the ranges are cut, written in place, retried and
skipped). It can be told to break the first stream after some bytes, as a cut link does. The real
ssh path runs in tests/integration/test_migrate.py between two loopback sshd hosts.
"""
from __future__ import annotations

import hashlib
import os
import stat
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils import transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.errors import GpuCkptError

FAKE_SSH = r'''#!%(py)s
import os, subprocess, sys
cmd = sys.argv[-1]
log = os.environ["FAKE_SSH_LOG"]
with open(log, "a") as fh:
    fh.write(cmd + "\n")
cut = os.environ.get("FAKE_SSH_CUT")
if cut and "dd of=" in cmd and not os.path.exists(cut):
    open(cut, "w").close()
    sys.stdin.buffer.read(3 * 2**20)  # some bytes get through, then the link dies
    sys.exit(255)
sys.exit(subprocess.call(["sh", "-c", cmd]))
'''


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH % {"py": sys.executable})
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", "%s:%s" % (bindir, os.environ["PATH"]))
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    return tmp_path / "ssh.log"


def _image(tmp_path, sizes):
    src = tmp_path / "src"
    src.mkdir()
    for name, size in sizes.items():
        with open(src / name, "wb") as fh:
            fh.write(os.urandom(size))
    return src


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _dd_calls(log):
    return [line for line in open(log) if "dd of=" in line]


def test_large_files_arrive_whole_over_several_streams(tmp_path, fake_ssh):
    src = _image(tmp_path, {"pages-1.img": 9 * 2**20 + 123, "pages-2.img": 5 * 2**20, "core-1.img": 1000})
    dest = tmp_path / "dest"
    sent = transfer.stream_files(str(src), "hostb", str(dest), ["pages-1.img", "pages-2.img"], streams=4,
                                 progress=transfer.Progress(0))
    assert sent == 14 * 2**20 + 123
    for name in ("pages-1.img", "pages-2.img"):
        assert _digest(dest / name) == _digest(src / name)
        assert int(os.stat(dest / name).st_mtime) == int(os.stat(src / name).st_mtime)
    calls = _dd_calls(fake_ssh)
    for name in ("pages-1.img", "pages-2.img"):  # ranges of whole MiB, at most one per stream
        assert 2 <= len([c for c in calls if name in c]) <= 4
    assert not (dest / "core-1.img").exists()  # small files are rsync's


def test_a_rerun_sends_nothing(tmp_path, fake_ssh):
    src = _image(tmp_path, {"pages-1.img": 4 * 2**20})
    dest = str(tmp_path / "dest")
    transfer.stream_files(str(src), "hostb", dest, ["pages-1.img"], streams=2, progress=transfer.Progress(0))
    calls = len(_dd_calls(fake_ssh))
    assert transfer.stream_files(str(src), "hostb", dest, ["pages-1.img"], streams=2,
                                 progress=transfer.Progress(0)) == 0
    assert len(_dd_calls(fake_ssh)) == calls


def test_a_cut_stream_is_sent_again_and_the_file_is_whole(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_CUT", str(tmp_path / "cut-once"))
    src = _image(tmp_path, {"pages-1.img": 16 * 2**20})
    dest = tmp_path / "dest"
    progress = transfer.Progress(16 * 2**20, str(tmp_path / "progress.json"))
    transfer.stream_files(str(src), "hostb", str(dest), ["pages-1.img"], streams=4, retry_delay=0,
                          progress=progress)
    assert (tmp_path / "cut-once").exists(), "the test double never cut a stream"
    assert _digest(dest / "pages-1.img") == _digest(src / "pages-1.img")
    assert len(_dd_calls(fake_ssh)) == 5  # 4 ranges, one of them twice
    assert progress.done == 16 * 2**20  # the cut range's bytes are not counted twice


def test_a_stream_that_keeps_failing_gives_up_with_the_command(tmp_path, fake_ssh, monkeypatch):
    src = _image(tmp_path, {"pages-1.img": 2 * 2**20})
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "pages-1.img").mkdir()  # dd cannot open a directory for writing: every attempt fails
    with pytest.raises(GpuCkptError) as err:
        transfer.stream_files(str(src), "hostb", str(dest), ["pages-1.img"], streams=1, retries=2,
                              retry_delay=0, progress=transfer.Progress(0))
    assert "failed after 3 attempts" in err.value.msg and "pages-1.img" in err.value.msg
    assert "dd of=" in err.value.cmd[-1] and "Is a directory" in err.value.stderr


def test_pieces_cover_each_file_exactly_once():
    pieces = transfer._pieces([("a", 10 * 2**20 + 7), ("b", 1)], 3)
    for name, size in (("a", 10 * 2**20 + 7), ("b", 1)):
        ranges = sorted((off, n) for f, off, n in pieces if f == name)
        pos = 0
        for off, n in ranges:
            assert off == pos and n > 0
            pos += n
        assert pos == size


@pytest.mark.parametrize("cpus,streams", [(1, 1), (2, 1), (7, 1), (16, 4), (128, 8)])
def test_automatic_streams_are_a_quarter_of_the_cores(cpus, streams):
    assert transfer.auto_streams(cpus) == streams


def test_a_killed_runs_progress_file_is_removed_by_the_next_run(tmp_path):
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.progress import BytesProgress
    old, fresh = tmp_path / ".gpuckpt-progress-old.json", tmp_path / ".gpuckpt-progress-fresh.json"
    old.write_text("{}")
    fresh.write_text("{}")
    os.utime(old, (1, 1))
    p = BytesProgress(10, str(tmp_path / ".gpuckpt-progress-new.json"))
    p.start()
    p.add(10, force=True)
    assert '"bytes_done": 10' in (tmp_path / ".gpuckpt-progress-new.json").read_text()
    p.close()
    assert sorted(f.name for f in tmp_path.iterdir()) == [".gpuckpt-progress-fresh.json"]


def test_push_sends_a_growing_page_file_while_it_is_written_then_the_rest_and_the_manifest_last(tmp_path, fake_ssh):
    """A writer appends to pages-1.img in 1 MiB steps (as CRIU does while it dumps) while the Pusher
    watches: completed pieces go out during the writing, the tail and the other files after
    complete(), and the manifest only at the very end, under its final name, with every size and mtime
    as on the source."""
    import threading
    import time
    src, dest = tmp_path / "img", tmp_path / "dest"
    src.mkdir()
    (src / ".gpuckpt").mkdir()
    (src / ".gpuckpt" / "dump.log").write_text("ours, not the image's")
    (src / "core-1.img").write_bytes(os.urandom(5000))
    data = os.urandom(9 * 2**20 + 123)
    p = transfer.Pusher("host-b", str(dest), streams=2, python=sys.executable, piece=2**20)
    p.start()
    p.watch(str(src))

    def write():
        with open(src / "pages-1.img", "wb") as fh:
            for i in range(0, len(data), 2**20):
                fh.write(data[i:i + 2**20])
                fh.flush()
                time.sleep(0.1)
    t = threading.Thread(target=write)
    t.start()
    t.join()
    time.sleep(0.2)
    assert not (dest / "manifest.json").exists()
    p.complete(str(src))
    (src / "manifest.json").write_text('{"id": "m"}')
    report = p.finish(str(src))
    assert report["pushed"] is True, report
    assert report["bytes_sent_during_dump"] >= 4 * 2**20, report  # pieces went out while it grew
    assert report["bytes"] == len(data) + 5000 + len('{"id": "m"}')
    for name in ("pages-1.img", "core-1.img", "manifest.json"):
        assert _digest(dest / name) == _digest(src / name)
        assert os.stat(dest / name).st_mtime_ns == os.stat(src / name).st_mtime_ns
    assert not (dest / ".gpuckpt" / "dump.log").exists() and not (dest / "manifest.json.part").exists()
    # The receivers' receipts stand in for reading the files again, and only while they are unchanged.
    from ansible_collections.gpuckpt.fleet.plugins.module_utils import image
    expected = image.checksum_files(str(src), ["pages-1.img", "core-1.img"])
    got = image.push_receipts(str(dest), expected)
    assert got["core-1.img"] == expected["core-1.img"]
    assert "pages-1.img" not in got, "1 MiB pieces are not the manifest's 64 MiB chunks: read from disk"
    with open(dest / "core-1.img", "r+b") as fh:
        fh.write(b"x")
    assert image.push_receipts(str(dest), expected) == {}, "a file written since the push is read again"


def test_a_cut_push_is_reported_not_raised_and_leaves_no_manifest(tmp_path, fake_ssh):
    src, dest = tmp_path / "img", tmp_path / "dest"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(6 * 2**20))
    (src / "manifest.json").write_text("{}")
    cut = tmp_path / "cut-python"
    cut.write_text('#!/bin/sh\nhead -c 1000000 | %s "$@"\n' % sys.executable)
    cut.chmod(0o755)
    p = transfer.Pusher("host-b", str(dest), streams=2, python=str(cut), piece=2**20)
    p.start()
    p.complete(str(src))
    report = p.finish(str(src))
    assert report["pushed"] is False and "stream" in report["error"], report
    assert not (dest / "manifest.json").exists()


def test_verify_takes_the_push_receipts_and_still_judges_a_mismatch_from_the_file(tmp_path, fake_ssh):
    """With the default 64 MiB pieces every received range is one checksum chunk: image.verify takes
    their hashes from the receipts instead of reading the 65 MiB again. A receipt that disagrees
    with the manifest does not condemn the file by itself: the file is hashed from disk and judged."""
    import json
    from ansible_collections.gpuckpt.fleet.plugins.module_utils import image
    src, dest = tmp_path / "img", tmp_path / "dest"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(65 * 2**20))
    manifest = {"files": image.checksum_files(str(src))}
    image.write_manifest(str(src), manifest)
    p = transfer.Pusher("host-b", str(dest), streams=2, python=sys.executable)
    p.start()
    p.complete(str(src))
    assert p.finish(str(src))["pushed"] is True
    loaded = image.load_manifest(str(dest))
    assert image.push_receipts(str(dest), loaded["files"]) == loaded["files"]
    image.verify(str(dest), loaded)
    for name in os.listdir(dest / ".gpuckpt"):  # a receipt that lies about the first chunk
        if name.startswith("push-receipt-"):
            path = dest / ".gpuckpt" / name
            data = json.loads(path.read_text())
            for items in data.values():
                for item in items:
                    item[2] = "0" * 64
            path.write_text(json.dumps(data))
    image.verify(str(dest), loaded)  # the file itself is right: it passes, judged from disk
