"""Touch fresh host memory, hold it all, then give it back: a measurement for issue 15, not a product feature.

On the GPU machines (Firecracker VMs) the host backs a guest's memory when the guest first touches it: the first
56 GiB checkpoint of a fresh machine ran 45.9 and 53.7 s, the second, on memory already touched, 37.4 and 40.0 s
(docs/benchmarks, sessions 8 and 9). If that first touch is the whole difference, a first checkpoint run after this
script should be as fast as a second one. Run on the GPU machine before the benchmark:

  python3 bench/pretouch.py --leave-gib 6 --out "$OUT/pretouch.jsonl"

It maps 1 GiB pieces populated at once (MAP_POPULATE) until MemAvailable would fall below --leave-gib, holds them
all (so each piece is new memory, not the last piece's pages again), then unmaps them, and prints one JSON line:
how much was touched, how fast, and MemAvailable before and after. ``--huge``: each piece is asked for huge pages
(MADV_HUGEPAGE) and touched once every 2 MiB instead, as the driver's and CRIU's memory is touched under THP
``always``.
"""
import argparse
import json
import mmap
import time

GIB = 1 << 30


def mem_available():
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leave-gib", type=float, default=6.0, help="MemAvailable left untouched (GiB)")
    ap.add_argument("--max-gib", type=int, default=1024)
    ap.add_argument("--out", help="a file to append the JSON line to")
    ap.add_argument("--huge", action="store_true", help="touch the memory as 2 MiB huge pages")
    args = ap.parse_args()
    before = mem_available()
    held, t0 = [], time.monotonic()
    while len(held) < args.max_gib and mem_available() - GIB > args.leave_gib * GIB:
        if args.huge:
            m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            for off in range(0, GIB, 2 << 20):
                m[off] = 1
        else:
            m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        held.append(m)
    touched = time.monotonic() - t0
    low = mem_available()
    for m in held:
        m.close()
    time.sleep(1)
    line = {"kind": "pretouch", "huge": args.huge, "gib": len(held), "seconds": round(touched, 3),
            "gb_per_s": round(len(held) * GIB / 1e9 / touched, 3) if touched else None,
            "mem_available_gib": {"before": round(before / GIB, 1), "while_held": round(low / GIB, 1),
                                  "after": round(mem_available() / GIB, 1)},
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
