"""The push alone: the transfer a migration uses (transfer.Sender, hashing what it sends, into receivers on the
target) against the link it runs on, measured in one run between two loopback hosts (tests/hosts/loopback.py),
each on its own cores (--cpusets split), with no GPU and no CRIU.

For a synthetic image of --gb GB in a tmpfs on the source (one CRIU-like page file and a few small files):
  link         k ssh streams from hosta to hostb, the fastest cipher, into /dev/null (migrate_bench's link term)
  link_disk    the same streams into files on hostb's image root (what the target's page cache takes)
  push[tree]   transfer.Sender with k streams (take_checksums on, as in a migration) into hostb's image root,
               for each collection tree given (--tree name=DIR, DIR holding ansible_collections: an A/B of
               two commits in one run, see bench/baseline_tree.sh)
and, for each, the share of each host's cores that was busy (from /proc/stat), to say which side is the limit.
Prints one JSON line per measurement (RESULT {...}) and a summary line. Run from the repo root after
tests/setup.sh (or on the GPU machine after tests/gpu/run_on_device.sh has installed its tools):

  python3 bench/push_bench.py --gb 8 --streams 4 --cpusets split
  python3 bench/push_bench.py --gb 26 --streams 4,8 --cpusets split --tree base=.carry-baseline --repeat 2
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
from loopback import LoopbackHosts  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer.targets import FAST_CIPHERS  # noqa: E402
PAGE_FILE = "pages-1.img"
BLOCK = 64 * 2**20

SENDER = r"""
import json, os, sys, time
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
src, dest, streams, cfg, host, port, image_id = sys.argv[1:8]
target = targets.Target(host, port=int(port), ssh_args=["-F", cfg])
sender = transfer.Sender(target, dest, int(streams), receiver={"image_id": image_id})
files = {rel: st.st_size for rel, st in image.walk(src).items()}
t0 = time.monotonic()
sender.start()
started = time.monotonic()
digests = sender.take_checksums()
report = sender.finish(src, files)
end = time.monotonic()
hashed = sum(1 for f in (digests or {}).values() if f.result() is not None)
print("SENT " + json.dumps({"seconds": end - t0, "start_s": started - t0, "bytes": report["bytes"],
                            "chunks_hashed": hashed, "streams": report["streams"]}))
"""


def cpu_times(cpus):
    """(busy, total) jiffies summed over ``cpus`` (ints)."""
    busy = total = 0
    with open("/proc/stat") as fh:
        for line in fh:
            name = line.split(" ", 1)[0]
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cpus:
                v = [int(x) for x in line.split()[1:]]
                idle = v[3] + v[4]
                busy += sum(v[:8]) - idle
                total += sum(v[:8])
    return busy, total


def parse_cpus(spec):
    out = set()
    for part in (spec or "").split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


class Meter(object):
    """The share of each host's cores busy while a measurement ran (1.0: all of them, all the time)."""

    def __init__(self, hosts):
        self.sets = {name: parse_cpus(hosts.cpusets[name]) if hosts.cpusets.get(name) else set(os.sched_getaffinity(0))
                     for name, _addr in hosts.hosts}

    def __enter__(self):
        self.before = {n: cpu_times(c) for n, c in self.sets.items()}
        return self

    def __exit__(self, *exc):
        self.busy = {}
        for n, c in self.sets.items():
            b0, t0 = self.before[n]
            b1, t1 = cpu_times(c)
            self.busy[n] = round((b1 - b0) / float(max(1, t1 - t0)), 3)


def make_image(src, size):
    """A CRIU-like image: one page file of ``size`` bytes (a random 64 MiB block over and over: hashing and
    ciphers take the same time on any bytes, and nothing on the way compresses) and a few small files."""
    block = os.urandom(BLOCK)
    with open(os.path.join(src, PAGE_FILE), "wb") as fh:
        left = size
        while left:
            n = min(BLOCK, left)
            fh.write(block[:n])
            left -= n
    for i in range(8):
        with open(os.path.join(src, "pagemap-%d.img" % (i + 1)), "wb") as fh:
            fh.write(os.urandom(4096 * (i + 1)))
    with open(os.path.join(src, "manifest.json"), "w") as fh:
        json.dump({"id": "push-bench", "files": {}}, fh)


def link(hosts, src, size, k, into):
    """k ssh streams, each a k-th of the page file, into /dev/null or (``into``) files in that directory on hostb."""
    per = size // BLOCK // k
    cfg = hosts.path("ssh_config")
    sink = "cat > /dev/null" if into is None else "cat > %s/part-%%d" % into
    cmd = ("ssh -F %s hosta 'dd if=%s bs=64M skip=%%d count=%d status=none | ssh -F %s -o Ciphers=%s hostb "
           "\"%s\"'" % (cfg, os.path.join(src, PAGE_FILE), per, cfg, FAST_CIPHERS, sink))
    t = time.monotonic()
    procs = [subprocess.Popen(cmd % ((i * per, i) if into else (i * per,)), shell=True) for i in range(k)]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("the link measurement failed")
    return per * k * BLOCK, time.monotonic() - t


def push(hosts, src, dest, k, tree, port):
    cmd = "env PYTHONPATH=%s python3 -c %s %s %s %d %s %s %d push-bench" % (
        tree, _quote(SENDER), src, dest, k, hosts.path("ssh_config"), dict(hosts.hosts)["hostb"], port)
    out = hosts.ssh("hosta", cmd, timeout=1800).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("SENT ")]
    if not line:
        raise RuntimeError("the push failed:\n%s" % out[-3000:])
    return json.loads(line[-1][5:])


def _quote(s):
    return "'" + s.replace("'", "'\"'\"'") + "'"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4, help="the page file's size in GB")
    ap.add_argument("--streams", default="4", help="stream counts to measure, comma separated")
    ap.add_argument("--cpusets", default="split", help="'split' (half the cores each), or '' for none")
    ap.add_argument("--port", type=int, default=22)
    ap.add_argument("--base", default=None)
    ap.add_argument("--tree", action="append", default=[],
                    help="name=DIR: a collection tree (DIR/ansible_collections) to push with; the first is the "
                         "baseline of the ratios; default: this checkout's .build/collections as 'head'")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-disk-link", action="store_true", help="skip the link into files on hostb")
    args = ap.parse_args()
    # A timeout's SIGTERM still stops the hosts and unmounts the image's tmpfs (the finally below): a bench run
    # after this one must not find 26 GB of this one's RAM taken.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trees = [t.split("=", 1) for t in args.tree] or [["head", os.path.join(REPO, ".build", "collections")]]
    trees = [(n, os.path.abspath(d)) for n, d in trees]
    for name, d in trees:
        if not os.path.isdir(os.path.join(d, "ansible_collections", "gpuckpt", "fleet")):
            raise SystemExit("tree %s: %s has no ansible_collections/gpuckpt/fleet" % (name, d))
    base = args.base or tempfile.mkdtemp(prefix="gpuckpt-push-")
    hosts = LoopbackHosts(os.path.join(base, "hosts"), port=args.port, pid_namespaces=False,
                          cpusets=args.cpusets or None)
    src = os.path.join(base, "src")
    os.makedirs(src)
    size = int(args.gb * 1e9) // BLOCK * BLOCK
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d,huge=within_size,mode=0700" % (size + 2**30),
                    "gpuckpt-push-bench", src], check=True)
    results = []

    def emit(doc):
        doc.update(gb=round(size / 1e9, 2), cpusets=hosts.cpusets, nproc=os.cpu_count())
        results.append(doc)
        print("RESULT " + json.dumps(doc, sort_keys=True), flush=True)

    try:
        hosts.start()
        make_image(src, size)
        dest_root = hosts.host_dir("hostb", "images")
        os.makedirs(dest_root, exist_ok=True)
        for rep in range(args.repeat):
            for k in [int(x) for x in args.streams.split(",")]:
                meter = Meter(hosts)
                with meter:
                    n, secs = link(hosts, src, size, k, None)
                emit({"what": "link", "streams": k, "rep": rep, "seconds": round(secs, 3), "GBps": round(n / secs / 1e9, 3),
                      "busy": meter.busy})
                if not args.no_disk_link:
                    into = os.path.join(dest_root, "link-disk")
                    os.makedirs(into)
                    with meter:
                        n, secs = link(hosts, src, size, k, into)
                    shutil.rmtree(into)
                    emit({"what": "link_disk", "streams": k, "rep": rep, "seconds": round(secs, 3),
                          "GBps": round(n / secs / 1e9, 3), "busy": meter.busy})
                for name, tree in trees:
                    dest = os.path.join(dest_root, "push-%s-%d-%d" % (name, k, rep))
                    with meter:
                        sent = push(hosts, src, dest, k, tree, args.port)
                    shutil.rmtree(dest)
                    emit({"what": "push", "tree": name, "streams": k, "rep": rep, "seconds": round(sent["seconds"], 3),
                          "start_s": round(sent["start_s"], 3), "GBps": round(sent["bytes"] / sent["seconds"] / 1e9, 3),
                          "chunks_hashed": sent["chunks_hashed"], "busy": meter.busy})
        summary = {}
        for r in results:
            key = r["what"] + ("[%s]" % r["tree"] if r.get("tree") else "") + "x%d" % r["streams"]
            summary.setdefault(key, []).append(r["GBps"])
        print("SUMMARY " + json.dumps({k: max(v) for k, v in summary.items()}, sort_keys=True), flush=True)
    finally:
        hosts.stop()
        subprocess.run(["umount", "-l", src], check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
