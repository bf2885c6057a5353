"""A deterministic data-parallel training job for the GPU machine: one rank per GPU, NCCL between them. Each rank
appends every step's loss, exactly (float.hex), to <out>/rank<R>.losses: a run that was checkpointed and restored
must log the very losses of an uninterrupted run.

  torchrun --standalone --nproc-per-node 2 ddp_job.py OUT STEPS PAUSE_S
  ddp_job.py --launch 2 OUT STEPS PAUSE_S     its own launcher: starts the ranks (RANK, WORLD_SIZE, LOCAL_RANK,
                                             MASTER_ADDR/PORT; rank 0 hosts the store) and waits for them
  python tools/gpuckpt_quiesce.py --standalone --nproc-per-node 2 ddp_job.py OUT STEPS PAUSE_S
                                             the helper's torchrun (its store without libuv), for the cooperative mode

Environment:
  GPUCKPT_DDP_COOP=1    use tools/gpuckpt_quiesce.py's Cooperative (two lines, as docs/multi_gpu.md shows); each
                        cycle's record goes to <out>/rank<R>.cycles (one JSON object a line)
  GPUCKPT_DDP_WIDTH=N   the hidden layers' width (1024): the all-reduce per step is about 4*N*1024 bytes (one layer)
  GPUCKPT_DDP_LAYERS=K  K more hidden layers of N x N (0); GPUCKPT_DDP_BATCH=B the batch (256): a longer step, so that
                        a cost of 2% stands out of the host's noise (a 2 ms step is launch-bound)
Every rank appends "<step> <time.time() after the step>" to <out>/rank<R>.times (the step time; a checkpoint's stall).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    out, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist.init_process_group("nccl")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    width = int(os.environ.get("GPUCKPT_DDP_WIDTH", "1024"))
    hidden = []
    for unused in range(int(os.environ.get("GPUCKPT_DDP_LAYERS", "0"))):
        hidden += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    batch = int(os.environ.get("GPUCKPT_DDP_BATCH", "256"))
    model = torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(), *hidden, torch.nn.Linear(width, 1)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[local])
    coop = None
    if os.environ.get("GPUCKPT_DDP_COOP") == "1":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
        import gpuckpt_quiesce
        coop = gpuckpt_quiesce.Cooperative()  # line 1
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    with open(os.path.join(out, "rank%d.losses" % rank), "a") as fh, \
            open(os.path.join(out, "rank%d.times" % rank), "a") as times:
        for step in range(steps):
            x = torch.randn(batch, 1024, device="cuda", generator=gen)
            y = x.sum(dim=1, keepdim=True) / 32.0
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            fh.write("%d %s\n" % (step, loss.item().hex()))
            fh.flush()
            times.write("%d %.6f\n" % (step, time.time()))
            if coop is not None and coop.step_boundary(step):  # line 2: re-wrap what holds the old group
                ddp = DistributedDataParallel(model, device_ids=[local])
                with open(os.path.join(out, "rank%d.cycles" % rank), "a") as cyc:
                    cyc.write(json.dumps(coop.history[-1]) + "\n")
            if pause:
                time.sleep(pause)
        times.flush()
    if coop is not None:  # (the spacing of its checks, in steps: chosen by the helper from its steps' time)
        with open(os.path.join(out, "rank%d.every" % rank), "w") as ev:
            ev.write("%s\n" % coop.every)
    dist.barrier()
    dist.destroy_process_group()


def launch(n, argv):
    """The ranks, each this script exec'd with its own environment (what /proc/<pid>/environ shows); waits."""
    import socket
    import subprocess
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(n)]
    sys.exit(max(p.wait() for p in ranks))


if __name__ == "__main__":
    if sys.argv[1] == "--launch":
        launch(int(sys.argv[2]), sys.argv[3:])
    main()
