"""A runc container, checkpointed and restored through the playbooks: real runc 1.1.5 driving real
CRIU 4.1.1. Inside the container a parent and a child count and hold a memory pattern, registered
with the libcuda TEST DOUBLE, so the CUDA stage runs on the container's host pids as it does on a GPU
node (the driver resolves host pids)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from helpers import COUNTER, FAKE_LIBCUDA, CountingWorkload, alive, tree, write_nvidia_proc, write_runc_bundle

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
RUNC = shutil.which("runc")
pytestmark = pytest.mark.skipif(RUNC is None, reason="runc is not installed (tests/setup.sh installs it)")


class RuncWorkload(CountingWorkload):
    """A runc container (its bundle binds /usr and /etc read-only, the repo and the work dir at their
    host paths, so the test double finds its library at the same path) running tests/workloads/counter.py."""

    roles = ("parent", "child1")

    def __init__(self, base, fakecuda):
        self.base, self.dir = base, os.path.join(base, "w")
        self.root, self.bundle = os.path.join(base, "runc-root"), os.path.join(base, "bundle")
        self.id = "gpuckpt-t-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        write_runc_bundle(self.bundle, ["/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                                        "--fakecuda", FAKE_LIBCUDA],
                          env=["%s=%s" % kv for kv in fakecuda.env.items()], rw=[self.dir, fakecuda.state_dir])
        self.start()

    def runc(self, *args, check=True):
        return subprocess.run([RUNC, "--root", self.root] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, check=check)

    def start(self):
        # CRIU dumps a container whose stdio are pipes, never host files: a relay reads them.
        log = open(os.path.join(self.base, "container.log"), "ab")
        relay = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
        subprocess.run([RUNC, "--root", self.root, "run", "--detach", "--bundle", self.bundle, self.id],
                       stdin=subprocess.DEVNULL, stdout=relay.stdin, stderr=relay.stdin, check=True)
        relay.stdin.close()
        log.close()
        self.wait_counting()

    def state(self):
        res = self.runc("state", self.id, check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def host_pids(self):
        return tree(int(self.state()["pid"]))

    def stop(self):
        self.runc("delete", "--force", self.id, check=False)


@pytest.fixture
def runc_workload(tmp_path, fakecuda):
    made = []

    def make():
        w = RuncWorkload(str(tmp_path / ("c%d" % len(made))), fakecuda)
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop()


def _ckpt(playbook, fakecuda, w, image_dir, **extra):
    v = {"gpuckpt_container": w.id, "gpuckpt_runc_root": w.root, "gpuckpt_image_dir": image_dir}
    v.update(extra)
    return playbook(CHECKPOINT, v, env=fakecuda.env)


def _restore(playbook, fakecuda, w, image_dir):
    return playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root}, env=fakecuda.env)


def test_container_checkpoint_then_restore_counts_on_with_memory_intact(tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    host_pids = w.host_pids()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint container")
    assert res["changed"] is True and res["gpu_stage"] == "done"
    assert sorted(res["cuda_pids"]) == sorted(host_pids)  # the driver is called with host pids
    locks = [p for c, p in fakecuda.calls() if c == "lock"]
    assert len(locks) == 2 and {int(p) for p in locks} == set(res["cuda_pids"])
    assert w.state() is None, "runc checkpoint removes the container"
    assert not any(alive(p) for p in res["cuda_pids"])
    stopped_at = w.counts()

    again = _ckpt(playbook, fakecuda, w, image_dir)
    assert again.rc == 0 and again.task("Checkpoint container")["changed"] is False

    run = _restore(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and len(rs["cuda_pids"]) == 2
    assert w.state()["status"] == "running"
    assert all(fakecuda.state(p) == "running" for p in rs["cuda_pids"])
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]

    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc == 0 and second.task("Restore from")["changed"] is False


def test_container_leave_running_never_stops_and_a_restore_beside_it_is_refused(
        tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir, gpuckpt_leave_running=True)
    assert run.rc == 0, run.stdout
    assert w.state()["status"] == "running" and w.is_counting()
    res = run.task("Checkpoint container")
    assert all(fakecuda.state(p) == "running" for p in res["cuda_pids"])
    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc != 0
    assert "already exists on this host; refusing to start a second copy" in second.task("Restore from")["msg"]
    assert w.is_counting()


def test_unknown_container_is_refused_and_nothing_is_written(tmp_path, playbook, runc_workload, fakecuda):
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, {"gpuckpt_container": "no-such-container", "gpuckpt_runc_root": w.root,
                                "gpuckpt_image_dir": image_dir}, env=fakecuda.env)
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight" and "no runc container 'no-such-container'" in res["msg"]
    assert not os.path.exists(image_dir) and w.is_counting()


def test_a_failed_container_dump_leaves_it_running_and_unlocked(tmp_path, playbook, runc_workload, fakecuda):
    """runc's CRIU fails (the image dir's filesystem is 1 MiB): the engine restores and unlocks the CUDA
    processes and the container runs on."""
    w = runc_workload()
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "gpuckpt-small", str(small)], check=True)
    try:
        run = _ckpt(playbook, fakecuda, w, str(small / "img"))
        assert run.rc != 0
        res = run.task("Checkpoint container")
        assert res["stage"] == "runtime-dump" and res["rolled_back"] is True, res
        assert w.state()["status"] == "running" and w.is_counting()
        states = {p: fakecuda.state(p) for p in w.host_pids()}
        assert len(states) == 2 and set(states.values()) == {"running"}, (states, res)
    finally:
        subprocess.run(["umount", str(small)], check=False)


NO_IPTABLES_PATH = "/usr/local/sbin:/usr/local/bin:/usr/bin:/bin"  # (bookworm installs iptables-restore in /usr/sbin)


def test_a_container_network_without_iptables_is_locked_with_nftables_through_crius_configuration(
        tmp_path, playbook, runc_workload, fakecuda):
    """The container has a network namespace of its own (runc's default spec), which CRIU locks during the dump,
    by default with iptables-restore. On a host without it (the GPU machines; here a PATH without /usr/sbin) CRIU
    locks with nftables: runc has no flag for that, so its CRIU reads it from the configuration file named by
    CRIU_CONFIG_FILE. The container is checkpointed and restored and counts on."""
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    assert shutil.which("iptables-restore", path=NO_IPTABLES_PATH) is None
    env = dict(fakecuda.env, PATH=NO_IPTABLES_PATH)
    run = playbook(CHECKPOINT, {"gpuckpt_container": w.id, "gpuckpt_runc_root": w.root, "gpuckpt_runc_path": RUNC,
                                "gpuckpt_image_dir": image_dir}, env=env)
    assert run.rc == 0, run.stdout
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        recorded = json.load(fh)["runtime"]
    assert "--network-lock=nftables" in recorded["auto_flags"], recorded
    stopped_at = w.counts()
    restored = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root,
                                  "gpuckpt_runc_path": RUNC}, env=env)
    assert restored.rc == 0, restored.stdout
    assert w.state()["status"] == "running"
    w.went_on_intact(stopped_at)


def test_a_container_network_that_criu_cannot_lock_is_refused_before_anything_is_frozen(
        tmp_path, playbook, runc_workload, fakecuda):
    """The same host, with the user's CRIU options asking for iptables: the dump would fail after the CUDA stage;
    the engine refuses in preflight instead: nothing is locked, nothing is written, the container counts on."""
    w = runc_workload()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, {"gpuckpt_container": w.id, "gpuckpt_runc_root": w.root, "gpuckpt_runc_path": RUNC,
                                "gpuckpt_image_dir": image_dir, "gpuckpt_criu_options": ["--network-lock=iptables"]},
                   env=dict(fakecuda.env, PATH=NO_IPTABLES_PATH))
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight", res
    assert "network namespace of its own" in res["msg"] and "iptables-restore" in res["msg"]
    assert "nothing was frozen" in res["msg"] and "install iptables" in res["msg"]
    assert not os.path.exists(image_dir)
    assert [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")] == []
    assert w.state()["status"] == "running" and w.is_counting()


GPU_UUIDS = ["GPU-cccccccc-0000-4000-8000-00000000000%d" % m for m in range(2)]


def give_gpus(bundle, minors):
    """Give a bundle's container the GPUs ``minors`` as CDI writes them into its spec: their nodes (and the
    driver's control node) in linux.devices, each allowed by the device cgroup."""
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    nodes = [("/dev/nvidia%d" % m, 195, m) for m in minors] + [("/dev/nvidiactl", 195, 255)]
    cfg["linux"]["devices"] = [{"path": p, "type": "c", "major": ma, "minor": mi, "fileMode": 0o666, "uid": 0, "gid": 0}
                               for p, ma, mi in nodes]
    cfg["linux"].setdefault("resources", {})["devices"] = [{"allow": False, "access": "rwm"}] + [
        {"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rwm"} for unused, ma, mi in nodes]
    with open(path, "w") as fh:
        json.dump(cfg, fh)


def test_a_container_restored_into_a_bundle_that_gives_it_another_gpu_goes_onto_that_gpu(
        tmp_path, playbook, runc_workload, fakecuda, monkeypatch):
    """The target's bundle gives the container /dev/nvidia1 where it had /dev/nvidia0 (another GPU of the
    node, or the same place on another node): its processes are restored with the driver's pairs onto that
    GPU (the libcuda double logs them, and refuses a GPU the host does not list), and its /dev, which CRIU
    brings back as it was, holds that GPU's node only. A bundle with another count of GPUs is refused before
    anything is restored; the image is then restored into the right one."""
    proc = write_nvidia_proc(str(tmp_path / "nvidia-proc"), GPU_UUIDS)
    monkeypatch.setenv("GPUCKPT_NVIDIA_PROC", proc)
    with open(os.path.join(fakecuda.state_dir, "gpus"), "w") as fh:
        fh.write("".join(u + "\n" for u in GPU_UUIDS))
    w = runc_workload()
    # the running container is given GPU 0 (runc applies the spec at start: stop and start it again with it)
    w.stop()
    give_gpus(w.bundle, [0])
    w.start()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        assert json.load(fh)["runtime"]["gpus"] == [{"uuid": GPU_UUIDS[0], "minor": 0}]
    stopped_at = w.counts()

    def bundle_with(name, minors):
        other = os.path.join(str(tmp_path), name)
        with open(os.path.join(w.bundle, "config.json")) as fh:
            cfg = json.load(fh)
        os.makedirs(other)
        shutil.copytree(os.path.join(w.bundle, "rootfs"), os.path.join(other, "rootfs"), symlinks=True)
        with open(os.path.join(other, "config.json"), "w") as fh:
            json.dump(cfg, fh)
        give_gpus(other, minors)
        return other

    def restore_into(bundle):
        return playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root,
                                  "gpuckpt_runc_bundle": bundle}, env=fakecuda.env)

    two = restore_into(bundle_with("bundle-two-gpus", [0, 1]))
    assert two.rc != 0
    res = two.task("Restore from")
    assert "held 1 GPU(s) when it was checkpointed and is given 2 here" in res["msg"], res
    assert w.state() is None and not any(ln.startswith("restore-pairs") for ln in fakecuda.calls_log())

    run = restore_into(bundle_with("bundle-gpu1", [1]))
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert w.state()["status"] == "running"
    pairs = [ln.split() for ln in fakecuda.calls_log() if ln.startswith("restore-pairs ")]
    assert sorted(int(p[1]) for p in pairs) == sorted(rs["cuda_pids"])
    assert {p[2] for p in pairs} == {"%s=%s" % (GPU_UUIDS[0], GPU_UUIDS[1])}, pairs
    dev = "/proc/%d/root/dev" % int(w.state()["pid"])
    nodes = {n: os.stat(os.path.join(dev, n)).st_rdev for n in os.listdir(dev) if n.startswith("nvidia")}
    assert nodes == {"nvidia1": os.makedev(195, 1), "nvidiactl": os.makedev(195, 255)}, nodes
    w.went_on_intact(stopped_at)
