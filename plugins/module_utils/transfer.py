# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Moving an image from this host to another: rsync over the hosts' own ssh.

Why rsync: it is on every fleet node, speaks ssh (no extra port or daemon), keeps partial files, and
resumes them (--append-verify, from the second attempt on) when a transfer is cut; the first attempt
sends whole files with no extra checksum pass, as fast as the link allows; a repair pass (--checksum) re-sends only the
blocks that differ after a checksum mismatch. The manifest's chunked SHA-256 checksums, verified by
gpu_restore on the target before anything is restored, are what prove the copy.
"""
from __future__ import annotations

import re
import shlex
import time

from .errors import CommandError
from .run import find_binary, run

STATE_EXCLUDE = "/.gpuckpt/"  # logs and the restore marker of the source stay there
FAST_CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"


def _stat(text, label):
    m = re.search(r"^%s:\s*([\d,]+)" % re.escape(label), text, re.M)
    return int(m.group(1).replace(",", "")) if m else 0


def push(src, dest_host, dest, user="root", port=22, ssh_args=(), rsync_path=None, repair=False,
         bwlimit=0, io_timeout=120, retries=3, retry_delay=1.0, progress_file=None):
    """rsync ``src``/ to ``user@dest_host:dest``/; retried (and resumed) up to ``retries`` times."""
    rsync = find_binary("rsync", what="install rsync on both hosts")
    # The user's ssh arguments first: for ssh, the first value given for an option wins. AES-GCM is
    # preferred over OpenSSH's default chacha20-poly1305: on the CI kind of machine (AES-NI) one ssh
    # stream moved 1.06 GB/s with aes128-gcm against 0.69 GB/s with chacha20 (see docs/benchmarks).
    ssh = ["ssh"] + list(ssh_args) + ["-p", str(port), "-o", "BatchMode=yes", "-o", "Compression=no",
                                      "-o", "Ciphers=" + FAST_CIPHERS]
    cmd = [rsync, "-a", "--mkpath", "--stats", "--exclude", STATE_EXCLUDE, "--timeout", str(io_timeout),
           "-e", " ".join(shlex.quote(a) for a in ssh)]
    if repair:
        cmd += ["--checksum", "--inplace", "--no-whole-file"]
    else:
        cmd += ["--partial", "--whole-file"]
    if bwlimit:
        cmd += ["--bwlimit", str(bwlimit)]
    if rsync_path:
        cmd += ["--rsync-path", rsync_path]
    if progress_file:
        cmd += ["--info=progress2", "--log-file", progress_file]
    cmd += [src.rstrip("/") + "/", "%s@%s:%s/" % (user, dest_host, dest.rstrip("/"))]
    attempts, moved, start, last = 0, 0, time.monotonic(), None
    while attempts <= retries:
        attempts += 1
        try:
            res = run(cmd, stage="transfer", check=True,
                      hint="check that this host reaches %s over ssh and that the target has free disk" % dest_host)
            moved += _stat(res.stdout, "Total transferred file size")
            return {"attempts": attempts, "bytes_transferred": moved, "seconds": round(time.monotonic() - start, 3),
                    "bytes_total": _stat(res.stdout, "Total file size"), "cmd": cmd}
        except CommandError as exc:
            last = exc
            text = (exc.stderr or "") + (exc.stdout or "")
            if "No space left on device" in text:
                exc.msg = "transfer to %s:%s failed: the target's disk is full" % (dest_host, dest)
                exc.hint = "free space on the target (the image needs what the manifest's sizes say)"
                raise exc
            if attempts <= retries:
                time.sleep(retry_delay)
                # Resume what the cut transfer left: append to the partial files and check each whole
                # file's checksum (rsync's own) once it is complete.
                cmd = [c for c in cmd if c != "--whole-file"]
                if "--append-verify" not in cmd and not repair:
                    cmd.insert(cmd.index("--partial") + 1, "--append-verify")
    last.msg = "transfer to %s:%s failed after %d attempts: %s" % (dest_host, dest, attempts, last.msg)
    raise last
