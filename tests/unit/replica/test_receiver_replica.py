"""A push into a replica store, as the receiver takes it (receiver.py with replica/replica.py), and the store's
operations a node asks for (transfer.replica_call): a fenced copy is refused before any byte is written and
again before its manifest is written, a push goes only to <root>/<job>/<image_id>, and a fence comes back as
a fence, not as a broken link.

The receiver runs in this process, as the other receiver tests run it; the end-to-end ones go through a TEST
DOUBLE ``ssh`` that runs the remote command here with sh (the real receiver program, assembled from core/)."""
from __future__ import annotations

import io
import json
import os
import stat
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica, replica_images, replica_owner
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import receiver, streams, targets, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError

JOB = "train-1"


def _source(tmp_path, image_id="img-1", at=1000.0):
    src = tmp_path / ("src-" + image_id)
    image.prepare_dir(str(src))
    (src / "pages-1.img").write_bytes(os.urandom(70000))
    (src / "core-1.img").write_bytes(b"core" * 10)
    image.write_manifest(str(src), {"id": image_id, "frozen_at": at, "files": image.checksum_files(str(src))})
    return src


def _ops(src):
    """The framed operations a sender writes for the whole image ``src``: data, fix, deliver, end."""
    manifest = image.load_manifest(str(src))
    out = b""
    for rel, meta in sorted(manifest["files"].items()):
        data = (src / rel).read_bytes()
        out += json.dumps({"op": "data", "path": rel, "off": 0, "len": len(data)}).encode() + b"\n" + data
    out += json.dumps({"op": "fix", "files": [[r, m["size"]] for r, m in sorted(manifest["files"].items())]}).encode() + b"\n"
    body = (src / image.MANIFEST).read_bytes()
    out += json.dumps({"op": "deliver", "len": len(body)}).encode() + b"\n" + body
    return out + b'{"op": "end"}\n'


def _config(root, image_id="img-1", epoch=1, node="node-a", job=JOB, dest=None):
    return {"dest": dest or os.path.join(str(root), job, image_id), "image_id": image_id,
            "replica": {"root": str(root), "job": job, "epoch": epoch, "node": node}}


def _receive(config, data=b'{"op": "end"}\n'):
    out = io.BytesIO()
    try:
        rc = receiver.Receiver(config, io.BytesIO(data), out).run()
    except receiver.Refused:
        rc = receiver.REFUSED
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


def _root(tmp_path):
    root = tmp_path / "replicas"
    root.mkdir(mode=0o700)
    return root


def test_a_push_lands_whole_in_the_store_and_its_commit_counts_it(tmp_path):
    root = _root(tmp_path)
    src = _source(tmp_path)
    rc, replies = _receive(_config(root), _ops(src))
    assert rc == 0 and replies[0]["ready"] and replies[-1] == {"delivered": True}
    dest = root / JOB / "img-1"
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o700 and (dest / image.MANIFEST).exists()
    assert json.loads((dest / ".gpuckpt" / "transfer.json").read_text()) == {
        "image_id": "img-1", "replica": {"epoch": 1, "node": "node-a"}}
    assert replica_images.list_images(str(root), JOB)["record"]["owner"] == "node-a"
    rc, replies = _receive({"replica_op": "commit", "root": str(root), "job": JOB, "image_id": "img-1", "epoch": 1,
                            "node": "node-a", "keep": 2, "meta": {"progress": {"step": 5}, "stall_s": 0.2}})
    assert rc == 0 and replies == [{"ready": True, "verified": True, "image_id": "img-1", "kept": ["img-1"], "removed": []}]
    rc, replies = _receive({"replica_op": "list", "root": str(root), "job": JOB})
    assert rc == 0 and replies[0]["images"][0]["verified"] and replies[0]["images"][0]["progress"] == {"step": 5}


def test_a_fenced_copy_is_refused_before_any_byte_is_written(tmp_path):
    root = _root(tmp_path)
    replica.check_push(str(root), JOB, 1, "node-a")
    replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-0")
    ops = _ops(_source(tmp_path))
    rc, replies = _receive(_config(root, "img-1"), ops)
    assert rc == receiver.REFUSED and replies == [{"ready": False, "fenced": True, "error": replies[0]["error"]}]
    assert "failed over to node-b at epoch 2" in replies[0]["error"]
    assert not (root / JOB / "img-1").exists()
    # The new owner's push is taken.
    rc, replies = _receive(_config(root, "img-1", epoch=2, node="node-b"), ops)
    assert rc == 0 and replies[-1] == {"delivered": True}


def test_a_failover_during_the_push_keeps_its_manifest_out(tmp_path):
    root = _root(tmp_path)
    src = _source(tmp_path)
    ops = _ops(src)
    deliver_at = ops.index(b'{"op": "deliver"')
    out = io.BytesIO()
    recv = receiver.Receiver(_config(root), io.BytesIO(ops[deliver_at:]), out)
    recv.open()
    for line in ops[:deliver_at].split(b"\n"):  # the data and sizes arrive while the job still belongs to node-a
        if line.startswith(b'{"op": "fix"'):
            recv.fix(json.loads(line))
    replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-0", "node-a lost")
    header = json.loads(recv.inp.readline())
    with pytest.raises(receiver.Refused, match="failed over to node-b"):
        recv.deliver(header)
    recv.close()
    assert json.loads(out.getvalue())["fenced"] is True
    assert not (root / JOB / "img-1" / image.MANIFEST).exists()
    assert [i["complete"] for i in replica_images.list_images(str(root), JOB)["images"]] == [False]


def test_a_push_goes_only_to_its_place_in_the_store(tmp_path):
    root = _root(tmp_path)
    other = tmp_path / "other"
    for config, words in (
            (_config(root, dest=str(other / "img-1")), "goes to"),
            (_config(root, "../img-1", dest=str(root / "img-1")), "image id"),
            (_config(root, "a/b", dest=str(root / JOB / "a" / "b")), "image id"),
            (_config(root, job="../etc", dest=str(root / "etc" / "img-1")), "job name"),
            (dict(_config(root), replica={"job": JOB}), "names its root")):
        rc, replies = _receive(config)
        assert rc == receiver.REFUSED and words in replies[0]["error"], replies
    assert not other.exists() and os.listdir(root) == []
    # A job directory that is a symlink is never written through.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / JOB).symlink_to(elsewhere)
    rc, replies = _receive(_config(root), _ops(_source(tmp_path)))
    assert rc == receiver.REFUSED and "symlink" in replies[0]["error"] and os.listdir(elsewhere) == []


def test_the_store_operations_reply_once_and_refuse_what_they_cannot_do(tmp_path):
    root = _root(tmp_path)
    rc, replies = _receive({"replica_op": "check", "root": str(root), "job": JOB, "epoch": 1, "node": "node-a",
                            "create": False})
    assert rc == 0 and replies == [{"ready": True, "epoch": None, "owner": None, "fenced": False,
                                    "reason": "no record of job %s on this replica" % JOB}]
    assert os.listdir(root) == []
    rc, replies = _receive({"replica_op": "commit", "root": str(root), "job": JOB, "image_id": "img-9", "epoch": 1,
                            "node": "node-a", "keep": 1})
    assert rc == receiver.REFUSED and "not on this replica" in replies[0]["error"] and "fenced" not in replies[0]
    rc, replies = _receive({"replica_op": "nope", "root": str(root), "job": JOB})
    assert rc == receiver.REFUSED and "unknown replica operation" in replies[0]["error"]
    rc, replies = _receive({"replica_op": "commit", "root": str(root), "job": JOB})
    assert rc == receiver.REFUSED and replies[0]["ready"] is False


# -- through the sender and the receiver program -------------------------------------------------------
@pytest.fixture
def local_ssh(tmp_path, monkeypatch):
    """TEST DOUBLE: an ``ssh`` that runs the remote command on this host (as test_transfer.py's)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text("#!%s\nimport subprocess, sys\nsys.exit(subprocess.call(['sh', '-c', sys.argv[-1]]))\n"
                   % sys.executable)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", "%s:%s" % (bindir, os.environ["PATH"]))


def _target():
    return targets.Target("replica-1", io_timeout=30, python=sys.executable)


def _ref(root, epoch=1, node="node-a"):
    return {"root": str(root), "job": JOB, "epoch": epoch, "node": node}


def test_a_node_pushes_commits_and_is_fenced_through_the_receiver_program(tmp_path, local_ssh):
    root = _root(tmp_path)
    for i, at in enumerate((1000.0, 2000.0, 3000.0)):
        image_id = "img-%d" % i
        src = _source(tmp_path, image_id, at)
        res = transfer.send_image(str(src), _target(), str(root / JOB / image_id),
                                  receiver={"image_id": image_id, "replica": _ref(root)}, streams=2)
        assert res["attempts"] == 1
        reply = transfer.replica_call(_target(), dict(_ref(root), replica_op="commit", image_id=image_id, keep=2,
                                                      meta={"checkpoint_at": at, "stall_s": 0.1}))
        assert reply["ready"] and reply["verified"] and reply["image_id"] == image_id
    assert reply["kept"] == ["img-2", "img-1"] and reply["removed"] == ["img-0"]
    listed = transfer.replica_call(_target(), {"replica_op": "list", "root": str(root), "job": JOB})
    assert [i["id"] for i in listed["images"]] == ["img-2", "img-1"] and listed["record"]["epoch"] == 1
    # The job is failed over; the old node's check, push and commit each say it is fenced.
    replica_owner.failover(str(root), JOB, "node-a", "node-b", "img-2", "node-a lost")
    said = transfer.replica_call(_target(), dict(_ref(root), replica_op="check", create=False))
    assert said["ready"] and said["fenced"] and said["owner"] == "node-b" and said["epoch"] == 2
    src = _source(tmp_path, "img-3", 4000.0)
    with pytest.raises(streams.TransferError) as err:
        transfer.send_image(str(src), _target(), str(root / JOB / "img-3"),
                            receiver={"image_id": "img-3", "replica": _ref(root)}, retries=3, retry_delay=0)
    assert err.value.details.get("fenced") is True and not err.value.retryable and "1 attempt" in err.value.msg
    assert not (root / JOB / "img-3").exists()
    said = transfer.replica_call(_target(), dict(_ref(root), replica_op="commit", image_id="img-2", keep=2))
    assert said["fenced"] and said["ready"] is False and "fenced" in said["error"]
    # A store that refuses for another reason, and a link that breaks, are errors.
    with pytest.raises(streams.TransferError, match="not on this replica"):
        transfer.replica_call(_target(), dict(_ref(root, 2, "node-b"), replica_op="commit", image_id="img-9", keep=2))
    with pytest.raises(GpuCkptError, match="replica store"):
        transfer.replica_call(targets.Target("replica-1", io_timeout=30, python="/nonexistent/python3"),
                              {"replica_op": "list", "root": str(root), "job": JOB})


def test_the_receiver_program_carries_the_replica_store():
    program = streams.receiver_program().decode()
    assert all("_SOURCES[%r] = " % mod.__name__ in program for mod in (replica, replica_images))  # core/bundle.py: receiver.py imports them
