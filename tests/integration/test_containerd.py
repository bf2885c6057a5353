"""containerd tasks, checkpointed and restored through the playbooks: a real containerd 2.1.9 (Debian
sid's build, started and stopped by these tests, CRI off) whose runc shim drives real runc 1.1.5 and
CRIU 4.2.1. Inside the container a parent and a child count and hold a memory pattern, registered
with the libcuda TEST DOUBLE, so the CUDA stage runs on the task's host pids as it does on a GPU node."""
from __future__ import annotations

import json
import os
import shlex
import time
import uuid

import pytest

from containerd_daemon import CTR, IMAGE, Containerd, available, start_on_host, stop_on_host
from helpers import COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, alive, give_container_gpus, tree, write_nvidia_proc

from loopback_workloads import MIGRATE, changed_tasks

CHECKPOINT = "gpuckpt.fleet.checkpoint"
FACTS = os.path.join(REPO, "tests", "integration", "playbooks", "facts_raw.yml")
RESTORE = "gpuckpt.fleet.restore"
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and python3-grpcio (tests/setup.sh) needed")


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    daemon = Containerd(str(tmp_path_factory.mktemp("containerd"))).start()
    daemon.import_skeleton()
    daemon.import_skeleton(namespace="k8s.io")
    yield daemon
    daemon.stop()


class ContainerdWorkload(CountingWorkload):
    """A container made by ``ctr run`` from the skeleton image (this machine's /usr and /etc, the repo
    and the work dir bound at their host paths), whose first act is to write a file into its own
    writable layer, then run tests/workloads/counter.py."""

    roles = ("parent", "child1")

    def __init__(self, daemon, base, fakecuda, namespace="default", labels=None, cid=None, gpu_minors=None):
        self.daemon, self.namespace = daemon, namespace
        self.fakecuda_dir = fakecuda.state_dir
        self.base, self.dir = base, os.path.join(base, "w")
        self.id = cid or "gpuckpt-t-" + uuid.uuid4().hex[:8]
        self.runc_root = os.path.join(base, "runc-root")
        os.makedirs(self.dir, exist_ok=True)
        args = ["run", "--detach", "--runc-root", self.runc_root, "--log-uri", "file://" + os.path.join(base, "out.log"),
                "--env", "PATH=/usr/bin:/bin"]
        for k, v in fakecuda.env.items():
            args += ["--env", "%s=%s" % (k, v)]
        for k, v in sorted((labels or {}).items()):
            args += ["--label", "%s=%s" % (k, v)]
        for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (self.dir, "rw"), (fakecuda.state_dir, "rw")]:
            args += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, opt)]
        cmd = ("echo %s > /var/written-in-the-layer && exec /usr/bin/python3 %s --dir %s --mb 8 --fakecuda %s"
               % (self.id, COUNTER, self.dir, FAKE_LIBCUDA))
        image = daemon.import_skeleton(namespace)
        if gpu_minors is None:
            daemon.ctr(*(args + [image, self.id, "/bin/sh", "-c", cmd]), namespace=namespace)
        else:  # created, given GPUs as a device plugin gives them (CDI), then started
            log_uri = args[args.index("--log-uri") + 1]
            create = [a for a in args[1:] if a != "--detach"]
            del create[create.index("--log-uri"):create.index("--log-uri") + 2]
            daemon.ctr(*(["containers", "create"] + create + [image, self.id, "/bin/sh", "-c", cmd]),
                       namespace=namespace)
            res = give_container_gpus(daemon.address, namespace, self.id, gpu_minors)
            assert res.returncode == 0, res.stderr
            daemon.ctr("tasks", "start", "--detach", "--log-uri", log_uri, self.id, namespace=namespace)
        self.wait_counting()

    def task(self):
        for line in self.daemon.ctr("tasks", "ls", namespace=self.namespace).stdout.splitlines()[1:]:
            f = line.split()
            if f and f[0] == self.id:
                return {"pid": int(f[1]), "status": f[2]}
        return None

    def exists(self):
        return self.id in self.daemon.ctr("containers", "ls", "-q", namespace=self.namespace).stdout.split()

    def host_pids(self):
        return tree(self.task()["pid"])

    def layer_file(self):
        return self.daemon.read_in_task(self.id, "/var/written-in-the-layer", namespace=self.namespace)

    def vars(self, image_dir, **extra):
        v = {"gpuckpt_container": self.id, "gpuckpt_runtime": "containerd", "gpuckpt_image_dir": image_dir,
             "gpuckpt_containerd_address": self.daemon.address, "gpuckpt_containerd_namespace": self.namespace}
        v.update(extra)
        return v


@pytest.fixture
def containerd_workload(tmp_path, fakecuda, containerd):
    made = []

    def make(namespace="default", gpu_minors=None):
        w = ContainerdWorkload(containerd, str(tmp_path / ("c%d" % len(made))), fakecuda, namespace,
                               gpu_minors=gpu_minors)
        made.append(w)
        return w
    yield make
    containerd.remove_all()


def test_task_checkpoint_then_restore_is_a_task_containerd_manages(
        tmp_path, playbook, containerd_workload, fakecuda, containerd):
    w = containerd_workload(namespace="k8s.io")
    host_pids = w.host_pids()
    image_dir = str(tmp_path / "img")
    # the node's facts name the container that holds these CUDA processes, by runtime and namespace
    facts = playbook(FACTS, {"facts_args": {"list_containers": ["containerd"], "containerd_address": containerd.address,
                                            "check_criu": False}}, env=fakecuda.env)
    assert facts.rc == 0, facts.stdout
    gpk = facts.task("cuda_process_facts")["ansible_facts"]["gpuckpt"]
    [mine] = [c for c in gpk["gpu_containers"] if c["id"] == w.id] or [{k: gpk.get(k) for k in ("gpu_containers", "container_errors", "cuda_processes")}]
    assert mine.get("namespace") == "k8s.io" and mine["runtime"] == "containerd" and mine["pid"] == host_pids[0]
    assert sorted(c["pid"] for c in mine["cuda_processes"]) == sorted(host_pids)
    assert sorted(c["ns_pid"] for c in mine["cuda_processes"])[0] == 1, "pids inside the container, init first"
    assert {p["pid"]: p.get("container", {}).get("id") for p in gpk["cuda_processes"]}[host_pids[0]] == w.id
    run = playbook(CHECKPOINT, w.vars(image_dir), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint container")
    assert res["changed"] is True and res["gpu_stage"] == "done"
    assert sorted(res["cuda_pids"]) == sorted(host_pids)
    assert w.task()["status"] == "STOPPED", "a checkpoint without leave_* stops the task"
    assert not any(alive(p) for p in host_pids)
    assert os.path.isfile(os.path.join(image_dir, "rootfs-diff.tar"))
    stopped_at = w.counts()

    again = playbook(CHECKPOINT, w.vars(image_dir), env=fakecuda.env)
    assert again.rc == 0 and again.task("Checkpoint container")["changed"] is False

    # The checkpointed container stays, its task stopped, until its image is restored in its place.
    assert w.exists() and w.task()["status"] == "STOPPED"
    # the probe runs inside the restored container: its root is the container's, with its layer
    run = playbook(RESTORE, w.vars(image_dir, gpuckpt_probe_command="cat /var/written-in-the-layer"), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and len(rs["cuda_pids"]) == 2
    assert rs["probe"]["rc"] == 0 and rs["probe"]["stdout"].strip() == w.id, rs["probe"]
    assert w.task()["status"] == "RUNNING"
    assert all(fakecuda.state(p) == "running" for p in rs["cuda_pids"])
    w.went_on_intact(stopped_at)
    assert w.layer_file() == w.id, "the file written into the container's layer came back with it"
    # containerd manages the restored task: it pauses, resumes, and is killed and deleted by it
    containerd.ctr("tasks", "pause", w.id, namespace="k8s.io")
    assert w.task()["status"] == "PAUSED"
    containerd.ctr("tasks", "resume", w.id, namespace="k8s.io")
    w.went_on_intact(w.counts())

    second = playbook(RESTORE, w.vars(image_dir), env=fakecuda.env)
    assert second.rc == 0 and second.task("Restore from")["changed"] is False


def test_a_task_restored_where_the_driver_lists_other_gpus_goes_onto_them_place_by_place(
        tmp_path, playbook, containerd_workload, fakecuda):
    """The container was given GPU minor 1 of node A; its image is restored where the driver lists other GPUs
    (node B's UUIDs: GPUCKPT_NVIDIA_PROC points at another node's driver files, the libcuda double holds node
    B's GPUs). Where minor 1 is not a GPU of that node, the restore is refused before anything is restored;
    where it is, the task's processes are restored onto node B's GPU of that place, with the driver's pairs."""
    node_a = ["GPU-aaaaaaaa-0000-4000-8000-00000000000%d" % m for m in range(2)]
    node_b = ["GPU-bbbbbbbb-0000-4000-8000-00000000000%d" % m for m in range(2)]
    proc_a = write_nvidia_proc(str(tmp_path / "proc-a"), node_a)
    proc_b = write_nvidia_proc(str(tmp_path / "proc-b"), node_b)
    proc_b_one = write_nvidia_proc(str(tmp_path / "proc-b-one"), node_b[:1])
    env_a, env_b = dict(fakecuda.env, GPUCKPT_NVIDIA_PROC=proc_a), dict(fakecuda.env, GPUCKPT_NVIDIA_PROC=proc_b)
    w = containerd_workload(gpu_minors=[1])
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, w.vars(image_dir), env=env_a)
    assert run.rc == 0, run.stdout
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        assert json.load(fh)["runtime"]["gpus"] == [{"uuid": node_a[1], "minor": 1}]
    stopped_at = w.counts()
    with open(os.path.join(fakecuda.state_dir, "gpus"), "w") as fh:
        fh.write("".join(u + "\n" for u in node_b))

    refused = playbook(RESTORE, w.vars(image_dir), env=dict(fakecuda.env, GPUCKPT_NVIDIA_PROC=proc_b_one))
    assert refused.rc != 0
    msg = refused.task("Restore from")["msg"]
    assert "/dev/nvidia1 (minor 1), a GPU this host's driver does not list; nothing was restored" in msg, msg
    assert w.task()["status"] == "STOPPED" and not [ln for ln in fakecuda.calls_log() if ln.startswith("restore")]

    run = playbook(RESTORE, w.vars(image_dir), env=env_b)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    pairs = [ln.split() for ln in fakecuda.calls_log() if ln.startswith("restore-pairs ")]
    assert sorted(int(p[1]) for p in pairs) == sorted(rs["cuda_pids"])
    assert {p[2] for p in pairs} == {"%s=%s" % (node_a[1], node_b[1])}, pairs
    dev = "/proc/%d/root/dev" % w.task()["pid"]
    assert sorted(n for n in os.listdir(dev) if n.startswith("nvidia")) == ["nvidia1"]
    w.went_on_intact(stopped_at)


def test_leave_stopped_holds_the_task_paused_and_a_restore_beside_it_is_refused(
        tmp_path, playbook, containerd_workload, fakecuda):
    w = containerd_workload()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, w.vars(image_dir, gpuckpt_leave_running=True), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    assert w.task()["status"] == "RUNNING" and w.is_counting()
    second = playbook(RESTORE, w.vars(image_dir), env=fakecuda.env)
    assert second.rc != 0
    assert "already exists in namespace default on this host" in second.task("Restore from")["msg"]
    assert w.is_counting()


@pytest.mark.parametrize("case", ["unknown container", "unknown namespace", "stopped task", "moby"])
def test_bad_targets_are_refused_before_anything_is_frozen(
        case, tmp_path, playbook, containerd_workload, fakecuda, containerd):
    w = containerd_workload()
    image_dir = str(tmp_path / "img")
    v = w.vars(image_dir)
    expect = {"unknown container": "no containerd container 'no-such' in namespace default",
              "unknown namespace": "has no namespace 'nowhere'",
              "stopped task": "a stopped task, not a running task",
              "moby": "namespace moby holds Docker's containers"}[case]
    if case == "unknown container":
        v["gpuckpt_container"] = "no-such"
    elif case in ("unknown namespace", "moby"):
        v["gpuckpt_containerd_namespace"] = "nowhere" if case == "unknown namespace" else "moby"
    else:
        other = containerd_workload()
        containerd.ctr("tasks", "kill", "-s", "SIGKILL", other.id)
        deadline = time.monotonic() + 20
        while other.task()["status"] != "STOPPED" and time.monotonic() < deadline:
            time.sleep(0.1)
        v["gpuckpt_container"] = other.id
    run = playbook(CHECKPOINT, v, env=fakecuda.env)
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight" and expect in res["msg"], res
    assert not os.path.exists(image_dir)
    assert [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")] == []
    assert w.task()["status"] == "RUNNING" and w.is_counting()


class RemoteContainerdWorkload(CountingWorkload):
    """A containerd per loopback host (started over ssh, so its shims and tasks live in that host's pid
    namespace), each with the skeleton image; a counting container started on hosta."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir, namespace="default"):
        self.hosts, self.dir, self.namespace = hosts, workdir, namespace
        self.id = "gpuckpt-cm-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        self.daemons = {}
        for name in ("hosta", "hostb"):
            d = start_on_host(hosts, name, loopback_dir(name))
            d.import_skeleton(namespace)
            self.daemons[name] = d
        fc = hosts.path("hosta", "fakecuda")
        args = ["run", "--detach", "--runc-root", hosts.host_vars["hosta"]["gpuckpt_runc_root"],
                "--log-uri", "file://" + os.path.join(workdir, "out.log"), "--env", "PATH=/usr/bin:/bin",
                "--env", "GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, "--env", "FAKECUDA_STATE_DIR=%s" % fc]
        for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (workdir, "rw"), (hosts.path(), "rw")]:
            args += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, opt)]
        cmd = "exec /usr/bin/python3 %s --dir %s --mb 8 --fakecuda %s" % (COUNTER, workdir, FAKE_LIBCUDA)
        hosts.ssh("hosta", " ".join(shlex.quote(a) for a in [CTR, "--address", self.daemons["hosta"].address,
                                                             "--namespace", namespace] + args
                                    + [IMAGE, self.id, "/bin/sh", "-c", cmd]))
        self.wait_counting()

    def status(self, host):
        for line in self.daemons[host].ctr("tasks", "ls", namespace=self.namespace).stdout.splitlines()[1:]:
            f = line.split()
            if f and f[0] == self.id:
                return f[2]
        return None

    def exists(self, host):
        return self.id in self.daemons[host].ctr("containers", "ls", "-q", namespace=self.namespace).stdout.split()

    def cleanup(self):
        for d in self.daemons.values():
            d.remove_all()


def loopback_dir(name):
    return "/tmp/gpk-ctrd-%s-%d" % (name, os.getpid())


@pytest.fixture(scope="module")
def loopback_containerds(hosts):
    yield
    for name in ("hosta", "hostb"):
        stop_on_host(hosts, name, loopback_dir(name))


def _migrate_vars(w, mid):
    return {"source": "hosta", "target": "hostb", "container": w.id, "runtime": "containerd",
            "containerd_namespace": w.namespace, "migration_id": mid}


def _inventory_with_addresses(hosts, w):
    """The hosts' inventory, each host naming its own containerd's socket."""
    import json
    with open(hosts.path("inventory.yml")) as fh:
        inv = json.load(fh)
    for name, d in w.daemons.items():
        inv["gpu_nodes"]["hosts"][name]["gpuckpt_containerd_address"] = d.address
    path = hosts.path("inventory-containerd.yml")
    with open(path, "w") as fh:
        json.dump(inv, fh)
    return path


def test_containerd_task_migrates_paused_source_and_a_rerun_changes_nothing(
        playbook, hosts, loopback_containerds, tmp_path):
    w = RemoteContainerdWorkload(hosts, str(tmp_path / "cw"), namespace="k8s.io")
    try:
        inventory = _inventory_with_addresses(hosts, w)
        before = w.counts()
        run = playbook(MIGRATE, _migrate_vars(w, "t-ctrd"), inventory=inventory)
        assert run.rc == 0, run.stdout
        ck = run.task("Stage 1/3")
        assert ck["leave_stopped"] is True and len(ck["cuda_pids"]) == 2
        assert "container %s moved from hosta to hostb" % w.id in "\n".join(run.task("Summary")["msg"])
        assert w.status("hostb") == "RUNNING"
        assert not w.exists("hosta"), "the source's paused task and its container are deleted on commit"
        w.went_on_intact(before)
        again = playbook(MIGRATE, _migrate_vars(w, "t-ctrd"), inventory=inventory)
        assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
        assert w.is_counting()
        assert w.no_count_twice()
    finally:
        w.cleanup()


def test_containerd_restore_failing_on_target_resumes_the_paused_source(
        playbook, hosts, loopback_containerds, tmp_path):
    """hostb's containerd lacks the container's image: the restore is refused there, the target is
    cleaned, and the task paused on hosta is resumed with its CUDA processes unlocked: one copy runs."""
    w = RemoteContainerdWorkload(hosts, str(tmp_path / "cw"))
    try:
        inventory = _inventory_with_addresses(hosts, w)
        w.daemons["hostb"].ctr("images", "rm", "--sync", IMAGE, namespace=w.namespace)
        run = playbook(MIGRATE, _migrate_vars(w, "t-ctrd-fail"), inventory=inventory)
        assert run.rc != 0
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "is not unpacked into snapshotter" in run.stdout
        assert w.status("hosta") == "RUNNING" and not w.exists("hostb")
        w.went_on_intact(w.counts())
        assert w.no_count_twice()
    finally:
        w.cleanup()


def test_a_probe_failing_in_the_restored_task_rolls_back_to_the_paused_source(
        playbook, hosts, loopback_containerds, tmp_path):
    """The restore on hostb works, but the user's probe fails inside the restored container: that copy
    is stopped and deleted, and the task paused on hosta runs on; one copy, no count written twice."""
    w = RemoteContainerdWorkload(hosts, str(tmp_path / "cw"))
    try:
        inventory = _inventory_with_addresses(hosts, w)
        v = dict(_migrate_vars(w, "t-ctrd-probe"), probe_command=["/bin/sh", "-c", "test -e /no/such/file"])
        run = playbook(MIGRATE, v, inventory=inventory)
        assert run.rc != 0
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "the probe /bin/sh -c test -e /no/such/file exited with rc=1" in run.stdout, run.stdout[-3000:]
        assert w.status("hosta") == "RUNNING" and not w.exists("hostb")
        w.went_on_intact(w.counts())
        assert w.no_count_twice()
    finally:
        w.cleanup()
