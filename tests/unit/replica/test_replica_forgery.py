"""What a push must not be able to forge in a replica store (issue 43, items 4 and 5).

4. A job's epoch and owner are the replica's alone, moved only by a failover (gpu_replica failover/fence) or by the
   operator's explicit re-protect (gpu_replica reprotect, which the protect role runs): a push, a commit or a fence
   check naming the owner at a higher epoch than the record's is refused or answered, never adopted, and nothing is
   written. (The bug: a push naming the owner at epoch 7 against a record at epoch 1 was taken; the owner's next
   fence check fenced itself and SIGKILLed the job.)
5. A sender names only the image's own files: every relative path of a data, fix or sums operation is normalised
   before any guard, so that ``./.gpuckpt/replica.json`` (the replica's verified mark) or ``./manifest.json`` is
   refused like ``.gpuckpt/replica.json``; and a second push of an image that already has its replica mark changes
   none of its files. (The bug: an image pushed complete but never committed was listed committed and verified
   after a later push of the same id wrote ``./.gpuckpt/replica.json``.)

The receiver runs in this process on in-memory streams, as test_receiver_replica.py runs it."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica, replica_images, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import receiver, streams
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.fsutil import UnsafePath
from ansible_collections.gpuckpt.fleet.plugins.modules import gpu_replica

JOB = "train-1"


def _root(tmp_path):
    root = tmp_path / "replicas"
    root.mkdir(mode=0o700)
    return root


def _source(tmp_path, image_id="img-1", at=1000.0):
    src = tmp_path / ("src-" + image_id)
    image.prepare_dir(str(src))
    (src / "pages-1.img").write_bytes(os.urandom(70000))
    (src / "core-1.img").write_bytes(b"core" * 10)
    image.write_manifest(str(src), {"id": image_id, "frozen_at": at, "files": image.checksum_files(str(src))})
    return src


def _data(rel, payload, off=0):
    return json.dumps({"op": "data", "path": rel, "off": off, "len": len(payload)}).encode() + b"\n" + payload


def _ops(src, end=True):
    """The framed operations a sender writes for the whole image ``src``: data, fix, deliver (and end)."""
    manifest = image.load_manifest(str(src))
    out = b""
    for rel, meta in sorted(manifest["files"].items()):
        out += _data(rel, (src / rel).read_bytes())
    out += json.dumps({"op": "fix", "files": [[r, m["size"]] for r, m in sorted(manifest["files"].items())]}).encode()
    body = (src / image.MANIFEST).read_bytes()
    out += b"\n" + json.dumps({"op": "deliver", "len": len(body)}).encode() + b"\n" + body
    return out + (b'{"op": "end"}\n' if end else b"")


def _config(root, image_id="img-1", epoch=1, node="node-a"):
    return {"dest": os.path.join(str(root), JOB, image_id), "image_id": image_id,
            "replica": {"root": str(root), "job": JOB, "epoch": epoch, "node": node}}


def _receive(config, data=b'{"op": "end"}\n'):
    out = io.BytesIO()
    try:
        rc = receiver.Receiver(config, io.BytesIO(data), out).run()
    except (receiver.Refused, UnsafePath):
        rc = receiver.REFUSED
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


def _record_bytes(root):
    return (root / JOB / "job.json").read_bytes()


def _tree(path):
    """{relpath: bytes} of every file below ``path``, the state dir's receipts aside (a refused push may leave its
    empty receipt)."""
    out = {}
    for where, _dirs, files in os.walk(str(path)):
        for name in files:
            rel = os.path.relpath(os.path.join(where, name), str(path))
            if not os.path.basename(rel).startswith(image.RECEIPT_PREFIX):
                with open(os.path.join(where, name), "rb") as fh:
                    out[rel] = fh.read()
    return out


# -- 4: a push never moves an epoch ------------------------------------------------------------------------------
def test_a_push_naming_the_owner_at_a_higher_epoch_is_refused_and_writes_nothing(tmp_path):
    root = _root(tmp_path)
    replica.check_push(str(root), JOB, 1, "node-a")
    before = _record_bytes(root)
    for create in (True, False):
        with pytest.raises(GpuCkptError, match="epoch 7 .*ahead of this replica's record .*epoch 1") as err:
            replica.check_push(str(root), JOB, 7, "node-a", create)
        assert not getattr(err.value, "fenced", False) and err.value.details["epoch"] == 1
    with pytest.raises(GpuCkptError, match="ahead"):
        with replica.push_guard(str(root), JOB, 7, "node-a"):
            raise AssertionError("the guard let a push at a higher epoch write its manifest")
    assert _record_bytes(root) == before
    # The owner's fence check at its own epoch: not fenced. A node whose config is ahead is told so, not fenced.
    assert replica.check(str(root), JOB, 1, "node-a") == {"epoch": 1, "owner": "node-a", "fenced": False,
                                                          "reason": None}
    said = replica.check(str(root), JOB, 7, "node-a", create=True)
    assert said["fenced"] is False and said["epoch"] == 1 and "ahead" in said["reason"]
    assert _record_bytes(root) == before


def test_the_push_of_the_issue_is_refused_before_a_byte_and_the_owner_is_not_fenced(tmp_path):
    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, replies = _receive(_config(root), _ops(src))
    assert rc == 0 and replies[-1] == {"delivered": True}
    before = _record_bytes(root)
    forged = _source(tmp_path, "img-2")
    rc, replies = _receive(_config(root, "img-2", epoch=7), _ops(forged))
    assert rc == receiver.REFUSED and replies[0]["ready"] is False and "fenced" not in replies[0], replies
    assert "ahead" in replies[0]["error"]
    assert not (root / JOB / "img-2").exists() and _record_bytes(root) == before
    assert json.loads(before)["epoch"] == 1 and json.loads(before)["owner"] == "node-a"
    said = replica.check(str(root), JOB, 1, "node-a")
    assert said["fenced"] is False and said["epoch"] == 1
    # Nor does its commit move anything: refused, nothing marked.
    rc, replies = _receive({"replica_op": "commit", "root": str(root), "job": JOB, "image_id": "img-1", "epoch": 7,
                            "node": "node-a", "keep": 2})
    assert rc == receiver.REFUSED and "ahead" in replies[0]["error"] and "fenced" not in replies[0]
    assert not (root / JOB / "img-1" / image.STATE_DIR / replica_images.REPLICA_MARK).exists()
    assert _record_bytes(root) == before
    # The owner's own commit at its epoch still counts the image.
    assert replica_images.commit(str(root), JOB, "img-1", 1, "node-a", 2)["verified"]
    assert _record_bytes(root) == before


def test_a_commit_at_a_higher_epoch_is_refused_even_while_the_push_was_taken(tmp_path):
    """A push delivered at the record's epoch, then committed claiming a higher one: refused, nothing written."""
    root = _root(tmp_path)
    rc, unused = _receive(_config(root), _ops(_source(tmp_path)))
    assert rc == 0
    before = _record_bytes(root)
    with pytest.raises(GpuCkptError, match="ahead"):
        replica_images.commit(str(root), JOB, "img-1", 2, "node-a", 2)
    assert _record_bytes(root) == before
    assert not (root / JOB / "img-1" / image.STATE_DIR / replica_images.REPLICA_MARK).exists()


def test_only_an_explicit_reprotect_raises_the_owners_epoch(tmp_path):
    root = _root(tmp_path)
    replica.check_push(str(root), JOB, 1, "node-a")
    before = _record_bytes(root)
    # Check mode: what it would record, nothing written.
    res = replica_owner.reprotect(str(root), JOB, 3, "node-a", "protected again", write=False)
    assert res["changed"] and res["record"]["epoch"] == 3 and _record_bytes(root) == before
    res = replica_owner.reprotect(str(root), JOB, 3, "node-a", "protected again")
    assert res["changed"] and res["record"]["epoch"] == 3 and res["record"]["owner"] == "node-a"
    record = json.loads(_record_bytes(root))
    assert record["epoch"] == 3 and record["history"][-1]["event"] == "reprotected"
    last = record["history"][-1]
    assert last["reason"] == "protected again (epoch 1 before)" and last["from"] == last["owner"] == "node-a"
    assert replica.check_push(str(root), JOB, 3, "node-a")["epoch"] == 3  # the owner's pushes at it are taken
    with pytest.raises(replica.StaleEpoch):
        replica.check_push(str(root), JOB, 1, "node-a")
    # The same epoch again: nothing to do. A lower one, or another node: refused (a failover moves owners).
    assert replica_owner.reprotect(str(root), JOB, 3, "node-a")["changed"] is False
    after = _record_bytes(root)
    with pytest.raises(replica.FailoverRefused, match="higher"):
        replica_owner.reprotect(str(root), JOB, 2, "node-a")
    with pytest.raises(replica.FailoverRefused, match="belongs to node-a"):
        replica_owner.reprotect(str(root), JOB, 4, "node-b")
    assert _record_bytes(root) == after
    # A job without a record on this replica gets one.
    other = tmp_path / "replica-2"
    other.mkdir(mode=0o700)
    res = replica_owner.reprotect(str(other), JOB, 3, "node-a")
    assert res["changed"] and replica_images.list_images(str(other), JOB)["record"]["epoch"] == 3
    # A node's request to the receiver cannot do it: that is no replica_op.
    rc, replies = _receive({"replica_op": "reprotect", "root": str(root), "job": JOB, "epoch": 9, "node": "node-a"})
    assert rc == receiver.REFUSED and "unknown replica operation" in replies[0]["error"]
    assert _record_bytes(root) == after


def _module(capsys, check_mode=False, **args):
    if check_mode:
        args["_ansible_check_mode"] = True
    with patch_module_args(args), pytest.raises(SystemExit):
        gpu_replica.main()
    return json.loads(capsys.readouterr().out)


def test_the_module_reprotects(tmp_path, capsys):
    root = _root(tmp_path)
    replica.check_push(str(root), JOB, 1, "node-a")
    res = _module(capsys, True, root=str(root), job=JOB, state="reprotect", node="node-a", epoch=3)
    assert res["changed"] and res["epoch"] == 3 and res["record"]["epoch"] == 1
    res = _module(capsys, root=str(root), job=JOB, state="reprotect", node="node-a", epoch=3, reason="protect role")
    assert res["changed"] and res["epoch"] == 3 and res["record"]["epoch"] == 3
    res = _module(capsys, root=str(root), job=JOB, state="reprotect", node="node-a", epoch=3)
    assert not res["changed"] and res["epoch"] == 3
    res = _module(capsys, root=str(root), job=JOB, state="reprotect", node="node-b", epoch=4)
    assert res["failed"] and "belongs to node-a" in res["msg"]
    res = _module(capsys, root=str(root), job=JOB, state="reprotect", epoch=4)
    assert res["failed"] and "node" in res["msg"]


# -- 5: a sender names only the image's files --------------------------------------------------------------------
BAD_PATHS = ("./.gpuckpt/replica.json", ".gpuckpt/replica.json", ".//.gpuckpt/replica.json", "./.gpuckpt",
             ".gpuckpt", "a/../.gpuckpt/replica.json", "./manifest.json", "manifest.json", ".//manifest.json.tmp",
             "manifest.json/", "", ".", "./", "/etc/passwd", "//etc/passwd", "..", "../x", "a/../../x", "a/..",
             "x\0y")


@pytest.mark.parametrize("rel", BAD_PATHS)
def test_no_path_a_sender_names_reaches_the_state_dir_the_manifest_or_outside(tmp_path, rel):
    for op in ("data", "fix", "sums"):
        (tmp_path / op).mkdir()
        root = _root(tmp_path / op)
        src = _source(tmp_path / op)
        if op == "data":
            sent = _data(rel, b'{"verified": true, "epoch": 1, "node": "node-a"}')
        elif op == "fix":
            sent = json.dumps({"op": "fix", "files": [[rel, 0]]}).encode() + b"\n"
        else:
            sent = json.dumps({"op": "sums", "files": [rel]}).encode() + b"\n"
        rc, replies = _receive(_config(root), _ops(src, end=False) + sent + b'{"op": "end"}\n')
        assert rc == receiver.REFUSED, (op, rel, replies)
        dest = root / JOB / "img-1"
        assert not (dest / image.STATE_DIR / replica_images.REPLICA_MARK).exists(), (op, rel)
        assert (dest / image.MANIFEST).read_bytes() == (src / image.MANIFEST).read_bytes(), (op, rel)
        assert sorted(os.listdir(str(root / JOB))) == [".lock", "img-1", "job.json"], (op, rel)
        listed = replica_images.list_images(str(root), JOB)["images"]
        assert [(i["committed"], i["verified"]) for i in listed] == [(False, False)], (op, rel)


def test_one_function_normalises_every_path_a_sender_names():
    assert receiver.image_rel("./pages-1.img") == "pages-1.img"
    assert receiver.image_rel("a//b/./c") == "a/b/c"
    assert receiver.image_rel(".gpuckpt-probe-1/x") == ".gpuckpt-probe-1/x"  # a name that only begins so
    assert receiver.image_rel("manifest-of-mine.txt") == "manifest-of-mine.txt"
    for bad in BAD_PATHS + (None, 3, b"pages-1.img"):
        with pytest.raises(receiver.Refused):
            receiver.image_rel(bad)


def test_the_issues_forged_verified_mark_is_refused(tmp_path):
    """An image pushed complete but never committed, then a push of the same id writing the replica's mark."""
    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, unused = _receive(_config(root), _ops(src))
    assert rc == 0
    mark = {"verified": True, "verified_at": "2026-01-01T00:00:00+00:00", "epoch": 1, "node": "node-a",
            "bytes": 1, "checkpoint_at": "2026-01-01T00:00:00+00:00", "progress": None, "stall_s": None,
            "corrupt": None}
    rc, replies = _receive(_config(root), _data("./.gpuckpt/replica.json", json.dumps(mark).encode())
                           + b'{"op": "end"}\n')
    assert rc == receiver.REFUSED and replies[0]["ready"]
    listed = replica_images.list_images(str(root), JOB)["images"]
    assert [(i["id"], i["committed"], i["verified"]) for i in listed] == [("img-1", False, False)]
    ok, why, unused = replica_images.reverify(str(root), JOB, "img-1")
    assert not ok and "never committed" in why


def test_a_second_push_of_a_committed_image_changes_none_of_its_files(tmp_path):
    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, unused = _receive(_config(root), _ops(src))
    assert rc == 0 and replica_images.commit(str(root), JOB, "img-1", 1, "node-a", 2)["verified"]
    dest = root / JOB / "img-1"
    before = _tree(dest)
    other = _source(tmp_path, "img-1-again")
    for sent in (_data("pages-1.img", os.urandom(70000)), _data("new-file.img", b"x"),
                 json.dumps({"op": "fix", "files": [["pages-1.img", 1]]}).encode() + b"\n",
                 _ops(other, end=False)):
        rc, replies = _receive(_config(root), sent + b'{"op": "end"}\n')
        assert rc == receiver.REFUSED and replies[0]["ready"] is False and "committed" in replies[0]["error"]
        assert _tree(dest) == before
    assert replica_images.reverify(str(root), JOB, "img-1")[0]


def test_a_push_that_was_open_when_its_image_was_committed_writes_nothing_more(tmp_path):
    """A second receiver of the same id, opened before the first push's commit: its later operations are refused."""
    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, unused = _receive(_config(root), _ops(src))
    assert rc == 0
    later = _data("pages-1.img", os.urandom(70000)) + b'{"op": "end"}\n'
    recv = receiver.Receiver(_config(root), io.BytesIO(later), io.BytesIO())
    recv.open()
    try:
        assert replica_images.commit(str(root), JOB, "img-1", 1, "node-a", 2)["verified"]
        dest = root / JOB / "img-1"
        before = _tree(dest)
        header = json.loads(recv.inp.readline())
        with pytest.raises(receiver.Refused, match="committed"):
            recv.data(header)
        recv._written()
        assert _tree(dest) == before
    finally:
        recv.close()
    assert replica_images.reverify(str(root), JOB, "img-1")[0]


def test_the_receiver_program_refuses_them_too(tmp_path):
    """The assembled receiver program (what ssh runs on a replica), not this process's modules."""
    program = streams.receiver_program()

    def run(config, ops):
        proc = subprocess.run([sys.executable, "-c", streams._BOOTSTRAP % len(program), json.dumps(config)],
                              input=program + ops, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60,
                              check=False)
        return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]

    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, replies = run(_config(root), _ops(src))
    assert rc == 0 and replies[-1] == {"delivered": True}
    rc, replies = run(_config(root), _data("./.gpuckpt/replica.json", b'{"verified": true}') + b'{"op": "end"}\n')
    assert rc == receiver.REFUSED and [(i["committed"], i["verified"]) for i in
                                       replica_images.list_images(str(root), JOB)["images"]] == [(False, False)]
    rc, replies = run(_config(root, "img-2", epoch=7), _ops(_source(tmp_path, "img-2")))
    assert rc == receiver.REFUSED and "ahead" in replies[0]["error"] and not (root / JOB / "img-2").exists()
    assert replica_images.commit(str(root), JOB, "img-1", 1, "node-a", 2)["verified"]
    before = _tree(root / JOB / "img-1")
    rc, replies = run(_config(root), _data("pages-1.img", b"x" * 100) + b'{"op": "end"}\n')
    assert rc == receiver.REFUSED and "committed" in replies[0]["error"] and _tree(root / JOB / "img-1") == before
