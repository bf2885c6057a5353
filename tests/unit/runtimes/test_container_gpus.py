"""Docker and Podman containers restored onto the GPUs and device numbers of the host they are restored on:
the spec a restored container runs under (a containerd shim's bundle; Podman's OCIConfigPath), the refusals
that remove the restored container, and a Podman export given this host's device numbers in a copy while the
image itself stays as it was. The real runtimes run in tests/integration/test_docker_cdi.py."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import base, podman_export

GPU_A, GPU_B = "GPU-aaaaaaaa-0000-4000-8000-000000000000", "GPU-bbbbbbbb-0000-4000-8000-000000000001"


def _spec(*nodes):
    return {"linux": {"devices": [{"path": p, "type": "c", "major": ma, "minor": mi} for p, ma, mi in nodes],
                      "resources": {"devices": [{"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rwm"}
                                                for _p, ma, mi in nodes]}}}


def test_the_spec_of_a_shim_started_container_is_the_config_in_the_shims_working_directory(tmp_path):
    """A containerd shim runs in its bundle: the spec of the container it started is config.json there."""
    (tmp_path / "config.json").write_text(json.dumps(_spec(("/dev/nvidia0", 195, 0))))
    shim = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen(['sleep', '30']); "
                             "print(p.pid, flush=True); p.wait()"], cwd=str(tmp_path), stdout=subprocess.PIPE)
    try:
        child = int(shim.stdout.readline())
        assert base.shim_bundle_spec(child)["linux"]["devices"][0]["path"] == "/dev/nvidia0"
        assert base.shim_bundle_spec(shim.pid) is None  # its parent's directory holds no config.json
    finally:
        shim.kill()
        shim.wait()
    assert base.shim_bundle_spec(2 ** 22 + 7) is None  # no such process: unknown, not "no GPU"


class _Container(base.ContainerBackend):
    name = "docker"

    def __init__(self):
        super().__init__()
        self.container, self.removed, self.adopted = "train-7", 0, []

    def remove(self):
        self.removed += 1

    # (what these tests never reach: the placement of a restored container's GPUs alone)
    def resolve(self, target):
        raise AssertionError("not reached")

    def dump(self, target, image_dir, work_dir, after):
        raise AssertionError("not reached")

    def restore(self, image_dir, work_dir, manifest):
        raise AssertionError("not reached")

    def runtime_facts(self):
        raise AssertionError("not reached")

    def running_containers(self):
        raise AssertionError("not reached")

    def adopt_devices(self, pid, tree, spec, pairs, sync):
        self.adopted.append((pid, pairs, sync))


MANIFEST = {"runtime": {"container": "train-7", "gpus": [{"uuid": GPU_A, "minor": 0}]},
            "target": {"cuda_pids": [11]}}


def test_a_restored_container_goes_onto_the_gpu_its_new_spec_gives_it(monkeypatch):
    monkeypatch.setattr(base.gpu_devices, "inventory", lambda root=None: [{"uuid": GPU_B, "minor": 1, "bus": "b"}])
    c = _Container()
    c.adopt_restored(MANIFEST, 42, [42], _spec(("/dev/nvidia1", 195, 1), ("/dev/nvidiactl", 195, 255)))
    assert c.adopted == [(42, [(GPU_A, GPU_B)], True)] and c.removed == 0


@pytest.mark.parametrize("spec, words", [
    (_spec(("/dev/nvidia0", 195, 0), ("/dev/nvidia1", 195, 1)), "held 1 GPU(s) when it was checkpointed and is given 2"),
    (None, "OCI spec could not be read"),
])
def test_a_restored_container_that_cannot_have_its_gpus_is_removed_and_the_error_says_so(monkeypatch, spec, words):
    monkeypatch.setattr(base.gpu_devices, "inventory", lambda root=None: [
        {"uuid": GPU_A, "minor": 0, "bus": "a"}, {"uuid": GPU_B, "minor": 1, "bus": "b"}])
    c = _Container()
    with pytest.raises(InvalidTarget) as err:
        c.adopt_restored(MANIFEST, 42, [42], spec)
    assert words in str(err.value) and "the restored container was removed" in str(err.value)
    assert c.removed == 1 and c.adopted == []


def test_an_image_of_an_older_collection_or_without_gpus_is_restored_as_before(monkeypatch):
    monkeypatch.setattr(base.gpu_devices, "inventory", lambda root=None: [])
    c = _Container()
    c.adopt_restored({"runtime": {"container": "x"}, "target": {"cuda_pids": [3]}}, 42, [42], None)
    c.adopt_restored({"runtime": {"container": "x"}, "target": {"cuda_pids": [3]}}, 42, [42], _spec())
    assert c.removed == 0 and c.adopted == [(42, None, False)]


def _export(path, spec):
    """An uncompressed Podman export: the checkpoint's files, then config.dump and spec.dump (indented, as
    Podman writes them)."""
    with tarfile.open(path, "w") as tf:
        for name, data in (("checkpoint/pages-1.img", os.urandom(70000)), ("config.dump", b"{}"),
                           ("spec.dump", json.dumps(spec, indent=2).encode()), ("stats-dump", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_a_podman_export_naming_other_device_numbers_is_imported_from_a_copy_with_this_hosts(tmp_path, monkeypatch):
    export, work = str(tmp_path / "container.tar"), tmp_path / "work"
    work.mkdir()
    _export(export, _spec(("/dev/nvidia0", 195, 0), ("/dev/nvidia-uvm", 235, 0)))
    before = open(export, "rb").read()

    def uvm_is_236_here(spec, host_root="/"):
        for entry in spec["linux"]["devices"]:
            if entry["path"] == "/dev/nvidia-uvm":
                entry["major"] = 236
        return ["/dev/nvidia-uvm 235:0 -> 236:0"]
    monkeypatch.setattr(podman_export.gpu_devices, "retarget_spec_devices", uvm_is_236_here)
    copy, moved = podman_export.retarget_export(export, str(work))
    assert copy == str(work / "container.tar") and moved == ["/dev/nvidia-uvm 235:0 -> 236:0"]
    assert open(export, "rb").read() == before, "the image itself must not change"
    with tarfile.open(copy) as tf:
        assert tf.getnames() == ["checkpoint/pages-1.img", "config.dump", "spec.dump", "stats-dump"]
        spec = json.loads(tf.extractfile("spec.dump").read())
        assert [d["major"] for d in spec["linux"]["devices"]] == [195, 236]
        with tarfile.open(export) as orig:
            assert tf.extractfile("checkpoint/pages-1.img").read() == orig.extractfile("checkpoint/pages-1.img").read()


def test_a_podman_export_with_this_hosts_numbers_or_no_spec_is_imported_as_it_is(tmp_path, monkeypatch):
    export = str(tmp_path / "container.tar")
    _export(export, _spec(("/dev/nvidia0", 195, 0)))
    monkeypatch.setattr(podman_export.gpu_devices, "retarget_spec_devices", lambda spec, host_root="/": [])
    assert podman_export.retarget_export(export, str(tmp_path)) == (export, [])
    with tarfile.open(str(tmp_path / "bare.tar"), "w") as tf:
        info = tarfile.TarInfo("config.dump")
        tf.addfile(info, io.BytesIO(b""))
    assert podman_export.retarget_export(str(tmp_path / "bare.tar"), str(tmp_path)) == (str(tmp_path / "bare.tar"), [])


def test_a_podman_export_that_cannot_be_copied_fails_with_the_reason_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    export, work = str(tmp_path / "container.tar"), tmp_path / "work"
    work.mkdir()
    _export(export, _spec(("/dev/nvidia-uvm", 235, 0)))
    monkeypatch.setattr(podman_export.gpu_devices, "retarget_spec_devices", lambda spec, host_root="/": ["uvm 235:0 -> 236:0"])

    def disk_full(src, dst):
        with open(dst, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(podman_export, "_copy", disk_full)
    with pytest.raises(podman_export.GpuCkptError) as err:
        podman_export.retarget_export(export, str(work))
    assert "No space left on device" in str(err.value) and err.value.stage == "runtime-restore"
    assert "image's size free in the restore's work dir" in str(err.value)
    assert os.listdir(str(work)) == []
