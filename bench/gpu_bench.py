"""GPU checkpoint/restore benchmark (issue: GPU proof and performance). Run on the GPU machine
through tests/gpu/run_on_device.sh (GPUCKPT_BENCH=1), or by hand where a GPU and CRIU are present:

  python3 bench/gpu_bench.py --sizes 4,16,56 --image-root /tmp/gpuckpt-bench

For each size it starts a PyTorch process holding that many GiB of GPU memory, then measures, in one
run: the engine's first checkpoint + restore, the raw driver calls alone on the same process
(bench/raw_driver.py, no engine), and a second engine checkpoint + restore (host memory already faulted
in). It checks the GPU memory checksum after each restore. Floors measured once: pinned
device-to-host copy, copy into fresh pageable memory, and disk write bandwidth.
Prints JSON lines (also appended to $GPUCKPT_RESULTS).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import hugepages  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.criu import Criu  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend  # noqa: E402
from gpu_helpers import TorchWorkload, raw_driver  # noqa: E402


def emit(kind, **data):
    data.update(kind=kind, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    line = json.dumps(data)
    print("RESULT", line, flush=True)
    if os.environ.get("GPUCKPT_RESULTS"):
        with open(os.environ["GPUCKPT_RESULTS"], "a") as fh:
            fh.write(line + "\n")


def floors(image_root, gib=8):
    code = r"""
import json, time, torch
n = %d * 2**30
x = torch.empty(n, dtype=torch.uint8, device="cuda"); x.fill_(7); torch.cuda.synchronize()
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
pinned.copy_(x); torch.cuda.synchronize()
t = time.perf_counter(); pinned.copy_(x); torch.cuda.synchronize(); d2h = n / (time.perf_counter() - t)
t = time.perf_counter(); x.copy_(pinned); torch.cuda.synchronize(); h2d = n / (time.perf_counter() - t)
t = time.perf_counter(); fresh = x.cpu(); fresh_bw = n / (time.perf_counter() - t)
print(json.dumps({"pinned_d2h_GBps": d2h / 1e9, "pinned_h2d_GBps": h2d / 1e9, "fresh_pageable_d2h_GBps": fresh_bw / 1e9}))
""" % gib
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([os.environ.get("GPUCKPT_WORKLOAD_PYTHON", "python3"), "-c", code], stdout=subprocess.PIPE,
                         env=env, universal_newlines=True, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    os.makedirs(image_root, exist_ok=True)
    path = os.path.join(image_root, "disk-floor.bin")
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/urandom", "of=/dev/null", "bs=1M", "count=1"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    buf = os.urandom(64 * 2**20)
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for unused in range(gib * 16):
            fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
    res["disk_write_GBps"] = gib * 2**30 / (time.perf_counter() - t) / 1e9
    os.unlink(path)
    emit("floors", gib=gib, **res)


def cycle(w, image_dir, label, parallel=False, criu_path=None, **options):
    backend = ProcessBackend(criu_path) if criu_path else None
    ck = checkpoint(w.pid, image_dir, parallel=parallel, backend=backend, **options)
    stopped = w.counts()
    rs = restore(image_dir, parallel=parallel, host_huge_pages=options.get("host_huge_pages", False),
                 backend=ProcessBackend(criu_path) if criu_path else None)
    w.wait_counting(beyond=stopped)
    ok = w.verified_after(stopped)
    shutil.rmtree(image_dir)
    return {"label": label, "checkpoint": ck["timings"], "checkpoint_driver": ck["driver_call_seconds"],
            "restore": rs["timings"], "restore_driver": rs["driver_call_seconds"], "image_bytes": ck["image_bytes"],
            "data_intact": ok, "thp": hugepages.read_mode(), "huge_pages": ck.get("huge_pages"),
            "quiesce": ck.get("quiesce")}


def speed(args):
    """The speed options in one run, on one PyTorch process holding --speed GiB of tensors and
    --cache-gib GiB of freed blocks in its caching allocator: THP as the host has it vs always for the
    operation (alternated, twice each), the checksums taken during the dump vs after it, then the
    quiesce signal (last: it empties the cache)."""
    wdir = os.path.join(args.image_root, "w-speed")
    shutil.rmtree(wdir, ignore_errors=True)
    w = TorchWorkload(wdir, gib=args.speed, verify_every=2.0, cache_gib=args.cache_gib, quiesce=True)
    img = os.path.join(args.image_root, "img-speed")
    cycles = []
    try:
        plan = [("host-thp", {}), ("thp-always", {"host_huge_pages": True})] * 2
        plan.append(("thp-always-hash-after-dump", {"host_huge_pages": True, "_hash_after": True}))
        plan.append(("thp-always-quiesced", {"host_huge_pages": True, "quiesce_signal": "SIGUSR1"}))
        for label, opts in plan:
            follow = image.ChunkHasher.follow
            if opts.pop("_hash_after", False):
                image.ChunkHasher.follow = lambda self: self  # the checksums all taken after the dump, as before
            try:
                cycles.append(cycle(w, img, label, **opts))
            finally:
                image.ChunkHasher.follow = follow
            w.wait_counting(beyond=w.counts())
        emit("speed", gib=args.speed, cache_gib=args.cache_gib, host_thp=hugepages.read_mode(), cycles=cycles)
    finally:
        w.kill()
        time.sleep(2)


def criu_compare(args):
    """The installed CRIU against --criu-compare (another build), alternated on one PyTorch process of
    --compare-gib GiB, THP always for every operation (the fast setting), two cycles each, one run."""
    versions = {label: Criu(path).version() for label, path in (("default", None), ("compare", args.criu_compare))}
    wdir = os.path.join(args.image_root, "w-criu")
    shutil.rmtree(wdir, ignore_errors=True)
    w = TorchWorkload(wdir, gib=args.compare_gib, verify_every=2.0)
    img = os.path.join(args.image_root, "img-criu")
    cycles = []
    try:
        for label, path in [("default", None), ("compare", args.criu_compare)] * 2:
            c = cycle(w, img, "criu-%s-%s" % (label, versions[label]), criu_path=path, host_huge_pages=True)
            c["criu_version"] = versions[label]
            cycles.append(c)
            w.wait_counting(beyond=w.counts())
        emit("criu_compare", gib=args.compare_gib, versions=versions, cycles=cycles)
    finally:
        w.kill()
        time.sleep(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--image-root", default="/tmp/gpuckpt-bench")
    ap.add_argument("--no-floors", action="store_true")
    ap.add_argument("--speed", type=float, default=0, help="GiB of tensors for the speed options' run (see speed())")
    ap.add_argument("--cache-gib", type=float, default=0, help="GiB the allocator keeps cached in that run")
    ap.add_argument("--multi", type=float, default=0,
                    help="GiB per process of a 3-process workload: driver calls one after another vs in parallel")
    ap.add_argument("--thp", action="store_true", help="the sizes' cycles with host_huge_pages (THP always)")
    ap.add_argument("--criu-compare", help="another criu binary, compared with the installed one in one run")
    ap.add_argument("--compare-gib", type=float, default=16, help="GiB of tensors for --criu-compare")
    args = ap.parse_args()
    if args.criu_compare:
        criu_compare(args)
        return
    if args.speed:
        speed(args)
        return
    if args.multi:
        wdir = os.path.join(args.image_root, "w-multi")
        shutil.rmtree(wdir, ignore_errors=True)
        w = TorchWorkload(wdir, gib=args.multi, children=2, verify_every=2.0)
        try:
            seq = cycle(w, os.path.join(args.image_root, "img-multi-seq"), "sequential")
            w.wait_counting(beyond=w.counts())
            par = cycle(w, os.path.join(args.image_root, "img-multi-par"), "parallel", parallel=True)
            w.wait_counting(beyond=w.counts())
            seq2 = cycle(w, os.path.join(args.image_root, "img-multi-seq2"), "sequential-again")
            emit("multi", processes=3, gib_each=args.multi, cycles=[seq, par, seq2])
        finally:
            w.kill()
            time.sleep(2)
        return
    if not args.no_floors:
        floors(args.image_root)
    for gib in [float(s) for s in args.sizes.split(",") if s]:
        wdir = os.path.join(args.image_root, "w-%g" % gib)
        shutil.rmtree(wdir, ignore_errors=True)
        w = TorchWorkload(wdir, gib=gib, verify_every=2.0)
        try:
            opts = {"host_huge_pages": True} if args.thp else {}
            first = cycle(w, os.path.join(args.image_root, "img-%g-1" % gib), "first", **opts)
            raw = raw_driver(w.pids)[0]
            w.wait_counting(beyond=w.counts())
            second = cycle(w, os.path.join(args.image_root, "img-%g-2" % gib), "second", **opts)
            emit("size", gib=gib, image_root=args.image_root, fill_seconds=w.fill_seconds, first=first,
                 raw_driver=raw, second=second, host_huge_pages=bool(args.thp))
        finally:
            w.kill()
            time.sleep(2)


if __name__ == "__main__":
    main()
