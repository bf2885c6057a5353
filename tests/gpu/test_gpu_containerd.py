"""On a real GPU: a PyTorch workload as a containerd task, moved by migrate.yml between the two
loopback "hosts" of the GPU machine and back, each host with a containerd 2.1 of its own (carried:
tests/gpu/prepare_carry.sh) started over ssh, its runc state apart.

The container is made from an image (the skeleton image, imported as an OCI archive) in namespace
k8s.io, as a Kubernetes node's pods are; its GPU comes in as CDI puts it into a spec: the /dev/nvidia*
device nodes with their cgroup rules and the driver's libraries bound from the host (tests/gpu/
test_gpu_runc.gpu_spec). The migration runs `nvidia-smi` inside the restored container as its probe.
Its GPU memory is checked by checksum after each move, and a re-run changes nothing."""
from __future__ import annotations

import os
import shlex
import sys
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, TorchWorkload
from test_gpu_runc import PASS_ENV, gpu_spec

sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from containerd_daemon import CONTAINERD, CTR, PREFIX, Containerd, available  # noqa: E402
from loopback import LoopbackHosts  # noqa: E402

GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))
NAMESPACE = "k8s.io"
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and grpcio (tests/gpu/install_tools.sh)")


def containerd_dir(host):
    """Short (a unix socket's path has at most 107 bytes), one per loopback host and test process."""
    return "/tmp/gpk-cg-%s-%d" % (host, os.getpid())


def _api(address, namespace=NAMESPACE):
    sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_api import Client
    return Client(address, namespace)


def start_containerds(hosts, namespace=NAMESPACE):
    """A containerd 2.1 of its own on each loopback host, started over ssh, the skeleton image imported."""
    daemons = {}
    for name in ("hosta", "hostb"):
        d = Containerd(containerd_dir(name))
        d.write_config()
        hosts.ssh(name, "PATH=%s:$PATH setsid %s --config %s/config.toml >%s/containerd.log 2>&1 </dev/null & "
                        "echo $! >%s/pid" % (PREFIX, CONTAINERD, d.dir, d.dir, d.dir))
        d.wait_ready()
        d.import_skeleton(namespace)
        daemons[name] = d
    return daemons


def start_task(hosts, daemon, cid, args, env, binds, log, spec_edit=None, namespace=NAMESPACE):
    """Container ``cid`` on hosta's ``daemon`` running ``args`` on the host's network, given every GPU (gpu_spec; then
    ``spec_edit(spec)``), with ``binds`` ({host path: "ro" or "rw"}) at their host paths, its task started detached
    with its output in ``log``."""
    create = [CTR, "--address", daemon.address, "--namespace", namespace, "containers", "create", "--net-host",
              "--runc-root", hosts.path("hosta", "runc-root")]
    for k, v in sorted(env.items()):
        create += ["--env", "%s=%s" % (k, v)]
    for src, mode in binds.items():
        create += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, mode)]
    hosts.ssh("hosta", " ".join(shlex.quote(x) for x in create + [daemon.import_skeleton(namespace), cid] + args))
    api = _api(daemon.address, namespace)
    try:
        record = api.container(cid)
        spec = gpu_spec(record["spec"])
        if spec_edit is not None:
            spec_edit(spec)
        api.update_spec(cid, spec, record["spec_url"], "test")
    finally:
        api.close()
    hosts.ssh("hosta", " ".join(shlex.quote(x) for x in [CTR, "--address", daemon.address, "--namespace", namespace,
                                                         "tasks", "start", "--detach", "--log-uri", "file://" + log,
                                                         cid]))


def task_status(daemon, cid, namespace=NAMESPACE):
    """The task's status on ``daemon`` (RUNNING, PAUSED, ...), None where it has none."""
    for line in daemon.ctr("tasks", "ls", namespace=namespace).stdout.splitlines()[1:]:
        f = line.split()
        if f and f[0] == cid:
            return f[2]
    return None


def container_exists(daemon, cid, namespace=NAMESPACE):
    return cid in daemon.ctr("containers", "ls", "-q", namespace=namespace).stdout.split()


def stop_containerds(hosts, daemons):
    for name, d in daemons.items():
        d.remove_all()
        hosts.ssh(name, "kill $(cat %s/pid)" % d.dir, check=False)
        time.sleep(1)
        hosts.ssh(name, "umount -R %s/root; rm -rf %s" % (d.dir, d.dir), check=False)


class ContainerdTorch(TorchWorkload):
    """torch_counter.py as the init of a containerd task on hosta."""

    def __init__(self, hosts, directory, gib):  # pylint: disable=super-init-not-called
        self.hosts, self.dir, self.gib = hosts, directory, gib
        self.id = "gpuckpt-cg-" + uuid.uuid4().hex[:8]
        self.roles = ["parent"]
        os.makedirs(directory, exist_ok=True)
        self.daemons = start_containerds(hosts)
        a = self.daemons["hosta"]
        args = [WORKLOAD_PYTHON, os.path.join(REPO, "tests", "workloads", "torch_counter.py"), "--dir", directory,
                "--gib", str(gib)]
        start_task(hosts, a, self.id, args, PASS_ENV, {REPO: "ro", directory: "rw"},
                   os.path.join(directory, "container.log"))
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(directory, "parent.state")):
            if time.monotonic() > deadline:
                log = os.path.join(directory, "container.log")
                raise AssertionError("the task never started counting; its log:\n%s\ntasks: %s"
                                     % (open(log).read()[-3000:] if os.path.exists(log) else "(none)",
                                        a.ctr("tasks", "ls", namespace=NAMESPACE).stdout))
            time.sleep(0.2)
        self.wait_counting()
        self.pids = []

    def status(self, host):
        return task_status(self.daemons[host], self.id)

    def exists(self, host):
        return container_exists(self.daemons[host], self.id)

    def kill(self):
        stop_containerds(self.hosts, self.daemons)


@pytest.fixture
def containerd_hosts(tmp_path):
    base = str(tmp_path / "hosts")
    hv = {n: {"gpuckpt_environment": dict(PASS_ENV),
              "gpuckpt_runc_root": os.path.join(base, n, "runc-root"),
              "gpuckpt_containerd_address": os.path.join(containerd_dir(n), "containerd.sock")}
          for n in ("hosta", "hostb")}
    h = LoopbackHosts(base, pid_namespaces=False, python=WORKLOAD_PYTHON).start(hv)
    yield h
    h.stop()
    time.sleep(1)


def _migrate(playbook, hosts, w, source, target, mid, record):
    v = {"source": source, "target": target, "container": w.id, "runtime": "containerd",
         "containerd_namespace": NAMESPACE, "migration_id": mid, "gpuckpt_runtime_timeout": 300,
         "probe_command": ["nvidia-smi", "--query-gpu=name,memory.used", "--format=csv,noheader"]}
    before = w.counts()
    run = playbook("gpuckpt.fleet.migrate", v, inventory=hosts.path("inventory.yml"))
    record("gpu_containerd_migrate_attempt", rc=run.rc, source=source, tail=run.stdout[-4000:] if run.rc else "")
    if run.rc != 0:  # whatever failed, exactly one copy must run on with its GPU memory intact
        assert "rolled back; the workload runs on %s" % source in run.stdout, run.stdout
        assert w.status(source) == "RUNNING" and not w.exists(target)
        w.wait_counting(beyond=before)
        assert w.verified_after(w.counts())
    assert run.rc == 0, run.stdout
    ck, sy, rs = run.task("Stage 1/3"), run.task("Stage 2/3"), run.task("Restore on %s" % target)
    assert len(ck["cuda_pids"]) == 1
    assert rs["probe"]["rc"] == 0, rs["probe"]
    assert w.status(target) == "RUNNING" and not w.exists(source)
    w.wait_counting(beyond=before)
    assert w.verified_after(w.counts())
    shown = "\n".join(run.task("Show the preflight")["msg"])
    record("gpu_containerd_migrate", gib=GIB, source=source, target=target, image_bytes=ck["image_bytes"],
           leave_stopped=ck["leave_stopped"], checkpoint=ck["timings"], push=ck.get("push"),
           transfer_seconds=sy.get("seconds"), restore=rs["timings"], probe=rs["probe"],
           downtime=rs["resumed_at"] - ck["frozen_at"], summary=run.task("Summary")["msg"], preflight=shown)
    again = playbook("gpuckpt.fleet.migrate", v, inventory=hosts.path("inventory.yml"))
    assert again.rc == 0
    assert [t for t in again.results if t.get("changed")] == [], "a re-run must change nothing"
    assert w.status(target) == "RUNNING"


def test_containerd_gpu_task_migrates_there_and_back_with_its_gpu_memory(
        playbook, containerd_hosts, tmp_path, record):
    w = ContainerdTorch(containerd_hosts, str(tmp_path / "w"), GIB)
    try:
        # the node's facts name the task that holds the GPU process, with its pids on the host and inside
        facts = playbook(os.path.join(REPO, "tests", "integration", "playbooks", "facts_raw.yml"),
                         {"facts_args": {"list_containers": ["containerd"], "check_criu": False,
                                         "containerd_address": os.path.join(containerd_dir("hosta"), "containerd.sock")}})
        assert facts.rc == 0, facts.stdout
        gpk = facts.task("cuda_process_facts")["ansible_facts"]["gpuckpt"]
        mine = [c for c in gpk["gpu_containers"] if c["id"] == w.id]
        record("gpu_containerd_facts", gpu_containers=gpk["gpu_containers"], container_errors=gpk["container_errors"])
        assert mine and mine[0]["namespace"] == NAMESPACE and mine[0]["cuda_processes"][0]["ns_pid"] == 1, gpk
        _migrate(playbook, containerd_hosts, w, "hosta", "hostb", "gpu-ctrd-1", record)
        _migrate(playbook, containerd_hosts, w, "hostb", "hosta", "gpu-ctrd-2", record)
    finally:
        w.kill()
