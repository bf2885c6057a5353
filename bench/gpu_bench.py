"""GPU checkpoint/restore benchmark (issue: GPU proof and performance). Run on the GPU machine
through tests/gpu/run_on_device.sh (GPUCKPT_BENCH=1), or by hand where a GPU and CRIU are present:

  python3 bench/gpu_bench.py --sizes 4,16,56 --image-root /tmp/gpuckpt-bench

For each size it starts a PyTorch process holding that many GiB of GPU memory, then measures, in one
run: the engine's first checkpoint + restore, the raw driver calls alone on the same process
(bench/raw_driver.py, no engine), and a second engine checkpoint + restore (host memory already faulted
in). It checks the GPU memory checksum after each restore. Floors measured once: pinned
device-to-host copy, copy into fresh pageable memory, and disk write bandwidth.
Prints JSON lines (also appended to $GPUCKPT_RESULTS).

--same-size-floors (issue 32; off by default, so older runs stay comparable): each size also gets the
floors of its own bytes, measured in the same run, and the engine's times as ratios to them (one
"same_size_floors" line a size, see same_size_line()). Before the size's PyTorch process starts, a plain
sequential write into a new file in the image root (the cold write: the first write of the run there, if
it is the first size and the 8 GiB floors are off); after the size's cycles, with the process gone: GPU to
pinned RAM and back for the size's GiB, the write again of the first image's byte count (warm), its read
right after (the page cache as the engine's restore found its image), and its read with the cache dropped.
"--same-size-floors direct" writes the cold file with O_DIRECT, so that it does not touch the page cache's
memory before the engine's first checkpoint (a buffered cold write touches as much host RAM as it writes,
which on lazily backed VMs is the first-touch cost the first checkpoint would otherwise pay).
"""
import argparse
import json
import mmap
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
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import chunk_hasher  # noqa: E402
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


GIB = 2**30
BLOCK = 64 * 2**20  # the floors' write and read size: large sequential blocks, as CRIU's pages files are written
# Bytes this run wrote into image roots before each cold write: a block is "cold" only if never written before.
WRITTEN = {"bytes": 0}


def run_torch(code, *args):
    """One JSON line printed by ``code`` run in the workload's Python (torch), without the carried PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([os.environ.get("GPUCKPT_WORKLOAD_PYTHON", "python3"), "-c", code] + [str(a) for a in args],
                         stdout=subprocess.PIPE, env=env, universal_newlines=True, check=True, timeout=900).stdout
    return json.loads(out.strip().splitlines()[-1])


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
    res = run_torch(code)
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
    WRITTEN["bytes"] += gib * 2**30
    os.unlink(path)
    emit("floors", gib=gib, **res)


def cycle(w, image_dir, label, parallel=False, criu_path=None, **options):
    backend = ProcessBackend(criu_path) if criu_path else None
    t = time.perf_counter()
    ck = checkpoint(w.pid, image_dir, parallel=parallel, backend=backend, **options)
    checkpoint_wall = time.perf_counter() - t
    WRITTEN["bytes"] += ck["image_bytes"]
    stopped = w.counts()
    t, began = time.perf_counter(), time.time()
    rs = restore(image_dir, parallel=parallel, host_huge_pages=options.get("host_huge_pages", False),
                 backend=ProcessBackend(criu_path) if criu_path else None)
    restore_wall = time.perf_counter() - t
    w.wait_counting(beyond=stopped)
    ok = w.verified_after(stopped)
    shutil.rmtree(image_dir)
    return {"label": label, "checkpoint": ck["timings"], "checkpoint_driver": ck["driver_call_seconds"],
            "restore": rs["timings"], "restore_driver": rs["driver_call_seconds"], "image_bytes": ck["image_bytes"],
            "data_intact": ok, "thp": hugepages.read_mode(), "huge_pages": ck.get("huge_pages"),
            "quiesce": ck.get("quiesce"), "checkpoint_wall_s": checkpoint_wall, "restore_wall_s": restore_wall,
            "restore_verify_s": rs.get("verify_seconds"), "pages_verified_beside_restore": rs.get("pages_verified_beside_restore"),
            # Until the workload runs again (resumed_at: its validation after that is not downtime), less the wait for
            # the pids of the process this bench dumped a moment before (its exit and reaping, which a restore from an
            # image taken earlier does not wait for).
            "restore_running_s": (rs["resumed_at"] - began - rs["timings"].get("wait_pids_free", 0))
            if rs.get("resumed_at") else None}


GPU_COPY_FLOORS = r"""
import json, sys, time, torch
n, chunk = int(float(sys.argv[1]) * 2**30), 2**30
x = torch.empty(n, dtype=torch.uint8, device="cuda"); x.fill_(7); torch.cuda.synchronize()
t = time.perf_counter()
# 1 GiB pieces: PyTorch's pinned allocator rounds each request up to a power of two.
pinned = [torch.empty(min(chunk, n - off), dtype=torch.uint8, pin_memory=True) for off in range(0, n, chunk)]
alloc = time.perf_counter() - t
def copy(to_host):
    t = time.perf_counter()
    for i, p in enumerate(pinned):
        dev = x[i * chunk:i * chunk + p.numel()]
        (p.copy_(dev, non_blocking=True) if to_host else dev.copy_(p, non_blocking=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t
first = copy(True); again = copy(True); h2d = copy(False)
print(json.dumps({"pin_alloc_s": alloc, "d2h_pinned_first_s": first, "d2h_pinned_s": again, "h2d_pinned_s": h2d,
                  "copied_intact": bool((pinned[-1][-4096:] == 7).all())}))
"""


def gpu_copy_floors(gib):
    """GPU to fresh pinned RAM and back, ``gib`` GiB, in a process of its own: the allocation (pinning touches
    the pages), the first copy into it, a second (the floor, as floors() takes it), then RAM to GPU."""
    try:
        return run_torch(GPU_COPY_FLOORS, gib)
    except subprocess.CalledProcessError as e:
        return {"skipped": "GPU copy floors: exit status %s (its stderr is in the log)" % e.returncode}
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return {"skipped": "GPU copy floors: %s" % e}


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write_floor(path, nbytes, direct=False, margin=GIB, cap_to_free=False):
    """A plain sequential write of ``nbytes`` into a new file at ``path`` in BLOCK pieces from memory, ended by
    fsync: seconds until the last write returned and until the fsync did. The file is left for the reads (the
    caller removes it). Skipped, with the reason, where the disk would keep less than ``margin`` free;
    ``cap_to_free``: write what fits instead (the cold write's size is an estimate: its time is scaled)."""
    if os.path.exists(path):
        os.unlink(path)
    room = free_bytes(os.path.dirname(path)) - margin
    res = {"bytes_asked": nbytes, "new_file": True, "direct": direct, "written_before_in_run": WRITTEN["bytes"]}
    if nbytes > room:
        if not cap_to_free or room < nbytes // 2:
            return dict(res, skipped="%d bytes asked, %d free beyond a %d margin" % (nbytes, max(room, 0), margin))
        nbytes = room
    # A page-aligned, random buffer: O_DIRECT needs the alignment, and random bytes keep a compressing or
    # deduplicating virtual disk from writing less than it is given.
    buf = mmap.mmap(-1, BLOCK)
    buf.write(os.urandom(BLOCK))
    view = memoryview(buf)
    if direct:
        nbytes -= nbytes % 4096
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    os.sync()  # what earlier steps left dirty is not this write's to flush
    done = 0
    try:
        fd = os.open(path, flags, 0o600)
        try:
            t = time.perf_counter()
            while done < nbytes:
                done += os.write(fd, view[:min(BLOCK, nbytes - done)])
            write_s = time.perf_counter() - t
            os.fsync(fd)
            fsync_s = time.perf_counter() - t
        finally:
            os.close(fd)
    except OSError as e:
        if os.path.exists(path):
            os.unlink(path)
        return dict(res, skipped="write after %d bytes: %s" % (done, e))
    finally:
        WRITTEN["bytes"] += done
        view.release()
        buf.close()
    return dict(res, bytes=nbytes, write_s=write_s, write_fsync_s=fsync_s)


def drop_page_cache(path):
    """The file's cached pages dropped (posix_fadvise, no root needed) and, as root, the whole page cache
    (echo 3 > /proc/sys/vm/drop_caches). Returns what was done."""
    os.sync()
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out["file_pages_dropped"] = True
    except OSError as e:
        out["file_pages_dropped"] = "no: %s" % e
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        out["drop_caches"] = True
    except OSError as e:
        out["drop_caches"] = "no: %s" % e
    return out


def read_floor(path):
    """A plain sequential read of the whole file in BLOCK pieces, the page cache as it is: seconds and bytes."""
    buf = bytearray(BLOCK)
    done = 0
    with open(path, "rb", buffering=0) as fh:
        t = time.perf_counter()
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            done += n
        return {"bytes": done, "read_s": time.perf_counter() - t}


def estimated_image_bytes(gib):
    # Every recorded run's image was the tensors plus 1.48 GiB (CUDA context and libraries): 4 GiB -> 5.48 GiB,
    # 16 -> 17.48, 56 -> 57.48, with or without THP.
    return int((gib + 1.5) * GIB)


def cold_write(image_root, gib, direct):
    """The write floor on blocks this run has not written (new file, before the size's first checkpoint),
    sized as the image is expected to be; the file is removed at once, before the engine writes its image."""
    os.makedirs(image_root, exist_ok=True)
    path = os.path.join(image_root, "floor-cold.bin")
    try:
        return write_floor(path, estimated_image_bytes(gib), direct=direct, cap_to_free=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def warm_disk_floors(image_root, image_bytes):
    """After the size's cycles (their images removed): the write of the image's byte count into a new file
    again, its read at once (cached as the engine's restore found its image, right after the checkpoint),
    then its read with the page cache dropped. The file is removed after."""
    path = os.path.join(image_root, "floor-warm.bin")
    try:
        write = write_floor(path, image_bytes)
        if "skipped" in write:
            return write, {}, {}, {}
        warm = read_floor(path)
        dropped = drop_page_cache(path)
        return write, warm, read_floor(path), dropped
    finally:
        if os.path.exists(path):
            os.unlink(path)


def total(*terms):
    return None if any(x is None for x in terms) else sum(terms)


def ratio(engine_s, floor_s):
    return engine_s / floor_s if engine_s is not None and floor_s else None


def same_size_line(gib, image_bytes, first, second, cold, write, read_warm, read_cold, dropped, gpu):
    """The "same_size_floors" JSON line: the floor terms (None where skipped, the reason in ``skipped``), the
    floors and the engine's first and second cycles of this size as ratios to them. The engine's times are the
    wall time of its checkpoint() and restore() calls (cycle(): checkpoint_wall_s, restore_wall_s)."""
    d2h, h2d = gpu.get("d2h_pinned_s"), gpu.get("h2d_pinned_s")
    cold_s = cold.get("write_s")
    # The cold file was sized before the image existed: its time scaled to the image's bytes, at its own rate.
    cold_scaled = cold_s * image_bytes / cold["bytes"] if cold_s is not None else None
    floor = {"checkpoint": total(d2h, write.get("write_s")), "checkpoint_fsync": total(d2h, write.get("write_fsync_s")),
             "checkpoint_cold": total(d2h, cold_scaled), "restore": total(read_warm.get("read_s"), h2d),
             "restore_cold_cache": total(read_cold.get("read_s"), h2d)}
    engine = {"checkpoint_first_s": first.get("checkpoint_wall_s"), "checkpoint_second_s": second.get("checkpoint_wall_s"),
              "restore_first_s": first.get("restore_wall_s"), "restore_second_s": second.get("restore_wall_s"),
              "restore_first_running_s": first.get("restore_running_s"),
              "restore_second_running_s": second.get("restore_running_s"),
              "checkpoint_first_stages_s": sum(first["checkpoint"].values()),
              "checkpoint_second_stages_s": sum(second["checkpoint"].values()),
              "restore_first_stages_s": sum(first["restore"].values()), "restore_second_stages_s": sum(second["restore"].values())}
    skipped = {k: v["skipped"] for k, v in (("write_cold", cold), ("write_warm", write), ("gpu", gpu)) if "skipped" in v}
    return {
        "gib": gib, "image_bytes": image_bytes,
        "pin_alloc_s": gpu.get("pin_alloc_s"), "d2h_pinned_first_s": gpu.get("d2h_pinned_first_s"), "d2h_pinned_s": d2h,
        "h2d_pinned_s": h2d, "gpu_copy_intact": gpu.get("copied_intact"),
        "write_cold_bytes": cold.get("bytes"), "write_cold_s": cold_s, "write_cold_fsync_s": cold.get("write_fsync_s"),
        "write_cold_direct": cold.get("direct"), "write_cold_new_file": cold.get("new_file"),
        "written_before_cold_write_in_run": cold.get("written_before_in_run"), "write_cold_scaled_to_image_s": cold_scaled,
        "write_warm_s": write.get("write_s"), "write_warm_fsync_s": write.get("write_fsync_s"),
        "read_warm_s": read_warm.get("read_s"), "read_cold_s": read_cold.get("read_s"), "read_cold_cache_dropped": dropped,
        "checkpoint_floor_s": floor["checkpoint"], "checkpoint_floor_fsync_s": floor["checkpoint_fsync"],
        "checkpoint_cold_floor_s": floor["checkpoint_cold"], "restore_floor_s": floor["restore"],
        "restore_floor_cold_cache_s": floor["restore_cold_cache"],
        "engine": engine,
        "checkpoint_first_over_floor": ratio(engine["checkpoint_first_s"], floor["checkpoint"]),
        "checkpoint_second_over_floor": ratio(engine["checkpoint_second_s"], floor["checkpoint"]),
        "checkpoint_first_over_cold_floor": ratio(engine["checkpoint_first_s"], floor["checkpoint_cold"]),
        "restore_first_over_floor": ratio(engine["restore_first_s"], floor["restore"]),
        "restore_second_over_floor": ratio(engine["restore_second_s"], floor["restore"]),
        "restore_first_running_over_floor": ratio(engine["restore_first_running_s"], floor["restore"]),
        "restore_second_running_over_floor": ratio(engine["restore_second_running_s"], floor["restore"]),
        "floor_definitions": {
            "checkpoint_floor_s": "d2h_pinned_s + write_warm_s (no fsync: the engine fsyncs only its manifest)",
            "checkpoint_floor_fsync_s": "d2h_pinned_s + write_warm_fsync_s",
            "checkpoint_cold_floor_s": "d2h_pinned_s + write_cold_scaled_to_image_s (no fsync)",
            "restore_floor_s": "read_warm_s + h2d_pinned_s (the engine's restore ran right after its checkpoint)",
            "restore_floor_cold_cache_s": "read_cold_s + h2d_pinned_s",
            "engine": "wall time of the engine's checkpoint()/restore() call; *_stages_s: the sum of its stages; "
                      "restore_*_running_s: from the restore() call until the workload runs (resumed_at), less its wait "
                      "for the pids of the process dumped just before"},
        "skipped": skipped}


def same_size_floors(w, image_root, gib, first, second, cold):
    """The size's floors after its cycles, once its killed PyTorch process ``w`` is gone (the GPU copies need
    the size's GiB of GPU memory again): GPU copies first, then the disk, so that nothing runs between the warm
    write and its read."""
    deadline = time.monotonic() + 60
    while w.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    gpu = gpu_copy_floors(gib)
    write, read_warm, read_cold, dropped = warm_disk_floors(image_root, first["image_bytes"])
    emit("same_size_floors", **same_size_line(gib, first["image_bytes"], first, second, cold, write, read_warm,
                                              read_cold, dropped, gpu))


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
            follow = chunk_hasher.ChunkHasher.follow
            if opts.pop("_hash_after", False):
                chunk_hasher.ChunkHasher.follow = lambda self: self  # the checksums all taken after the dump, as before
            try:
                cycles.append(cycle(w, img, label, **opts))
            finally:
                chunk_hasher.ChunkHasher.follow = follow
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


def run_sizes(args):
    """The 8 GiB floors (unless --no-floors), then for each size its cycles (a "size" line) and, with
    --same-size-floors, its own floors (a "same_size_floors" line)."""
    if not args.no_floors:
        floors(args.image_root)
    for gib in [float(s) for s in args.sizes.split(",") if s]:
        wdir = os.path.join(args.image_root, "w-%g" % gib)
        shutil.rmtree(wdir, ignore_errors=True)
        cold = cold_write(args.image_root, gib, args.same_size_floors == "direct") if args.same_size_floors else None
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
        if args.same_size_floors:
            same_size_floors(w, args.image_root, gib, first, second, cold)


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
    ap.add_argument("--same-size-floors", nargs="?", const="buffered", choices=["buffered", "direct"],
                    help="each size's floors of its own bytes and the engine's ratios to them (a same_size_floors "
                         "line a size); 'direct': the cold write with O_DIRECT, leaving the page cache untouched")
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
    run_sizes(args)


if __name__ == "__main__":
    main()
