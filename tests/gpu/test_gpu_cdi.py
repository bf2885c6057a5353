"""On a real GPU: the CDI spec the collection writes where NVIDIA's toolkit is missing (cuda/cdi.py, the module
gpu_cdi_spec), made from this machine's driver, is complete enough for a container that holds nothing of the
driver to run nvidia-smi: a runc container whose root holds only the C library that nvidia-smi links against,
given the spec's edits for device "all" (device nodes with their cgroup rules, the driver's libraries and tools
bound in, the spec's environment), lists the machine's GPUs.

Neither Docker nor Podman is on the GPU machine; runc applies the edits here as a CDI-aware engine would."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import cdi

pytestmark = pytest.mark.skipif(shutil.which("runc") is None,
                                reason="runc is not here (tests/gpu/install_tools.sh puts the carried one in place)")


def _c_library(binary, rootfs):
    """Copy into ``rootfs`` what ldd says ``binary`` links against (the C library and the loader), nothing of the
    driver: nvidia-smi opens libnvidia-ml itself, which must come from the spec's mounts."""
    out = subprocess.run(["ldd", binary], stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
    for line in out.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/") and os.path.exists(path) and "nvidia" not in path:
            dest = os.path.join(rootfs, path.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(os.path.realpath(path), dest)


def _device(path):
    st = os.stat(path)
    return {"path": path, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev), "fileMode": 0o666,
            "uid": 0, "gid": 0}


def _apply(cfg, spec, name="all"):
    """What a CDI-aware engine does with the spec for device ``name``: its device nodes and the common ones (with
    the cgroup rules that let the container open them), the mounts, the environment."""
    edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"] if d["name"] == name]
    for e in edits:
        for node in e.get("deviceNodes") or []:
            dev = _device(node.get("hostPath") or node["path"])
            dev["path"] = node["path"]
            cfg["linux"].setdefault("devices", []).append(dev)
            cfg["linux"].setdefault("resources", {}).setdefault("devices", []).append(
                {"allow": True, "type": "c", "major": dev["major"], "minor": dev["minor"], "access": "rwm"})
        for m in e.get("mounts") or []:
            cfg["mounts"].append({"destination": m["containerPath"], "source": m["hostPath"], "type": "bind",
                                  "options": m.get("options") or ["ro", "bind"]})
        cfg["process"]["env"] += e.get("env") or []


def test_a_container_given_only_the_cdi_spec_lists_the_gpus(tmp_path, record):
    listing = cdi.gather()
    spec = cdi.build_spec(listing, lib_dir="/usr/lib/x86_64-linux-gnu")
    libs = sorted(os.path.basename(lib["path"]) for lib in listing["libraries"])
    record("cdi_spec", driver_version=listing["driver_version"], gpus=len(listing["gpus"]), libraries=len(libs),
           binaries=listing["binaries"], control_nodes=listing["control_nodes"], devices=cdi.device_names(spec),
           libcuda=[n for n in libs if n.startswith("libcuda.so")], nvml=[n for n in libs if n.startswith("libnvidia-ml")])
    assert listing["gpus"] and not listing["missing_gpu_nodes"], listing
    assert [n for n in libs if n.startswith("libnvidia-ml.so.")], "the spec lacks NVML: %s" % libs
    assert [n for n in libs if n.startswith("libcuda.so.")], "the spec lacks libcuda: %s" % libs
    smi = [b for b in listing["binaries"] if b.endswith("/nvidia-smi")]
    assert smi, listing["binaries"]

    bundle = tmp_path / "bundle"
    rootfs = bundle / "rootfs"
    os.makedirs(str(rootfs / "usr/bin"))
    _c_library(smi[0], str(rootfs))
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    with open(str(bundle / "config.json")) as fh:
        cfg = json.load(fh)
    cfg["process"].update(terminal=False, args=["/usr/bin/nvidia-smi", "-L"])
    cfg["process"].pop("rlimits", None)
    cfg["process"]["env"] = ["PATH=/usr/bin:/bin"]
    cfg["root"]["readonly"] = False
    _apply(cfg, spec)
    with open(str(bundle / "config.json"), "w") as fh:
        json.dump(cfg, fh)
    # the mount points a bind needs, in the container's own root (never in the host's trees)
    for m in cfg["mounts"]:
        if m["type"] == "bind":
            dest = os.path.join(str(rootfs), m["destination"].lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.exists(dest):
                if stat.S_ISDIR(os.stat(m["source"]).st_mode):
                    os.makedirs(dest)
                else:
                    open(dest, "w").close()
    name = "cdi-" + os.path.basename(str(tmp_path))[-20:]
    res = subprocess.run(["runc", "run", "--bundle", str(bundle), name], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, universal_newlines=True, timeout=120, check=False)
    subprocess.run(["runc", "delete", "-f", name], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record("cdi_container_nvidia_smi", rc=res.returncode, output=res.stdout[-2000:])
    assert res.returncode == 0 and res.stdout.count("GPU ") == len(listing["gpus"]), res.stdout
