"""A deterministic data-parallel training job for the GPU machine: one rank per GPU, NCCL between them. Each rank
appends every step's loss, exactly (float.hex), to <out>/rank<R>.losses: a run that was checkpointed and restored
must log the very losses of an uninterrupted run.

  torchrun --standalone --nproc-per-node 2 ddp_job.py OUT STEPS PAUSE_S
  ddp_job.py --launch 2 OUT STEPS PAUSE_S     its own launcher: starts the ranks (RANK, WORLD_SIZE, LOCAL_RANK,
                                             MASTER_ADDR/PORT; rank 0 hosts the store) and waits for them
"""
from __future__ import annotations

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
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    with open(os.path.join(out, "rank%d.losses" % rank), "a") as fh:
        for step in range(steps):
            x = torch.randn(256, 1024, device="cuda", generator=gen)
            y = x.sum(dim=1, keepdim=True) / 32.0
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            fh.write("%d %s\n" % (step, loss.item().hex()))
            fh.flush()
            time.sleep(pause)
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
