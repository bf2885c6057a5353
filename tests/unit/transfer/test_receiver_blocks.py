"""The receiver's data path (block_writer.BlockWriter): the blocks read from the stream are written and hashed by a
thread of their own while the next ones are read. What must hold whatever the pieces' sizes: every byte lands
where its operation says, a block is read into again only once it is written (a pool smaller than one piece),
each range's receipt is the hash of the bytes written and comes only after them, a cut stream leaves no receipt
of its range, and a write that fails (a full disk) is the receiver's failure, in its words.

The receiver runs in this process on in-memory streams; the full disk is a real ENOSPC on a small tmpfs (root)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import block_writer, receiver, streams


def _data(rel, off, payload):
    return json.dumps({"op": "data", "path": rel, "off": off, "len": len(payload)}).encode() + b"\n" + payload


def _receipts(dest):
    state = os.path.join(dest, image.STATE_DIR)
    out = []
    for name in sorted(os.listdir(state)):
        if name.startswith(image.RECEIPT_PREFIX):
            with open(os.path.join(state, name)) as fh:
                out.extend(json.loads(line) for line in fh)
    return out


def _run(dest, stream):
    out = io.BytesIO()
    rc = receiver.Receiver({"dest": dest, "image_id": "img-b"}, io.BytesIO(stream), out).run()
    return rc, out


def test_pieces_of_any_size_land_whole_with_their_receipts(tmp_path):
    """Pieces larger than the whole pool, smaller than a block and not on block boundaries, two files
    interleaved: the files are the bytes sent and each receipt hashes its range."""
    dest = str(tmp_path / "img")
    block, pool = block_writer.RECEIVE_BLOCK, block_writer.RECEIVE_BLOCKS
    big = os.urandom(block * (pool + 3) + 12345)   # more than the pool holds: its blocks are reused
    small = os.urandom(1000)
    tail = os.urandom(block + 1)
    stream = (_data("pages-1.img", 0, big) + _data("core-1.img", 0, small)
              + _data("pages-1.img", len(big), tail) + b'{"op": "end"}\n')
    rc, _out = _run(dest, stream)
    assert rc == 0
    with open(os.path.join(dest, "pages-1.img"), "rb") as fh:
        assert fh.read() == big + tail
    with open(os.path.join(dest, "core-1.img"), "rb") as fh:
        assert fh.read() == small
    got = {(r["path"], r["off"], r["len"]): r["sha256"] for r in _receipts(dest)}
    assert got == {("pages-1.img", 0, len(big)): hashlib.sha256(big).hexdigest(),
                   ("core-1.img", 0, len(small)): hashlib.sha256(small).hexdigest(),
                   ("pages-1.img", len(big), len(tail)): hashlib.sha256(tail).hexdigest()}


def test_a_cut_stream_leaves_no_receipt_of_its_range(tmp_path):
    dest = str(tmp_path / "img")
    whole = os.urandom(3 * block_writer.RECEIVE_BLOCK)
    first = os.urandom(5000)
    stream = _data("pages-1.img", 0, first) + _data("pages-1.img", len(first), whole)[:-(block_writer.RECEIVE_BLOCK + 7)]
    with pytest.raises(receiver.StreamCut) as err:
        _run(dest, stream)
    assert "at byte" in str(err.value)
    receipts = _receipts(dest)
    assert [(r["off"], r["len"]) for r in receipts] == [(0, len(first))], "only the whole range has a receipt"
    with open(os.path.join(dest, "pages-1.img"), "rb") as fh:
        assert fh.read(len(first)) == first


def test_a_manifest_is_delivered_only_after_every_byte_before_it_is_written(tmp_path):
    """deliver (and fix, sums) wait for the writer: the image is complete on disk when its manifest appears."""
    dest = str(tmp_path / "img")
    payload = os.urandom(block_writer.RECEIVE_BLOCK * (block_writer.RECEIVE_BLOCKS + 1))
    manifest = json.dumps({"id": "img-b", "files": {}}).encode()
    stream = (_data("pages-1.img", 0, payload) + b'{"op": "fix", "files": [["pages-1.img", %d]]}\n' % len(payload)
              + json.dumps({"op": "deliver", "len": len(manifest)}).encode() + b"\n" + manifest + b'{"op": "end"}\n')
    rc, out = _run(dest, stream)
    assert rc == 0 and json.loads(out.getvalue().splitlines()[-1]) == {"delivered": True}
    with open(os.path.join(dest, "pages-1.img"), "rb") as fh:
        assert fh.read() == payload
    assert len(_receipts(dest)) == 1 and os.path.exists(os.path.join(dest, image.MANIFEST))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_the_receivers_failure_in_its_words(tmp_path):
    """A real ENOSPC in the writer thread: the receiver program exits 1 saying so (the sender reads "No space
    left on device" and does not retry), and no receipt claims the range."""
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "gpuckpt-test-small", str(root)], check=True)
    try:
        dest = str(root / "img")
        stream = _data("pages-1.img", 0, os.urandom(6 * 2**20)) + b'{"op": "end"}\n'
        program = streams.receiver_program()  # the receiver as a stream starts it (no package on the target)
        proc = subprocess.run([sys.executable, "-c", streams._BOOTSTRAP % len(program),
                               json.dumps({"dest": dest, "image_id": "img-b"})],
                              input=program + stream, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
        assert proc.returncode == 1, proc.stderr
        assert b"gpuckpt receiver: [Errno 28] No space left on device" in proc.stderr
        assert _receipts(dest) == []
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
