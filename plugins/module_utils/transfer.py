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

import os
import re
import shlex
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .errors import CommandError, GpuCkptError
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
                                       "-o", "ServerAliveCountMax=%d" % alive]


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
            res = _rsync(cmd, progress, "check that this host reaches %s over ssh and that the target has free disk"
                         % dest_host)
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
