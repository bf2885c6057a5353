"""All-reduce bus bandwidth between the GPUs of one host, as nccl-tests reports it (issue 45: the cost of a
configuration the driver can restore, against NCCL's defaults). One rank per GPU, under a torchrun:

  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
  python tools/gpuckpt_quiesce.py --standalone --nproc-per-node 2 bench/allreduce_bw.py --mib 256 --label defaults
  NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0 NCCL_CUMEM_HOST_ENABLE=0 python tools/gpuckpt_quiesce.py ... --label config

Rank 0 prints one line "RESULT {json}": the message size, the iterations, the mean time of one all-reduce, the
algorithm bandwidth (bytes / time) and the bus bandwidth (algbw * 2(n-1)/n), and the NCCL settings of its environment.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="a directory: rank 0 writes its RESULT there too, as allreduce.json")
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = dist.get_world_size()
    x = torch.ones(int(args.mib * (1 << 20)) // 4, dtype=torch.float32, device="cuda")
    for unused in range(args.warmup):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for unused in range(args.iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / args.iters
    nbytes = x.numel() * 4
    algbw = nbytes / seconds / 1e9
    if dist.get_rank() == 0:
        doc = {
            "kind": "allreduce_bw", "label": args.label, "ranks": n, "bytes": nbytes, "iters": args.iters,
            "seconds_per_allreduce": round(seconds, 6), "algbw_gbps": round(algbw, 2),
            "busbw_gbps": round(algbw * 2 * (n - 1) / n, 2), "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}}
        print("RESULT " + json.dumps(doc), flush=True)
        if args.out:
            with open(os.path.join(args.out, "allreduce.json"), "w") as fh:
                json.dump(doc, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
