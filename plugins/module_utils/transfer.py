# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Moving an image from this host to another over the hosts' own ssh: no extra port or daemon.

Two ways, used together:
- Large files (the pages of GPU memory and RAM) go as byte ranges over several ssh streams at once.
  One ssh stream is bound by one core's cipher (0.45 GB/s with chacha20 on the GPU machine, about
  1 GB/s with AES-GCM), far below a datacenter link or a local disk; several streams add up. Each
  range is written in place on the target by ``dd`` (coreutils, on every node); a range that fails is
  sent again whole.
- Everything else goes through rsync, which keeps partial files and resumes them (--append-verify,
  from the second attempt on); its repair pass (--checksum) re-sends only the blocks that differ
  after a checksum mismatch.
The manifest's chunked SHA-256 checksums, verified by gpu_restore on the target before anything is
restored, are what prove the copy; ssh's MAC protects each stream in transit.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .errors import CommandError, GpuCkptError
from .image import CHUNK, MANIFEST
from .progress import BytesProgress
from .run import Result, find_binary, run

STATE_EXCLUDE = "/.gpuckpt/"  # logs and the restore marker of the source stay there
FAST_CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"


def _stat(text, label):
    m = re.search(r"^%s:\s*([\d,]+)" % re.escape(label), text, re.M)
    return int(m.group(1).replace(",", "")) if m else 0


def auto_streams(cpus=None):
    """A quarter of this host's cores, 1 to 8. Each stream costs a core for its cipher on each end
    (and on one machine both ends share its cores): on the 2-core CI kind of machine 4 streams were
    slower than 1 (docs/benchmarks)."""
    return min(8, max(1, (cpus or os.cpu_count() or 1) // 4))


STREAM_MIN_BYTES = 256 * 2**20  # smaller files are not worth a stream of their own
PIECE_ALIGN = 2**20


Progress = BytesProgress  # the name the streams and tests use


def ssh_command(ssh_args=(), port=22, io_timeout=120):
    # The user's ssh arguments first: for ssh, the first value given for an option wins. AES-GCM is
    # preferred over OpenSSH's default chacha20-poly1305: on the CI kind of machine (AES-NI) one ssh
    # stream moved 1.06 GB/s with aes128-gcm against 0.69 GB/s with chacha20 (see docs/benchmarks).
    alive = max(1, int(io_timeout) // 15)
    return ["ssh"] + list(ssh_args) + ["-p", str(port), "-o", "BatchMode=yes", "-o", "Compression=no",
                                       "-o", "Ciphers=" + FAST_CIPHERS, "-o", "ServerAliveInterval=15",
                                       "-o", "ServerAliveCountMax=%d" % alive,
                                       # a target that does not answer fails fast (the source is frozen)
                                       "-o", "ConnectTimeout=%d" % min(30, max(5, int(io_timeout)))]


def _pieces(files, streams):
    """Split (rel, size) files into about ``streams`` ranges each, aligned to PIECE_ALIGN."""
    out = []
    for rel, size in files:
        step = -(-size // streams)
        step = -(-step // PIECE_ALIGN) * PIECE_ALIGN
        for off in range(0, size, step):
            out.append((rel, off, min(step, size - off)))
    # Largest first: the pool then ends its streams at about the same time.
    return sorted(out, key=lambda p: -p[2])


def _send_piece(ssh, target, src, dest, piece, progress, io_timeout):
    rel, off, length = piece
    remote = ("mkdir -p %s && exec dd of=%s bs=4M seek=%d oflag=seek_bytes conv=notrunc status=none"
              % (shlex.quote(os.path.dirname(os.path.join(dest, rel))), shlex.quote(os.path.join(dest, rel)), off))
    cmd = ssh + [target, remote]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sent, err = 0, None
    try:
        with open(os.path.join(src, rel), "rb") as fh:
            fd, out = fh.fileno(), proc.stdin.fileno()
            while sent < length:
                n = os.sendfile(out, fd, off + sent, min(8 * 2**20, length - sent))
                if n <= 0:
                    raise OSError("short read of %s at %d" % (rel, off + sent))
                sent += n
                progress.add(n)
    except OSError as exc:  # the stream broke (ssh died); its stderr says why
        err = exc
    try:
        proc.stdin.close()
    except OSError:
        pass
    proc.stdin = None  # closed: end of the range; communicate() must not flush it
    try:
        stdout, stderr = proc.communicate(timeout=io_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0 or err is not None or sent != length:
        progress.add(-sent)
        why = ": %s" % err if err else ""
        raise CommandError("sending %s bytes %d-%d to %s failed (rc=%s)%s"
                           % (rel, off, off + length - 1, target, proc.returncode, why),
                           stage="transfer", cmd=cmd, rc=proc.returncode,
                           stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"))
    return length


def _remote(ssh, target, script, io_timeout):
    return run(ssh + [target, script], stage="transfer", check=True, timeout=io_timeout,
               hint="check that this host reaches %s over ssh" % target)


def stream_files(src, dest_host, dest, files, user="root", port=22, ssh_args=(), streams=4, io_timeout=120,
                 retries=3, retry_delay=1.0, progress=None):
    """Send the large ``files`` (relative paths) as byte ranges over ``streams`` parallel ssh streams.
    Files the target already holds with the same size and mtime are skipped. Returns bytes sent."""
    ssh = ssh_command(ssh_args, port, io_timeout)
    target = "%s@%s" % (user, dest_host)
    local = {rel: os.stat(os.path.join(src, rel)) for rel in files}
    # The mtime is set on the target once a file is whole; the same size and mtime there means a
    # finished earlier transfer (a re-run), so nothing is sent again.
    probe = "cd %s 2>/dev/null && stat -c '%%s %%Y %%n' -- %s 2>/dev/null; true" % (
        shlex.quote(dest), " ".join(shlex.quote(r) for r in files))
    have = {}
    for line in _remote(ssh, target, probe, io_timeout).stdout.splitlines():
        size, mtime, name = line.split(" ", 2)
        have[name] = (int(size), int(mtime))
    todo = [(rel, st.st_size) for rel, st in local.items() if have.get(rel) != (st.st_size, int(st.st_mtime))]
    if not todo:
        return 0
    pending = _pieces(todo, streams)
    sent = 0
    for attempt in range(retries + 1):
        failed, errors = [], []
        with ThreadPoolExecutor(max_workers=streams) as pool:
            futures = [(p, pool.submit(_send_piece, ssh, target, src, dest, p, progress, io_timeout))
                       for p in pending]
            for piece, fut in futures:
                try:
                    sent += fut.result()
                except GpuCkptError as exc:
                    failed.append(piece)
                    errors.append(exc)
        if not failed:
            break
        if any("No space left on device" in (e.stderr or "") for e in errors):
            raise _disk_full(errors[0], dest_host, dest)
        if attempt == retries:
            exc = errors[0]
            exc.msg = "transfer to %s:%s failed after %d attempts: %s" % (dest_host, dest, attempt + 1, exc.msg)
            raise exc
        time.sleep(retry_delay)
        pending = failed
    # Whole now: cut each file to its exact size and give it the source's mtime (the re-run probe).
    fix = " && ".join("truncate -s %d %s && touch -m -d @%d %s" % (
        local[rel].st_size, shlex.quote(rel), int(local[rel].st_mtime), shlex.quote(rel)) for rel, _s in todo)
    _remote(ssh, target, "cd %s && %s" % (shlex.quote(dest), fix), io_timeout)
    return sent


_PROGRESS2 = re.compile(r"^\s*([\d,]+)\s+\d+%")


def _rsync(cmd, progress, hint):
    """Run rsync with --info=progress2 and feed its running byte count to ``progress`` (rsync's own
    count of this run, added to what the streams sent before). Raises CommandError like run()."""
    cmd = list(cmd[:1]) + ["--info=progress2"] + list(cmd[1:])
    base = progress.done
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.daemon = True
    reader.start()
    out, pending = [], b""
    while True:
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        out.append(chunk)
        pending += chunk
        parts = re.split(rb"[\r\n]", pending)
        pending = parts.pop()
        for part in reversed(parts):
            m = _PROGRESS2.match(part.decode("utf-8", "replace"))
            if m:
                progress.set(base + int(m.group(1).replace(",", "")))
                break
    proc.wait()
    reader.join()
    stdout = b"".join(out).decode("utf-8", "replace")
    stderr = (err[0] if err else b"").decode("utf-8", "replace")
    if proc.returncode != 0:
        raise CommandError("rsync exited with rc=%d" % proc.returncode, stage="transfer", cmd=cmd,
                           rc=proc.returncode, stdout=stdout[-4000:], stderr=stderr[-4000:], hint=hint)
    progress.set(base + _stat(stdout, "Total transferred file size"), force=True)
    return Result(cmd, proc.returncode, stdout, stderr, 0.0)


def _disk_full(exc, dest_host, dest):
    exc.msg = "transfer to %s:%s failed: the target's disk is full" % (dest_host, dest)
    exc.hint = "free space on the target (the image needs what the manifest's sizes say)"
    return exc


def push(src, dest_host, dest, user="root", port=22, ssh_args=(), rsync_path=None, repair=False,
         bwlimit=0, io_timeout=120, retries=3, retry_delay=1.0, progress_file=None, streams=0,
         stream_min_bytes=STREAM_MIN_BYTES):
    """Send ``src``/ to ``user@dest_host:dest``/: large files over ``streams`` parallel ssh streams,
    the rest (and everything, in repair mode or with a bandwidth limit) through rsync; retried (and
    resumed) up to ``retries`` times."""
    rsync = find_binary("rsync", what="install rsync on both hosts")
    start = time.monotonic()
    streams = streams if streams and streams > 0 else auto_streams()
    sizes = {}
    for root, dirs, names in os.walk(src):
        if os.path.relpath(root, src) == ".":
            dirs[:] = [d for d in dirs if "/%s/" % d != STATE_EXCLUDE]
        for n in names:
            rel = os.path.normpath(os.path.relpath(os.path.join(root, n), src))
            sizes[rel] = os.path.getsize(os.path.join(src, rel))
    progress = Progress(sum(sizes.values()), progress_file)
    progress.start()
    try:
        return _push(src, dest_host, dest, user, port, ssh_args, rsync_path, repair, bwlimit, io_timeout, retries,
                     retry_delay, streams, stream_min_bytes, rsync, start, sizes, progress)
    finally:
        progress.close()


def _push(src, dest_host, dest, user, port, ssh_args, rsync_path, repair, bwlimit, io_timeout, retries,
          retry_delay, streams, stream_min_bytes, rsync, start, sizes, progress):
    big = []
    if streams > 1 and not repair and not bwlimit:
        big = sorted(rel for rel, size in sizes.items() if size >= stream_min_bytes)
    streamed = 0
    if big:
        streamed = stream_files(src, dest_host, dest, big, user=user, port=port, ssh_args=ssh_args,
                                streams=streams, io_timeout=io_timeout, retries=retries,
                                retry_delay=retry_delay, progress=progress)
    ssh = ssh_command(ssh_args, port, io_timeout)
    cmd = [rsync, "-a", "--mkpath", "--stats", "--exclude", STATE_EXCLUDE, "--timeout", str(io_timeout),
           "-e", " ".join(shlex.quote(a) for a in ssh)]
    for rel in big:  # already there, whole
        cmd += ["--exclude", "/" + rel]
    # The manifest goes last, alone, once everything else is there: its presence on the target means
    # the image is complete (a restore that waits for the image begins when it lands).
    cmd += ["--exclude", "/" + MANIFEST]
    only_manifest = ["--include", "/" + MANIFEST, "--exclude", "*"]
    if repair:
        cmd += ["--checksum", "--inplace", "--no-whole-file"]
    else:
        cmd += ["--partial", "--whole-file"]
    if bwlimit:
        cmd += ["--bwlimit", str(bwlimit)]
    if rsync_path:
        cmd += ["--rsync-path", rsync_path]
    cmd += [src.rstrip("/") + "/", "%s@%s:%s/" % (user, dest_host, dest.rstrip("/"))]
    attempts, moved, last = 0, streamed, None
    while attempts <= retries:
        attempts += 1
        try:
            hint = "check that this host reaches %s over ssh and that the target has free disk" % dest_host
            res = _rsync(cmd, progress, hint)
            moved += _stat(res.stdout, "Total transferred file size")
            i = cmd.index("/" + MANIFEST)
            res = _rsync(cmd[:i - 1] + cmd[i + 1:-2] + only_manifest + cmd[-2:], progress, hint)
            moved += _stat(res.stdout, "Total transferred file size")
            return {"attempts": attempts, "bytes_transferred": moved, "seconds": round(time.monotonic() - start, 3),
                    "bytes_total": sum(sizes.values()), "streams": streams if big else 1,
                    "bytes_streamed": streamed, "cmd": cmd}
        except CommandError as exc:
            last = exc
            text = (exc.stderr or "") + (exc.stdout or "")
            if "No space left on device" in text:
                raise _disk_full(exc, dest_host, dest)
            if attempts <= retries:
                time.sleep(retry_delay)
                # Resume what the cut transfer left: append to the partial files and check each whole
                # file's checksum (rsync's own) once it is complete.
                cmd = [c for c in cmd if c != "--whole-file"]
                if "--append-verify" not in cmd and not repair:
                    cmd.insert(cmd.index("--partial") + 1, "--append-verify")
    last.msg = "transfer to %s:%s failed after %d attempts: %s" % (dest_host, dest, attempts, last.msg)
    raise last


# The receiving end of a push: run on the target as ``python3 -c RECEIVER <dest>`` at the end of each
# ssh stream. It reads framed operations from stdin: a JSON header line, then for "data" that many
# bytes, written in place (pwrite) into the file under dest. A stream that ends without its "end"
# mark exits non-zero, so a cut stream is never taken for a finished one. It keeps the SHA-256 of
# every range it wrote (a receipt in dest/.gpuckpt/), and the exact size and mtime it gave each file:
# image.verify() takes a chunk's hash from the receipt when its file is unchanged since, instead of
# reading the whole image again.
RECEIVER = r'''
import hashlib, json, os, sys
dest = sys.argv[1]
inp = sys.stdin.buffer
fds, receipt = {}, {}
def path(rel):
    if rel.startswith("/") or ".." in rel.split("/"):
        sys.exit("refusing path %r" % rel)
    return os.path.join(dest, rel)
def fd(rel):
    if rel not in fds:
        p = path(rel)
        os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
        fds[rel] = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    return fds[rel]
def save(name, data):
    d = os.path.join(dest, ".gpuckpt")
    os.makedirs(d, mode=0o700, exist_ok=True)
    with open(os.path.join(d, name + ".tmp"), "w") as fh:
        json.dump(data, fh)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))
while True:
    line = inp.readline()
    if not line:
        sys.exit("the stream ended before its end mark")
    m = json.loads(line)
    if m["op"] == "data":
        f, off, n = fd(m["path"]), m["off"], m["len"]
        h, start, total = hashlib.sha256(), off, n
        while n:
            b = inp.read(min(n, 4 << 20))
            if not b:
                sys.exit("the stream was cut in %s at byte %d" % (m["path"], off))
            os.pwrite(f, b, off)
            h.update(b)
            off += len(b)
            n -= len(b)
        receipt.setdefault(m["path"], []).append([start, total, h.hexdigest()])
    elif m["op"] == "fix":
        for rel, size, mtime_ns in m["files"]:
            os.truncate(path(rel), size)
            os.utime(path(rel), ns=(mtime_ns, mtime_ns))
        save("push-fixed.json", {rel: [size, mtime_ns] for rel, size, mtime_ns in m["files"]})
    elif m["op"] == "rename":
        save("push-receipt-%d.json" % os.getpid(), receipt)  # before the manifest lands: a restore may begin at once
        os.rename(path(m["src"]), path(m["dst"]))
    elif m["op"] == "end":
        break
for f in fds.values():
    os.close(f)
save("push-receipt-%d.json" % os.getpid(), receipt)
'''

GROWING = re.compile(r"^pages-\d+\.img$")  # CRIU appends page data to these while it dumps
PUSH_PIECE = CHUNK  # one piece is one checksum chunk of the manifest, so a receipt's hashes are its chunks'


class Pusher(object):
    """Send an image to another host WHILE it is being written, over ``streams`` persistent ssh streams.

    start() opens the streams before anything is frozen (their handshakes cost no downtime).
    watch(image_dir) then sends each completed 64 MiB piece of the page files (``pages-*.img``,
    which CRIU only appends to) during the dump; finish(image_dir) sends everything else once the
    image is complete (the rest of the page files and every other file), gives each file its exact
    size and mtime, and writes the manifest last (as a rename), so the target holds a complete image
    or none. The manifest's checksums, taken from the finished files on the source and verified on
    the target before any restore, catch any difference. Any failure leaves the image on the source
    intact and is reported, not raised: a later gpu_image_sync sends what is missing."""

    def __init__(self, dest_host, dest, user="root", port=22, ssh_args=(), streams=0, python="python3",
                 io_timeout=120, piece=PUSH_PIECE, manifest="manifest.json", exclude_dir=".gpuckpt"):
        self.target = "%s@%s" % (user, dest_host)
        self.dest_host, self.dest = dest_host, dest
        self.ssh = ssh_command(ssh_args, port, io_timeout)
        self.streams = streams if streams and streams > 0 else auto_streams()
        self.python, self.io_timeout, self.piece = python, io_timeout, piece
        self.manifest, self.exclude_dir = manifest, exclude_dir
        self.procs, self.threads, self.errors = [], [], []
        self.queue = None
        self.sent_upto = {}  # rel -> bytes queued from the start of the file
        self.bytes_sent = 0
        self.bytes_before_complete = 0
        self._final = None
        self._lock = threading.Lock()
        self._watching = None
        self._stop_watch = threading.Event()
        self.started = None

    def _cmd(self):
        remote = "exec %s -c %s %s" % (shlex.quote(self.python), shlex.quote(RECEIVER), shlex.quote(self.dest))
        return self.ssh + [self.target, remote]

    def start(self):
        import queue
        import tempfile
        self.queue = queue.Queue()
        self.started = time.monotonic()
        for i in range(self.streams):
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen(self._cmd(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
            proc.err_file = err
            self.procs.append(proc)
            t = threading.Thread(target=self._sender, args=(proc,), name="gpuckpt-push-%d" % i)
            t.daemon = True
            t.start()
            self.threads.append(t)
        return self

    def _send(self, proc, header, src=None, off=0, length=0):
        out = proc.stdin.fileno()
        data = (json.dumps(header) + "\n").encode()
        while data:
            data = data[os.write(out, data):]
        if src is None:
            return
        with open(src, "rb") as fh:
            done = 0
            while done < length:
                n = os.sendfile(out, fh.fileno(), off + done, min(8 * 2**20, length - done))
                if n <= 0:
                    raise OSError("%s is shorter than expected at byte %d" % (src, off + done))
                done += n

    def _sender(self, proc):
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.errors:
                    continue  # a stream failed: the push is lost anyway, drain the queue
                root, rel, off, length = item
                self._send(proc, {"op": "data", "path": rel, "off": off, "len": length},
                           os.path.join(root, rel), off, length)
                with self._lock:
                    self.bytes_sent += length
            except (OSError, ValueError) as exc:
                self.errors.append("stream to %s failed: %s" % (self.target, exc))
            finally:
                self.queue.task_done()

    def _files(self, image_dir):
        out = {}
        for root, dirs, names in os.walk(image_dir):
            if os.path.relpath(root, image_dir) == ".":
                dirs[:] = [d for d in dirs if d != self.exclude_dir]
            for n in names:
                rel = os.path.normpath(os.path.relpath(os.path.join(root, n), image_dir))
                if rel != self.manifest and not rel.startswith(self.manifest + "."):
                    out[rel] = os.stat(os.path.join(root, n))
        return out

    def _queue_ranges(self, image_dir, rel, upto, during):
        start = self.sent_upto.get(rel, 0)
        while start < upto:
            n = min(self.piece, upto - start)
            if during and n < self.piece:
                break  # only whole pieces while the file still grows
            self.queue.put((image_dir, rel, start, n))
            start += n
        self.sent_upto[rel] = start

    def watch(self, image_dir):
        """Send the completed pieces of the growing page files until finish() or abort()."""
        def loop():
            while not self._stop_watch.wait(0.02):
                try:
                    for rel, st in self._files(image_dir).items():
                        if GROWING.match(os.path.basename(rel)):
                            self._queue_ranges(image_dir, rel, st.st_size - st.st_size % self.piece, True)
                except OSError:
                    pass  # a file went away (a failed dump is being discarded)
        self._watching = threading.Thread(target=loop, name="gpuckpt-push-watch")
        self._watching.daemon = True
        self._watching.start()

    def _stop_watching(self):
        self._stop_watch.set()
        if self._watching is not None:
            self._watching.join()

    def _wait(self, proc):
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            rc = proc.wait(timeout=self.io_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if rc != 0:
            proc.err_file.seek(0)
            err = proc.err_file.read().decode("utf-8", "replace").strip()
            self.errors.append("stream to %s ended with rc=%s: %s" % (self.target, rc, err[-2000:]))

    def complete(self, image_dir):
        """The image's files are final (the dump ended): queue all that is not sent yet, largest
        first, while the engine hashes them and writes the manifest."""
        if self._final is not None:
            return
        self._stop_watching()
        self.bytes_before_complete = self.bytes_sent
        try:
            self._final = self._files(image_dir)
            for rel, st in sorted(self._final.items(), key=lambda kv: -kv[1].st_size):
                self._queue_ranges(image_dir, rel, st.st_size, False)
        except OSError as exc:  # never fail the checkpoint for its push
            self._final = {}
            self.errors.append("push to %s failed: %s" % (self.target, exc))

    def finish(self, image_dir):
        """Send the rest of the complete image, then its manifest. Returns the push's report."""
        report = {"pushed": False, "dest_host": self.dest_host, "dest": self.dest, "streams": self.streams}
        try:
            self.complete(image_dir)
            files = self._final
            for _p in self.procs:
                self.queue.put(None)
            self.queue.join()
            for t in self.threads:
                t.join()
            first, rest = self.procs[0], self.procs[1:]
            for proc in rest:  # every other stream has written all it carried
                if not self.errors:
                    self._send(proc, {"op": "end"})
                self._wait(proc)
            if not self.errors:
                mpath = os.path.join(image_dir, self.manifest)
                mst = os.stat(mpath)
                part = self.manifest + ".part"
                self._send(first, {"op": "data", "path": part, "off": 0, "len": mst.st_size}, mpath, 0, mst.st_size)
                fix = [[rel, st.st_size, st.st_mtime_ns] for rel, st in sorted(files.items())]
                fix.append([part, mst.st_size, mst.st_mtime_ns])
                self._send(first, {"op": "fix", "files": fix})
                self._send(first, {"op": "rename", "src": part, "dst": self.manifest})
                self._send(first, {"op": "end"})
                self.bytes_sent += mst.st_size
            self._wait(first)
        except (OSError, ValueError) as exc:
            self.errors.append("push to %s failed: %s" % (self.target, exc))
            self.abort()
        report.update(pushed=not self.errors, bytes=self.bytes_sent,
                      bytes_sent_during_dump=self.bytes_before_complete,
                      seconds=round(time.monotonic() - self.started, 3))
        if self.errors:
            report["error"] = self.errors[0]
            if any("No space left on device" in e for e in self.errors):
                report["error"] = "the target's disk is full (%s)" % self.errors[0]
        return report

    def abort(self):
        """Stop at once (the checkpoint failed): kill the streams; the receivers exit without a manifest."""
        self._stop_watching()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            if self.queue is not None:
                self.queue.put(None)  # let its sender thread end
