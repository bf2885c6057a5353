"""The page files verified beside the runtime's restore (engine/verify_beside.py): the restore checks
the rest of the image first, and the gate (runtimes/criu_gate.py, its real script run here as CRIU
runs it at post-restore) holds the restored tree until the pages check out. The backend and driver are
test_steps' TEST DOUBLES; this one plays CRIU by running the gate's script, and its failure as CRIU's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import CommandError, ImageError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import restore as restore_mod
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import verify_beside
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.steps import Clock

pytestmark = pytest.mark.usefixtures("no_host_facts")  # (tests/unit/engine/conftest.py)


@pytest.fixture
def gated_backend(recording_backend):
    """The class of a runtime TEST DOUBLE whose restore takes a gate."""
    class GatedBackend(recording_backend):
        """It writes CRIU's metadata and pages, and its restore runs the gate's script as CRIU does at
        post-restore, failing as CRIU does when it fails."""
        capabilities = recording_backend.capabilities._replace(gates_restore=True)

        def dump(self, target, image_dir, work_dir, after):
            out = super().dump(target, image_dir, work_dir, after)
            with open(os.path.join(image_dir, "core-1.img"), "wb") as fh:
                fh.write(b"\1" * 512)
            return out

        def restore(self, image_dir, work_dir, manifest, gate=None):
            self._record("runtime_restore", gate is not None)
            if gate is not None:
                rc = subprocess.run([gate.script], env={"CRTOOLS_SCRIPT_ACTION": "post-restore"}, timeout=30,
                                    check=False).returncode
                self.log.append(("gate", rc))
                if rc:
                    raise CommandError("criu exited with rc=1 (Aborting restore due to post-restore script ret code 1)",
                                       stage="criu-restore")
            return list(self.pids)
    return GatedBackend


def _gated_image(doubles, gated_backend, workload, tmp_path):
    root, b, c = workload
    log, drv, backend = doubles(backend_class=gated_backend)
    image_dir = str(tmp_path / "img")
    checkpoint(root, image_dir, backend=backend, parallel=False)
    log[:] = []
    drv.log = log
    return image_dir, backend, log


def _flip_a_byte(path):
    with open(path, "r+b") as fh:
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))


def test_pages_checked_beside_the_restore_open_its_gate(workload, tmp_path, doubles, gated_backend, gpu_given_back):
    root, b, c = workload
    image_dir, backend, log = _gated_image(doubles, gated_backend, workload, tmp_path)
    res = restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0, verify_beside_bytes=0)
    assert log == [("runtime_restore", True), ("gate", 0)] + gpu_given_back(b, c)
    assert res["pages_verified_beside_restore"] is True and res["verify_seconds"] >= 0
    assert res["pids"] == workload


def test_pages_that_do_not_check_out_fail_the_gate_and_nothing_of_the_restore_runs(workload, tmp_path, doubles, gated_backend):
    image_dir, backend, log = _gated_image(doubles, gated_backend, workload, tmp_path)
    _flip_a_byte(os.path.join(image_dir, "pages-1.img"))
    with pytest.raises(ImageError) as err:
        restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0, verify_beside_bytes=0)
    assert err.value.details["bad_files"] == ["pages-1.img"] and "checksum mismatch" in err.value.msg
    # The gate failed the runtime's restore (CRIU kills the tree it built): no GPU given back, no unlock.
    assert log == [("runtime_restore", True), ("gate", 1)]
    with image.Image.open(image_dir) as img:
        assert img.restored_mark() is None


def test_the_rest_of_the_image_is_checked_before_the_runtime_restores_anything(workload, tmp_path, doubles, gated_backend):
    image_dir, backend, log = _gated_image(doubles, gated_backend, workload, tmp_path)
    _flip_a_byte(os.path.join(image_dir, "core-1.img"))
    with pytest.raises(ImageError) as err:
        restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0, verify_beside_bytes=0)
    assert err.value.details["bad_files"] == ["core-1.img"]
    assert log == [], "CRIU's metadata steers it as root: it is never read unchecked"


def test_small_pages_or_check_mode_are_checked_first_without_a_gate(workload, tmp_path, doubles, gated_backend, gpu_given_back):
    root, b, c = workload
    image_dir, backend, log = _gated_image(doubles, gated_backend, workload, tmp_path)
    checked = restore(image_dir, backend=backend, check_mode=True, pid_wait=0, verify_beside_bytes=0)
    assert checked["changed"] is True and log == []
    res = restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0)  # 4 KiB of pages
    assert log == [("runtime_restore", False)] + gpu_given_back(b, c)
    assert res["pages_verified_beside_restore"] is False


class Journal(object):
    """TEST DOUBLE of a migration's target journal: the transitions a restore makes."""

    def __init__(self):
        self.phases = []

    def transition(self, phase, **data):
        self.phases.append((phase, data.get("bad_files")))

    def record(self, **data):
        self.phases.append(("record", None))


def test_in_a_migration_pages_that_fail_leave_the_journal_restore_failed_naming_them(workload, tmp_path, doubles, gated_backend):
    image_dir, backend, log = _gated_image(doubles, gated_backend, workload, tmp_path)
    _flip_a_byte(os.path.join(image_dir, "pages-1.img"))
    opts = restore_mod.RestoreOptions(parallel=False, validate_wait=0, pid_wait=0, verify_beside_bytes=0)
    journal = Journal()
    with image.Image.open(image_dir) as img:
        gate = verify_beside.open_gate(img, opts, backend)
        pages = verify_beside.PagesBeside(img, opts, gate).start()
        try:
            with pytest.raises(ImageError):
                restore_mod._bring_up(img, backend, backend.drv, None, Clock(), opts, journal, pages)
        finally:
            pages.settle()
    assert journal.phases == [("restoring", None), ("restore_failed", ["pages-1.img"])]
    assert not os.path.exists(gate.directory), "the gate's script is removed"


def _run_gate(script, action="post-restore"):
    """The gate's script as CRIU runs it: by exec, every descriptor but 0-2 closed, its action in the env."""
    return subprocess.Popen([script], env={"CRTOOLS_SCRIPT_ACTION": action}, stdin=subprocess.DEVNULL)


def test_the_gate_opens_only_on_ok_and_fails_when_its_engine_dies_without_a_verdict(tmp_path):
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.criu_gate import RestoreGate

    for verdict, rc in ((True, 0), (False, 1)):
        with RestoreGate.open([str(tmp_path)]) as gate:
            assert os.stat(gate.directory).st_mode & 0o777 == 0o700
            assert _run_gate(gate.script, "pre-restore").wait(10) == 0, "every other action passes at once"
            waiting = _run_gate(gate.script)
            with pytest.raises(subprocess.TimeoutExpired):
                waiting.wait(0.3)  # held until the verdict
            gate.decide(verdict)
            gate.decide(not verdict)  # a verdict is given once
            assert waiting.wait(10) == rc
    assert os.listdir(str(tmp_path)) == [], "a closed gate leaves nothing"

    # The engine is SIGKILLed while CRIU waits at its gate: the kernel lets go of its lock, no verdict.
    code = ("import sys, time; from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.criu_gate "
            "import RestoreGate; g = RestoreGate.open([sys.argv[1]]); print(g.script, flush=True); time.sleep(60)")
    engine = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, universal_newlines=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        script = engine.stdout.readline().strip()
        waiting = _run_gate(script)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(0.3)
        engine.kill()
        assert waiting.wait(10) == 1
    finally:
        engine.kill()
        engine.wait()
    assert RestoreGate.open([str(tmp_path / "absent")]) is None
