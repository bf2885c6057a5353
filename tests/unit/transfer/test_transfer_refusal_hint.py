"""transfer/transfer.py: the hint of a failed transfer says what failed. A receiver that answered (ssh and its Python ran)
and refused for a full disk (ENOSPC creating the image: issue 43, item 8) is named as a full disk, never as ssh or
Python; a receiver that refused for another reason is not hinted as ssh or Python either; an ssh that cannot connect
is.

TEST DOUBLE: ``ssh`` is replaced by a script that, as FAKE_SSH_MODE says, answers as a receiver that refuses with
ENOSPC (``refuse-full``) or for another reason (``refuse-other``), or fails as an ssh that cannot connect (``down``).
The real ssh path runs in tests/integration/test_failover_more.py.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import targets, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer.streams import TransferError

FAKE_SSH = r'''#!%(py)s
import json, os, re, sys
cmd = sys.argv[-1]
mode = os.environ["FAKE_SSH_MODE"]
if mode == "down":
    sys.stderr.write("ssh: connect to host hostb port 22: Connection refused\n")
    sys.exit(255)
left = int(re.search(r"read\((\d+)\)", cmd).group(1))  # the receiver program, as a receiver reads it
while left > 0:
    left -= len(os.read(0, left))
error = {"refuse-full": "[Errno 28] No space left on device: '/srv/images/x/.gpuckpt'",
         "refuse-other": "/srv/images/x holds something other than an image"}[mode]
sys.stdout.write(json.dumps({"ready": False, "error": error}) + "\n")
sys.stdout.flush()
sys.exit(2)
'''


def _send(tmp_path, retries=0):
    src = tmp_path / "src"
    image.prepare_dir(str(src))
    (src / "pages-1.img").write_bytes(os.urandom(4096))
    image.write_manifest(str(src), {"id": "img-1", "files": image.checksum_files(str(src))})
    target = targets.Target("hostb", io_timeout=30, python=sys.executable)
    with pytest.raises(TransferError) as exc:
        transfer.send_image(str(src), target, str(tmp_path / "dest"), receiver={"image_id": "img-1"}, streams=1,
                            retries=retries, retry_delay=0.01)
    return exc.value


def test_a_receiver_that_refuses_with_a_full_disk_is_named_a_full_disk(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "refuse-full")
    err = _send(tmp_path, retries=2)
    assert "the target's disk is full" in err.msg, err.msg
    assert err.hint == "free space on the target", err.hint
    assert not err.retryable and re.search(r"failed after 1 attempt", err.msg), err.msg
    assert "ssh" not in json.dumps(err.to_dict().get("hint")), err.to_dict()


def test_a_receiver_that_refuses_for_another_reason_is_not_hinted_as_ssh_or_python(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "refuse-other")
    err = _send(tmp_path)
    assert "holds something other" in err.msg and "disk is full" not in err.msg, err.msg
    assert "ssh" not in err.hint and "Python" not in err.hint, err.hint


def test_an_ssh_that_cannot_connect_is_hinted_as_ssh_and_python(tmp_path, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_MODE", "down")
    err = _send(tmp_path)
    assert "over ssh and that its Python 3 runs" in err.hint, err.hint
