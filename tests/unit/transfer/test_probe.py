"""transfer/link_probe.probe and the receiver's side of it: a measured probe of the link (gpu_image_sync's probe_mib),
with the transfer a migration uses, that leaves nothing on either host, also when the transfer fails.

TEST DOUBLE: ``ssh`` is replaced by a script that runs the remote command here with sh (the real receiver),
and can be told to cut the stream after some bytes, as a broken link does. The real ssh path runs in
tests/integration/test_probe.py between the loopback hosts.
"""
from __future__ import annotations

import io
import json
import os
import sys
import zlib

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import link_probe, receiver, streams, targets
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.modules import gpu_image_sync

FAKE_SSH = r'''#!%(py)s
import os, subprocess, sys
cmd = sys.argv[-1]
with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
    fh.write(("remove" if "remove_probe" in cmd else "send") + "\n")
cut = os.environ.get("FAKE_SSH_CUT")
if cut and "remove_probe" not in cmd:
    proc = subprocess.Popen(["sh", "-c", cmd], stdin=subprocess.PIPE)
    left = int(cut)
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


def _target():
    return targets.Target("hostb", io_timeout=30, python=sys.executable)


def _roots(tmp_path):
    node, target = tmp_path / "images-a", tmp_path / "images-b"
    node.mkdir(mode=0o700)
    target.mkdir(mode=0o700)
    return node, target


def test_a_probe_measures_the_transfer_and_leaves_nothing_on_either_host(tmp_path, fake_ssh):
    node, target = _roots(tmp_path)
    res = link_probe.probe(str(node / ".gpuckpt-probe-1"), _target(), str(target / ".gpuckpt-probe-1"), 3, streams=2)
    assert res["bytes"] > 3 * 2**20 and res["seconds"] > 0 and res["streams"] == 2 and res["attempts"] == 1
    assert res["bytes_s"] == int(round(res["bytes"] / res["data_seconds"])) and 0 < res["data_seconds"] <= res["seconds"]
    assert res["setup_seconds"] == round(res["seconds"] - res["data_seconds"], 3)
    assert os.listdir(node) == [] and os.listdir(target) == []
    # Its streams (one: 3 MiB is one 64 MiB piece, but both streams open), then one receiver that removed the copy.
    assert open(fake_ssh).read().split() == ["send", "send", "remove"]


def test_a_failed_transfer_still_leaves_nothing_and_says_why(tmp_path, fake_ssh, monkeypatch):
    node, target = _roots(tmp_path)
    monkeypatch.setenv("FAKE_SSH_CUT", str(len(streams.receiver_program()) + 2 * 2**20))
    with pytest.raises(GpuCkptError) as err:
        link_probe.probe(str(node / ".gpuckpt-probe-1"), _target(), str(target / ".gpuckpt-probe-1"), 8, streams=1,
                         retries=0)
    assert "failed after 1 attempt" in err.value.msg and "could not remove" not in err.value.msg
    assert os.listdir(node) == [] and os.listdir(target) == []
    assert open(fake_ssh).read().split() == ["send", "remove"]


def test_a_scratch_dir_that_exists_or_a_dest_not_named_as_a_probe_is_refused_untouched(tmp_path, fake_ssh):
    node, target = _roots(tmp_path)
    mine = node / ".gpuckpt-probe-1"
    mine.mkdir()
    (mine / "keep").write_text("mine")
    with pytest.raises(InvalidTarget, match="cannot create the probe's scratch image"):
        link_probe.probe(str(mine), _target(), str(target / ".gpuckpt-probe-1"), 1)
    assert (mine / "keep").read_text() == "mine"
    with pytest.raises(InvalidTarget, match="not named as a probe"):
        link_probe.probe(str(node / ".gpuckpt-probe-2"), _target(), str(target / "job-1"), 1)
    with pytest.raises(InvalidTarget, match="at least 1 MiB"):
        link_probe.probe(str(node / ".gpuckpt-probe-2"), _target(), str(target / ".gpuckpt-probe-2"), 0)
    assert sorted(os.listdir(node)) == [".gpuckpt-probe-1"] and os.listdir(target) == []
    assert not fake_ssh.exists()  # nothing reached the target


def test_the_scratch_image_is_complete_and_cannot_be_compressed(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    m = link_probe.write_probe_image(str(scratch), 2, "probe-x")
    assert m["id"] == "probe-x" and m["probe"] and image.image_bytes(m) == 2 * 2**20
    assert image.load_manifest(str(scratch))["files"] == image.checksum_files(str(scratch))
    data = (scratch / link_probe.PROBE_FILE).read_bytes()
    assert len(zlib.compress(data[:2**20], 6)) > 0.99 * 2**20


def _receive(config):
    out = io.BytesIO()
    rc = receiver.Receiver(config, io.BytesIO(b'{"op": "end"}\n'), out).run()
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_probe_receiver_writes_only_into_a_directory_it_created(tmp_path):
    empty = tmp_path / ".gpuckpt-probe-1"
    empty.mkdir(mode=0o700)  # empty, but not created by a receiver of this probe
    rc, replies = _receive({"dest": str(empty), "image_id": "probe-1", "probe": True})
    assert rc == receiver.REFUSED and "holds something other" in replies[0]["error"]
    rc, replies = _receive({"dest": str(tmp_path / "job-1"), "image_id": "probe-1", "probe": True})
    assert rc == receiver.REFUSED and "not named as a probe" in replies[0]["error"]
    assert not (tmp_path / "job-1").exists()
    new = tmp_path / ".gpuckpt-probe-2"
    assert _receive({"dest": str(new), "image_id": "probe-2", "probe": True})[0] == 0
    assert json.load(open(new / ".gpuckpt" / "transfer.json")) == {"image_id": "probe-2", "probe": True}
    assert _receive({"dest": str(new), "image_id": "probe-2", "probe": True})[0] == 0  # its other streams, a retry


def _probe_dir(path, probe_id):
    assert receiver.Receiver({"dest": str(path), "image_id": probe_id, "probe": True}, io.BytesIO(b'{"op": "end"}\n'),
                             io.BytesIO()).run() == 0
    (path / "probe.bin").write_bytes(b"x" * 10)


def test_the_receiver_removes_only_the_scratch_image_of_its_probe_and_follows_no_symlink(tmp_path):
    probe_dir = tmp_path / ".gpuckpt-probe-1"
    _probe_dir(probe_dir, "probe-1")
    with pytest.raises(receiver.Refused, match="not the scratch image of probe probe-2"):
        receiver.remove_probe_dir(str(probe_dir), "probe-2")  # another probe's
    with pytest.raises(receiver.Refused, match="not named as a probe"):
        receiver.remove_probe_dir(str(tmp_path), "probe-1")
    # A symlink named as a probe's, to the probe's own directory, is not followed.
    link = tmp_path / ".gpuckpt-probe-link"
    link.symlink_to(probe_dir)
    with pytest.raises(receiver.UnsafePath):
        receiver.remove_probe_dir(str(link), "probe-1")
    # A directory of someone's, named as a probe's but without the mark, stays.
    other = tmp_path / ".gpuckpt-probe-other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(receiver.Refused):
        receiver.remove_probe_dir(str(other), "probe-1")
    assert (other / "notes.txt").exists() and (probe_dir / "probe.bin").exists() and link.is_symlink()
    # Through the receiver program's own operation: removed, then absent.
    rc, replies = _receive({"dest": str(probe_dir), "image_id": "probe-1", "remove_probe": True})
    assert rc == 0 and replies == [{"ready": True, "removed": True}] and not probe_dir.exists()
    rc, replies = _receive({"dest": str(probe_dir), "image_id": "probe-1", "remove_probe": True})
    assert rc == 0 and replies == [{"ready": True, "removed": False}]
    rc, replies = _receive({"dest": str(other), "image_id": "probe-1", "remove_probe": True})
    assert rc == receiver.REFUSED and "not the scratch image" in replies[0]["error"] and other.exists()


def test_the_module_probes_nothing_in_check_mode():
    res = gpu_image_sync.probe_link({"probe_mib": 64}, True)
    assert res["probe"] is None and not res["changed"]
