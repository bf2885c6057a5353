"""A CPU stand-in of a 2-rank NCCL job under a launcher, for the libcuda TEST DOUBLE (no GPU): the root is the
"launcher" (torchrun's agent) with its rendezvous store, a TCP listener on 127.0.0.1; each rank is a child that
registers with the double as a CUDA process, maps the job's NCCL shared memory (/dev/shm/nccl-<tag>, as NCCL's
shared-memory transport does), keeps a TCP connection to the store, and every tick: calls the double's blocking
sync (a lock freezes it), adds one to its count in the shared segment and in <dir>/rank<N>.count (one line per
count), and asks the store for the other rank's count over TCP. Each rank's environment is the launcher's
(RANK and WORLD_SIZE added), so NCCL_* settings given to the launcher reach the ranks as torchrun passes them.

With --hello each rank first says hello to the store on a connection of its own, which the store closes first (as
a TCPStore server ends a client's short connection): that leaves a TIME_WAIT socket on the store's listening port
for the kernel's 60 s, which a restore in the same network namespace must wait out to bind the port again.

  nccl_ranks.py --dir D --fakecuda LIB --tag T [--daemon] [--hello]     prints the launcher's pid
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time

WORLD = 2
HELLO = b"\xff"


def serve(lst, fd):
    """The store: answers each rank's ask (a byte, its rank) with the other rank's count, read from the segment
    (read, not mapped: a launcher maps no NCCL memory)."""
    def one(conn):
        while True:
            b = conn.recv(1)
            if not b:
                return
            if b == HELLO:  # answered, then closed from this side first (the store's port keeps a TIME_WAIT)
                conn.sendall(b"ok")
                conn.close()
                return
            other = 1 - b[0]
            conn.sendall(os.pread(fd, 8, 8 * other))
    while True:
        conn, unused = lst.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def rank(args, r, port):
    lib = ctypes.CDLL(args.fakecuda)
    lib.fakeCudaAttach()
    fd = os.open("/dev/shm/nccl-%s" % args.tag, os.O_RDWR)
    shm = mmap.mmap(fd, 4096)
    if args.hello:
        with socket.create_connection(("127.0.0.1", port)) as hello:
            hello.sendall(HELLO)
            while hello.recv(8):  # its answer, then the store's close
                pass
    store = socket.create_connection(("127.0.0.1", port))
    path = os.path.join(args.dir, "rank%d.count" % r)
    count = struct.unpack_from("<Q", shm, 8 * r)[0]
    while True:
        lib.fakeCudaSync()
        count += 1
        struct.pack_into("<Q", shm, 8 * r, count)
        with open(path, "a") as fh:
            fh.write("%d\n" % count)
        store.sendall(bytes([r]))
        store.recv(8)
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--fakecuda", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--daemon", action="store_true")
    ap.add_argument("--hello", action="store_true", help="each rank's hello closed by the store first (TIME_WAIT)")
    ap.add_argument("--rank", type=int, help="(the launcher starts each rank so)")
    ap.add_argument("--port", type=int, help="(the launcher starts each rank so)")
    args = ap.parse_args()
    if args.rank is not None:
        return rank(args, args.rank, args.port)
    os.makedirs(args.dir, exist_ok=True)
    if args.daemon and os.fork():  # the launcher in a session of its own (CRIU dumps a session with its leader)
        return
    if args.daemon:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    seg = "/dev/shm/nccl-%s" % args.tag
    fd = os.open(seg, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(WORLD)
    port = lst.getsockname()[1]
    with open(os.path.join(args.dir, "launcher.pid"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    for r in range(WORLD):  # (exec'd: each rank's /proc/<pid>/environ shows its RANK and WORLD_SIZE)
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r))
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--fakecuda", args.fakecuda,
                          "--tag", args.tag, "--rank", str(r), "--port", str(port)] + (["--hello"] if args.hello else []),
                         env=env, close_fds=True)
    serve(lst, fd)


if __name__ == "__main__":
    sys.exit(main())
