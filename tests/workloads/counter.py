"""A CPU workload for the CI tests and the demo: a parent and N children that each hold a known
memory pattern and count, once per tick, into <dir>/<role>.state (JSON: count, digest, pid), and
append each count to <dir>/<role>.counts (a side effect that survives a rewind: a copy thrown away
after it ran, and an older copy resumed, write a count twice there).

Each process checks its memory pattern every tick; a changed pattern writes <role>.corrupt.
With --fakecuda LIB each process registers with the libcuda TEST DOUBLE and calls its blocking
sync once per tick, so a lock freezes the counting exactly as a real CUDA call would block.

With --serve PORT the parent is an inference server in miniature: it listens on 127.0.0.1:PORT and
answers each line a client sends, on connections it keeps open, with "<count> <digest> <pid>".

With --print-counts each process also writes "<role> <count>" to its stdout once per tick (a container's
log: `docker logs` shows where it counts).

  counter.py --dir D --daemon   # double-forks (reparented to init, no zombie), prints the root pid
"""
import argparse
import ctypes
import hashlib
import json
import os
import random
import sys
import time


def write_atomic(path, text):
    # A random part, not the pid alone: two copies of a job (a failover's restored copy and the stale one behind a
    # partition) run with the same pids in their own namespaces and write into one directory (the loopback hosts
    # share the filesystem); with pid-named temporaries one copy renamed the other's away and died of it.
    tmp = "%s.tmp.%d.%s" % (path, os.getpid(), os.urandom(4).hex())
    with open(tmp, "w") as fh:
        fh.write(text)
    os.rename(tmp, path)


def serve(server, clients, answer):
    """Accept who connects, answer every request line; keep the connections open."""
    import select
    try:
        while True:
            c, _addr = server.accept()
            c.setblocking(False)
            clients.append(c)
    except BlockingIOError:
        pass
    readable, _w, _x = select.select(clients, [], [], 0) if clients else ([], [], [])
    for c in readable:
        try:
            data = c.recv(4096)
        except OSError:
            data = b""
        if not data:
            clients.remove(c)
            c.close()
            continue
        for _line in data.splitlines():
            c.sendall(answer)
    return clients


def run(role, args):
    cuda = None
    if args.fakecuda:
        cuda = ctypes.CDLL(args.fakecuda)
        cuda.fakeCudaAttach()
    listener = None
    if args.listen and role == "parent":  # a bound name, as CUDA and NCCL hold some
        import socket
        listener = socket.socket(socket.AF_UNIX)
        listener.bind("\0" + args.listen)
        listener.listen(8)
    server, clients = None, []
    if args.serve and role == "parent":
        import socket
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", args.serve))
        server.listen(8)
        server.setblocking(False)
    rng = random.Random(role)
    buf = bytearray()
    for unused in range(args.mb):  # 1 MiB at a time: randbytes() of more than 256 MiB overflows
        buf += rng.randbytes(2**20)
    digest0 = hashlib.sha256(buf).hexdigest()
    # A cache the process could do without (as a caching allocator's free blocks): given back when
    # gpuckpt.fleet asks before a checkpoint (--quiesce: tools/gpuckpt_quiesce.py's handler).
    cache = [bytearray(b"\xa5") * 2**20 for unused in range(args.cache_mb)]
    if args.quiesce:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
        import gpuckpt_quiesce

        def release():
            n = sum(len(b) for b in cache)
            del cache[:]
            gpuckpt_quiesce.release_pytorch_cache()
            return {"released_bytes": n}
        gpuckpt_quiesce.install(release=release)
    write_atomic(os.path.join(args.dir, role + ".digest"), digest0)
    count, digest, digest_count = 0, digest0, 0
    # The whole pattern is hashed again every verify_every seconds, or ten times as long as a hash takes: hashed at
    # every count, the suite's workloads spent a fifth of the test machine's CPU on it. A freeze longer than that
    # (a checkpoint, a move, a restore) makes the first count after it check the pattern: digest_count says when.
    last_verify, verify_every = time.monotonic(), args.verify_every
    counts = os.open(os.path.join(args.dir, role + ".counts"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        if cuda is not None and cuda.fakeCudaSync() != 0:
            write_atomic(os.path.join(args.dir, role + ".corrupt"), "fake CUDA sync failed\n")
        count += 1
        started = time.monotonic()
        if started - last_verify >= verify_every:
            digest, digest_count = hashlib.sha256(buf).hexdigest(), count
            last_verify = time.monotonic()
            verify_every = max(args.verify_every, 10 * (last_verify - started))
            if digest != digest0:
                write_atomic(os.path.join(args.dir, role + ".corrupt"), "pattern changed at count %d\n" % count)
        write_atomic(os.path.join(args.dir, role + ".state"),
                     json.dumps({"count": count, "digest": digest, "digest_count": digest_count, "pid": os.getpid(),
                                 "t": time.time()}))
        os.write(counts, b"%d\n" % count)
        if args.print_counts:
            os.write(1, b"%s %d\n" % (role.encode(), count))  # unbuffered: the log shows each count as it is made
        if server is not None:
            clients = serve(server, clients, b"%d %s %d\n" % (count, digest.encode(), os.getpid()))
        time.sleep(args.interval)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--children", type=int, default=1)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--verify-every", type=float, default=0.5,
                    help="seconds between two checks of the whole memory pattern (at least ten hashes' time)")
    ap.add_argument("--cache-mb", type=int, default=0, help="MiB of releasable cache in each process")
    ap.add_argument("--quiesce", action="store_true", help="release the cache on SIGUSR1 (gpuckpt_quiesce)")
    ap.add_argument("--fakecuda")
    ap.add_argument("--listen", help="the parent listens on this abstract unix socket name")
    ap.add_argument("--serve", type=int, help="the parent answers requests on this TCP port of 127.0.0.1")
    ap.add_argument("--print-counts", action="store_true", help="also write '<role> <count>' to stdout each tick")
    ap.add_argument("--daemon", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.daemon:
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            pid = os.read(r, 32).decode().strip()
            print(pid, flush=True)
            os._exit(0 if pid else 1)
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(os.path.join(args.dir, "workload.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
    for i in range(args.children):
        if os.fork() == 0:
            run("child%d" % (i + 1), args)
    run("parent", args)


if __name__ == "__main__":
    sys.exit(main())
