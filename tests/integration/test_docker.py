"""A Docker container, checkpointed and restored through the playbooks: a real dockerd 20.10
(experimental features on, no bridge and no iptables, as the CI machine allows) started by the
tests, driving runc and real CRIU 4.1.1. Inside the container a parent and a child count and hold a
memory pattern, registered with the libcuda TEST DOUBLE, so the CUDA stage runs on the container's
host pids as it does on a GPU node."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from helpers import COUNTER, FAKE_LIBCUDA, REPO, SKELETON_IMAGE, CountingWorkload, alive, skeleton_tar, tree

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
DOCKER, DOCKERD = "/usr/bin/docker", shutil.which("dockerd")
pytestmark = pytest.mark.skipif(DOCKERD is None, reason="dockerd is not installed (tests/setup.sh installs it)")


@pytest.fixture(scope="module")
def dockerd():
    """Our own dockerd: its own data root, exec root, socket and containerd namespace; stopped by pid."""
    base = tempfile.mkdtemp(prefix="gpk-dk-", dir="/tmp")  # short: containerd's sockets live under it
    cfg = {"experimental": True, "bridge": "none", "iptables": False, "ip6tables": False,
           "data-root": os.path.join(base, "data"), "exec-root": os.path.join(base, "exec"),
           "pidfile": os.path.join(base, "docker.pid"), "hosts": ["unix://%s/docker.sock" % base],
           "containerd-namespace": "gpuckpt-test", "containerd-plugins-namespace": "gpuckpt-test-p"}
    with open(os.path.join(base, "daemon.json"), "w") as fh:
        json.dump(cfg, fh)
    log = open(os.path.join(base, "dockerd.log"), "w")
    proc = subprocess.Popen([DOCKERD, "--config-file", os.path.join(base, "daemon.json")], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    host = "unix://%s/docker.sock" % base
    deadline = time.monotonic() + 60
    while subprocess.run([DOCKER, "--host", host, "version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         check=False).returncode != 0:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError("dockerd did not start:\n" + open(os.path.join(base, "dockerd.log")).read()[-3000:])
        time.sleep(0.3)
    subprocess.run([DOCKER, "--host", host, "import", skeleton_tar(os.path.join(base, "skel.tar")), SKELETON_IMAGE],
                   check=True, stdout=subprocess.DEVNULL)
    yield host
    subprocess.run("%s --host %s ps -aq | xargs -r %s --host %s rm -f" % (DOCKER, host, DOCKER, host), shell=True,
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    subprocess.run(["umount", "-R", os.path.join(base, "exec")], check=False, stderr=subprocess.DEVNULL)
    shutil.rmtree(base, ignore_errors=True)


class DockerWorkload(CountingWorkload):
    roles = ("parent", "child1")

    def __init__(self, host, base, fakecuda):
        self.host, self.dir = host, os.path.join(base, "w")
        self.name = "gpuckpt-d-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        args = ["run", "--detach", "--name", self.name, "--network", "none"]
        for src, opt in (("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (self.dir, "rw"), (fakecuda.state_dir, "rw")):
            args += ["--volume", "%s:%s:%s" % (src, src, opt)]
        for kv in fakecuda.env.items():
            args += ["--env", "%s=%s" % kv]
        self.docker(*(args + [SKELETON_IMAGE, "/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                              "--fakecuda", FAKE_LIBCUDA]))
        self.wait_counting()

    def docker(self, *args, check=True):
        return subprocess.run([DOCKER, "--host", self.host] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, check=check)

    def state(self):
        res = self.docker("container", "inspect", self.name, check=False)
        return json.loads(res.stdout)[0]["State"] if res.returncode == 0 else None

    def host_pids(self):
        return tree(int(self.state()["Pid"]))

    def stop(self):
        self.docker("rm", "--force", self.name, check=False)


@pytest.fixture
def docker_workload(dockerd, tmp_path, fakecuda):
    made = []

    def make():
        w = DockerWorkload(dockerd, str(tmp_path / ("d%d" % len(made))), fakecuda)
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop()


def _ckpt(playbook, fakecuda, w, image_dir, **extra):
    v = {"gpuckpt_image_dir": image_dir, "gpuckpt_container": w.name, "gpuckpt_runtime": "docker",
         "gpuckpt_docker_host": w.host}
    v.update(extra)
    return playbook(CHECKPOINT, v, env=fakecuda.env)


def _restore(playbook, fakecuda, w, image_dir):
    return playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_docker_host": w.host}, env=fakecuda.env)


def _counts_on_intact(w, stopped_at):
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]


def test_docker_checkpoint_then_restore_counts_on_with_memory_intact(tmp_path, playbook, docker_workload, fakecuda):
    w = docker_workload()
    host_pids = w.host_pids()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint container")
    assert res["changed"] is True and sorted(res["cuda_pids"]) == sorted(host_pids)
    assert w.state()["Running"] is False and not any(alive(p) for p in host_pids)
    stopped_at = w.counts()
    run = _restore(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and sorted(rs["cuda_pids"]) == sorted(w.host_pids())
    assert all(fakecuda.state(p) == "running" for p in rs["cuda_pids"])
    _counts_on_intact(w, stopped_at)
    again = _restore(playbook, fakecuda, w, image_dir)
    assert again.rc == 0 and again.task("Restore from")["changed"] is False


def test_docker_restore_on_a_host_without_the_container_creates_it_again(tmp_path, playbook, docker_workload,
                                                                         fakecuda):
    """What a migration's target sees: no such container. It is created again from the configuration
    saved in the image (Engine API), under the same name, and restored into."""
    w = docker_workload()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    old_id = json.loads(w.docker("container", "inspect", w.name).stdout)[0]["Id"]
    stopped_at = w.counts()
    w.docker("rm", w.name)
    run = _restore(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    new = json.loads(w.docker("container", "inspect", w.name).stdout)[0]
    assert new["Id"] != old_id and new["State"]["Running"] is True
    _counts_on_intact(w, stopped_at)


def test_docker_leave_running_and_a_restore_beside_it_is_refused(tmp_path, playbook, docker_workload, fakecuda):
    w = docker_workload()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir, gpuckpt_leave_running=True)
    assert run.rc == 0, run.stdout
    assert w.state()["Running"] is True and w.is_counting()
    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc != 0
    assert "already runs on this host; refusing to start a second copy" in second.task("Restore from")["msg"]
    assert w.is_counting()
