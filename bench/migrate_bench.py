"""Migration downtime against its floor and against the plain chain, measured in one run.

Two loopback "hosts" (tests/hosts/loopback.py: sshd on 127.0.0.2/.3, real ssh and rsync). For a
workload of the given size it measures:
  floor   = stage 1 (driver checkpoint + restore, from the engine's own timings)
            + image bytes / disk write bandwidth (dd with fsync, same size)
            + image bytes / link bandwidth (the better of one ssh stream and --streams parallel ssh
              streams, the fastest cipher, into /dev/null: what the link carries at best)
  chain   = the plain chain by hand on a fresh workload: criu dump, rsync to the target, criu restore
            there (plus the driver's checkpoint/restore when on the GPU)
  ours    = migrate.yml on a fresh workload: downtime = resumed on the target - frozen on the source
Prints a JSON line and a markdown row. Run it from the repo root after tests/setup.sh:

  python3 bench/migrate_bench.py --mb 512          # CPU workload: parent + child, 512 MiB each
  python3 bench/migrate_bench.py --torch-gib 4     # GPU workload (GPU machine)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
from loopback import LoopbackHosts  # noqa: E402
from push_bench import cpu_times, parse_cpus  # noqa: E402  (bench/, this script's own directory)
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer.targets import FAST_CIPHERS  # noqa: E402

PLAYBOOK = os.environ.get("GPUCKPT_ANSIBLE_PLAYBOOK") or os.path.join(REPO, ".venv", "bin", "ansible-playbook")
PY = os.environ.get("GPUCKPT_WORKLOAD_PYTHON", "python3")
PASS_ENV = {k: os.environ[k] for k in ("LD_LIBRARY_PATH", "PATH") if k in os.environ}


def start(hosts, args, workdir):
    env = " ".join("%s=%s" % kv for kv in PASS_ENV.items())
    if args.torch_gib:
        cmd = "%s %s/tests/workloads/torch_counter.py --dir %s --gib %s --daemon --cache-gib %s --quiesce" % (
            PY, REPO, workdir, args.torch_gib, args.cache_gib)
    else:
        cmd = "%s %s/tests/workloads/counter.py --dir %s --mb %d --daemon" % (PY, REPO, workdir, args.mb)
    # Under a subreaper, as systemd or a container shim runs real workloads (tests/workloads/reaper.py).
    cmd = "%s %s/tests/workloads/reaper.py %s" % (PY, REPO, cmd)
    out = hosts.ssh("hosta", "echo 20000 > /proc/sys/kernel/ns_last_pid; env %s %s" % (env, cmd), timeout=900).stdout
    pid = int(out.strip().splitlines()[-1])
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(workdir, "parent.state")) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    return pid


def timed(fn):
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def remote_py(hosts, host, code):
    env = " ".join("%s=%s" % kv for kv in PASS_ENV.items())
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:  # the hosts share the filesystem
        fh.write(code)
    cmd = "env %s PYTHONPATH=%s %s %s" % (env, os.path.join(REPO, ".build", "collections"), PY, fh.name)
    return hosts.ssh(host, cmd, timeout=900)


def plain_chain(hosts, args, base, fast_cipher=False, tag="chain"):
    """criu dump (+ driver checkpoint) on hosta, rsync, criu restore (+ driver restore) on hostb.
    ``fast_cipher``: rsync's ssh told to use AES-GCM, as a user who tuned the chain would."""
    wdir = os.path.join(base, tag + "-w")
    pid = start(hosts, args, wdir)
    src, dst = os.path.join(base, tag + "-src"), os.path.join(base, tag + "-dst")
    os.makedirs(src)
    stage1 = ("from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import driver as d\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs as q\n"
              "drv=d.CudaDriver()\nps=[p for p in q.process_tree(%d) if drv.cuda_state(p)]\n"
              "[drv.lock(p) for p in ps]\n[drv.checkpoint(p) for p in ps]\n") % pid
    steps = {}
    t0 = time.monotonic()
    if args.torch_gib:
        remote_py(hosts, "hosta", stage1)
    steps["stage1_checkpoint"] = time.monotonic() - t0
    hosts.ssh("hosta", "cd %s && criu dump -t %d -D %s --shell-job -o dump.log" % (src, pid, src))
    steps["dump"] = time.monotonic() - t0 - sum(steps.values())
    cipher = " -c aes128-gcm@openssh.com" if fast_cipher else ""
    subprocess.run(["ssh", "-F", hosts.path("ssh_config"), "hosta", "rsync -a -e 'ssh -F %s%s' %s/ hostb:%s/"
                    % (hosts.path("ssh_config"), cipher, src, dst)], check=True)
    steps["rsync"] = time.monotonic() - t0 - sum(steps.values())
    hosts.ssh("hostb", "while [ -e /proc/%d ]; do sleep 0.05; done" % pid)  # one pid space: wait for the reaper
    hosts.ssh("hostb", "cd %s && setsid criu restore -D %s --shell-job -d -o restore.log --pidfile %s/pid" % (dst, dst, dst))
    steps["restore"] = time.monotonic() - t0 - sum(steps.values())
    if args.torch_gib:
        remote_py(hosts, "hostb", "from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import driver as d\n"
                  "from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs as q\n"
                  "drv=d.CudaDriver()\nps=[p for p in q.process_tree(%d) if drv.cuda_state(p)]\n"
                  "[drv.restore(p) for p in ps]\n[drv.unlock(p) for p in ps]\n" % pid)
    total = time.monotonic() - t0
    steps["stage1_restore"] = total - sum(steps.values())
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    shutil.rmtree(src, ignore_errors=True)  # (a 40 GB image twice over would fill the GPU machine's disk)
    shutil.rmtree(dst, ignore_errors=True)
    return total, size, steps


def ours(hosts, args, base, streams, tag="ours", during_dump=True, restore_early=True, extra=None, collections=None):
    wdir = os.path.join(base, tag + "-w")
    pid = start(hosts, args, wdir)
    rec = os.path.join(base, tag + ".jsonl")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=collections or os.path.join(REPO, ".build", "collections"),
               ANSIBLE_PIPELINING="true", ANSIBLE_HOST_KEY_CHECKING="false", GPUCKPT_RECORD=rec,
               ANSIBLE_SSH_CONTROL_PATH_DIR=os.path.join(base, "cp-" + tag),
               ANSIBLE_CALLBACK_PLUGINS=os.path.join(REPO, "tests", "integration", "callback_plugins"),
               ANSIBLE_CALLBACKS_ENABLED="record_results")
    extra_vars = {"source": "hosta", "target": "hostb", "pid": pid, "migration_id": "bench-" + tag,
                  "gpuckpt_transfer_streams": streams, "gpuckpt_transfer_during_dump": during_dump,
                  "gpuckpt_restore_early": restore_early}
    extra_vars.update(extra or {})
    subprocess.run([PLAYBOOK, "gpuckpt.fleet.migrate", "-i", hosts.path("inventory.yml"), "-e", json.dumps(extra_vars)],
                   check=True, env=env, stdout=open(os.path.join(base, tag + ".log"), "w"))
    res = {}
    for line in open(rec):
        r = json.loads(line)
        if r["_task"].startswith("Stage 1/3"):
            res["ck"] = r
        if r["_task"].startswith("Stage 2/3"):
            res["sync"] = r
        if r["_task"].startswith("Restore on hostb") and r.get("_status") != "skipped":
            res["rs"] = r  # the restore begun before the freeze (attached), or the one started after the transfer
    downtime = res["rs"]["resumed_at"] - res["ck"]["frozen_at"]
    stage1 = res["ck"]["timings"].get("cuda_checkpoint", 0) + res["ck"]["timings"].get("cuda_lock", 0) + \
        res["rs"]["timings"].get("cuda_restore", 0) + res["rs"]["timings"].get("cuda_unlock", 0)
    return downtime, res["ck"]["image_bytes"], stage1, res


class Sampler(object):
    """Samples, every ``period`` seconds while a variant runs, what could hold the push back: the kernel's dirty and
    writeback pages against their thresholds, reclaim (pages scanned by kswapd and directly, allocation stalls),
    MemAvailable, and the share of each host's cores busy. One JSON line per sample (wall-clock ``t``, to set
    beside the variant's frozen_at and its stages) in ``path``."""
    VMSTAT = ("nr_dirty", "nr_writeback", "nr_dirty_threshold", "nr_dirty_background_threshold", "pgscan_kswapd",
              "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "allocstall_normal", "allocstall_movable", "nr_shmem",
              "nr_anon_pages", "nr_file_pages")

    def __init__(self, path, cpusets, period=0.25, dirs=None):
        import threading
        self.path, self.period, self.dirs = path, period, dict(dirs or {})
        self.sets = {n: parse_cpus(c) for n, c in (cpusets or {}).items()}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()

    def _run(self):
        prev = None
        with open(self.path, "w") as out:
            while not self.stop_event.wait(self.period):
                doc = {"t": round(time.time(), 3)}
                with open("/proc/vmstat") as fh:
                    for line in fh:
                        k, v = line.split()
                        if k in self.VMSTAT:
                            doc[k] = int(v)
                with open("/proc/meminfo") as fh:
                    for line in fh:
                        if line.startswith(("MemAvailable:", "Dirty:", "Writeback:")):
                            doc[line.split(":")[0]] = int(line.split()[1]) * 1024
                for name, d in self.dirs.items():  # the image's bytes on each host so far (allocated blocks)
                    doc["bytes_" + name] = _allocated(d)
                cpu = {n: cpu_times(c) for n, c in self.sets.items()}
                if prev is not None:
                    doc["busy"] = {n: round((cpu[n][0] - prev[n][0]) / float(max(1, cpu[n][1] - prev[n][1])), 3)
                                   for n in cpu}
                prev = cpu
                out.write(json.dumps(doc) + "\n")


def _allocated(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def shmem_folios():
    """{folio size in KiB: tmpfs/shmem folios of that size allocated so far} from the kernel's mTHP counters
    (what an image tmpfs's huge= policy gave its files); {} on a kernel without them."""
    root, out = "/sys/kernel/mm/transparent_hugepage", {}
    for name in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, name, "stats", "shmem_alloc")) as fh:
                out[int(name[len("hugepages-"):-len("kB")])] = int(fh.read())
        except (OSError, ValueError):
            continue
    return out


def bandwidths(hosts, base, size, streams, pipelined_only=False):
    """(disk, one ssh stream, ``streams`` ssh streams) in bytes/s. ``pipelined_only``: only what the
    pipelined floor needs (the link over ``streams`` streams): the file is written without fsync and
    the disk and single-stream figures are None (for a 40 GB image they take minutes)."""
    f = os.path.join(base, "bw.bin")
    n = max(streams, size // (64 * 2**20))
    n -= n % streams
    write = timed(lambda: subprocess.run(
        ["dd", "if=/dev/zero", "of=%s" % f, "bs=64M", "count=%d" % n] + ([] if pipelined_only else ["conv=fsync"]),
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    disk = None if pipelined_only else n * 64 * 2**20 / write

    def send(k):  # k parallel ssh streams from hosta to hostb, each 1/k of the file
        per = n // k
        cfg = hosts.path("ssh_config")
        cmd = ("ssh -F %s hosta 'dd if=%s bs=64M skip=%%d count=%d status=none | ssh -F %s -o Ciphers=%s hostb "
               "\"cat > /dev/null\"'" % (cfg, f, per, cfg, FAST_CIPHERS))
        procs = [subprocess.Popen(cmd % (i * per), shell=True) for i in range(k)]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError("link measurement failed")

    link1 = None if pipelined_only else n * 64 * 2**20 / timed(lambda: send(1))
    link_n = n * 64 * 2**20 / timed(lambda: send(streams))
    os.unlink(f)
    return disk, link1, link_n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--torch-gib", type=float, default=0)
    ap.add_argument("--base", default=None)
    ap.add_argument("--pid-namespaces", type=int, default=1)
    ap.add_argument("--streams", type=int, default=4, help="gpuckpt_transfer_streams for our migration")
    ap.add_argument("--also-fast-chain", action="store_true",
                    help="also time the plain chain with rsync's ssh on AES-GCM (a tuned chain)")
    ap.add_argument("--also-after-dump", action="store_true",
                    help="also time our migration with the transfer after the dump (no push during it)")
    ap.add_argument("--warmup", action="store_true",
                    help="first run one migration that is not measured: on a fresh VM the first run pays for "
                         "host memory faulted in for the first time (the GPU machine's VM), which would bias the order")
    ap.add_argument("--also-late-restore", action="store_true",
                    help="also time our migration with the target's restore started after the transfer (not before the freeze)")
    ap.add_argument("--cache-gib", type=float, default=0,
                    help="GPU workload: GiB of freed blocks its caching allocator keeps (released on SIGUSR1)")
    ap.add_argument("--also-huge-pages", action="store_true",
                    help="also time our migration with gpuckpt_host_huge_pages (THP always while it runs)")
    ap.add_argument("--also-quiesce", action="store_true",
                    help="also time our migration with huge pages and quiesce_signal=SIGUSR1 (the cache released first)")
    ap.add_argument("--pipelined-only", action="store_true",
                    help="measure only what the pipelined floor needs (no disk bandwidth, no single-stream link), "
                         "and keep no image after its variant: for images of tens of GB")
    ap.add_argument("--only-huge-pages", action="store_true",
                    help="time our migration with gpuckpt_host_huge_pages only (the variant without it is skipped)")
    ap.add_argument("--images-in-memory", type=float, default=0, metavar="GIB",
                    help="keep both hosts' images on a tmpfs of this many GiB (gpuckpt_image_root there): the image "
                         "never goes through a disk-backed page cache, the pipelined floor's premise")
    ap.add_argument("--also-single-stream", action="store_true",
                    help="also time our migration with one ssh stream (one push stream during the dump), to show what the streams bring")
    ap.add_argument("--only-quiesced", action="store_true",
                    help="time our migration with huge pages and quiesce_signal=SIGUSR1 only (the speed options "
                         "as one would run a big job)")
    ap.add_argument("--source-in-memory", action="store_true",
                    help="our migration (the headline one) with the source's image in memory (gpuckpt_image_in_memory)")
    ap.add_argument("--also-source-in-memory", action="store_true",
                    help="also time our migration as the headline one, with the source's image in memory "
                         "(gpuckpt_image_in_memory: a tmpfs of its own, no disk on the source)")
    ap.add_argument("--tmpfs-huge-ab", action="store_true",
                    help="with --source-in-memory: after the headline variant (the image tmpfs's default huge= "
                         "policy), the same with 4 KiB pages (GPUCKPT_IMAGE_TMPFS_HUGE=never), with 2 MiB pages (=always), then "
                         "the headline again")
    ap.add_argument("--also-target-in-memory", action="store_true",
                    help="after the headline variant, the same with the target's image in memory too "
                         "(gpuckpt_target_image_in_memory), then the headline again")
    ap.add_argument("--baseline-collections", metavar="PATH",
                    help="after the headline variant, the same with the collection found in PATH (an "
                         "ansible_collections tree of another commit: bench/baseline_tree.sh), then the headline again")
    ap.add_argument("--no-chain", default="", metavar="WHY",
                    help="skip the plain chain, saying why (its image on both hosts' disk at once)")
    ap.add_argument("--samples-dir", metavar="DIR",
                    help="sample the kernel's dirty pages, reclaim and each host's busy cores while each variant runs, "
                         "into DIR/samples-<variant>.jsonl (with its stages in DIR/stages-<variant>.json)")
    ap.add_argument("--port", type=int, default=22, help="the loopback hosts' sshd port (another than a test run's)")
    ap.add_argument("--cpusets", default="", help="'split': each loopback host its own half of the cores (as two "
                    "machines), the floor's link measured between those halves in the same run")
    args = ap.parse_args()
    base = args.base or tempfile.mkdtemp(prefix="gpuckpt-mbench-")
    hv = {n: {"gpuckpt_environment": PASS_ENV} for n in ("hosta", "hostb")}
    mem_root = None
    if args.images_in_memory:  # one tmpfs, a directory per host (the loopback hosts share one machine)
        mem_root = os.path.join(base, "mem-images")
        os.makedirs(mem_root, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dm,mode=0700" % int(args.images_in_memory * 1024),
                        "gpuckpt-bench", mem_root], check=True)
        for n in hv:
            hv[n]["gpuckpt_image_root"] = os.path.join(mem_root, n)
    hosts = LoopbackHosts(os.path.join(base, "hosts"), port=args.port, pid_namespaces=bool(args.pid_namespaces), python=PY,
                          cpusets=args.cpusets or None).start(hv)

    def settle(tag):  # end the variant's workload: an idle machine for the next one
        time.sleep(1)
        subprocess.run("pkill -9 -f -- '[-]-dir %s/%s-w'" % (base, tag), shell=True, check=False)
        time.sleep(2)
        if args.pipelined_only:  # its images on both hosts: the next variant needs the disk
            for host in ("hosta", "hostb"):
                root = os.path.join(mem_root, host) if mem_root else hosts.host_dir(host, "images")
                shutil.rmtree(os.path.join(root, "bench-" + tag), ignore_errors=True)

    folios = {}

    def variant(tag, streams=None, **kw):
        """Our migration on a fresh workload, as the variant ``tag``; (downtime, size, stage1, results)."""
        before = shmem_folios()
        if args.samples_dir:
            os.makedirs(args.samples_dir, exist_ok=True)
            dirs = {h: os.path.join(mem_root, h, "bench-" + tag) if mem_root else
                    os.path.join(hosts.host_dir(h, "images"), "bench-" + tag) for h in ("hosta", "hostb")}
            with Sampler(os.path.join(args.samples_dir, "samples-%s.jsonl" % tag), hosts.cpusets, dirs=dirs):
                out = ours(hosts, args, base, args.streams if streams is None else streams, tag=tag, **kw)
            with open(os.path.join(args.samples_dir, "stages-%s.json" % tag), "w") as fh:
                json.dump({k: {"frozen_at": v.get("frozen_at"), "resumed_at": v.get("resumed_at"),
                               "timings": v.get("timings")} for k, v in out[3].items() if isinstance(v, dict)}, fh)
        else:
            out = ours(hosts, args, base, args.streams if streams is None else streams, tag=tag, **kw)
        after = shmem_folios()
        folios[tag] = {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}
        settle(tag)
        return out

    try:
        if args.warmup:
            variant("warmup")
        headline = {}
        if args.only_huge_pages or args.only_quiesced:  # the huge pages variant is the one reported as ours
            headline = {"gpuckpt_host_huge_pages": True}
        if args.only_quiesced:
            headline["quiesce_signal"] = "SIGUSR1"
        if args.source_in_memory:
            headline["gpuckpt_image_in_memory"] = True
        down, size, stage1, res = variant("ours", extra=headline)
        mem = variant("mem", extra=dict(headline, gpuckpt_image_in_memory=True)) if args.also_source_in_memory else None
        # Issue 32: the image tmpfs's large folios (memdir.huge_policy), against 4 KiB pages, each on memory the
        # run already touched (the headline variant ran first, on a fresh machine's memory), then the headline again.
        plain_tmpfs = variant("tmpfs4k", extra=dict(headline, gpuckpt_environment=dict(
            PASS_ENV, GPUCKPT_IMAGE_TMPFS_HUGE="never"))) if args.tmpfs_huge_ab else None
        pmd_tmpfs = variant("tmpfs2m", extra=dict(headline, gpuckpt_environment=dict(
            PASS_ENV, GPUCKPT_IMAGE_TMPFS_HUGE="always"))) if args.tmpfs_huge_ab else None
        again = variant("again", extra=headline) if args.tmpfs_huge_ab else None
        # The target's copy in memory as well (gpuckpt_target_image_in_memory), then the headline again.
        both = variant("both", extra=dict(headline, gpuckpt_target_image_in_memory=True)) \
            if args.also_target_in_memory else None
        again = variant("again", extra=headline) if args.also_target_in_memory else again
        # Another build of the collection (an earlier commit's tree), on warm memory, then ours again: an A/B in one run.
        baseline = variant("baseline", extra=headline, collections=args.baseline_collections) \
            if args.baseline_collections else None
        again = variant("again", extra=headline) if args.baseline_collections else again
        single = variant("single", streams=1)[0] if args.also_single_stream else None
        after_dump = variant("after", during_dump=False)[0] if args.also_after_dump else None
        late = variant("late", restore_early=False)[0] if args.also_late_restore else None
        thp = variant("thp", extra={"gpuckpt_host_huge_pages": True}) if args.also_huge_pages else None
        quiet = variant("quiesced", extra={"gpuckpt_host_huge_pages": True, "quiesce_signal": "SIGUSR1"}) \
            if args.also_quiesce else None
        chain, chain_size, chain_steps = None, None, {"skipped": args.no_chain}
        if not args.no_chain:
            chain, chain_size, chain_steps = plain_chain(hosts, args, base)
            settle("chain")
        fast_chain = None
        if args.also_fast_chain:
            fast_chain, _s, fast_chain_steps = plain_chain(hosts, args, base, fast_cipher=True, tag="fchain")
            settle("fchain")
        disk, link1, link_n = bandwidths(hosts, base, size, args.streams, args.pipelined_only)
        link = max(link1 or 0, link_n)
        floor = stage1 + size / disk + size / link if disk else None
        # Issue 15's floor: nothing forces the image through a disk before the restore.
        pipelined = stage1 + size / link

        def measured(v):
            if v is None:
                return None
            d, b, st1, r = v
            return {"downtime_s": d, "image_bytes": b, "stage1_s": st1, "pipelined_floor_s": st1 + b / link,
                    "ratio_to_pipelined_floor": d / (st1 + b / link), "chain_over_it": chain / d if chain else None,
                    "stages": {"checkpoint": r["ck"]["timings"], "push": r["ck"].get("push"),
                               "image_in_memory": r["ck"].get("image_in_memory"), "restore": r["rs"]["timings"]}}
        out = {"kind": "migration_downtime", "workload": ("torch %g GiB" % args.torch_gib) if args.torch_gib else
               ("cpu 2x%d MiB" % args.mb), "image_bytes": size, "downtime_s": down, "floor_s": floor,
               "stage1_s": stage1, "disk_GBps": disk / 1e9 if disk else None, "link_GBps": link / 1e9,
               "link_1_stream_GBps": link1 / 1e9 if link1 else None,
               "link_%d_streams_GBps" % args.streams: link_n / 1e9, "huge_pages": bool(args.only_huge_pages or args.only_quiesced),
               "quiesced": bool(args.only_quiesced), "source_in_memory": bool(args.source_in_memory),
               "cpusets": hosts.cpusets,
               "images_in_memory": bool(mem_root),
               "streams": args.streams, "ours_single_stream_s": single, "ours_after_dump_s": after_dump,
               "ours_late_restore_s": late, "plain_chain_s": chain,
               "plain_chain_bytes": chain_size, "plain_chain_steps": chain_steps,
               "fast_chain_s": fast_chain, "fast_chain_steps": fast_chain_steps if fast_chain else None,
               "fast_chain_over_ours": fast_chain / down if fast_chain else None,
               "ours_over_floor": down / floor if floor else None, "chain_over_ours": chain / down if chain else None,
               "pipelined_floor_s": pipelined, "ratio_to_pipelined_floor": down / pipelined,
               "ours_huge_pages": measured(thp), "ours_huge_pages_quiesced": measured(quiet),
               "ours_source_in_memory": measured(mem),
               "ours_tmpfs_4k_pages": measured(plain_tmpfs), "ours_tmpfs_huge_always": measured(pmd_tmpfs),
               "ours_again": measured(again), "baseline": measured(baseline),
               "ours_target_in_memory_too": measured(both),
               "baseline_collections": args.baseline_collections or None,
               "shmem_folios_kib_by_variant": folios,
               "ours_stages": {"checkpoint": res["ck"]["timings"], "push": res["ck"].get("push"),
                               "transfer_s": res["sync"].get("seconds"),
                               "transfer_streams": res["sync"].get("streams"),
                               "restore": res["rs"]["timings"]},
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print("RESULT", json.dumps(out))
        if os.environ.get("GPUCKPT_RESULTS"):
            with open(os.environ["GPUCKPT_RESULTS"], "a") as fh:
                fh.write(json.dumps(out) + "\n")
        print("| %s | %.2f GB | pipelined floor %.2f s | %.2f s | %s | %.2fx of it | chain %s |" % (
            out["workload"], size / 1e9, pipelined, down, "%.2f s" % chain if chain else "-", down / pipelined,
            "%.2fx slower" % (chain / down) if chain else "skipped: " + args.no_chain))
        for name, v in (("huge pages", out["ours_huge_pages"]), ("huge pages + quiesce", out["ours_huge_pages_quiesced"]),
                        ("source image in memory", out["ours_source_in_memory"]),
                        ("image tmpfs in 4 KiB pages", out["ours_tmpfs_4k_pages"]),
                        ("image tmpfs huge=always", out["ours_tmpfs_huge_always"]), ("headline again", out["ours_again"]),
                        ("baseline build", out["baseline"]), ("target's image in memory too", out["ours_target_in_memory_too"])):
            if v:
                print("| %s, %s | %.2f GB | pipelined floor %.2f s | %.2f s | %.2fx of it | chain %s |" % (
                    out["workload"], name, v["image_bytes"] / 1e9, v["pipelined_floor_s"], v["downtime_s"],
                    v["ratio_to_pipelined_floor"], "%.2fx slower" % v["chain_over_it"] if v["chain_over_it"] else "-"))
    finally:
        hosts.stop()
        if mem_root:
            subprocess.run(["umount", "-l", mem_root], check=False)
        if not os.environ.get("GPUCKPT_BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
