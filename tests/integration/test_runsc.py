"""gVisor sandboxes, checkpointed, restored and migrated through the playbooks: real runsc (Debian
bookworm-backports' 20240729 build, systrap platform) and, inside the sandbox, the collection's own
cuda-checkpoint tool (roles/cuda_checkpoint/files/cuda_checkpoint.c) against the libcuda TEST DOUBLE.

A sandbox runs its processes on gVisor's kernel, out of the host's sight: the CUDA stage runs inside it
with `runsc exec`, on the sandbox's own pids (1 and 2 here). gVisor lets no process write another's
memory, so there the test double keeps each process's state in a file of the sandbox's /dev/shm
(FAKECUDA_PROC_STATE_DIR), a tmpfs saved with the sandbox: the state travels in the image, as the GPU
state does. The double's call log and injections stay in a host directory bound into the sandbox."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from helpers import COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, FakeCuda, write_runc_bundle
from loopback_workloads import MIGRATE, changed_tasks

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
FACTS = os.path.join(REPO, "tests", "integration", "playbooks", "facts_raw.yml")
RUNSC = shutil.which("runsc") or ("/usr/local/sbin/runsc" if os.path.exists("/usr/local/sbin/runsc") else None)
TOOL = os.path.join(REPO, ".build", "gpuckpt-cuda-checkpoint")
TOOL_INSIDE = "/usr/local/bin/cuda-checkpoint"  # the collection's default place for it in a sandbox
PROC_STATE = "/dev/shm/fakecuda"
FLAGS = ["--network=none"]  # recorded in the image and given again to its restore
pytestmark = pytest.mark.skipif(RUNSC is None or not os.path.exists(TOOL),
                                reason="runsc and the cuda-checkpoint tool (tests/setup.sh) needed")


def write_sandbox_bundle(bundle, workdir, fc_dir, cgroup, gpu_device=False):
    """A bundle for the counting workload (parent + child) with the tool bound read-only inside; with
    ``gpu_device``, an NVIDIA device in its spec too (runsc without nvproxy ignores it): how a GPU
    sandbox looks to the collection."""
    write_runc_bundle(bundle, ["/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8", "--fakecuda", FAKE_LIBCUDA],
                      env=["FAKECUDA_STATE_DIR=%s" % fc_dir, "FAKECUDA_PROC_STATE_DIR=%s" % PROC_STATE],
                      rw=[workdir, fc_dir], cgroup=cgroup)
    path = os.path.join(bundle, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["mounts"].append({"destination": TOOL_INSIDE, "type": "bind", "source": TOOL, "options": ["bind", "ro"]})
    if gpu_device:
        cfg["linux"].setdefault("devices", []).append({"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
                                                       "fileMode": 438, "uid": 0, "gid": 0})
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return bundle


def copy_bundle(src, dst, cgroup):
    """The same container's bundle as another host has it: its own cgroup (one kernel here), the same rootfs."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["root"]["path"] = os.path.join(src, "rootfs")
    cfg["linux"]["cgroupsPath"] = cgroup
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst


class SandboxWorkload(CountingWorkload):
    roles = ("parent", "child1")

    def __init__(self, base, fc_dir, root, runner=None, gpu_device=False):
        self.base, self.dir, self.root, self.fc_dir = base, os.path.join(base, "w"), root, fc_dir
        self.id = "gpuckpt-s-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        self.bundle = write_sandbox_bundle(os.path.join(base, "bundle"), self.dir, fc_dir, "/gpuckpt-test/%s-a" % self.id,
                                           gpu_device)
        cmd = [RUNSC, "--root", root] + FLAGS + ["run", "-detach", "-bundle", self.bundle, self.id]
        if runner is None:
            with open(os.path.join(base, "out.log"), "ab") as log:
                subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True)
        else:
            runner(" ".join(cmd) + " </dev/null >>%s/out.log 2>&1" % base)
        self.wait_counting()

    def runsc(self, root, *args, check=True):
        return subprocess.run([RUNSC, "--root", root] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, check=check)

    def status(self, root=None):
        res = self.runsc(root or self.root, "state", self.id, check=False)
        return json.loads(res.stdout)["status"] if res.returncode == 0 else None

    def cuda_states(self, root=None):
        """Each sandbox pid's state, asked inside the sandbox with the tool (the host cannot see them)."""
        out = {}
        for pid in (1, 2):
            res = self.runsc(root or self.root, "exec", "-env", "GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, self.id,
                             TOOL_INSIDE, "--get-state", "--pid", str(pid), check=False)
            out[pid] = res.stdout.strip() or res.stderr.strip()[-80:]
        return out

    def calls(self):
        return FakeCuda(self.fc_dir).calls()  # the test double's log, as the sandbox's processes wrote it

    def vars(self, image_dir, **extra):
        v = {"gpuckpt_container": self.id, "gpuckpt_runtime": "runsc", "gpuckpt_runsc_root": self.root,
             "gpuckpt_runsc_flags": FLAGS, "gpuckpt_image_dir": image_dir}
        v.update(extra)
        return v

    def stop(self, *roots):
        for root in roots or (self.root,):
            self.runsc(root, "delete", "-force", self.id, check=False)


@pytest.fixture
def sandbox(tmp_path, fakecuda):
    made = []

    def make(**kw):
        w = SandboxWorkload(str(tmp_path / ("s%d" % len(made))), fakecuda.state_dir, str(tmp_path / "runsc-root"), **kw)
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop()


def test_sandbox_checkpoint_and_restore_run_the_cuda_stage_inside_it(playbook, sandbox, fakecuda, tmp_path):
    w = sandbox()
    facts = playbook(FACTS, {"facts_args": {"list_containers": ["runsc"], "runsc_root": w.root,
                                            "check_criu": False}}, env=fakecuda.env)
    assert facts.rc == 0, facts.stdout
    gpu = facts.task("facts")["ansible_facts"]["gpuckpt"]["gpu_containers"]
    assert [(c["id"], [p["pid"] for p in c["cuda_processes"]]) for c in gpu] == [(w.id, [1, 2])], gpu
    assert all(p["in_sandbox"] and p["cuda_state"] == "running" for p in gpu[0]["cuda_processes"])

    before = w.counts()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, w.vars(image_dir), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    ck = run.task("Checkpoint")
    assert ck["cuda_pids"] == [1, 2] and ck["gpu_stage"] == "done", ck
    assert w.status() is None, "after=exit: the checkpointed sandbox is gone and its id free"
    order = [c for c in w.calls() if c[0] in ("lock", "checkpoint")]
    assert order == [("lock", "1"), ("lock", "2"), ("checkpoint", "1"), ("checkpoint", "2")] or \
        order[:2] == [("lock", "1"), ("lock", "2")], order  # all locked before any checkpoint, sandbox pids
    assert os.path.exists(os.path.join(image_dir, "checkpoint.img"))

    run = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runsc_root": w.root}, env=fakecuda.env)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore")
    assert rs["cuda_pids"] == [1, 2] and rs["changed"], rs
    assert w.status() == "running"
    assert w.cuda_states() == {1: "running", 2: "running"}
    w.went_on_intact(before)
    assert w.no_count_twice()
    again = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_runsc_root": w.root}, env=fakecuda.env)
    assert again.rc == 0 and not again.task("Restore")["changed"], again.stdout


def test_a_failure_inside_the_sandbox_rolls_the_cuda_stage_back(playbook, sandbox, fakecuda, tmp_path):
    """The driver fails the checkpoint of sandbox pid 2: pid 1's checkpoint is restored and both are
    unlocked, inside the sandbox; the sandbox was never dumped and counts on."""
    w = sandbox()
    before = w.counts()
    fakecuda.inject("checkpoint", 2, 999)
    run = playbook(CHECKPOINT, w.vars(str(tmp_path / "img"), gpuckpt_leave_stopped=True), env=fakecuda.env)
    assert run.rc != 0
    failed = run.task("Checkpoint")
    assert failed["rolled_back"] is True and "CUDA_ERROR_UNKNOWN" in failed["msg"], failed["msg"]
    fakecuda.clear_injections()
    assert w.status() == "running"
    assert w.cuda_states() == {1: "running", 2: "running"}
    w.went_on_intact(before)
    assert not os.path.exists(str(tmp_path / "img" / "checkpoint.img"))


def test_quiesce_signal_and_a_missing_tool_are_refused_before_anything_is_frozen(playbook, sandbox, fakecuda, tmp_path):
    """In a GPU sandbox (an NVIDIA device in its spec), a cuda-checkpoint that is not there is refused,
    not taken for a CPU sandbox; a signal cannot reach the sandbox's processes."""
    w = sandbox(gpu_device=True)
    run = playbook(CHECKPOINT, w.vars(str(tmp_path / "img"), gpuckpt_quiesce_signal="SIGUSR1"), env=fakecuda.env)
    assert run.rc != 0 and "quiesce_command" in run.task("Checkpoint")["msg"]
    run = playbook(CHECKPOINT, w.vars(str(tmp_path / "img2"), gpuckpt_sandbox_cuda_checkpoint="/no/such/tool"),
                   env=fakecuda.env)
    assert run.rc != 0
    msg = run.task("Checkpoint")["msg"]
    assert "could not run inside sandbox" in msg and "/no/such/tool" in msg, msg
    # runsc's own CUDA stage (--cuda-checkpoint-path) asked of a runsc that lacks it
    run = playbook(CHECKPOINT, w.vars(str(tmp_path / "img3"), gpuckpt_runsc_cuda_stage="runsc"), env=fakecuda.env)
    assert run.rc != 0
    msg = run.task("Checkpoint")["msg"]
    assert "no --cuda-checkpoint-path" in msg and "nothing was frozen" in msg, msg
    assert [c for c in w.calls() if c[0] == "lock"] == []
    assert w.status() == "running" and w.is_counting()


# ---- migration between the loopback hosts -----------------------------------------------------------------
@pytest.fixture
def host_sandbox(hosts, fakecuda, tmp_path):
    made = []

    def make():
        base = str(tmp_path / ("hs%d" % len(made)))
        w = SandboxWorkload(base, hosts.path("hosta", "fakecuda"), hosts.path("hosta", "runsc-root"),
                            runner=lambda cmd: hosts.ssh("hosta", cmd))
        w.target_bundle = copy_bundle(w.bundle, os.path.join(base, "bundle-hostb"), "/gpuckpt-test/%s-b" % w.id)
        made.append(w)
        return w
    yield make
    for w in made:
        # Deleted on the host that runs it: runsc's delete, asked from outside that host's pid namespace, waited
        # 120 s for the sandbox's pid (the host's own) to exit before it gave up (seen in a full run's teardown).
        for name in ("hosta", "hostb"):
            hosts.ssh(name, " ".join([RUNSC, "--root", hosts.path(name, "runsc-root")] + FLAGS
                                     + ["delete", "-force", w.id, ">/dev/null", "2>&1"]), check=False)


def _inventory(hosts, w, bundle=None):
    with open(hosts.path("inventory.yml")) as fh:
        inv = json.load(fh)
    for name in ("hosta", "hostb"):
        inv["gpu_nodes"]["hosts"][name].update(gpuckpt_runsc_root=hosts.path(name, "runsc-root"),
                                               gpuckpt_runsc_flags=FLAGS)
    inv["gpu_nodes"]["hosts"]["hostb"]["gpuckpt_bundle"] = bundle or w.target_bundle
    path = hosts.path("inventory-runsc.yml")
    with open(path, "w") as fh:
        json.dump(inv, fh)
    return path


def _migrate_vars(w, mid):
    return {"source": "hosta", "target": "hostb", "container": w.id, "runtime": "runsc", "migration_id": mid}


def test_sandbox_migrates_with_its_source_paused_and_a_rerun_changes_nothing(playbook, hosts, host_sandbox):
    w = host_sandbox()
    root_a, root_b = hosts.path("hosta", "runsc-root"), hosts.path("hostb", "runsc-root")
    inventory = _inventory(hosts, w)
    before = w.counts()
    run = playbook(MIGRATE, _migrate_vars(w, "t-runsc"), inventory=inventory)
    assert run.rc == 0, run.stdout
    ck = run.task("Stage 1/3")
    assert ck["leave_stopped"] is True and ck["cuda_pids"] == [1, 2], ck
    assert w.status(root_b) == "running"
    assert w.status(root_a) is None, "the paused source sandbox is deleted on commit"
    assert w.cuda_states(root_b) == {1: "running", 2: "running"}
    w.went_on_intact(before)
    again = playbook(MIGRATE, _migrate_vars(w, "t-runsc"), inventory=inventory)
    assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
    assert w.is_counting()
    assert w.no_count_twice()


def test_a_restore_failing_on_the_target_resumes_the_paused_source_sandbox(playbook, hosts, host_sandbox, tmp_path):
    """hostb has no bundle for the container: its restore is refused, and the sandbox paused on hosta
    resumes, its CUDA processes restored and unlocked inside it: one copy runs, no count twice."""
    w = host_sandbox()
    root_a, root_b = hosts.path("hosta", "runsc-root"), hosts.path("hostb", "runsc-root")
    inventory = _inventory(hosts, w, bundle=str(tmp_path / "no-bundle-here"))
    before = w.counts()
    run = playbook(MIGRATE, _migrate_vars(w, "t-runsc-fail"), inventory=inventory)
    assert run.rc != 0
    assert "rolled back" in run.stdout and "no config.json" in run.stdout, run.stdout[-3000:]
    assert w.status(root_a) == "running" and w.status(root_b) is None
    assert w.cuda_states(root_a) == {1: "running", 2: "running"}
    w.went_on_intact(before)
    assert w.no_count_twice()
