"""What the tests that migrate between the loopback hosts share: the counting workload started on a
host, where its processes are, and running migrate.yml."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

from loopback import _descendants  # tests/hosts is on the path (tests/conftest.py)
from helpers import ANSIBLE_PLAYBOOK, COLLECTIONS, COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, workload_processes

NVIDIA_SMI_DOUBLE = os.path.join(REPO, "tests", "doubles", "nvidia-smi")  # a TEST DOUBLE of nvidia-smi


MIGRATE = "gpuckpt.fleet.migrate"
RECOVER = "gpuckpt.fleet.recover"
PODMAN_ROOT, PODMAN_RUNROOT = "/var/lib/gpuckpt-test-podman", "/run/gpuckpt-test-podman"


def fakecuda_host_vars(base, names=("hosta", "hostb")):
    """Per-host variables of the loopback hosts: each host its own state dir of the libcuda TEST DOUBLE."""
    host_vars = {}
    for name in names:
        state = os.path.join(base, name, "fakecuda")
        os.makedirs(state, exist_ok=True)
        # What nvidia-smi (its TEST DOUBLE) lists on this host: one GPU, and 1 MiB of it for each process that
        # maps the libcuda double, so that the preflight knows the workload's GPU memory. The libcuda double
        # holds no device memory, so its image holds none either: a larger figure would make the preflight
        # refuse tests whose small disks fit the real image (a 200 MiB tmpfs that must fill mid-transfer).
        smi = os.path.join(state, "nvidia-smi.json")
        uuid = "GPU-fake-%s-0" % name
        with open(smi, "w") as fh:
            json.dump({"gpus": [{"index": 0, "name": "Fake GPU (TEST DOUBLE)", "uuid": uuid, "memory.total": 81920,
                                 "memory.used": 0, "memory.free": 81920, "driver_version": "580.159.04"}],
                       "apps_mapping": {"path": FAKE_LIBCUDA, "gpu_uuid": uuid, "used_memory": 1}}, fh)
        host_vars[name] = {"gpuckpt_environment": {"GPUCKPT_LIBCUDA": FAKE_LIBCUDA, "FAKECUDA_STATE_DIR": state,
                                                   "GPUCKPT_NVIDIA_SMI": NVIDIA_SMI_DOUBLE, "GPUCKPT_FAKE_NVIDIA_SMI": smi}}
    return host_vars


def processes(workdir):
    return workload_processes(COUNTER, workdir)


class RemoteWorkload(CountingWorkload):
    roles = ("parent", "child1")

    def __init__(self, hosts, host, workdir, mb=8, listen=None, serve=None, cuda=True):
        self.dir = workdir
        # Start high in the host's pid space: CRIU restores the same pids on the target, where the
        # low ones are taken by that host's own sshd sessions.
        # cuda=False: a process that never loaded libcuda (a CPU job on a GPU node)
        res = hosts.ssh(host, "echo 20000 > /proc/sys/kernel/ns_last_pid; python3 %s --dir %s --daemon %s"
                        "--mb %d%s%s" % (COUNTER, workdir, "--fakecuda %s " % FAKE_LIBCUDA if cuda else "", mb,
                                         " --listen %s" % listen if listen else "", " --serve %d" % serve if serve else ""))
        self.pid = int(res.stdout.strip().splitlines()[-1])
        self.wait_counting()

    def one_copy_runs_intact(self):
        """Exactly one copy: one process per role, none stopped; it counts on; memory patterns intact."""
        deadline = time.monotonic() + 10
        while True:
            procs = processes(self.dir)
            if len(procs) == len(self.roles) and all(s != "T" for unused, s in procs):
                break
            if time.monotonic() > deadline:
                raise AssertionError("expected exactly one running copy, found %s" % procs)
            time.sleep(0.1)
        self.wait_counting(beyond=self.counts())
        assert not [f for f in os.listdir(self.dir) if f.endswith(".corrupt")]
        for r in self.roles:
            assert self.read(r)["digest"] == self.digest0(r), "memory pattern of %s changed" % r
        return True

    def kill(self):
        for p, unused in processes(self.dir):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def migrate(playbook, hosts, w, mid, **extra):
    v = {"source": "hosta", "target": "hostb", "pid": w.pid, "migration_id": mid}
    v.update(extra)
    return playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))


@contextlib.contextmanager
def restore_fails_on(hosts, host="hostb"):
    """Every driver restore on ``host`` fails (CUDA_ERROR_OUT_OF_MEMORY, the libcuda TEST DOUBLE's inject
    file) while the block runs: a target whose restore fails after the image arrived."""
    inject = hosts.path(host, "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("restore 0 2\n")
    try:
        yield
    finally:
        os.unlink(inject)


def changed_tasks(run):
    return [r["_task"] for r in run.results if r.get("changed")]


class Controller(object):
    """ansible-playbook (migrate.yml, or ``name``) running in the background, which a test kills as a whole."""

    def __init__(self, hosts, tmp_path, extra, inventory=None, name=MIGRATE):
        self.cp = str(tmp_path / "cpk")  # (short: ssh's control socket path must stay under 108 bytes)
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_HOST_KEY_CHECKING="false",
                   ANSIBLE_PIPELINING="true", ANSIBLE_SSH_CONTROL_PATH_DIR=self.cp)
        self.log = str(tmp_path / "controller.log")
        self.proc = subprocess.Popen([ANSIBLE_PLAYBOOK, name, "-i", inventory or hosts.path("inventory.yml"),
                                      "-e", json.dumps(extra)], stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)

    def output(self):
        with open(self.log) as fh:
            return fh.read()

    def tree(self):
        return [self.proc.pid] + _descendants(self.proc.pid)

    def freeze(self):
        """Stop every process of the controller, walking its tree until no new one appears (a worker
        that forks meanwhile is caught), so that none escapes the kill."""
        seen = set()
        while True:
            new = [p for p in self.tree() if p not in seen]
            if not new:
                return seen
            for p in new:
                try:
                    os.kill(p, signal.SIGSTOP)
                except OSError:
                    pass
                seen.add(p)

    def kill(self):
        """The controller dies with everything it started (its ssh connection masters too)."""
        for p in self.freeze():
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        subprocess.run(["pkill", "-9", "-f", self.cp], check=False)
        self.proc.wait()
