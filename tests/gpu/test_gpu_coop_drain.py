"""drain.yml empties hosta of a deterministic 2-rank DDP job in NCCL's default configuration with the helper
(tests/workloads/ddp_job.py, GPUCKPT_DDP_COOP=1, under the helper's torchrun) onto hostb, the GPU machine's loopback
hosts (sshd on 127.0.0.2 / 127.0.0.3, one pid space, real ssh, rsync and CRIU), in the cooperative mode
(gpuckpt_quiesce_mode=cooperative), and the same job started as the driver can restore it (the configuration mode:
NCCL's P2P and cuMem off, no helper, the drain's default quiesce mode), issue 45 part 3. No unknown is accepted: the
preflight sizes the job from its GPUs' used memory (engine/facts.used_memory_bound), since torchrun's agent holds a
CUDA context that nvidia-smi lists with no memory. The plan must see the job as one workload (torchrun's agent and
its two ranks); after the drain, every loss of both ranks is bit-identical to an uninterrupted run, one copy runs
(the node's gone), nothing is frozen. Records the move's downtime against its floors (each rank's driver checkpoint,
the transfer, each rank's driver restore) and each rank's stall. NVLink multicast stays off in every job."""
from __future__ import annotations

import time

import pytest

from gpu_helpers import gpu_count, nvidia_smi_pids
from test_gpu_cooperative import STEPS, Job, _same_losses, _stall
# (gpu_hosts is the fixture of the two loopback hosts)
from test_gpu_coop_migrate import MODES, THP, RemoteJob, _floors, _states, gpu_hosts  # noqa: F401 pylint: disable=unused-import
from test_gpu_drain import _move_of, _plan_line, _result

pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)")
DRAIN = "gpuckpt.fleet.drain"


@pytest.mark.parametrize("mode", ["cooperative", "config"])
def test_ddp_job_drained_off_its_node(playbook, gpu_hosts, tmp_path, record, mode):  # noqa: F811 pylint: disable=redefined-outer-name
    # The reference runs first, alone with the job: the drain moves every GPU workload of the node, and the loopback
    # hosts are one machine, so no other CUDA process may live while it plans (nor while the preflight bounds the
    # job's GPU memory by its GPUs' used memory). The job steps slowly (its pause does not change a loss) so that it is
    # mid-run when the drain comes.
    extra, coop = MODES[mode]
    env = dict(extra)
    env.pop("GPUCKPT_DDP_COOP", None)
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0, env=env)
    reference.wait_done()
    job = RemoteJob(gpu_hosts, "hosta", str(tmp_path / "job"), mode, pause=0.3)
    try:
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        smi = nvidia_smi_pids()
        assert set(smi) <= set(procs0), "GPU processes other than the job's: %s (the job: %s)" % (smi, procs0)
        # (a deadline makes the drain probe the link first: its rate gives the transfer's floor)
        v = {"node": "hosta", "targets": "hostb", "gpuckpt_runtime_timeout": 120, "gpuckpt_quiesce_timeout": 60,
             "deadline": 1800}
        if coop:
            v["gpuckpt_quiesce_mode"] = "cooperative"
        if THP:  # (transparent huge pages "always" while each operation runs: the driver's checkpoint and CRIU's restore
            v["gpuckpt_host_huge_pages"] = True  # fill host memory 1.5-1.8x faster on the GPU machines' VMs)
        t = time.monotonic()
        run = playbook(DRAIN, v, inventory=gpu_hosts.path("inventory.yml"))
        wall = round(time.monotonic() - t, 3)
        record("coop_drain_attempt", mode=mode, rc=run.rc, wall=wall, tail=run.stdout[-6000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        plan = run.task("Place each workload")["ansible_facts"]["gpuckpt_drain_plan"]
        report = run.task("Where each workload runs now")["msg"]
        assert len(plan["moves"]) == 1, plan["lines"]  # one job, one workload: the agent's tree with both ranks
        move = _move_of(plan, ("process", job.pid))
        assert sorted(move["workload"]["tree"].get("pids") or []) == sorted(procs0), (move["workload"]["tree"], procs0)
        assert "-> hostb" in _plan_line(report, "MOVED", "pid %d" % job.pid), report
        assert "runs no GPU workload any more" in run.task("The node is empty")["msg"]
        mid = move["migration_id"]
        ck, rs = _result(run, "Stage 1/3", mid), _result(run, "Restore on hostb", mid)
        # (stage 2 is skipped when the image was pushed while CRIU wrote it: the transfer is then not timed apart)
        sy = ([r for r in run.results if "Stage 2/3" in r["_task"] and r["_host"] == mid] or [{}])[-1]
        outcome = _result(run, "Time the move", mid)["ansible_facts"]["gpuckpt_move_outcome"]
        assert outcome["status"] == "moved", outcome
        quiesce = ck.get("quiesce") or {}
        if coop:
            assert quiesce.get("mode") == "cooperative" and len(quiesce.get("ranks") or {}) == 2, quiesce
            assert len(rs.get("cooperative_resumed") or []) == 2, rs
        step = quiesce.get("step")
        procs1, ranks1 = job.procs(), job.ranks()
        assert all(s != "T" for s in _states(procs1).values()), _states(procs1)
        if job.steps_done() < STEPS:  # one copy: the same processes (one pid space: CRIU gave them their pids back)
            assert procs1 == procs0 and ranks1 == ranks0, (procs1, procs0, ranks1, ranks0)
        downtime = round(rs["resumed_at"] - ck["frozen_at"], 3)
        floors = _floors(ck, sy, rs, quiesce)
        # (the probe task loops over the targets: its items' results are under "results")
        probes = [item["probe"] for r in run.results if "Probe the link" in r["_task"]
                  for item in [r] + list(r.get("results") or []) if isinstance(item.get("probe"), dict)]
        rate = probes[-1].get("bytes_s") if probes else None
        if rate and ck.get("image_bytes") and floors["driver_checkpoint_max"] is not None \
                and floors["driver_restore_max"] is not None:
            # the image at the probe's rate: the transfer's floor where the push is not timed apart
            floors["transfer_floor_s_by_probe"] = round(ck["image_bytes"] / rate, 3)
            floors["floor_sum_by_probe"] = round(floors["driver_checkpoint_max"] + floors["transfer_floor_s_by_probe"]
                                                 + floors["driver_restore_max"], 3)
            floors["downtime_over_floor"] = round(downtime / floors["floor_sum_by_probe"], 2)
        floors["link_bytes_s"], floors["link_probe"] = rate, (probes or [None])[-1]
        record("coop_drain_result", mode=mode, host_huge_pages=THP, steps=STEPS, wall=wall, migration_id=mid, quiesce=quiesce,
               checkpoint=ck.get("timings"), restore=rs.get("timings"), image_bytes=ck.get("image_bytes"),
               cuda_pids=ck.get("cuda_pids"), cooperative_resumed=rs.get("cooperative_resumed"), downtime=downtime,
               downtime_s_report=outcome.get("downtime_s"), took_s=outcome.get("took_s"),
               plan_image_estimate_bytes=move["image_estimate_bytes"], floors=floors,
               processes=len(procs0), ranks_before=ranks0, ranks_after=ranks1, report=report,
               plan_lines=plan["lines"], plan_gpu=move["workload"]["tree"].get("gpu_memory_bound"),
               preflight=[x for x in run.stdout.splitlines() if "GPU memory is" in x][:4])
        job.wait_done()
        _same_losses(job, reference)
        cycles = {"rank%d" % r: job.cycles(r) for r in range(2)}
        if coop:
            assert all([c["resumed_by"] for c in rank] == ["resume"] for rank in cycles.values()), cycles
        record("coop_drain", mode=mode, losses_identical=True, dump_step=step, downtime=downtime,
               stall=_stall(job, step) if step is not None else None, cycles=cycles)
    finally:
        job.kill()
        reference.kill()
