"""On a real GPU: a PyTorch workload inside a runc container, moved by migrate.yml between the two
loopback "hosts" of the GPU machine (sshd on 127.0.0.2 and 127.0.0.3, each with its own runc state
and bundle, on a cgroup v2 machine). The container's CUDA processes are checkpointed by their host
pids; as the container shares the one network namespace of both "hosts", the source exits after the
dump rather than being paused (see the test). On hostb the container lands in its own bundle's cgroup,
and its restored processes (new host pids) are found again and restored onto the GPU.
Its GPU memory is checked by checksum after the move, and a re-run changes nothing.

runc is carried to the GPU machine (tests/gpu/prepare_carry.sh, bookworm's runc 1.1.5)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import sys
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, TorchWorkload
from helpers import RuncOnLoopbackHosts, write_runc_bundle

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import LoopbackHosts  # noqa: E402

GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))
PASS_ENV = {k: os.environ[k] for k in ("LD_LIBRARY_PATH", "PATH") if k in os.environ}
pytestmark = pytest.mark.skipif(shutil.which("runc") is None,
                                reason="runc is not here (tests/gpu/install_tools.sh puts the carried one in place)")


def gpu_bundle(bundle, args, workdir, cgroup):
    """A runc bundle for a CUDA process (see gpu_spec), its mountpoints made in its rootfs."""
    write_runc_bundle(bundle, args, env=["%s=%s" % kv for kv in PASS_ENV.items()], rw=[workdir], cgroup=cgroup)
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    gpu_spec(cfg, os.path.join(bundle, "rootfs"))
    with open(path, "w") as fh:
        json.dump(cfg, fh)


def gpu_spec(cfg, rootfs=None, gpu_minors=None):
    """Make an OCI spec run a CUDA process: the host's /usr, /etc and /opt read-only, /dev/nvidia* as
    devices with their cgroup rules (what CDI writes), no rlimits (these VMs refuse setrlimit above their
    own), and the host's network (as GPU jobs often run): CRIU locks a container network of its own with
    iptables-restore, which the GPU machine lacks (the engine refuses that case in preflight,
    tests/integration/test_runc.py). ``rootfs``: where to make mountpoints (None: the runtime makes them).
    ``gpu_minors``: the GPUs (/dev/nvidia<minor>) the container is given, as a device plugin gives them
    (None: all); the control nodes always."""
    cfg["process"].pop("rlimits", None)
    # Each host mount under the bound trees is bound on its own (runc tells CRIU that its config's bind
    # mounts are external): an rbind would carry submounts that CRIU cannot dump, like the GPU
    # machine's /usr/local/nvidia (the driver's libraries on a filesystem CRIU does not support).
    roots = ("/usr", "/etc", "/opt")
    bound = {m["destination"] for m in cfg["mounts"]}
    for root in roots:
        if os.path.isdir(root) and root not in bound:
            cfg["mounts"].append({"destination": root, "type": "bind", "source": root, "options": ["rbind", "ro"]})
    for m in cfg["mounts"]:
        if m["destination"] in roots:
            m["options"] = ["bind" if o == "rbind" else o for o in m["options"]]
    subs = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if any(point.startswith(r + "/") for r in roots) and os.path.exists(point):
                subs.append(point)
    for point in sorted(set(subs), key=len):
        if rootfs and os.path.isdir(point):
            os.makedirs(os.path.join(rootfs, point.lstrip("/")), exist_ok=True)
        cfg["mounts"].append({"destination": point, "type": "bind", "source": point, "options": ["bind", "ro"]})
    if rootfs:
        for root in roots:
            os.makedirs(os.path.join(rootfs, root.lstrip("/")), exist_ok=True)
    cfg["linux"]["namespaces"] = [n for n in cfg["linux"]["namespaces"] if n["type"] != "network"]
    devices, allow = [], []
    for dev in sorted(glob.glob("/dev/nvidia*")):
        st = os.stat(dev)
        if not stat.S_ISCHR(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        name = os.path.basename(dev)
        if gpu_minors is not None and name[6:].isdigit() and int(name[6:]) not in gpu_minors:
            continue
        devices.append({"path": dev, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0})
        allow.append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
    assert devices, "no /dev/nvidia* device nodes on this machine"
    cfg["linux"]["devices"] = cfg["linux"].get("devices", []) + devices
    cfg["linux"].setdefault("resources", {}).setdefault("devices", []).extend(allow)
    return cfg


class RuncTorch(RuncOnLoopbackHosts, TorchWorkload):
    """torch_counter.py as the init of a runc container on a loopback host; stdio through a relay
    (CRIU cannot dump host files as a container's stdio)."""

    def __init__(self, hosts, directory, gib):
        self.hosts, self.dir, self.gib = hosts, directory, gib
        self.id = "gpuckpt-g-" + uuid.uuid4().hex[:8]
        self.roles = ["parent"]
        os.makedirs(directory, exist_ok=True)
        args = [WORKLOAD_PYTHON, os.path.join(REPO, "tests", "workloads", "torch_counter.py"), "--dir", directory,
                "--gib", str(gib)]
        for name in ("hosta", "hostb"):
            gpu_bundle(hosts.path(name, "bundle"), args, directory, "/gpuckpt-gpu-%s-%s" % (name, self.id))
        self.runc("hosta", "run --detach --bundle %s %s" % (hosts.path("hosta", "bundle"), self.id), relay=True)
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(directory, "parent.state")):
            if time.monotonic() > deadline:
                log = os.path.join(directory, "container.log")
                raise AssertionError("the container never started counting; its log:\n%s\nrunc state: %s"
                                     % (open(log).read()[-3000:] if os.path.exists(log) else "(none)",
                                        self.runc("hosta", "state %s" % self.id, check=False).stdout))
            time.sleep(0.2)
        self.wait_counting()
        self.pids = []

    kill = RuncOnLoopbackHosts.delete_everywhere


@pytest.fixture
def runc_hosts(tmp_path):
    base = str(tmp_path / "hosts")
    hv = {n: {"gpuckpt_environment": dict(PASS_ENV),
              "gpuckpt_runc_root": os.path.join(base, n, "runc-root"),
              "gpuckpt_runc_bundle": os.path.join(base, n, "bundle")} for n in ("hosta", "hostb")}
    h = LoopbackHosts(base, pid_namespaces=False, python=WORKLOAD_PYTHON).start(hv)
    yield h
    h.stop()
    time.sleep(1)


def test_runc_gpu_container_migrates_with_its_gpu_memory(playbook, runc_hosts, tmp_path, record):
    w = RuncTorch(runc_hosts, str(tmp_path / "w"), GIB)
    try:
        before = w.counts()
        # A bounded restore: on this machine (session 3) runc's restore hung inside CRIU; the migration
        # must then roll back to the paused source within the limit, not hold it forever.
        v = {"source": "hosta", "target": "hostb", "container": w.id, "runtime": "runc", "migration_id": "gpu-runc",
             "gpuckpt_runtime_timeout": 120}
        run = playbook("gpuckpt.fleet.migrate", v, inventory=runc_hosts.path("inventory.yml"))
        record("gpu_runc_migrate_attempt", rc=run.rc, tail=run.stdout[-3000:] if run.rc else "")
        if run.rc != 0:  # whatever failed, exactly one copy must run on with its GPU memory intact
            assert "rolled back; the workload runs on hosta" in run.stdout, run.stdout
            assert w.state("hosta")["status"] == "running" and w.state("hostb") is None
            w.wait_counting(beyond=before)
            assert w.verified_after(w.counts())
        assert run.rc == 0, run.stdout
        ck, sy, rs = run.task("Stage 1/3"), run.task("Stage 2/3"), run.task("Restore on hostb")
        # Both hosts are one kernel, and the container uses the host's network: its CUDA process holds
        # abstract unix socket names there, which a paused source would keep bound (the restore failed
        # with "Address already in use" when the source was held). So the source exits instead, and
        # its image is the way back.
        shown = "\n".join(run.task("Show the preflight")["msg"])
        assert ck["leave_stopped"] is False and "the workload holds unix @" in shown, shown
        assert len(ck["cuda_pids"]) == 1
        assert w.state("hostb")["status"] == "running" and w.state("hosta") is None
        w.wait_counting(beyond=before)
        assert w.verified_after(w.counts())
        record("gpu_runc_migrate", gib=GIB, image_bytes=ck["image_bytes"], checkpoint=ck["timings"],
               push=ck.get("push"), transfer_seconds=sy.get("seconds"), restore=rs["timings"],
               downtime=rs["resumed_at"] - ck["frozen_at"], summary=run.task("Summary")["msg"], preflight=shown)
        again = playbook("gpuckpt.fleet.migrate", v, inventory=runc_hosts.path("inventory.yml"))
        assert again.rc == 0
        assert [t for t in again.results if t.get("changed")] == [], "a re-run must change nothing"
        assert w.state("hostb")["status"] == "running"
    finally:
        w.kill()
