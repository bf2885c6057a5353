"""Turn the JSON lines of GPU runs (tests/gpu, bench/gpu_bench.py) into the markdown tables of
docs/benchmarks/: each stage's time and throughput, the floor beside it, and the ratios.

  python3 bench/report.py docs/benchmarks/raw/<run>.results.jsonl [...]
"""
import json
import sys


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds else float("nan")


def main(paths):
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    floors = next((r for r in rows if r["kind"] == "floors"), None)
    if floors:
        print("Floors (8 GiB): pinned device-to-host %.1f GB/s, host-to-device %.1f GB/s, into fresh pageable "
              "memory %.2f GB/s, disk write (fsync) %.2f GB/s.\n"
              % (floors["pinned_d2h_GBps"], floors["pinned_h2d_GBps"], floors["fresh_pageable_d2h_GBps"],
                 floors["disk_write_GBps"]))
    sizes = [r for r in rows if r["kind"] == "size"]
    if sizes:
        print("| GPU GiB | cycle | CUDA checkpoint s (GB/s) | raw driver checkpoint s | CRIU dump s (GB/s) | checksums s "
              "| checkpoint total s | verify s | CRIU restore s | CUDA restore s (raw) | restore total s | engine overhead in CUDA stages | data intact |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sizes:
            gpu_bytes = r["gib"] * 2**30
            for c in (r["first"], r["second"]):
                ck, rs = c["checkpoint"], c["restore"]
                over = (ck["cuda_checkpoint"] + ck["cuda_lock"] + rs["cuda_restore"] + rs["cuda_unlock"]) / (
                    sum(c["checkpoint_driver"].values()) + c["restore_driver"]["restore"] + c["restore_driver"]["unlock"]) - 1
                ck_total = ck["cuda_lock"] + ck["cuda_checkpoint"] + ck["runtime_dump"] + ck["checksum"] + ck["manifest"]
                rs_total = rs["verify"] + rs["preflight"] + rs["runtime_restore"] + rs["cuda_restore"] + rs["cuda_unlock"]
                print("| %g | %s | %.2f (%.2f) | %s | %.2f (%.2f) | %.2f | %.1f | %.2f | %.2f | %.2f (%s) | %.1f | %.4f%% | %s |" % (
                    r["gib"], c["label"], ck["cuda_checkpoint"], gbps(gpu_bytes, ck["cuda_checkpoint"]),
                    "%.2f" % r["raw_driver"]["checkpoint"] if c["label"] == "second" else "",
                    ck["runtime_dump"], gbps(c["image_bytes"], ck["runtime_dump"]), ck["checksum"], ck_total,
                    rs["verify"], rs["runtime_restore"], rs["cuda_restore"],
                    "%.2f" % r["raw_driver"]["restore"] if c["label"] == "second" else "-", rs_total, over * 100,
                    c["data_intact"]))
    for r in rows:
        if r["kind"] in ("checkpoint_restore", "multi_process"):
            ck, rs = r["checkpoint_timings"], r["restore_timings"]
            d = r["checkpoint_driver_calls"]
            print("\n%s: image %.2f GB; checkpoint stages %s; driver calls %s; restore stages %s"
                  % (r["kind"], r["image_bytes"] / 1e9, ck, d, rs))
            if "raw_driver" in r:
                print("  raw driver calls on the same process afterwards: %s" % r["raw_driver"])
        if r["kind"] == "gpu_migrate":
            print("\ngpu_migrate (%g GiB, image %.2f GB): downtime %.2f s; checkpoint %s; transfer %.2f s (%.2f GB/s); "
                  "restore %s" % (r["gib"], r["image_bytes"] / 1e9, r["downtime"], r["checkpoint"], r["transfer_seconds"],
                                  gbps(r["transfer_bytes"], r["transfer_seconds"]), r["restore"]))
        if r["kind"] == "gpu_migrate_other_gpu":
            print("\ngpu_migrate_other_gpu: %s -> %s, restore %s" % (r["from_gpu"], r["to_gpu"], r["restore"]))


if __name__ == "__main__":
    main(sys.argv[1:])
