"""Which GPUs a container holds and how a restored one is put onto the GPUs of its new container (gpus.py):
the driver's information files, OCI specs, the driver's pairs, and a real container-like process whose /dev is
made to match its new GPUs (a mount namespace and a root of its own, as root)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import devices as gpus
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget

UUIDS = ["GPU-11111111-2222-3333-4444-55555555555%d" % m for m in range(4)]


def write_proc(root, minors_by_bus):
    """A /proc/driver/nvidia lookalike: gpus/<bus>/information as driver 580 writes it."""
    for bus, minor in minors_by_bus.items():
        d = os.path.join(root, "gpus", bus)
        os.makedirs(d)
        with open(os.path.join(d, "information"), "w") as fh:
            fh.write("Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\nGPU UUID: \t %s\nVideo BIOS: \t ??.??.??.??.??\n"
                     "Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDevice Minor: \t %d\nBus Location: \t %s\n"
                     % (UUIDS[minor], minor, bus))
    return root


@pytest.fixture
def inv(tmp_path, monkeypatch):
    # minors not in bus order: the index of NVIDIA_VISIBLE_DEVICES is the bus order, a node's name its minor
    root = write_proc(str(tmp_path / "nvidia"), {"0000:1a:00.0": 0, "0000:2b:00.0": 2, "0000:3c:00.0": 1,
                                                 "0000:4d:00.0": 3})
    monkeypatch.setenv("GPUCKPT_NVIDIA_PROC", root)
    return gpus.inventory()


def dev(minor, path=None):
    return {"path": path or "/dev/nvidia%d" % minor, "type": "c", "major": 195, "minor": minor, "fileMode": 438}


def test_inventory_reads_the_driver_information_files_in_bus_order(inv):
    assert [(g["bus"], g["minor"], g["uuid"]) for g in inv] == [
        ("0000:1a:00.0", 0, UUIDS[0]), ("0000:2b:00.0", 2, UUIDS[2]), ("0000:3c:00.0", 1, UUIDS[1]),
        ("0000:4d:00.0", 3, UUIDS[3])]
    assert gpus.inventory("/nonexistent") == []


def test_a_spec_gives_its_gpus_by_device_nodes_then_by_the_runtime_variable(inv):
    spec = {"linux": {"devices": [dev(3), {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                                  {"path": "/dev/nvidia-uvm", "type": "c", "major": 507, "minor": 0}, dev(1)]},
            "process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
    assert [(g["minor"], g["uuid"]) for g in gpus.spec_gpus(spec, inv)] == [(1, UUIDS[1]), (3, UUIDS[3])]
    env = {"process": {"env": ["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=%s,%s" % (UUIDS[3], UUIDS[0])]}}
    assert [g["minor"] for g in gpus.spec_gpus(env, inv)] == [0, 3]
    by_index = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=1"]}}  # index 1 in bus order: minor 2
    assert [g["uuid"] for g in gpus.spec_gpus(by_index, inv)] == [UUIDS[2]]
    assert len(gpus.spec_gpus({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}, inv)) == 4
    for none in ("void", "none", ""):
        assert gpus.spec_gpus({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=" + none]}}, inv) == []
    assert gpus.spec_gpus({}, inv) == [] and gpus.spec_gpus(None, inv) == []
    unknown = gpus.spec_gpus({"linux": {"devices": [dev(7)]}}, inv)
    assert unknown == [{"uuid": None, "minor": 7, "path": "/dev/nvidia7"}]


def test_placement_maps_a_containers_gpus_place_by_place_or_refuses(inv):
    old = [{"uuid": UUIDS[0], "minor": 0}, {"uuid": UUIDS[1], "minor": 1}]
    assert gpus.placement_pairs(old, old, "c") is None  # its own GPUs: the driver's default
    swapped = [{"uuid": UUIDS[1], "minor": 1}, {"uuid": UUIDS[0], "minor": 0}]
    assert gpus.placement_pairs(old, swapped, "c") == [(UUIDS[0], UUIDS[1]), (UUIDS[1], UUIDS[0])]
    with pytest.raises(InvalidTarget) as exc:
        gpus.placement_pairs(old, old[:1], "container trainer of pod default/p")
    assert "held 2 GPU(s)" in exc.value.msg and "given 1" in exc.value.msg
    with pytest.raises(InvalidTarget) as exc:
        gpus.placement_pairs(old[:1], [{"uuid": None, "minor": 9}], "c")
    assert "device minor 9" in exc.value.msg
    # GPUs whose UUIDs the source's driver files did not give: the same places need no map, others are refused
    unnamed = [{"uuid": None, "minor": 0}]
    assert gpus.placement_pairs(unnamed, [{"uuid": UUIDS[0], "minor": 0}], "c") is None
    with pytest.raises(InvalidTarget) as exc:
        gpus.placement_pairs(unnamed, [{"uuid": UUIDS[1], "minor": 1}], "c")
    assert "device minor 0" in exc.value.msg


def test_a_process_without_gpu_files_holds_no_gpu(inv):
    assert gpus.process_gpus(os.getpid(), inv) == []
    assert gpus.process_gpus(2 ** 22 + 1, inv) == []


@pytest.fixture
def contained(tmp_path):
    """A process in a mount namespace of its own, chrooted into a root whose /dev is its own tmpfs, as a
    container's: /dev holds the old GPU's node nvidia0, a regular file where nvidia2 should be, and a
    symlink planted at nvidia5 pointing at a file of the host."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    root = tmp_path / "root"
    for d in ("dev", "usr", "proc"):
        (root / d).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + link):
            os.symlink(os.readlink("/" + link), str(root / link))
    victim = tmp_path / "host-file"
    victim.write_text("the host's")
    script = ("mount --make-rprivate / && mount --rbind /usr {r}/usr && mount -t tmpfs dev {r}/dev && "
              "mknod -m 666 {r}/dev/nvidia0 c 195 0 && mknod -m 666 {r}/dev/nvidia-uvm c 510 0 && echo x > {r}/dev/nvidia2 && ln -s {v} {r}/dev/nvidia5 && "
              "mknod -m 666 {r}/dev/null c 1 3 && exec chroot {r} /usr/bin/sleep 120").format(r=root, v=victim)
    proc = subprocess.Popen(["unshare", "--mount", "--", "/bin/sh", "-c", script])
    deadline = time.monotonic() + 10
    while os.readlink("/proc/%d/root" % proc.pid) != str(root):
        assert proc.poll() is None and time.monotonic() < deadline, "the contained process did not start"
        time.sleep(0.05)
    yield proc.pid, root, victim
    proc.kill()
    proc.wait()


def test_the_restored_containers_dev_is_made_to_hold_its_new_gpus_only(contained):
    pid, root, victim = contained
    # the new spec: GPUs 1 and 2, and nvidia-uvm under this node's major (the container has the source's)
    spec = {"linux": {"devices": [dev(1), dev(2), {"path": "/dev/nvidia-uvm", "type": "c", "major": 511, "minor": 0,
                                                   "fileMode": 0o666},
                                  {"path": "/dev/../etc/x", "type": "c", "major": 1, "minor": 3},
                                  {"path": "/dev/dri/card0", "type": "c", "major": 226, "minor": 0}]}}
    report = gpus.sync_device_nodes(pid, spec)
    assert report == {"made": ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidia2"], "removed": ["/dev/nvidia0"]}
    dev_dir = "/proc/%d/root/dev" % pid
    nodes = {n: os.lstat(os.path.join(dev_dir, n)) for n in os.listdir(dev_dir) if n.startswith("nvidia")}
    assert sorted(nodes) == ["nvidia-uvm", "nvidia1", "nvidia2", "nvidia5"]
    assert os.minor(nodes["nvidia-uvm"].st_rdev) == 0 and os.major(nodes["nvidia-uvm"].st_rdev) == 511
    for n, minor in (("nvidia1", 1), ("nvidia2", 2)):
        st = nodes[n]
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, minor)
        assert stat.S_IMODE(st.st_mode) == 0o666
    assert stat.S_ISLNK(nodes["nvidia5"].st_mode) and victim.read_text() == "the host's"
    assert not os.path.exists(str(root / "dev" / "nvidia1")), "made in the container's /dev, not the host's view"
    assert gpus.sync_device_nodes(pid, spec) == {"made": [], "removed": []}


def test_a_dev_that_is_a_symlink_out_of_the_container_is_refused(contained, tmp_path):
    pid, root, unused = contained
    outside = tmp_path / "outside"
    outside.mkdir()
    subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "/bin/sh", "-c",
                    "umount -l %s/dev && rmdir %s/dev && ln -s %s %s/dev" % (root, root, outside, root)], check=True)
    with pytest.raises(GpuCkptError) as exc:
        gpus.sync_device_nodes(pid, {"linux": {"devices": [dev(1)]}})
    assert "could not set the GPU device nodes" in exc.value.msg
    assert os.listdir(str(outside)) == []


def node(root, name, kind, major, minor):
    path = os.path.join(root, "dev", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mknod(path, 0o600 | kind, os.makedev(major, minor))


def test_a_spec_from_another_node_gets_this_nodes_nvidia_numbers_and_nothing_else(inv, tmp_path):
    """nvidia-uvm's major is the kernel's choice on each node: a recorded spec's entries for the driver's nodes
    (and the device-cgroup rules that allowed them) take this host's numbers, by path, all at once (one
    entry's new numbers are another's old ones here); a device given under another name is left alone."""
    host = str(tmp_path / "host")
    node(host, "nvidia-uvm", stat.S_IFCHR, 509, 0)
    node(host, "nvidia-uvm-tools", stat.S_IFCHR, 509, 1)
    node(host, "nvidiactl", stat.S_IFCHR, 195, 255)
    node(host, "nvidia0", stat.S_IFCHR, 195, 0)
    node(host, "xvdc", stat.S_IFBLK, 8, 0)
    spec = {"linux": {
        "devices": [dev(0), {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                    {"path": "/dev/nvidia-uvm", "type": "c", "major": 507, "minor": 0},
                    {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 509, "minor": 0},
                    {"path": "/dev/nvidia-caps/nvidia-cap1", "type": "c", "major": 238, "minor": 1},
                    {"path": "/dev/xvdc", "type": "b", "major": 8, "minor": 32}],
        "resources": {"devices": [{"allow": False, "access": "rwm"},
                                  {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
                                  {"allow": True, "type": "c", "major": 507, "minor": 0, "access": "rwm"},
                                  {"allow": True, "type": "c", "major": 509, "minor": 0, "access": "rwm"},
                                  {"allow": True, "type": "b", "major": 8, "minor": 32, "access": "rwm"}]}}}
    assert [e["path"] for e, unused, unused2 in gpus.stale_spec_devices(spec, host)] == [
        "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    changed = gpus.retarget_spec_devices(spec, host)
    assert changed == ["/dev/nvidia-uvm 507:0 -> 509:0", "/dev/nvidia-uvm-tools 509:0 -> 509:1"]
    numbers = {e["path"]: (e["major"], e["minor"]) for e in spec["linux"]["devices"]}
    assert numbers == {"/dev/nvidia0": (195, 0), "/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (509, 0),
                       "/dev/nvidia-uvm-tools": (509, 1), "/dev/nvidia-caps/nvidia-cap1": (238, 1),
                       "/dev/xvdc": (8, 32)}
    rules = [(r.get("type"), r.get("major"), r.get("minor")) for r in spec["linux"]["resources"]["devices"]]
    assert rules == [(None, None, None), ("c", 195, 0), ("c", 509, 0), ("c", 509, 1), ("b", 8, 32)]
    assert gpus.retarget_spec_devices(spec, host) == [], "a spec of this host is left as it is"


def test_a_spec_naming_a_gpu_the_driver_does_not_list_is_refused(inv, tmp_path):
    spec = {"linux": {"devices": [dev(1), dev(7)]}}
    with pytest.raises(InvalidTarget) as err:
        gpus.stale_spec_devices(spec, str(tmp_path))
    assert "/dev/nvidia7 (minor 7), a GPU this host's driver does not list" in err.value.msg
    assert err.value.stage == "preflight"
    assert gpus.stale_spec_devices({"linux": {"devices": [dev(1), dev(3)]}}, str(tmp_path)) == []
    assert gpus.lists_nvidia_devices(spec) and not gpus.lists_nvidia_devices({"linux": {"devices": []}})


def test_a_gpu_node_the_drivers_restore_makes_again_is_removed_before_the_unlock(contained):
    """On 2 x H100 (driver 580.159.04) the driver's restore of a container moved onto GPU 1 made /dev/nvidia0 again
    inside it (issue 43, 9): the backend syncs its /dev again after the CUDA restore (engine: after_gpu_restore)."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.runc import RuncBackend
    pid, root, unused = contained
    spec = {"linux": {"devices": [dev(1)]}}
    backend = RuncBackend()
    backend.adopt_devices(pid, [pid], spec, [["GPU-a", "GPU-b"]], sync=True)
    dev_dir = "/proc/%d/root/dev" % pid

    def gpu_nodes():
        return sorted(n for n in os.listdir(dev_dir)
                      if stat.S_ISCHR(os.lstat(os.path.join(dev_dir, n)).st_mode) and n[6:].isdigit())

    assert gpu_nodes() == ["nvidia1"]
    subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "mknod", "-m", "666", "%s/dev/nvidia0" % root, "c", "195",
                    "0"], check=True)  # what the driver's restore did
    assert gpu_nodes() == ["nvidia0", "nvidia1"]
    backend.after_gpu_restore()
    assert gpu_nodes() == ["nvidia1"]
