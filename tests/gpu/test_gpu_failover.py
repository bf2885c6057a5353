"""On a real GPU: a protected PyTorch training job (issue 30). The protect role on ``node``, the timer's command run
three times (the stall of each checkpoint, and the overhead it means at 5, 15 and 60 minute intervals); then the
node is lost (the job killed, its sshd gone) and failover.yml restores the replica's newest image on ``target``.
The job goes on from that checkpoint's step: its GPU memory checksum as at the start, and every later loss
bit-identical to a run of the same training, uninterrupted, in a fresh process.

The loopback hosts share one pid space here (the driver's checkpoint API resolves pids in the initial pid
namespace: see test_gpu_migrate.py), so the lost node's job is killed by the test rather than with a namespace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpu_helpers import REPO, WORKLOAD_PYTHON, TORCH_COUNTER, TorchWorkload, _clean_env
from helpers import workload_processes

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import LoopbackHosts  # noqa: E402

GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))
PASS_ENV = {k: os.environ[k] for k in ("LD_LIBRARY_PATH", "PATH") if k in os.environ}
HOSTS = (("node", "127.0.0.22"), ("replica", "127.0.0.23"), ("target", "127.0.0.24"))


class TrainingJob(TorchWorkload):
    """torch_counter.py --train, started on a test host through ssh."""

    def __init__(self, hosts, host, directory, gib):
        self.dir = directory
        env = " ".join("%s=%s" % kv for kv in PASS_ENV.items())
        res = hosts.ssh(host, "env %s %s %s --dir %s --gib %s --daemon --train --interval 0.02" % (
            env, WORKLOAD_PYTHON, TORCH_COUNTER, directory, gib), timeout=600)
        self.pid = int(res.stdout.strip().splitlines()[-1])
        self.gib = gib
        self.roles = ["parent"]
        self.wait_counting()
        self.pids = [self.pid]

    def kill(self):
        for p, unused in workload_processes("torch_counter.py", self.dir):
            try:
                os.kill(p, 9)
            except OSError:
                pass

    def losses(self, path=None):
        """{step: loss bits} from the job's log; a step logged twice (the lost copy's, then the restored
        copy's) keeps its last line."""
        out = {}
        with open(path or os.path.join(self.dir, "parent.losses")) as fh:
            for line in fh:
                step, bits = line.split()
                out[int(step)] = bits
        return out


def test_protected_training_job_fails_over_with_bit_identical_losses(playbook, tmp_path, record):
    base = str(tmp_path / "hosts")
    hv = {}
    for name, unused in HOSTS:
        hv[name] = {"gpuckpt_environment": dict(PASS_ENV),
                    "gpuckpt_protect_dir": os.path.join(base, name, "protect"),
                    "gpuckpt_protect_lib_dir": os.path.join(base, name, "lib"),
                    "gpuckpt_protect_bin": os.path.join(base, name, "bin", "gpuckpt-protect"),
                    "gpuckpt_protect_image_root": os.path.join(base, name, "protect-images"),
                    "gpuckpt_protect_replica_root": os.path.join(base, name, "replicas")}
    hv["node"]["gpuckpt_protect_replicas"] = ["replica"]
    hosts = LoopbackHosts(base, pid_namespaces=False, python=WORKLOAD_PYTHON, hosts=HOSTS).start(hv)
    w = None
    try:
        w = TrainingJob(hosts, "node", str(tmp_path / "job"), GIB)
        with open(os.path.join(w.dir, "job.pid"), "w") as fh:
            fh.write("%d\n" % w.pid)
        jobs = [{"name": "train", "pid_file": os.path.join(w.dir, "job.pid"), "interval": 900, "keep": 2,
                 "progress_file": os.path.join(w.dir, "parent.state"), "progress_key": "count"}]
        inv = hosts.path("inventory.yml")
        run = playbook("gpuckpt.fleet.protect", {"node": "node", "gpuckpt_protected_jobs": jobs}, inventory=inv)
        assert run.rc == 0, run.stdout
        runs = []
        for unused in range(3):
            timer = "%s run --protect-dir %s --job train" % (hv["node"]["gpuckpt_protect_bin"], hv["node"]["gpuckpt_protect_dir"])
            res = hosts.ssh("node", timer, timeout=600)
            doc = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
            assert doc["result"] == "ok", res.stdout
            runs.append(doc)
            w.wait_counting(beyond=w.counts())
        stalls = [d["stall_s"] for d in runs]
        record("gpu_protect_checkpoints", gib=GIB, stall_s=stalls, duration_s=[d["duration_s"] for d in runs],
               bytes=[d["bytes"] for d in runs],
               overhead={"%d_min" % m: round(max(stalls) / (m * 60.0), 6) for m in (5, 15, 60)}, runs=runs)

        w.kill()  # the node is lost: its job with it, then its sshd
        hosts.crash("node")
        time.sleep(1)
        assert not workload_processes("torch_counter.py", w.dir)
        run = playbook("gpuckpt.fleet.failover", {"job": "train", "lost_node": "node", "target": "target",
                                                  "lost_node_confirmed": True, "gpuckpt_protected_jobs": jobs},
                       inventory=inv)
        record("gpu_failover_attempt", rc=run.rc, tail=run.stdout[-3000:] if run.rc else "")
        assert run.rc == 0, run.stdout
        procs = workload_processes("torch_counter.py", w.dir)
        assert len(procs) == 1 and procs[0][1] != "T", procs
        w.pids = [procs[0][0]]
        restored_at = w.counts()["parent"]
        w.wait_counting(beyond={"parent": restored_at + 50}, timeout=300)
        assert w.verified_after(w.counts())
        last = max(w.losses())
        ref_dir = str(tmp_path / "reference")
        os.makedirs(ref_dir)
        out = subprocess.run([WORKLOAD_PYTHON, TORCH_COUNTER, "--dir", ref_dir, "--reference-losses", str(last)],
                             env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                             timeout=900, check=False)
        assert out.returncode == 0, out.stdout
        got, want = w.losses(), w.losses(os.path.join(ref_dir, "reference.losses"))
        # (the job went on while the reference ran: compare the steps the reference ran)
        differ = [s for s in sorted(got) if s <= last and got[s] != want.get(s)]
        record("gpu_failover", gib=GIB, restored_at_count=restored_at, steps_compared=last, steps_differ=len(differ),
               first_differ=differ[:5], report=[t for t in run.stdout.splitlines() if "rolled" in t.lower()][-3:],
               restore=run.task("Restore from").get("timings"))
        assert not differ, "losses differ from the uninterrupted run at steps %s" % differ[:10]
    finally:
        if w is not None:
            w.kill()
        hosts.stop()
        time.sleep(1)
