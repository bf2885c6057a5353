"""A real CRIU restore whose image's pages are verified beside it (engine/verify_beside.py): CRIU holds
the restored tree at its post-restore action until the verdict (runtimes/criu_gate.py). Pages that do
not check out, or a verdict that never comes (the engine died), make CRIU kill the tree it built: the
workload never runs from them, counts nothing twice, and the same image, once whole, restores intact.

The GPU stage runs against the libcuda TEST DOUBLE (tests/fakecuda): CI has no GPU."""
from __future__ import annotations

import glob
import os
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import CommandError, ImageError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.criu_gate import RestoreGate
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend


def _flip_a_byte(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _nothing_ran(w, stopped):
    time.sleep(0.5)
    assert not w.alive(), "a restored process outlived the failed gate"
    assert w.counts() == stopped, "the restored tree ran before its pages checked out"


def test_a_real_criu_restore_runs_only_once_its_pages_check_out(tmp_path, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda, mb=16)
    image_dir = str(tmp_path / "img")
    checkpoint(w.pid, image_dir)
    stopped = w.counts()
    pages = max(glob.glob(os.path.join(image_dir, "pages-*.img")), key=os.path.getsize)
    middle = os.path.getsize(pages) // 2

    _flip_a_byte(pages, middle)
    with pytest.raises(ImageError) as err:
        restore(image_dir, verify_beside_bytes=0, pid_wait=2)
    assert err.value.details["bad_files"] == [os.path.basename(pages)]
    with open(os.path.join(image.state_dir(image_dir), "restore.log"), errors="replace") as fh:
        assert "post-restore script" in fh.read(), "CRIU restored the tree and the gate failed it"
    _nothing_ran(w, stopped)

    # The engine dies while CRIU waits at the gate: the kernel lets go of its lock, no verdict given.
    _flip_a_byte(pages, middle)  # whole again
    with image.Image.open(image_dir) as img, RestoreGate.open() as gate:
        gate._unlock()  # what the kernel does with the lock of a process that died
        with pytest.raises(CommandError):
            ProcessBackend().restore(img.path, img.state_dir, img.manifest, gate=gate)
    _nothing_ran(w, stopped)

    res = restore(image_dir, verify_beside_bytes=0, pid_wait=2)
    assert res["pages_verified_beside_restore"] is True and sorted(res["pids"]) == sorted(w.pids)
    after = w.wait_counting(beyond=stopped)
    for role in w.roles:
        assert stopped[role] < after[role] < stopped[role] + 200, "it counts on from where it stopped"
    assert w.intact()
