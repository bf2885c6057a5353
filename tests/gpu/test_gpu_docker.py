"""On a real GPU: a PyTorch container under Docker 26 and under Podman 4.3.1, its GPU given by CDI as issue 31's seed
runs it (``--device nvidia.com/gpu=0``, the spec written by the collection's gpu_cdi_spec module from this machine's
driver): checkpointed by name and restored on one host through the playbooks, then moved by migrate.yml between the two
loopback hosts, ``nvidia-smi`` run inside it as the probe each time. Its GPU memory is checked by checksum, its /dev
against the spec's device nodes, and its training's losses are bit-identical to an uninterrupted run's.

Neither engine is on the GPU machine: tests/gpu/prepare_docker_carry.sh carries them, tests/gpu/install_engines.sh puts
them in place (Docker 26 at DOCKER26_DIR with the containerd 1.6 it runs; Podman on the PATH). The container's root is
the skeleton image with the host's /usr, /etc and /opt bound read-only, each without its submounts, which are bound one
by one (/usr/local/nvidia, the driver's files, may be a filesystem CRIU cannot dump), as test_gpu_runc.py does; its
network is the host's (CRIU would lock a network of its own with iptables-restore, which the machine lacks).

The loopback hosts share one pid space (the driver's checkpoint API resolves pids in the initial one: see
test_gpu_migrate.py). Each runs its own dockerd, started through its ssh. For Podman each host also has a mount
namespace of its own: Podman's export records its storage's paths, so each host binds a storage of its own at the same
paths, as two machines have them.

GPUCKPT_GPU_DRYRUN=1 runs the same plumbing without a GPU (the CI kind of machine, with Docker 26 and Podman installed):
the driver is a fake /proc/driver/nvidia, the spec's device nodes are stand-ins made with mknod, and the workload is
tests/workloads/counter.py on the libcuda TEST DOUBLE."""
from __future__ import annotations

import glob
import json
import os
import resource
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from gpu_helpers import REPO, TORCH_COUNTER, WORKLOAD_PYTHON, TorchWorkload, _clean_env, gpu_count
from docker_daemon import DOCKER26_DIR, daemon_config, docker26_installed, dockerd_command, wait_until_up
from helpers import COUNTER, FAKE_LIBCUDA, SKELETON_IMAGE, skeleton_tar, write_nvidia_proc
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import devices as gpu_devices

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import SSHD, LoopbackHosts  # noqa: E402

DRY = os.environ.get("GPUCKPT_GPU_DRYRUN") == "1"
GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))
PASS_ENV = {k: os.environ[k] for k in ("LD_LIBRARY_PATH", "PATH") if k in os.environ}
# what dockerd and the engines' runtimes look up (runc, criu, containerd) where an ssh session's PATH may be shorter
TOOL_PATH = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCKER = os.path.join(DOCKER26_DIR, "docker")
PODMAN_CARRIED = "/usr/local/lib/gpuckpt-podman/bin"  # (tests/gpu/install_engines.sh)
PODMAN = shutil.which("podman") or (os.path.join(PODMAN_CARRIED, "podman")
                                    if os.access(os.path.join(PODMAN_CARRIED, "podman"), os.X_OK) else None)
PODMAN_ROOT, PODMAN_RUNROOT = "/var/lib/gpuckpt-gpu-podman", "/run/gpuckpt-gpu-podman"  # each loopback host's own
HOSTS = (("hosta", "127.0.0.71"), ("hostb", "127.0.0.72"))
BOUND_ROOTS = ("/usr", "/etc", "/opt")
DRY_UUIDS = ["GPU-dddddddd-1111-4000-8000-00000000000%d" % m for m in range(2)]
PROBE = ["test", "-c", "/dev/nvidia0"] if DRY else ["nvidia-smi", "--query-gpu=name,memory.used", "--format=csv,noheader"]
CHECKPOINT, RESTORE, MIGRATE = "gpuckpt.fleet.checkpoint", "gpuckpt.fleet.restore", "gpuckpt.fleet.migrate"


@pytest.fixture(autouse=True, scope="session")
def _need_gpu():
    """(tests/gpu/conftest.py's, but GPUCKPT_GPU_DRYRUN=1 runs this module without a GPU)"""
    if not DRY and gpu_count() == 0:
        pytest.skip("no NVIDIA GPU on this machine (GPUCKPT_GPU_DRYRUN=1 runs this module's plumbing without one)")


def _docker_missing():
    if not docker26_installed():
        return "Docker 26 is not in %s (bash tests/gpu/prepare_docker_carry.sh here, install_engines.sh there)" % DOCKER26_DIR
    for tool, path in (("containerd", DOCKER26_DIR + ":" + TOOL_PATH), ("runc", TOOL_PATH), ("criu", TOOL_PATH)):
        if not shutil.which(tool, path=path):
            return "dockerd would find no %s (containerd travels with Docker; runc and CRIU with .carry)" % tool
    return None


def _podman_missing():
    if PODMAN is None:
        return "podman is not here (bash tests/gpu/prepare_docker_carry.sh podman here, install_engines.sh there)"
    if not any(os.access(p, os.X_OK) for p in [os.path.join(PODMAN_CARRIED, "conmon"), "/usr/libexec/podman/conmon",
                                               shutil.which("conmon") or ""]):
        return "conmon is not here (it travels with Podman)"
    return None


@pytest.fixture(params=["docker", "podman"])
def engine(request):
    why = {"docker": _docker_missing, "podman": _podman_missing}[request.param]()
    if why:
        pytest.skip(why)
    return request.param


class Node(object):
    """This machine's GPUs as the test sees them, and the CDI spec that the collection's gpu_cdi_spec module writes from
    them: on the GPU, the driver's; dry, a fake driver's dir (``proc``) and stand-in device nodes (``dev``)."""

    def __init__(self, base, playbook, env):
        self.tag = uuid.uuid4().hex[:8]
        self.kind = "t%s.gpuckpt.fleet/gpu" % self.tag if DRY else "nvidia.com/gpu"
        self.env = env  # what the collection's modules are given here (dry: the doubles)
        self.docker_dir = os.path.join(base, "cdi")  # Docker 26 reads specs only from its daemon's cdi-spec-dirs
        os.makedirs(self.docker_dir)
        args = {"path": os.path.join(self.docker_dir, "gpus.yaml"), "kind": self.kind}
        if DRY:
            args.update(dev_dir=self.stand_ins(os.path.join(base, "dev")), driver_proc_dir=env["GPUCKPT_NVIDIA_PROC"],
                        ldconfig_path=self.no_libraries(os.path.join(base, "ldconfig")))
        self.gpus = gpu_devices.inventory(env.get("GPUCKPT_NVIDIA_PROC"))
        book = os.path.join(base, "cdi.yml")
        with open(book, "w") as fh:  # (JSON is YAML)
            json.dump([{"hosts": "localhost", "gather_facts": False, "tasks": [
                {"name": "Write the CDI spec", "gpuckpt.fleet.gpu_cdi_spec": args}]}], fh)
        run = playbook(book, env=env)
        assert run.rc == 0, run.stdout
        self.written = run.task("Write the CDI spec")
        import yaml  # (the carried wheels have it, as ansible needs it)
        with open(args["path"]) as fh:
            self.spec = yaml.safe_load(fh)
        self.podman_spec, self.dropped = self.for_podman()

    @staticmethod
    def stand_ins(dev):
        os.makedirs(dev)
        for name, major, minor in (("nvidia0", 195, 0), ("nvidia1", 195, 1), ("nvidiactl", 195, 255), ("nvidia-uvm", 235, 0)):
            os.mknod(os.path.join(dev, name), 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        return dev

    @staticmethod
    def no_libraries(path):
        """An ldconfig that lists nothing: the dry spec mounts none of this machine's libraries."""
        with open(path, "w") as fh:
            fh.write("#!/bin/sh\nexit 0\n")
        os.chmod(path, 0o755)
        return path

    def request(self):
        return self.kind + "=0"

    def gpu0(self):
        return {"uuid": self.gpus[0]["uuid"], "minor": self.gpus[0]["minor"]}

    def nodes_of(self, device="0"):
        """The device nodes a container given ``device`` holds: name -> (major, minor)."""
        edits = [self.spec.get("containerEdits") or {}] + [d["containerEdits"] for d in self.spec["devices"]
                                                           if d["name"] == device]
        out = {}
        for e in edits:
            for node in e.get("deviceNodes") or []:
                rdev = os.stat(node.get("hostPath") or node["path"]).st_rdev
                out[os.path.basename(node["path"])] = (os.major(rdev), os.minor(rdev))
        return out

    def for_podman(self):
        """Podman 4.3.1 reads specs only from /etc/cdi and /var/run/cdi, and applies their mounts after the container's
        own: a mount whose target is missing in a tree bound read-only from the host (a tool the host keeps elsewhere,
        mounted by the spec at /usr/bin/<name>) cannot get its mount point there. Those are left out of its copy (the
        container has the host's own through the binds); Docker 26 mounts the spec's before the container's own."""
        spec = json.loads(json.dumps(self.spec))
        edits = spec.get("containerEdits") or {}
        keep, dropped = [], []
        for m in edits.get("mounts") or []:
            under = any(m["containerPath"].startswith(r + "/") for r in BOUND_ROOTS)
            (dropped if under and not os.path.exists(m["containerPath"]) else keep).append(m)
        if "mounts" in edits:
            edits["mounts"] = keep
        os.makedirs("/var/run/cdi", exist_ok=True)
        for stale in glob.glob("/var/run/cdi/gpuckpt-gpu-test-*.json") if not DRY else []:
            os.unlink(stale)  # (a killed run's: the same devices in two specs are a conflict Podman refuses)
        path = "/var/run/cdi/gpuckpt-gpu-test-%s.json" % self.tag
        with open(path, "w") as fh:
            json.dump(spec, fh)
        return path, [m["containerPath"] for m in dropped]

    def summary(self):
        """What the module wrote, for the record."""
        return {"devices": self.written.get("devices"), "driver_version": self.written.get("driver_version"),
                "libraries": len(self.written.get("libraries") or []),
                "mounts": len((self.spec.get("containerEdits") or {}).get("mounts") or [])}

    def remove(self):
        os.unlink(self.podman_spec)


@pytest.fixture
def node(request, tmp_path, playbook, monkeypatch):
    env = {}
    if DRY:
        fc = request.getfixturevalue("fakecuda")  # (sets the double's variables for this test's playbooks)
        env = dict(fc.env, GPUCKPT_NVIDIA_PROC=write_nvidia_proc(str(tmp_path / "nvidia-proc"), DRY_UUIDS))
        monkeypatch.setenv("GPUCKPT_NVIDIA_PROC", env["GPUCKPT_NVIDIA_PROC"])
        with open(os.path.join(fc.state_dir, "gpus"), "w") as fh:
            fh.write("".join(u + "\n" for u in DRY_UUIDS))
    n = Node(str(tmp_path / "node"), playbook, env)
    yield n
    n.remove()


class Local(object):
    """Runs an engine's commands on this machine."""

    def sh(self, command, check=True, timeout=600):
        return subprocess.run(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, check=check, timeout=timeout)


class OnHost(object):
    """Runs an engine's commands on a loopback host, through its ssh."""

    def __init__(self, hosts, name):
        self.hosts, self.name = hosts, name

    def sh(self, command, check=True, timeout=600):
        return self.hosts.ssh(self.name, command, check=check, timeout=timeout)


def _quote(argv):
    return " ".join(shlex.quote(str(a)) for a in argv)


def _host_mounts():
    """The host's trees the container gets read-only: /usr, /etc, /opt, then each mount under them on its own."""
    subs = set()
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if any(point.startswith(r + "/") for r in BOUND_ROOTS) and os.path.exists(point):
                subs.add(point)
    return [r for r in BOUND_ROOTS if os.path.isdir(r)] + sorted(subs, key=len)


def _security():
    """Docker and Podman confine a container with an AppArmor profile of their own where the kernel has AppArmor; they
    load it with apparmor_parser, which the GPU machine may lack."""
    try:
        with open("/sys/module/apparmor/parameters/enabled") as fh:
            enabled = fh.read().strip() == "Y"
    except OSError:
        enabled = False
    return ["--security-opt", "apparmor=unconfined"] if enabled else []


class DockerEngine(object):
    """A Docker 26 dockerd of the test's own (CDI on, specs from the node's dir; cgroupfs, as the runc and containerd
    GPU tests' containers have it) where ``where`` runs commands."""

    name = "docker"

    def __init__(self, where, base, node, namespace):
        self.where, self.base = where, base
        self.host = "unix://%s/docker.sock" % base
        config = daemon_config(base, self.host, namespace, cdi_spec_dirs=[node.docker_dir])
        with open(config) as fh:
            cfg = json.load(fh)
        cfg["exec-opts"] = ["native.cgroupdriver=cgroupfs"]
        with open(config, "w") as fh:
            json.dump(cfg, fh)
        where.sh("export PATH=%s; %s" % (shlex.quote(TOOL_PATH), dockerd_command(DOCKER26_DIR, config)))
        wait_until_up(DOCKER26_DIR, self.host, os.path.join(base, "dockerd.log"), timeout=90,
                      run=lambda argv: where.sh(_quote(argv) + " >/dev/null 2>&1", check=False).returncode)
        self.request = node.request()

    def cli(self, *args, check=True):
        return self.where.sh(_quote([DOCKER, "--host", self.host] + list(args)), check=check)

    def run(self, name, ro, rw, env, args):
        cmd = ["run", "--detach", "--name", name, "--network", "host", "--device", self.request] + _security()
        cmd += ["--mount=type=bind,source=%s,target=%s,readonly,bind-recursive=disabled" % (p, p) for p in ro]
        cmd += ["--mount=type=bind,source=%s,target=%s" % (p, p) for p in rw]
        cmd += ["--env=%s=%s" % kv for kv in sorted(env.items())]
        return self.cli(*(cmd + [SKELETON_IMAGE] + args), check=False)

    def state(self, name):
        res = self.where.sh(_quote([DOCKER, "--host", self.host, "container", "inspect", name]) + " 2>/dev/null",
                            check=False)
        return json.loads(res.stdout)[0]["State"] if res.returncode == 0 else None

    def logs(self, name):
        return self.cli("logs", "--tail", "40", name, check=False).stdout

    def remove(self, name):
        self.cli("rm", "--force", name, check=False)

    def playbook_vars(self):
        return {"gpuckpt_docker_host": self.host, "gpuckpt_docker_path": DOCKER}

    def stop(self):
        self.where.sh("%s ps -aq | xargs -r %s rm -f" % ((_quote([DOCKER, "--host", self.host]),) * 2), check=False)
        self.where.sh("kill $(cat %s/docker.pid)" % self.base, check=False)
        deadline = time.monotonic() + 30
        while self.where.sh("kill -0 $(cat %s/docker.pid)" % self.base, check=False).returncode == 0:
            if time.monotonic() > deadline:
                self.where.sh("kill -9 $(cat %s/docker.pid)" % self.base, check=False)
                break
            time.sleep(0.3)
        # (what dockerd mounted under its dirs, its network namespace's file among them, deepest first)
        self.where.sh("awk -v b=%s/ 'index($5, b) == 1 {print $5}' /proc/self/mountinfo | sort -r | xargs -r -n1 umount; "
                      "rm -rf %s" % (shlex.quote(self.base), shlex.quote(self.base)), check=False)


class PodmanEngine(object):
    """Podman with a storage of the test's own (``root``, ``runroot``) where ``where`` runs commands."""

    name = "podman"

    def __init__(self, where, root, runroot, node, own_runroot=False):
        self.where, self.root, self.runroot, self.own_runroot = where, root, runroot, own_runroot
        self.request = node.request()

    def cli(self, *args, check=True):
        return self.where.sh(_quote([PODMAN, "--root", self.root, "--runroot", self.runroot] + list(args)), check=check)

    def run(self, name, ro, rw, env, args):
        cmd = ["run", "--detach", "--name", name, "--network", "host", "--device", self.request] + _security()
        cmd += ["--ulimit=%s=%s" % limit for limit in _ulimits()]
        cmd += ["--mount=type=bind,source=%s,destination=%s,ro,bind-nonrecursive" % (p, p) for p in ro]
        cmd += ["--mount=type=bind,source=%s,destination=%s" % (p, p) for p in rw]
        cmd += ["--env=%s=%s" % kv for kv in sorted(env.items())]
        return self.cli(*(cmd + [SKELETON_IMAGE] + args), check=False)

    def state(self, name):
        res = self.where.sh(_quote([PODMAN, "--root", self.root, "--runroot", self.runroot, "container", "inspect",
                                    "--format", "json", name]) + " 2>/dev/null", check=False)
        return json.loads(res.stdout)[0]["State"] if res.returncode == 0 else None

    def logs(self, name):
        return self.cli("logs", "--tail", "40", name, check=False).stdout

    def remove(self, name):
        self.cli("rm", "--force", "--time", "0", name, check=False)

    def playbook_vars(self):
        return {"gpuckpt_podman_root": self.root, "gpuckpt_podman_runroot": self.runroot, "gpuckpt_podman_path": PODMAN}

    def stop(self):
        podman = _quote([PODMAN, "--root", self.root, "--runroot", self.runroot])
        self.where.sh("%s ps -aq | xargs -r %s rm -f -t 0" % (podman, podman), check=False)
        self.where.sh("umount %s/overlay" % self.root, check=False)  # (the storage binds its layers' dir onto itself)
        if self.own_runroot:
            self.where.sh("rm -rf %s" % shlex.quote(self.runroot), check=False)


def _ulimits():
    """Podman's default limits are above what a VM allows a container (it refuses the setrlimit): at most test_podman's
    numbers, and never above this machine's own."""
    out = []
    for name, which, cap in (("nofile", resource.RLIMIT_NOFILE, 20000), ("nproc", resource.RLIMIT_NPROC, 32768)):
        soft, hard = resource.getrlimit(which)
        value = min([cap] + [x for x in (soft, hard) if x != resource.RLIM_INFINITY])
        out.append((name, "%d:%d" % (value, value)))
    return out


def _images(engines, base):
    """The skeleton image imported into the first engine and copied to the others, the same id on each (a pull)."""
    first = engines[0]
    first.cli("import", skeleton_tar(os.path.join(base, "skel.tar")), SKELETON_IMAGE)
    if len(engines) > 1:
        first.cli("save", "--output", os.path.join(base, "skel-image.tar"), SKELETON_IMAGE)
        for other in engines[1:]:
            other.cli("load", "--input", os.path.join(base, "skel-image.tar"))


class ContainerWorkload(TorchWorkload):
    """The workload as a container's init: torch_counter.py --train on the GPU (dry: counter.py on the libcuda double,
    a parent and a child), its state files in ``directory`` bound in read-write."""

    count_timeout = 180

    def __init__(self, eng, directory, rw=(), env=None):  # pylint: disable=super-init-not-called
        self.engine, self.dir, self.gib, self.pids = eng, directory, GIB, []
        self.name = "gpuckpt-gd-" + uuid.uuid4().hex[:8]
        self.roles = ["parent", "child1"] if DRY else ["parent"]
        os.makedirs(directory)
        if DRY:
            args = ["/usr/bin/python3", COUNTER, "--dir", directory, "--mb", "8", "--fakecuda", FAKE_LIBCUDA]
        else:
            args = [WORKLOAD_PYTHON, TORCH_COUNTER, "--dir", directory, "--gib", str(GIB), "--train"]
        res = eng.run(self.name, _host_mounts() + [REPO], [directory] + list(rw), dict(PASS_ENV, **(env or {})), args)
        assert res.returncode == 0, "%s run failed:\n%s" % (eng.name, res.stdout[-3000:])
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(directory, "parent.state")):
            state = eng.state(self.name) or {}
            if time.monotonic() > deadline or state.get("Status") not in ("running", "created", "configured", "initialized"):
                raise AssertionError("the container never started counting (%s); its log:\n%s"
                                     % (state.get("Status"), eng.logs(self.name)))
            time.sleep(0.5)
        self.wait_counting()

    def pid(self):
        return int(self.engine.state(self.name)["Pid"])

    def gpu_nodes(self):
        """The NVIDIA device nodes in the container's /dev: name -> (major, minor)."""
        dev = "/proc/%d/root/dev" % self.pid()
        out = {}
        for n in os.listdir(dev):
            st = os.stat(os.path.join(dev, n), follow_symlinks=False)
            if n.startswith("nvidia") and stat.S_ISCHR(st.st_mode):  # (not the nvidia-caps directory)
                out[n] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        return out

    def holds_nodes(self, nodes):
        """Its /dev holds the spec's ``nodes``, and beyond them at most other GPUs' nodes (/dev/nvidia<minor>). On a
        machine with two GPUs, libcuda in a Docker container makes /dev/nvidia1 itself: Docker's default device rules
        let a container make any device node (mknod), not open it (seen on 2 x H100, 2026-11-27). Which GPU the
        workload uses is checked apart (the image's runtime.gpus, nvidia-smi inside)."""
        have = self.gpu_nodes()
        extra = {n: rdev for n, rdev in have.items() if n not in nodes}
        assert {n: have.get(n) for n in nodes} == nodes, (have, nodes)
        assert all(n[len("nvidia"):].isdigit() and rdev[0] == 195 for n, rdev in extra.items()), (extra, nodes)
        return True

    def went_on_intact(self, before):
        """It counts on from ``before`` with its (GPU) memory as it was filled."""
        self.wait_counting(beyond=before)
        if DRY:
            super(ContainerWorkload, self).went_on_intact(before)
        else:
            assert self.verified_after(self.counts())
        assert not [f for f in os.listdir(self.dir) if f.endswith(".corrupt")]

    def losses_as_uninterrupted(self, base):
        """Every loss the job logged is the very bits of the same training run alone in a fresh process; the number
        of steps compared (0 dry: the double trains nothing)."""
        if DRY:
            return 0
        got = _losses(os.path.join(self.dir, "parent.losses"))
        last = max(got)
        ref = os.path.join(base, "reference")
        os.makedirs(ref)
        out = subprocess.run([WORKLOAD_PYTHON, TORCH_COUNTER, "--dir", ref, "--reference-losses", str(last)],
                             env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             universal_newlines=True, timeout=900, check=False)
        assert out.returncode == 0, out.stdout
        want = _losses(os.path.join(ref, "reference.losses"))
        differ = [s for s in sorted(got) if s <= last and got[s] != want.get(s)]
        assert not differ, "losses differ from the uninterrupted run at steps %s" % differ[:10]
        return last

    def kill(self):
        self.engine.remove(self.name)


def _losses(path):
    """{step: loss bits}; a step logged twice keeps its last line."""
    out = {}
    with open(path) as fh:
        for line in fh:
            step, bits = line.split()
            out[int(step)] = bits
    return out


def _manifest_gpus(image_dir):
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        return json.load(fh)["runtime"].get("gpus")


def _local_engine(kind, node, tmp_path):
    if kind == "docker":
        return DockerEngine(Local(), tempfile.mkdtemp(prefix="gpk-dg-", dir="/tmp"), node, "gpuckpt-gpu")
    # (a run root under 50 characters: Podman's limit)
    return PodmanEngine(Local(), str(tmp_path / "podman-root"), tempfile.mkdtemp(prefix="gpk-pg-", dir="/tmp"), node,
                        own_runroot=True)


def test_gpu_container_checkpointed_and_restored_on_one_host(engine, node, playbook, tmp_path, record):
    """Checkpointed by name through checkpoint.yml, restored by restore.yml with nvidia-smi as the probe: it counts
    on with its GPU memory intact, its /dev holds the spec's nodes, and a second restore changes nothing."""
    eng = _local_engine(engine, node, tmp_path)
    w = None
    try:
        _images([eng], str(tmp_path))
        rw = [node.env["FAKECUDA_STATE_DIR"]] if DRY else []
        w = ContainerWorkload(eng, str(tmp_path / "w"), rw=rw, env={k: node.env[k] for k in (
            "GPUCKPT_LIBCUDA", "FAKECUDA_STATE_DIR") if k in node.env})
        nodes = node.nodes_of("0")
        assert w.holds_nodes(nodes)
        image_dir = str(tmp_path / "img")
        v = dict(eng.playbook_vars(), gpuckpt_image_dir=image_dir)
        ck = playbook(CHECKPOINT, dict(v, gpuckpt_container=w.name, gpuckpt_runtime=engine), env=node.env)
        record("gpu_%s_checkpoint_attempt" % engine, rc=ck.rc, tail=ck.stdout[-3000:] if ck.rc else "")
        assert ck.rc == 0, ck.stdout
        c = ck.task("Checkpoint container")
        assert c["changed"] is True
        assert _manifest_gpus(image_dir) == [node.gpu0()], "the GPU it held, recorded from the spec the engine made"
        stopped_at = w.counts()
        rs = playbook(RESTORE, dict(v, gpuckpt_probe_command=PROBE), env=node.env)
        record("gpu_%s_restore_attempt" % engine, rc=rs.rc, tail=rs.stdout[-3000:] if rs.rc else "")
        assert rs.rc == 0, rs.stdout
        r = rs.task("Restore from")
        assert r["changed"] is True and r["probe"]["rc"] == 0, r.get("probe")
        assert eng.state(w.name)["Status"] == "running"
        assert w.holds_nodes(nodes)
        w.went_on_intact(stopped_at)
        # (frozen_to_running: from the freeze to running again, the two playbooks' own start-up between them included)
        record("gpu_%s_checkpoint_restore" % engine, dry=DRY, gib=GIB, request=node.request(), cdi_spec=node.summary(),
               gpus=_manifest_gpus(image_dir), nodes=nodes, image_bytes=c.get("image_bytes"), checkpoint=c.get("timings"),
               restore=r.get("timings"), probe=r.get("probe"), frozen_to_running=r["resumed_at"] - c["frozen_at"],
               spec_mounts_left_out_for_podman=node.dropped if engine == "podman" else None)
        again = playbook(RESTORE, dict(v, gpuckpt_probe_command=PROBE), env=node.env)
        assert again.rc == 0 and again.task("Restore from")["changed"] is False
        record("gpu_%s_checkpoint_restore_losses" % engine, steps_bit_identical=w.losses_as_uninterrupted(str(tmp_path)))
    finally:
        if w is not None:
            w.kill()
        eng.stop()


class MountNamespaceHosts(LoopbackHosts):
    """Loopback hosts in this machine's pid space, each in a mount namespace of its own (private: what one host mounts,
    its Podman storage at the shared paths, the other does not see)."""

    def _spawn(self, name):
        d = self.path(name)
        log = open(os.path.join(d, "sshd.log"), "ab")
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", SSHD, "-D", "-e", "-f",
                                 os.path.join(d, "sshd_config")], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.pids[name] = proc.pid


def _hosts(engine, node, tmp_path):
    """The two loopback hosts, their variables naming each one's engine; and (name -> engine)."""
    base = str(tmp_path / "hosts")
    hv = {}
    if DRY:
        sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
        from loopback_workloads import fakecuda_host_vars
        hv = fakecuda_host_vars(base)
    for name, unused in HOSTS:
        env = hv.setdefault(name, {}).setdefault("gpuckpt_environment", {})
        env.update(PASS_ENV)
        if DRY:
            env["GPUCKPT_NVIDIA_PROC"] = node.env["GPUCKPT_NVIDIA_PROC"]
            with open(os.path.join(env["FAKECUDA_STATE_DIR"], "gpus"), "w") as fh:
                fh.write("".join(u + "\n" for u in DRY_UUIDS))
        if engine == "docker":
            d = "/tmp/gpk-dg-%s-%d" % (name, os.getpid())  # short: containerd's sockets live under it
            hv[name].update({"gpuckpt_docker_host": "unix://%s/docker.sock" % d, "gpuckpt_docker_path": DOCKER})
        else:
            hv[name].update({"gpuckpt_podman_root": PODMAN_ROOT, "gpuckpt_podman_runroot": PODMAN_RUNROOT,
                             "gpuckpt_podman_path": PODMAN})
    kind = LoopbackHosts if engine == "docker" else MountNamespaceHosts
    hosts = kind(base, pid_namespaces=False, python=WORKLOAD_PYTHON, hosts=HOSTS).start(hv)
    hosts.host_vars = hv
    engines = {}
    try:
        for name, unused in HOSTS:
            if engine == "docker":
                d = hv[name]["gpuckpt_docker_host"][len("unix://"):-len("/docker.sock")]
                engines[name] = DockerEngine(OnHost(hosts, name), d, node, "gpuckpt-gpu-" + name)
            else:
                store = hosts.path(name, "podman-store")
                hosts.ssh(name, "mkdir -p {s}/root {s}/run {r} {rr} && mount --bind {s}/root {r} && mount --bind {s}/run {rr}"
                          .format(s=store, r=PODMAN_ROOT, rr=PODMAN_RUNROOT))
                engines[name] = PodmanEngine(OnHost(hosts, name), PODMAN_ROOT, PODMAN_RUNROOT, node)
    except BaseException:
        _stop_hosts(hosts, engines)
        raise
    return hosts, engines


def _stop_hosts(hosts, engines):
    for eng in engines.values():
        eng.stop()
    hosts.stop()
    time.sleep(1)
    for path in (PODMAN_ROOT, PODMAN_RUNROOT):  # (the mount points each host's namespace bound its storage at)
        try:
            os.rmdir(path)
        except OSError:
            pass


def test_gpu_container_migrates_between_the_loopback_hosts(engine, node, playbook, tmp_path, record):
    """migrate.yml moves it from hosta to hostb (created again there by name from its saved configuration, or
    imported from Podman's export), nvidia-smi the probe inside the restored copy: it counts on there with its GPU
    memory intact and hostb's spec's device nodes, hosta's copy gone; a re-run changes nothing."""
    hosts, engines = _hosts(engine, node, tmp_path)
    w = None
    try:
        _images([engines["hosta"], engines["hostb"]], hosts.path())
        hv = hosts.host_vars["hosta"]["gpuckpt_environment"]
        env = {k: hv[k] for k in ("GPUCKPT_LIBCUDA", "FAKECUDA_STATE_DIR") if k in hv}
        w = ContainerWorkload(engines["hosta"], str(tmp_path / "w"), rw=[hosts.path()] if DRY else [], env=env)
        nodes = node.nodes_of("0")
        assert w.holds_nodes(nodes)
        v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": engine,
             "migration_id": "gpu-%s-%s" % (engine, node.tag), "gpuckpt_runtime_timeout": 300, "probe_command": PROBE}
        before = w.counts()
        run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        record("gpu_%s_migrate_attempt" % engine, rc=run.rc, tail=run.stdout[-4000:] if run.rc else "")
        if run.rc != 0:  # whatever failed, exactly one copy must run on, on hosta, with its GPU memory intact
            assert "rolled back; the workload runs on hosta" in run.stdout, run.stdout
            assert engines["hosta"].state(w.name)["Status"] == "running" and engines["hostb"].state(w.name) is None
            w.went_on_intact(before)
        assert run.rc == 0, run.stdout
        ck, sy, rs = run.task("Stage 1/3"), run.task("Stage 2/3"), run.task("Restore on hostb")
        assert rs["probe"]["rc"] == 0, rs["probe"]
        source = engines["hosta"].state(w.name)
        assert source is None or source["Status"] == "exited", source  # (Docker keeps it exited, Podman removes it)
        w.engine = engines["hostb"]
        assert w.engine.state(w.name)["Status"] == "running"
        assert w.holds_nodes(nodes)
        w.went_on_intact(before)
        record("gpu_%s_migrate" % engine, dry=DRY, gib=GIB, request=node.request(), cuda_pids=len(ck["cuda_pids"]),
               image_bytes=ck["image_bytes"], leave_stopped=ck["leave_stopped"], checkpoint=ck["timings"],
               push=ck.get("push"), transfer_seconds=sy.get("seconds"), restore=rs["timings"], probe=rs["probe"],
               downtime=rs["resumed_at"] - ck["frozen_at"], summary=run.task("Summary")["msg"],
               preflight="\n".join(run.task("Show the preflight")["msg"]))
        again = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert again.rc == 0, again.stdout
        assert [t for t in again.results if t.get("changed")] == [], "a re-run must change nothing"
        record("gpu_%s_migrate_losses" % engine, steps_bit_identical=w.losses_as_uninterrupted(str(tmp_path)))
    finally:
        if w is not None:
            for eng in engines.values():
                eng.remove(w.name)
        _stop_hosts(hosts, engines)
