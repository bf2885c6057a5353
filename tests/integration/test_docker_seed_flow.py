"""The seed's Docker flow, end to end: a container started with `docker run --device nvidia.com/gpu=0 --name ...`
on one host moves with migrate.yml (runtime docker) to another, where the same CDI name is another GPU.

Two loopback hosts of this module's own (127.0.0.61 and 127.0.0.62, each with its own pid and mount namespaces),
each with a Docker 26 dockerd of its own, started through its ssh so that it runs in that host's namespaces, with
CDI on and its own spec directory. The two nodes differ as two real ones can: on hosta nvidia.com/gpu=0 is
/dev/nvidia0 (195:0), on hostb /dev/nvidia1 (195:1), and hostb's nvidia-uvm has another major. The nodes are made
with mknod (no GPU in CI); each host's driver files (GPUCKPT_NVIDIA_PROC) give its minors their UUIDs, and the libcuda
TEST DOUBLE logs the GPU pairs the restore gives it. The probe is nvidia-smi, a TEST DOUBLE inside the container
that lists the GPUs whose /dev/nvidia<N> nodes it finds.
"""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import time
import uuid

import pytest

from docker_daemon import DOCKER26_DIR, daemon_config, docker26_installed, dockerd_command, wait_until_up
from helpers import COUNTER, FAKE_LIBCUDA, REPO, SKELETON_IMAGE, CountingWorkload, skeleton_tar, write_nvidia_proc
from loopback import LoopbackHosts
from loopback_workloads import MIGRATE, changed_tasks, fakecuda_host_vars

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not docker26_installed(),
    reason="needs root and Docker 26 (tests/setup.sh installs it into %s)" % DOCKER26_DIR)

HOSTS = (("hosta", "127.0.0.61"), ("hostb", "127.0.0.62"))  # not the shared `hosts` fixture's addresses
DOCKER = os.path.join(DOCKER26_DIR, "docker")
NVIDIA_MAJOR = 195
# Each host's GPUs as its driver lists them (minor m <-> UUIDs[m]), and its nodes: the GPU nvidia.com/gpu=0 names
# there, the control node, and nvidia-uvm, whose major the kernel gives at load time (another on each node).
UUIDS = {"hosta": ["GPU-aaaaaaaa-0000-4000-8000-00000000000%d" % m for m in range(2)],
         "hostb": ["GPU-bbbbbbbb-0000-4000-8000-00000000000%d" % m for m in range(2)]}
GPU_MINOR = {"hosta": 0, "hostb": 1}
UVM_MAJOR = {"hosta": 235, "hostb": 236}
PROBE_DIR = "/gpuckpt-probe"  # where the container finds the nvidia-smi double (first on its PATH)
PATH = PROBE_DIR + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# TEST DOUBLE of nvidia-smi inside a container: it lists the GPUs whose device nodes (/dev/nvidia<N>, character
# devices of NVIDIA's major) the container has, and fails as nvidia-smi does when it finds none.
NVIDIA_SMI_IN_CONTAINER = '''#!/usr/bin/python3
"""TEST DOUBLE of nvidia-smi -L: the GPUs whose /dev/nvidia<N> nodes this container has."""
import os, re, stat, sys
found = []
for name in sorted(os.listdir("/dev")):
    if re.fullmatch(r"nvidia[0-9]+", name):
        st = os.stat("/dev/" + name)
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == %d:
            found.append((os.minor(st.st_rdev), name))
if not found:
    print("No devices were found")
    sys.exit(6)
for index, (minor, name) in enumerate(sorted(found)):
    print("GPU %%d: /dev/%%s (minor %%d, TEST DOUBLE)" %% (index, name, minor))
''' % NVIDIA_MAJOR


def make_node(path, major, minor):
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return path


def write_cdi_spec(spec_dir, dev_dir, host):
    """The host's CDI spec, as nvidia-ctk writes one: nvidia.com/gpu=0 is this host's GPU node; every request
    adds the control nodes. hostPath: the nodes made here (the container's are under /dev)."""
    os.makedirs(spec_dir, exist_ok=True)
    os.makedirs(dev_dir, exist_ok=True)
    minor = GPU_MINOR[host]

    def node(name, major, mi):
        return {"path": "/dev/" + name, "hostPath": make_node(os.path.join(dev_dir, name), major, mi),
                "type": "c", "major": major, "minor": mi}
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [node("nvidia%d" % minor, NVIDIA_MAJOR, minor)]}}],
            "containerEdits": {"deviceNodes": [node("nvidiactl", NVIDIA_MAJOR, 255),
                                               node("nvidia-uvm", UVM_MAJOR[host], 0)]}}
    with open(os.path.join(spec_dir, "nvidia.json"), "w") as fh:
        json.dump(spec, fh)


class SeedHosts(LoopbackHosts):
    """The two loopback hosts, each with its Docker 26 dockerd (CDI on, its own spec directory)."""

    def docker(self, host, args, check=True):
        cmd = [DOCKER, "--host", self.host_vars[host]["gpuckpt_docker_host"]] + list(args)
        return self.ssh(host, " ".join(shlex.quote(a) for a in cmd), check=check)

    def start_dockerd(self, host):
        d = self.docker_dirs[host]
        cfg = daemon_config(d, self.host_vars[host]["gpuckpt_docker_host"], "gpuckpt-seed-" + host,
                            cdi_spec_dirs=[self.path(host, "cdi")])
        self.ssh(host, dockerd_command(DOCKER26_DIR, cfg))
        wait_until_up(DOCKER26_DIR, self.host_vars[host]["gpuckpt_docker_host"], os.path.join(d, "dockerd.log"),
                      run=lambda argv: self.ssh(host, " ".join(shlex.quote(a) for a in argv), check=False).returncode)

    def stop_dockerd(self, host):
        """Its containers removed, then the daemon stopped by its pid (in the host's pid space) and waited for."""
        d = self.docker_dirs[host]
        if not os.path.exists(os.path.join(d, "docker.pid")):
            return
        self.ssh(host, "{docker} --host {sock} ps -aq | xargs -r {docker} --host {sock} rm -f; pid=$(cat {d}/docker.pid); "
                       "kill $pid; for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done"
                 .format(docker=DOCKER, sock=self.host_vars[host]["gpuckpt_docker_host"], d=d), check=False)


@pytest.fixture(scope="module")
def seed_hosts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("seed-hosts"))
    host_vars = fakecuda_host_vars(base)
    docker_dirs = {}
    for name, unused in HOSTS:
        docker_dirs[name] = "/tmp/gpk6-%s-%d" % (name, os.getpid())  # short: containerd's sockets live under it
        write_cdi_spec(os.path.join(base, name, "cdi"), os.path.join(base, name, "dev"), name)
        env = dict(host_vars[name]["gpuckpt_environment"],
                   GPUCKPT_NVIDIA_PROC=write_nvidia_proc(os.path.join(base, name, "nvidia-proc"), UUIDS[name]))
        host_vars[name].update(gpuckpt_environment=env, gpuckpt_docker_path=DOCKER,
                               gpuckpt_docker_host="unix://%s/docker.sock" % docker_dirs[name])
        with open(os.path.join(env["FAKECUDA_STATE_DIR"], "gpus"), "w") as fh:  # the GPUs this host's driver has
            fh.write("".join(u + "\n" for u in UUIDS[name]))
    probe_dir = os.path.join(base, "probe")
    os.makedirs(probe_dir)
    with open(os.path.join(probe_dir, "nvidia-smi"), "w") as fh:
        fh.write(NVIDIA_SMI_IN_CONTAINER)
    os.chmod(os.path.join(probe_dir, "nvidia-smi"), 0o755)
    h = SeedHosts(base, hosts=HOSTS)
    h.host_vars, h.docker_dirs, h.probe_dir = host_vars, docker_dirs, probe_dir
    try:
        h.start(host_vars)
        for name, unused in HOSTS:
            h.start_dockerd(name)
        h.docker("hosta", ["import", skeleton_tar(h.path("skel.tar")), SKELETON_IMAGE])
        h.docker("hosta", ["save", "--output", h.path("skel-docker.tar"), SKELETON_IMAGE])
        h.docker("hostb", ["load", "--input", h.path("skel-docker.tar")])  # the same image id on both
        yield h
    finally:
        for name, unused in HOSTS:
            if h.pids:
                h.stop_dockerd(name)
        h.stop()
        for name, d in docker_dirs.items():
            for sub in ("exec", "data"):
                subprocess.run(["umount", "-R", os.path.join(d, sub)], check=False, stderr=subprocess.DEVNULL)
            subprocess.run(["rm", "-rf", d], check=False)


class SeedContainer(CountingWorkload):
    """The seed's container on hosta: `docker run --device nvidia.com/gpu=0 --name <name>`, counting with the libcuda
    double and logging each count to stdout."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        self.hosts, self.dir = hosts, workdir
        self.name = "gpuckpt-seed-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir)
        args = ["run", "--detach", "--device", "nvidia.com/gpu=0", "--name", self.name, "--network", "none"]
        for src, dst, opt in (("/usr", "/usr", "ro"), ("/etc", "/etc", "ro"), (REPO, REPO, "ro"),
                              (hosts.probe_dir, PROBE_DIR, "ro"), (workdir, workdir, "rw"), (hosts.path(), hosts.path(), "rw")):
            args += ["--volume", "%s:%s:%s" % (src, dst, opt)]
        args += ["--env", "PATH=" + PATH, "--env", "GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA,
                 "--env", "FAKECUDA_STATE_DIR=%s" % hosts.path("hosta", "fakecuda")]
        hosts.docker("hosta", args + [SKELETON_IMAGE, "/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8",
                                      "--fakecuda", FAKE_LIBCUDA, "--print-counts"])
        self.wait_counting()

    def state(self, host):
        res = self.hosts.docker(host, ["container", "inspect", self.name], check=False)
        return json.loads(res.stdout)[0]["State"] if res.returncode == 0 else None

    def logged_counts(self, host, role="parent"):
        """The counts ``role`` wrote to the container's stdout on ``host``, as `docker logs` shows them."""
        out = self.hosts.docker(host, ["logs", self.name]).stdout
        return [int(line.split()[1]) for line in out.splitlines() if line.startswith(role + " ")]

    def gpu_nodes(self, host):
        """{name: (major, minor)} of the NVIDIA nodes in the running container's /dev (read in the host's pid space)."""
        pid = self.state(host)["Pid"]
        read = ("import json, os; d = '/proc/%d/root/dev'; print(json.dumps({n: [os.major(os.stat(d + '/' + n).st_rdev), "
                "os.minor(os.stat(d + '/' + n).st_rdev)] for n in os.listdir(d) if n.startswith('nvidia')}))" % pid)
        out = self.hosts.ssh(host, "python3 -c %s" % shlex.quote(read)).stdout
        return {n: tuple(v) for n, v in json.loads(out.strip().splitlines()[-1]).items()}


def test_the_seeds_docker_container_moves_onto_the_targets_gpu_and_a_rerun_changes_nothing(
        playbook, seed_hosts, tmp_path):
    h = seed_hosts
    w = SeedContainer(h, str(tmp_path / "seed"))
    inventory = h.path("inventory.yml")
    assert w.gpu_nodes("hosta") == {"nvidia0": (195, 0), "nvidiactl": (195, 255), "nvidia-uvm": (235, 0)}
    calls_b = os.path.join(h.host_vars["hostb"]["gpuckpt_environment"]["FAKECUDA_STATE_DIR"], "calls.log")
    before = w.counts()
    v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "docker",
         "migration_id": "t-seed-" + w.name[-8:], "probe_command": "nvidia-smi"}
    run = playbook(MIGRATE, v, inventory=inventory)
    assert run.rc == 0, run.stdout[-8000:]
    summary = "\n".join(run.task("Summary")["msg"])
    assert "moved from hosta to hostb" in summary, summary
    assert len(run.task("Stage 1/3")["cuda_pids"]) == 2
    # The same name runs on hostb and counts on from where it stopped, its memory intact; Docker cannot hold the
    # source stopped, so hosta's exited.
    assert w.state("hostb")["Status"] == "running" and w.state("hosta")["Status"] == "exited"
    w.went_on_intact(before)
    # `docker logs` on hostb: the counts made there, after the last one hosta's log shows
    stopped_at = max(w.logged_counts("hosta"))
    deadline = time.monotonic() + 10
    while not [c for c in w.logged_counts("hostb") if c > stopped_at + 2] and time.monotonic() < deadline:
        time.sleep(0.2)
    on_b = w.logged_counts("hostb")
    assert on_b and min(on_b) > stopped_at and max(on_b) > stopped_at + 2, (stopped_at, on_b[:5])
    assert on_b == list(range(on_b[0], on_b[0] + len(on_b))), on_b[:20]
    probe = run.task("Restore on hostb")["probe"]
    assert probe["rc"] == 0 and probe["cmd"] == ["nvidia-smi"], probe

    again = playbook(MIGRATE, v, inventory=inventory)
    assert again.rc == 0, again.stdout[-8000:]
    assert changed_tasks(again) == [], changed_tasks(again)
    assert w.state("hostb")["Status"] == "running" and w.is_counting()

    # Restored onto hostb's GPU of that place: the driver's pairs, and /dev as hostb's spec gives it.
    with open(calls_b) if os.path.exists(calls_b) else open(os.devnull) as fh:
        pairs = [ln.split() for ln in fh if ln.startswith("restore-pairs ")]
    assert len(pairs) == 2 and {p[2] for p in pairs} == {"%s=%s" % (UUIDS["hosta"][0], UUIDS["hostb"][1])}, pairs
    assert "/dev/nvidia1 (minor 1" in probe["stdout"], probe
    assert "nvidia0" not in probe["stdout"], probe
    assert w.gpu_nodes("hostb") == {"nvidia1": (195, 1), "nvidiactl": (195, 255), "nvidia-uvm": (236, 0)}
