"""A CPU stand-in of a cooperative 2-rank DDP job (issue 45 part 2), for the libcuda TEST DOUBLE (no GPU).

Started under torchrun with the gloo backend, each rank:
- is a "CUDA process" of the double (fakeCudaAttach; its blocking sync once a step, so a lock stops it), and holds
  1 MiB of stand-in GPU memory with a known pattern (pattern_digest), checked every step (<out>/rank<R>.corrupt
  when it changed);
- maps /dev/shm/nccl-<tag>-r<R> while its process group lives, as NCCL's shared-memory transport does: the
  collection's judge sees an NCCL job in NCCL's default configuration;
- trains a tiny deterministic model (DDP over gloo) and appends every step to <out>/rank<R>.log as
  "<step> <loss.hex()> <memory digest> <pid>";
- uses tools/gpuckpt_quiesce.py's Cooperative: at the agreed boundary it saves its own state (<out>/state.r<R>.pt,
  what a restart under torchrun resumes from), unmaps its NCCL stand-in, and after the resume maps it again and
  re-wraps DDP.

  python tools/gpuckpt_quiesce.py --standalone --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1 \\
      coop_ddp_job.py OUT FAKECUDA TAG [PAUSE_S]

<out>/stall.r<R> holding a number of seconds: once asked, rank R stalls that long before its step boundary (a rank
stuck in a long call, which cannot acknowledge in time), then removes the file.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))

import gpuckpt_quiesce  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

MEM = 1 << 20


def pattern(rank):
    return bytes((i * 31 + rank * 7) & 255 for i in range(256)) * (MEM // 256)


def pattern_digest(rank):
    return hashlib.sha256(pattern(rank)).hexdigest()[:16]


class NcclStandIn(object):
    """/dev/shm/nccl-<tag>-r<rank>, mapped while the process group lives."""

    def __init__(self, tag, rank):
        self.path, self.map = "/dev/shm/nccl-%s-r%d" % (tag, rank), None

    def open(self, unused_step=None):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        self.map = mmap.mmap(fd, 4096)
        os.close(fd)

    def close(self, unused_step=None):
        if self.map is not None:
            self.map.close()
            self.map = None
        try:
            os.unlink(self.path)
        except OSError:
            pass


def main():
    out, lib_path, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
    lib = ctypes.CDLL(lib_path)
    lib.fakeCudaAttach()
    memory = bytearray(pattern(int(os.environ["RANK"])))
    # torchrun's store (its agent's), under a prefix of this attempt: a restarted job's gloo would otherwise read
    # the addresses the ranks of the attempt before left there, and fail to connect
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, use_libuv=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("attempt-%s/" % os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0"), store), rank=rank, world_size=world)
    want = pattern_digest(rank)
    with open(os.path.join(out, "launcher.pid"), "w") as fh:
        fh.write("%d\n" % os.getppid())
    shm = NcclStandIn(tag, rank)
    shm.open()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state_path = os.path.join(out, "state.r%d.pt" % rank)
    start = 0
    if os.path.exists(state_path):  # a restart (torchrun's) resumes from the state saved at the last boundary
        state = torch.load(state_path)
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def save(step):
        tmp = "%s.%d.tmp" % (state_path, os.getpid())
        torch.save({"step": step, "model": model.state_dict()}, tmp)
        os.replace(tmp, state_path)

    coop = gpuckpt_quiesce.Cooperative(on_release=[save, shm.close], on_resume=[shm.open])
    ddp = DistributedDataParallel(model)
    stall_path = os.path.join(out, "stall.r%d" % rank)
    log = open(os.path.join(out, "rank%d.log" % rank), "a")
    step = start
    while True:
        lib.fakeCudaSync()
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True) / 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        digest = hashlib.sha256(memory).hexdigest()[:16]
        if digest != want:
            open(os.path.join(out, "rank%d.corrupt" % rank), "w").close()
        log.write("%d %s %s %d\n" % (step, loss.item().hex(), digest, os.getpid()))
        log.flush()
        if coop.requested > coop.handled and os.path.exists(stall_path):
            with open(stall_path) as fh:
                stall_s = float(fh.read())
            os.unlink(stall_path)
            time.sleep(stall_s)
        if coop.step_boundary(step):
            ddp = DistributedDataParallel(model)  # (DDP holds the old process group: re-wrapped on the new one)
            with open(os.path.join(out, "rank%d.cycles" % rank), "a") as fh:
                fh.write("%r\n" % (coop.history[-1],))
        time.sleep(pause)
        step += 1


if __name__ == "__main__":
    main()
