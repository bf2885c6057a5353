"""cuda/cdi.py and the gpu_cdi_spec module: the CDI spec of a node's GPUs from the driver's files, on a fake
/proc/driver/nvidia, /dev and ``ldconfig -p`` in tmp_path (CI has no GPU and no NVIDIA driver)."""
from __future__ import annotations

import json
import os
import stat

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import cdi
from ansible_collections.gpuckpt.fleet.plugins.modules import gpu_cdi_spec

VERSION = "550.54.15"
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def _driver(tmp_path, gpus=((0, "0000:1a:00.0"), (1, "0000:3b:00.0")), version=VERSION):
    """A fake /proc/driver/nvidia with ``gpus`` [(minor, bus)]; the UUIDs from UUIDS by place."""
    proc = tmp_path / "proc-nvidia"
    for (minor, bus), uuid in zip(gpus, UUIDS):
        folder = proc / "gpus" / bus
        folder.mkdir(parents=True)
        (folder / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t %s\n"
                                            "Bus Location: \t %s\nDevice Minor: \t %d\n" % (uuid, bus, minor))
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  Fri Feb  9 2024\n"
                                  "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n" % version)
    return str(proc)


def _dev(tmp_path, names=("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")):
    """A fake /dev: a stand-in file for each node (mknod needs root; what the spec reads is the name)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).write_text("")
    return str(dev)


def _libs(tmp_path, version=VERSION):
    """A host library directory as the driver's packages leave it, and its ``ldconfig -p``: the driver's libraries
    (64-bit and 32-bit), one a former driver left behind, and a library that is not the driver's."""
    lib = tmp_path / "lib64"
    lib32 = tmp_path / "lib32"
    lib.mkdir()
    lib32.mkdir()
    lines = ["6 libs found in cache `/etc/ld.so.cache'"]
    for stem, soname in (("libcuda", "libcuda.so.1"), ("libnvidia-ml", "libnvidia-ml.so.1"),
                         ("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"),
                         ("libnvidia-nvvm", "libnvidia-nvvm.so.4")):
        for folder, marks in ((lib, "libc6,x86-64"), (lib32, "libc6")):
            real = folder / ("%s.so.%s" % (stem, version))
            real.write_text("")
            (folder / soname).symlink_to(real.name)
            lines.append("\t%s (%s) => %s" % (soname, marks, folder / soname))
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    lines.append("\tlibcuda.so (libc6,x86-64) => %s" % (lib / "libcuda.so"))
    stale = lib / "libnvidia-opencl.so.535.104.05"
    stale.write_text("")
    (lib / "libnvidia-opencl.so.1").symlink_to(stale.name)
    lines.append("\tlibnvidia-opencl.so.1 (libc6,x86-64) => %s" % (lib / "libnvidia-opencl.so.1"))
    lines.append("\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6")
    return str(lib), "\n".join(lines) + "\n"


def _bins(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("nvidia-smi", "nvidia-debugdump"):
        path = folder / name
        path.write_bytes(b"\x7fELF stand-in")  # a program of its own (an ELF file)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (folder / "nvidia-persistenced").write_text("not executable")
    wrapper = folder / "nvidia-cuda-mps-control"  # a shell wrapper that calls the tool elsewhere: useless in a container
    wrapper.write_text("#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-cuda-mps-control \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(folder)


@pytest.fixture
def node(tmp_path):
    """A fake node: its driver's files, /dev, libraries and tools; gather() over them."""
    proc, dev = _driver(tmp_path), _dev(tmp_path)
    lib, ldconfig = _libs(tmp_path)
    bins = _bins(tmp_path)

    def listing(**kw):
        return cdi.gather(proc_dir=proc, dev_dir=dev, ldconfig_text=ldconfig, bin_dirs=(bins,), sockets=(), **kw)
    return {"proc": proc, "dev": dev, "lib": lib, "bins": bins, "ldconfig": ldconfig, "listing": listing}


def test_the_driver_version_is_read_from_the_kernel_modules_line(tmp_path):
    assert cdi.driver_version(_driver(tmp_path)) == VERSION
    assert cdi.driver_version(str(tmp_path / "none")) is None


def test_gather_lists_the_gpus_in_bus_order_the_present_control_nodes_the_drivers_libraries_and_tools(node):
    listing = node["listing"]()
    assert listing["driver_version"] == VERSION
    assert [(g["minor"], g["uuid"]) for g in listing["gpus"]] == [(0, UUIDS[0]), (1, UUIDS[1])]
    assert listing["control_nodes"] == ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]  # no nvidia-modeset here
    assert listing["missing_gpu_nodes"] == []
    # the 64-bit copies of this driver's version only: not the 32-bit ones, not the former driver's OpenCL,
    # not libc, and the unversioned libcuda.so (a link to the same file) once more by its own name
    assert [(lib["soname"], os.path.basename(lib["path"])) for lib in listing["libraries"]] == [
        ("libcuda.so.1", "libcuda.so." + VERSION), ("libnvidia-ml.so.1", "libnvidia-ml.so." + VERSION),
        ("libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler.so." + VERSION),
        ("libnvidia-nvvm.so.4", "libnvidia-nvvm.so." + VERSION), ("libcuda.so", "libcuda.so." + VERSION)]
    assert all(os.path.dirname(lib["path"]) == node["lib"] for lib in listing["libraries"])
    assert listing["binaries"] == [os.path.join(node["bins"], "nvidia-smi"),
                                   os.path.join(node["bins"], "nvidia-debugdump")]  # persistenced: not executable;
    # mps-control: a wrapper script, not the tool


def test_a_gpu_whose_node_is_missing_is_named(tmp_path):
    listing = cdi.gather(proc_dir=_driver(tmp_path), dev_dir=_dev(tmp_path, ("nvidia1", "nvidiactl")),
                         ldconfig_text="", bin_dirs=(), sockets=())
    assert listing["missing_gpu_nodes"] == ["nvidia0"]


def test_the_spec_names_each_gpu_by_index_uuid_and_all_as_nvidia_ctk_does(node):
    spec = cdi.build_spec(node["listing"]())
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert by_name == {"0": [{"path": "/dev/nvidia0"}], "1": [{"path": "/dev/nvidia1"}],
                       UUIDS[0]: [{"path": "/dev/nvidia0"}], UUIDS[1]: [{"path": "/dev/nvidia1"}],
                       "all": [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]}
    assert cdi.device_names(spec) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=" + UUIDS[0],
                                      "nvidia.com/gpu=" + UUIDS[1], "nvidia.com/gpu=all"]
    edits = spec["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"},
                                    {"path": "/dev/nvidia-uvm-tools"}]
    assert "hooks" not in edits


def test_the_gpus_index_is_their_bus_order_not_their_minor(tmp_path):
    proc = _driver(tmp_path, gpus=((1, "0000:1a:00.0"), (0, "0000:3b:00.0")))
    spec = cdi.build_spec(cdi.gather(proc_dir=proc, dev_dir=_dev(tmp_path), ldconfig_text="", bin_dirs=(), sockets=()))
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert by_name["0"] == [{"path": "/dev/nvidia1"}] and by_name[UUIDS[0]] == [{"path": "/dev/nvidia1"}]


def test_each_library_is_mounted_read_only_by_its_file_name_and_its_soname(node):
    mounts = cdi.build_spec(node["listing"]())["containerEdits"]["mounts"]
    real = os.path.join(node["lib"], "libcuda.so." + VERSION)
    cuda = [(m["hostPath"], m["containerPath"]) for m in mounts if m["hostPath"] == real]
    assert sorted(cuda) == sorted([(real, real), (real, os.path.join(node["lib"], "libcuda.so.1")),
                                   (real, os.path.join(node["lib"], "libcuda.so"))])  # the file's own name once
    assert all(m["options"][:4] == ["ro", "nosuid", "nodev", "bind"] for m in mounts)
    smi = os.path.join(node["bins"], "nvidia-smi")
    assert {"hostPath": smi, "containerPath": "/usr/bin/nvidia-smi", "options": ["ro", "nosuid", "nodev", "bind"]} in mounts


def test_lib_dir_puts_the_libraries_where_the_image_looks_for_them(node):
    mounts = cdi.build_spec(node["listing"](), lib_dir="/usr/local/nvidia/lib64")["containerEdits"]["mounts"]
    libs = [m["containerPath"] for m in mounts if "libnvidia-ml" in m["hostPath"]]
    assert set(libs) == {"/usr/local/nvidia/lib64/libnvidia-ml.so." + VERSION,
                         "/usr/local/nvidia/lib64/libnvidia-ml.so.1"}


def test_nodes_outside_dev_get_a_host_path_and_keep_their_container_path(node):
    spec = cdi.build_spec(node["listing"](), dev_dir=node["dev"])
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": os.path.join(node["dev"], "nvidia0")}]
    control = {"path": "/dev/nvidiactl", "hostPath": os.path.join(node["dev"], "nvidiactl")}
    assert spec["containerEdits"]["deviceNodes"][0] == control


def test_rendered_yaml_reads_back_as_the_spec_with_every_name_a_string(node):
    spec = cdi.build_spec(node["listing"]())
    text = cdi.render(spec, header=["a header"])
    assert text.startswith("# a header\n")
    assert yaml.safe_load(text) == spec  # "0" stays a string, not the number 0
    assert json.loads(json.dumps(spec)) == spec


def test_a_driver_upgrade_changes_the_spec_and_nothing_else_does(tmp_path, node):
    before = cdi.render(cdi.build_spec(node["listing"]()))
    assert cdi.render(cdi.build_spec(node["listing"]())) == before
    new = tmp_path / "upgraded"
    new.mkdir()
    lib, ldconfig = _libs(new, version="560.35.03")
    listing = cdi.gather(proc_dir=_driver(new, version="560.35.03"), dev_dir=node["dev"], ldconfig_text=ldconfig,
                         bin_dirs=(node["bins"],), sockets=())
    after = cdi.render(cdi.build_spec(listing))
    assert after != before and "libcuda.so.560.35.03" in after and VERSION not in after


def _module(capsys, **args):
    with patch_module_args(args), pytest.raises(SystemExit):
        gpu_cdi_spec.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def module_node(node, monkeypatch):
    """The module on the fake node: ldconfig -p answers the fake listing."""
    ldconfig = os.path.join(node["bins"], "ldconfig")
    with open(ldconfig, "w") as fh:
        fh.write("#!/bin/sh\ncat <<'EOF'\n%sEOF\n" % node["ldconfig"])
    os.chmod(ldconfig, 0o755)
    monkeypatch.setattr(cdi, "BIN_DIRS", (node["bins"],))
    monkeypatch.setattr(cdi, "SOCKETS", ())
    return dict(node, args=dict(driver_proc_dir=node["proc"], dev_dir=node["dev"], ldconfig_path=ldconfig))


def test_the_module_writes_the_spec_0644_changed_once_and_not_in_check_mode(tmp_path, capsys, module_node):
    path = str(tmp_path / "etc" / "cdi" / "nvidia.yaml")
    res = _module(capsys, path=path, _ansible_check_mode=True, **module_node["args"])
    assert res["changed"] and not os.path.exists(path)
    res = _module(capsys, path=path, **module_node["args"])
    assert res["changed"], res
    assert res["devices"][-1] == "nvidia.com/gpu=all" and res["driver_version"] == VERSION
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with open(path) as fh:
        written = yaml.safe_load(fh)
    assert written["kind"] == "nvidia.com/gpu" and len(written["devices"]) == 5
    before = os.stat(path)
    res = _module(capsys, path=path, **module_node["args"])
    assert not res["changed"] and os.stat(path).st_ino == before.st_ino
    res = _module(capsys, path=path, state="absent")
    assert res["changed"] and not os.path.exists(path)


def test_the_module_refuses_a_node_whose_driver_lists_no_gpu(tmp_path, capsys, module_node):
    path = str(tmp_path / "nvidia.yaml")
    res = _module(capsys, path=path, **dict(module_node["args"], driver_proc_dir=str(tmp_path / "no-driver")))
    assert res["failed"] and "lists no GPU" in res["msg"] and not os.path.exists(path)
