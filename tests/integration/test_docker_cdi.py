"""Docker 26 and Podman 4.3.1 containers given GPUs by a CDI spec, checkpointed on one node and restored as
another node would give them their GPUs: other device numbers. The spec's device nodes are TEST DOUBLES
(mknod in the test's dir; the runtime only stats them), the node's driver is a fake /proc/driver/nvidia
(GPUCKPT_NVIDIA_PROC, minor m = GPU_UUIDS[m]), and the workload's processes are registered with the libcuda
TEST DOUBLE, which logs the GPU pairs a restore gives it. Docker 26 reads specs only from a dir of the test
dockerd's own (cdi-spec-dirs); Podman 4.3.1 has no setting for that (containers.conf's cdi_spec_dirs came
later), so its spec goes into /etc/cdi under a name and a kind of the test's own, and is removed after it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid

import pytest

from test_docker import DockerWorkload
from test_podman import PodmanWorkload
from docker_daemon import DOCKER26_DIR, daemon_config, docker26_installed, dockerd_command, wait_until_up
from helpers import (COUNTER, FAKE_LIBCUDA, REPO, SKELETON_IMAGE, podman_run_args, podman_skeleton,
                     skeleton_tar, workload_processes, write_nvidia_proc)

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
DOCKER26 = os.path.join(DOCKER26_DIR, "docker")
PODMAN = shutil.which("podman")
GPU_UUIDS = ["GPU-dddddddd-0000-4000-8000-00000000000%d" % m for m in range(2)]
OTHER_NODE_UUIDS = ["GPU-eeeeeeee-0000-4000-8000-00000000000%d" % m for m in range(2)]
NVIDIA_MAJOR, UVM_SOURCE_MAJOR, UVM_TARGET_MAJOR = 195, 235, 236  # nvidia-uvm's major is the node's own
pytestmark = pytest.mark.skipif(not docker26_installed(), reason="Docker 26 is not installed (tests/setup.sh does)")


class CdiNode(object):
    """One node's GPUs as a CDI spec gives them: device nodes made in ``base`` (test doubles of the driver's)
    and the spec, written to ``spec_path`` with kind ``kind`` (devices "0", "1", "all")."""

    def __init__(self, base, spec_path, kind):
        self.base, self.spec_path, self.kind = base, spec_path, kind
        os.makedirs(base, exist_ok=True)

    def node(self, name, major, minor):
        path = os.path.join(self.base, "%s-%d-%d" % (name, major, minor))
        if not os.path.exists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        return path

    def gpu(self, minor):
        return {"path": "/dev/nvidia%d" % minor, "hostPath": self.node("nvidia%d" % minor, NVIDIA_MAJOR, minor)}

    def write(self, devices, uvm_major):
        """``devices``: CDI device name -> the GPU minors it gives."""
        spec = {"cdiVersion": "0.5.0", "kind": self.kind,
                "devices": [{"name": name, "containerEdits": {"deviceNodes": [self.gpu(m) for m in minors]}}
                            for name, minors in sorted(devices.items())],
                "containerEdits": {"deviceNodes": [
                    {"path": "/dev/nvidiactl", "hostPath": self.node("nvidiactl", NVIDIA_MAJOR, 255)},
                    {"path": "/dev/nvidia-uvm", "hostPath": self.node("nvidia-uvm", uvm_major, 0)}]}}
        tmp = self.spec_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(spec, fh)
        os.rename(tmp, self.spec_path)  # (the runtimes watch or rescan the dir: never a half-written spec)

    def as_source(self):
        """The node the container is checkpointed on: "0" is /dev/nvidia0."""
        self.write({"0": [0], "1": [1], "all": [0, 1]}, UVM_SOURCE_MAJOR)

    def as_target(self):
        """Another node, as its spec names the same request: "0" is /dev/nvidia1, nvidia-uvm another major."""
        self.write({"0": [1], "1": [0], "all": [1, 0]}, UVM_TARGET_MAJOR)

    def as_target_with_two(self):
        """A node whose "0" gives two GPUs."""
        self.write({"0": [0, 1], "1": [1], "all": [0, 1]}, UVM_TARGET_MAJOR)


@pytest.fixture
def gpu_node(fakecuda, tmp_path, monkeypatch):
    """The node's driver as the collection and the libcuda double see it: two GPUs, GPU_UUIDS."""
    monkeypatch.setenv("GPUCKPT_NVIDIA_PROC", write_nvidia_proc(str(tmp_path / "nvidia-proc"), GPU_UUIDS))
    with open(os.path.join(fakecuda.state_dir, "gpus"), "w") as fh:
        fh.write("".join(u + "\n" for u in GPU_UUIDS))
    return dict(fakecuda.env, GPUCKPT_NVIDIA_PROC=os.environ["GPUCKPT_NVIDIA_PROC"])


def _stop_daemon(pid_file):
    try:
        with open(pid_file) as fh:
            pid = int(fh.read().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)  # (it stops the containerd it started; not our child: polled, not waited for)
    except OSError:
        return
    deadline = time.monotonic() + 30
    while os.path.exists("/proc/%d" % pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if os.path.exists("/proc/%d" % pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def dockerd26():
    """A Docker 26 dockerd of this module's own, CDI on, reading specs only from its own dir."""
    base = tempfile.mkdtemp(prefix="gpk-d26-", dir="/tmp")  # short: containerd's sockets live under it
    cdi_dir = os.path.join(base, "cdi")
    os.makedirs(cdi_dir)
    host = "unix://%s/docker.sock" % base
    config = daemon_config(base, host, "gpuckpt-cdi", cdi_spec_dirs=[cdi_dir])
    subprocess.run(dockerd_command(DOCKER26_DIR, config), shell=True, check=True)
    try:
        wait_until_up(DOCKER26_DIR, host, os.path.join(base, "dockerd.log"))
        subprocess.run([DOCKER26, "--host", host, "import", skeleton_tar(os.path.join(base, "skel.tar")),
                        SKELETON_IMAGE], check=True, stdout=subprocess.DEVNULL)
        yield {"host": host, "cdi_dir": cdi_dir}
    finally:
        subprocess.run("%s --host %s ps -aq | xargs -r %s --host %s rm -f" % (DOCKER26, host, DOCKER26, host),
                       shell=True, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _stop_daemon(os.path.join(base, "docker.pid"))
        subprocess.run(["umount", "-R", os.path.join(base, "exec")], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(base, ignore_errors=True)


class Docker26Workload(DockerWorkload):
    """test_docker.py's counting workload (a parent and a child, on the skeleton image with this machine's
    /usr and /etc), run by Docker 26 with ``--device <kind>=0``."""

    def __init__(self, host, base, fakecuda, device):
        self.host, self.dir = host, os.path.join(base, "w")
        self.name = "gpuckpt-cdi-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        args = ["run", "--detach", "--name", self.name, "--network", "none", "--device", device]
        for src, ro in (("/usr", True), ("/etc", True), (REPO, True), (self.dir, False), (fakecuda.state_dir, False)):
            args += ["--mount", "type=bind,source=%s,target=%s%s" % (src, src, ",readonly" if ro else "")]
        for kv in fakecuda.env.items():
            args += ["--env", "%s=%s" % kv]
        self.docker(*(args + [SKELETON_IMAGE, "/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                              "--fakecuda", FAKE_LIBCUDA]))
        self.wait_counting()

    def docker(self, *args, check=True):
        return subprocess.run([DOCKER26, "--host", self.host] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, check=check)


@pytest.fixture
def docker_cdi(dockerd26, tmp_path, fakecuda, gpu_node):
    """(the node's CDI spec, a workload maker): the spec file is this test's own in the daemon's dir."""
    node = CdiNode(str(tmp_path / "dev"), os.path.join(dockerd26["cdi_dir"], "gpu-%s.json" % uuid.uuid4().hex[:8]),
                   "nvidia.com/gpu")
    node.as_source()
    made = []

    def make():
        w = Docker26Workload(dockerd26["host"], str(tmp_path / ("d%d" % len(made))), fakecuda, node.kind + "=0")
        made.append(w)
        return w
    yield node, make
    for w in made:
        w.stop()
    os.unlink(node.spec_path)


def _gpu_nodes(init_pid):
    """The NVIDIA nodes in the container's /dev: name -> (major, minor)."""
    dev = "/proc/%d/root/dev" % init_pid
    out = {}
    for n in os.listdir(dev):
        if n.startswith("nvidia"):
            rdev = os.stat(os.path.join(dev, n)).st_rdev
            out[n] = (os.major(rdev), os.minor(rdev))
    return out


SOURCE_NODES = {"nvidia0": (195, 0), "nvidiactl": (195, 255), "nvidia-uvm": (UVM_SOURCE_MAJOR, 0)}
TARGET_NODES = {"nvidia1": (195, 1), "nvidiactl": (195, 255), "nvidia-uvm": (UVM_TARGET_MAJOR, 0)}


def _manifest_gpus(image_dir):
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        return json.load(fh)["runtime"].get("gpus")


def _went_onto(fakecuda, rs, old_uuid, new_uuid):
    """Every CUDA process of the restore was given the driver's pair old -> new (the libcuda double's log)."""
    pairs = [ln.split() for ln in fakecuda.calls_log() if ln.startswith("restore-pairs ")]
    assert sorted(int(p[1]) for p in pairs) == sorted(rs["cuda_pids"]), pairs
    assert {p[2] for p in pairs} == {"%s=%s" % (old_uuid, new_uuid)}, pairs


def _docker_vars(w, image_dir, **extra):
    v = {"gpuckpt_image_dir": image_dir, "gpuckpt_docker_host": w.host, "gpuckpt_docker_path": DOCKER26}
    v.update(extra)
    return v


def _docker_checkpoint_on_gpu0(playbook, env, w, tmp_path):
    assert _gpu_nodes(int(w.state()["Pid"])) == SOURCE_NODES
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, _docker_vars(w, image_dir, gpuckpt_container=w.name, gpuckpt_runtime="docker"), env=env)
    assert run.rc == 0, run.stdout
    assert run.task("Checkpoint container")["changed"] is True
    assert _manifest_gpus(image_dir) == [{"uuid": GPU_UUIDS[0], "minor": 0}]
    stopped_at = w.counts()
    w.docker("rm", w.name)  # what another node has: no such container; the restore creates it from its config
    return image_dir, stopped_at


def test_docker26_cdi_container_restored_where_its_gpu_has_other_device_numbers(tmp_path, playbook, docker_cdi,
                                                                                fakecuda, gpu_node):
    """Checkpointed holding GPU 0 (/dev/nvidia0) through `--device nvidia.com/gpu=0`, restored where that
    request gives /dev/nvidia1 and another nvidia-uvm major: it goes onto GPU 1 with the driver's pairs, and
    its /dev holds the target's nodes, not the source's."""
    node, make = docker_cdi
    w = make()
    image_dir, stopped_at = _docker_checkpoint_on_gpu0(playbook, gpu_node, w, tmp_path)
    node.as_target()
    run = playbook(RESTORE, _docker_vars(w, image_dir), env=gpu_node)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and w.state()["Running"] is True
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]
    _went_onto(fakecuda, rs, GPU_UUIDS[0], GPU_UUIDS[1])
    assert _gpu_nodes(int(w.state()["Pid"])) == TARGET_NODES


def test_docker26_cdi_restore_given_another_gpu_count_is_refused_and_leaves_nothing_running(
        tmp_path, playbook, docker_cdi, fakecuda, gpu_node):
    node, make = docker_cdi
    w = make()
    image_dir = _docker_checkpoint_on_gpu0(playbook, gpu_node, w, tmp_path)[0]
    node.as_target_with_two()
    run = playbook(RESTORE, _docker_vars(w, image_dir), env=gpu_node)
    assert run.rc != 0
    msg = run.task("Restore from")["msg"]
    assert "held 1 GPU(s) when it was checkpointed and is given 2 here" in msg, msg
    assert w.state() is None, "the restored copy is removed"
    assert not workload_processes(COUNTER, w.dir)
    assert not [ln for ln in fakecuda.calls_log() if ln.startswith("restore-pairs")]


class PodmanCdiWorkload(PodmanWorkload):
    """test_podman.py's counting workload in an isolated Podman storage, run with ``--device <kind>=0``."""

    def __init__(self, base, fakecuda, device):
        self.base, self.dir = base, os.path.join(base, "w")
        self.runroot = tempfile.mkdtemp(prefix="gpk-", dir="/tmp")  # podman wants it under 50 characters
        self.storage = ["--root", os.path.join(base, "storage"), "--runroot", self.runroot]
        self.name = "gpuckpt-pc-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        image = podman_skeleton(self.storage, tmpdir=base)
        args = podman_run_args(self.name, image, ["/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                                                  "--fakecuda", FAKE_LIBCUDA],
                               env=["%s=%s" % kv for kv in fakecuda.env.items()], rw=[self.dir, fakecuda.state_dir])
        at = args.index(image)
        self.podman(*(args[:at] + ["--device", device] + args[at:]))
        self.wait_counting()

    def stop(self):
        self.podman("container", "rm", "--force", "--time", "0", self.name, check=False)  # (no 10 s wait for SIGTERM)
        shutil.rmtree(self.runroot, ignore_errors=True)


@pytest.fixture
def podman_cdi(tmp_path, fakecuda, gpu_node):
    """(the node's CDI spec in /etc/cdi, with a kind of this test's own; a workload maker)."""
    if PODMAN is None:
        pytest.skip("podman is not installed (tests/setup.sh installs it)")
    tag = uuid.uuid4().hex[:8]
    made_dir = not os.path.isdir("/etc/cdi")
    os.makedirs("/etc/cdi", exist_ok=True)
    node = CdiNode(str(tmp_path / "dev"), "/etc/cdi/gpuckpt-test-%s.json" % tag, "t%s.gpuckpt.fleet/gpu" % tag)
    node.as_source()
    made = []

    def make():
        w = PodmanCdiWorkload(str(tmp_path / ("p%d" % len(made))), fakecuda, node.kind + "=0")
        made.append(w)
        return w
    try:
        yield node, make
    finally:
        for w in made:
            w.stop()
        os.unlink(node.spec_path)
        if made_dir:
            try:
                os.rmdir("/etc/cdi")
            except OSError:
                pass


def test_podman_cdi_container_restored_where_the_driver_lists_other_gpus_goes_onto_the_gpu_of_its_place(
        tmp_path, playbook, podman_cdi, fakecuda, gpu_node):
    """Podman 4.3.1 restores an export under the spec it carries (spec.dump): it does not apply the target's
    CDI spec again, so the container keeps its device paths, and the collection gives them the numbers of
    this host's nodes of those paths (podman_export.py; CI has no /dev/nvidia*, so the spec's numbers stay).
    Restored where the driver lists other GPUs (another node's UUIDs), it goes onto that node's GPU of its
    place, with the driver's pair."""
    node, make = podman_cdi
    w = make()
    assert _gpu_nodes(int(w.state()["Pid"])) == SOURCE_NODES
    image_dir = str(tmp_path / "img")
    v = {"gpuckpt_image_dir": image_dir, "gpuckpt_podman_root": w.storage[1], "gpuckpt_podman_runroot": w.storage[3]}
    run = playbook(CHECKPOINT, dict(v, gpuckpt_container=w.name, gpuckpt_runtime="podman"), env=gpu_node)
    assert run.rc == 0, run.stdout
    assert run.task("Checkpoint container")["changed"] is True
    assert _manifest_gpus(image_dir) == [{"uuid": GPU_UUIDS[0], "minor": 0}]
    assert w.state() is None, "the exported container is removed: the image is the container now"
    stopped_at = w.counts()
    other = write_nvidia_proc(str(tmp_path / "nvidia-proc-other"), OTHER_NODE_UUIDS)
    with open(os.path.join(fakecuda.state_dir, "gpus"), "w") as fh:
        fh.write("".join(u + "\n" for u in OTHER_NODE_UUIDS))
    run = playbook(RESTORE, v, env=dict(gpu_node, GPUCKPT_NVIDIA_PROC=other))
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and w.state()["Status"] == "running"
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]
    _went_onto(fakecuda, rs, GPU_UUIDS[0], OTHER_NODE_UUIDS[0])
    assert _gpu_nodes(int(w.state()["Pid"])) == SOURCE_NODES
