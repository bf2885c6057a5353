"""Is memory slower the first time a fresh machine touches it? (issue 45: the first CRIU dump of a drain on a newly
started GPU machine took 5.19 s where later ones took 2.5-2.7 s, for the same 4.8 GB.)

Run on a machine just started, before anything else: fills the same amount of memory three ways, in two rounds (the
second into what the first released), and prints one JSON line per fill with its rate:
  - anonymous memory (a job's pages),
  - the page cache of a file on disk, written without fsync (what CRIU's image writes land in first),
  - a tmpfs file (an image kept in memory).
A first fill much slower than the second, each way, is the hypervisor backing the machine's memory on first touch:
a node that has run for a while has touched its memory, so its dumps run at the second fill's rate.

    python3 bench/first_touch.py [GIB] [DISK_DIR]     (defaults: 6, /var/tmp)
"""
from __future__ import annotations

import json
import mmap
import os
import sys
import time

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
DISK_DIR = sys.argv[2] if len(sys.argv) > 2 else "/var/tmp"
CHUNK = 1 << 20
PAGE = mmap.PAGESIZE


def fill_anonymous(nbytes):
    """Seconds to write ``nbytes`` of new anonymous memory; the mapping (kept until released)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = time.monotonic()
    block = b"\x5a" * CHUNK
    for off in range(0, nbytes, CHUNK):
        m[off:off + CHUNK] = block
    return time.monotonic() - t, m.close


def fill_file(path, nbytes):
    """Seconds to write ``nbytes`` into a new file (no fsync); the file (kept until released)."""
    block = b"\x5a" * CHUNK
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.monotonic()
    try:
        for unused in range(nbytes // CHUNK):
            os.write(fd, block)
    finally:
        os.close(fd)
    return time.monotonic() - t, lambda: os.unlink(path)


def meminfo():
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemFree", "Cached", "Dirty", "AnonHugePages"):
                out[key] = value.strip()
    return out


def main():
    nbytes = int(GIB * (1 << 30)) // CHUNK * CHUNK
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            thp = fh.read().strip()
    except OSError:
        thp = "unknown"
    print(json.dumps({"what": "first_touch_machine", "bytes": nbytes, "thp": thp, "meminfo": meminfo(),
                      "uptime_s": float(open("/proc/uptime").read().split()[0])}), flush=True)
    ways = [("anonymous", lambda: fill_anonymous(nbytes)),
            ("page_cache", lambda: fill_file(os.path.join(DISK_DIR, "gpuckpt-first-touch"), nbytes)),
            ("tmpfs", lambda: fill_file("/dev/shm/gpuckpt-first-touch", nbytes))]
    # The first round keeps what each fill wrote until all three are done, so that no fill reuses the pages another
    # freed (the kernel hands recently freed pages out first); the second round then writes into released pages.
    for attempt in (1, 2):
        releases = []
        for name, fill in ways:
            seconds, release = fill()
            releases.append(release)
            print(json.dumps({"what": "first_touch", "way": name, "attempt": attempt, "seconds": round(seconds, 3),
                              "gb_per_s": round(nbytes / seconds / 1e9, 2)}), flush=True)
        for release in releases:
            release()
    print(json.dumps({"what": "first_touch_end", "meminfo": meminfo()}), flush=True)


if __name__ == "__main__":
    main()
