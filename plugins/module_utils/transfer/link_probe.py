# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A probe of the link: the transfer a migration uses (transfer.send_image), of a scratch image made for
it, timed alone, then removed on both hosts (gpu_image_sync's ``probe_mib``; the drain's throughput)."""
from __future__ import annotations

import os
import time

from ..core import fsutil
from ..core import image
from . import receiver
from ..core.errors import GpuCkptError, InvalidTarget
from .streams import Stream, TransferError, receiver_program
from .transfer import send_image

PROBE_BLOCK = 16 * 2**20
PROBE_FILE = "probe.bin"


def write_probe_image(scratch_dir, mib, probe_id):
    """A complete image in the (new, empty) directory ``scratch_dir``: ``mib`` MiB of random bytes, which
    nothing on the way can compress, in one file, and its manifest."""
    dir_fd = fsutil.open_dir(scratch_dir)
    try:
        fd = fsutil.open_beneath(dir_fd, PROBE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as fh:
        left = mib * 2**20
        while left:
            fh.write(os.urandom(min(PROBE_BLOCK, left)))
            left -= min(PROBE_BLOCK, left)
    return image.write_manifest(scratch_dir, {"id": probe_id, "probe": True, "files": image.checksum_files(scratch_dir)})


def remove_probe(target, dest, probe_id):
    """Have a receiver on the target remove the probe's scratch image at ``dest`` (receiver.remove_probe_dir:
    only the directory a receiver created for this probe). Returns whether it was there."""
    stream = Stream(target, {"dest": dest, "image_id": probe_id, "remove_probe": True}, receiver_program(), 0)
    try:
        removed = bool(stream.wait_ready().get("removed"))
        stream.close(target.io_timeout)
        return removed
    finally:
        stream.kill()


def _clean_probe(scratch_dir, made, target, dest, probe_id, reached):
    """Remove the probe's scratch image here and (once the transfer may have reached it) on the target.
    Returns what could not be removed, in words, or None; never raises (a failure in flight stays the error)."""
    left = []
    try:
        fsutil.remove_tree(scratch_dir, made)
    except OSError as exc:
        left.append("its scratch image %s on this host (%s)" % (scratch_dir, exc))
    for attempt in range(2 if reached else 0):
        try:
            remove_probe(target, dest, probe_id)
            break
        except (OSError, GpuCkptError) as exc:
            if attempt:
                left.append("its scratch image %s on %s may be left (%s)" % (dest, target, exc))
            else:
                time.sleep(1)
    return "the probe could not remove %s" % " and ".join(left) if left else None


def probe(scratch_dir, target, dest, mib, streams=0, bwlimit_kbps=0, retries=3, progress_file=None):
    """Measure the link to ``target`` with the transfer a migration uses: write a scratch image of ``mib``
    MiB in ``scratch_dir`` (new) and send it to ``dest`` (named receiver.PROBE_PREFIX*, new) with
    send_image, timed alone; then remove both copies, also when the transfer failed.
    Returns {"bytes", "seconds", "data_seconds", "setup_seconds", "bytes_s", "streams", "attempts"}. The rate is
    the bytes over the time from the streams' opening to the delivered manifest (``data_seconds``): a migration
    opens its streams before the freeze, and a small probe's ssh connections would otherwise weigh as if they
    were data (a 512 MiB probe over 8 streams read 0.42 GB/s where a migration's push ran above 1.4 GB/s,
    2 x H200, 2026-11-28)."""
    try:
        receiver.check_probe_dir(dest)
    except receiver.Refused as exc:
        raise InvalidTarget("dest %s" % exc, stage="preflight", hint="name the probe's directory on the target "
                            "%s<something> (below its image root)" % receiver.PROBE_PREFIX)
    if int(mib) < 1:
        raise InvalidTarget("a probe sends at least 1 MiB, not %r" % mib, stage="preflight")
    probe_id = "probe-" + os.urandom(8).hex()
    try:
        made = fsutil.create_private_dir(scratch_dir)
    except (fsutil.UnsafePath, OSError) as exc:
        raise InvalidTarget("cannot create the probe's scratch image %s: %s" % (scratch_dir, exc), stage="preflight",
                            hint="give a new directory below root-owned parents that others cannot write")
    reached = False
    try:
        write_probe_image(scratch_dir, int(mib), probe_id)
        reached = True
        report = send_image(scratch_dir, target, dest, receiver={"image_id": probe_id, "probe": True}, streams=streams,
                            bwlimit_kbps=bwlimit_kbps, retries=retries, progress_file=progress_file)
    except BaseException as exc:
        left = _clean_probe(scratch_dir, made, target, dest, probe_id, reached)
        if left and isinstance(exc, GpuCkptError):
            exc.msg = "%s; %s" % (exc.msg, left)
        raise
    left = _clean_probe(scratch_dir, made, target, dest, probe_id, reached)
    if left:
        raise TransferError("the probe sent %d bytes to %s in %.2fs, but %s" % (report["bytes_transferred"], target,
                            report["seconds"], left), retryable=False, stage="transfer")
    sent, seconds = report["bytes_transferred"], report["seconds"]
    data = report.get("data_seconds") or seconds
    return {"bytes": sent, "seconds": seconds, "data_seconds": data, "setup_seconds": round(max(seconds - data, 0), 3),
            "bytes_s": int(round(sent / data)) if data > 0 else None, "streams": report["streams"],
            "attempts": report["attempts"]}
