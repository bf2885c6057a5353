"""transfer/transfer.py: whether a failed transfer is tried again, as the error says (TransferError.retryable).

TEST DOUBLE: ``ssh`` is replaced by a script that, as FAKE_SSH_MODE says, runs the remote command here
(``local``: the real receiver), fails as an ssh that cannot connect does (``down``), or ends as a receiver
whose disk filled up does (``full``). The real ssh path runs in tests/integration.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import streams, targets, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer.receiver import REFUSED
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer.streams import TransferError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import transaction as migration

FAKE_SSH = r'''#!%(py)s
import os, re, subprocess, sys
cmd = sys.argv[-1]
with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
    fh.write(cmd[:40] + "\n")
mode = os.environ.get("FAKE_SSH_MODE", "local")
if mode == "down":
    sys.stderr.write("ssh: connect to host hostb port 22: Connection refused\n")
    sys.exit(255)
if mode == "full":
    left = int(re.search(r"read\((\d+)\)", cmd).group(1))  # the receiver program, as a receiver reads it
    while left > 0:
        left -= len(os.read(0, left))
    sys.stderr.write("gpuckpt receiver: [Errno 28] No space left on device: 'pages-1.img'\n")
    sys.exit(1)
sys.exit(subprocess.call(["sh", "-c", cmd]))
'''


def _image(tmp_path, nonce="n0nce0001"):
    src = tmp_path / "src"
    image.prepare_dir(str(src))
    (src / "pages-1.img").write_bytes(os.urandom(4096))
    image.write_manifest(str(src), {"id": "img-1", "files": image.checksum_files(str(src)),
                                    "migration": {"id": "m1", "nonce": nonce}})
    return str(src)


def _send(src, dest, receiver=None, retries=3, streams=1):
    target = targets.Target("hostb", io_timeout=30, python=sys.executable)
    return transfer.send_image(src, target, dest, receiver=receiver or {"image_id": "img-1"}, streams=streams,
                               retries=retries, retry_delay=0.01)


def _attempts(exc):
    return int(re.search(r"failed after (\d+) attempt", exc.msg).group(1))


def test_a_transfer_error_is_retryable_unless_told_otherwise():
    assert TransferError("the stream broke", stage="transfer").retryable is True
    final = TransferError("the receiver refused (x)", retryable=False, stage="transfer")
    assert final.retryable is False and final.stage == "transfer" and final.msg == "the receiver refused (x)"


def test_an_ssh_that_cannot_connect_is_tried_again(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "down")
    with pytest.raises(TransferError) as exc:
        _send(_image(tmp_path), str(tmp_path / "dest"), retries=2)
    assert exc.value.retryable and _attempts(exc.value) == 3
    assert len(open(fake_ssh).readlines()) == 3


def test_a_full_disk_on_the_target_is_not_tried_again(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "full")
    with pytest.raises(TransferError, match="the target's disk is full") as exc:
        _send(_image(tmp_path), str(tmp_path / "dest"))
    assert not exc.value.retryable and _attempts(exc.value) == 1
    assert exc.value.hint == "free space on the target"


def test_a_receiver_that_refuses_to_start_is_not_tried_again(tmp_path, fake_ssh):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(TransferError, match="the receiver refused .*holds something other") as exc:
        _send(_image(tmp_path), str(other))
    assert not exc.value.retryable and _attempts(exc.value) == 1
    assert len(open(fake_ssh).readlines()) == 1


def test_a_manifest_of_another_checkpoint_is_refused_once_not_tried_again(tmp_path, fake_ssh):
    """The receiver refuses the manifest (its nonce differs) after the pages arrived: its exit status
    says it refused, and the sender does not send the image again."""
    jdir = str(tmp_path / "journal-b")
    j = Journal(jdir, "m1", "target")
    dest = str(tmp_path / "images-b" / "m1")
    unused, doc = migration.begin_target(j, dest)
    receiver = {"migration_id": "m1", "journal_dir": jdir, "nonce": doc["nonce"]}
    with pytest.raises(TransferError, match="nonce differs") as exc:
        _send(_image(tmp_path, nonce="an0therone"), dest, receiver=receiver)
    assert not exc.value.retryable and _attempts(exc.value) == 1
    assert exc.value.rc == REFUSED
    assert not image.has_manifest(dest) and j.phase == "receiving"


def test_a_cut_stream_is_tried_again_and_resumed(tmp_path, fake_ssh, monkeypatch):
    """A receiver whose stream ends before its end mark failed on the way, not by refusing. (Of two
    streams the second is closed before the manifest goes: the first attempt delivers nothing.)"""
    src = _image(tmp_path)
    real = streams.Stream.close
    cut = []

    def close_once_cut(stream, timeout):
        if not cut:  # the first attempt's link dies in the middle of a piece, before the end mark
            cut.append(stream)
            stream._write(b'{"op": "data", "path": "pages-1.img", "off": 0, "len": 100}\n')
            with open(os.devnull, "wb") as devnull:
                os.dup2(devnull.fileno(), stream.proc.stdin.fileno())  # the receiver's end sees EOF
        return real(stream, timeout)

    monkeypatch.setattr(streams.Stream, "close", close_once_cut)
    res = _send(src, str(tmp_path / "dest"), streams=2)
    assert cut[0].index == 1 and res["attempts"] == 2 and cut[0].proc.returncode == 1  # not receiver.REFUSED
    image.verify(str(tmp_path / "dest"))
