# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Let gpuckpt.fleet shrink your job's checkpoint: give back cached memory when it asks.

A PyTorch job's caching allocator keeps the GPU memory of freed tensors for reuse; a checkpoint
copies all of it (GPU to host RAM, to disk, over the network, back). Ask the job to release it first:

    import gpuckpt_quiesce
    gpuckpt_quiesce.install()          # on SIGUSR1: torch.cuda.empty_cache(), then acknowledge

and checkpoint with ``quiesce_signal: SIGUSR1`` (gpu_checkpoint), or ``-e quiesce_signal=SIGUSR1``
(migrate.yml, checkpoint.yml). Your job runs on meanwhile; the allocator grows again on demand.

``install(release=fn)`` runs your own function instead (drop a KV cache's free pages, close a data
loader's workers' buffers...); it may return a dict, which is added to the acknowledgement. The
handler runs in the main thread between two Python bytecodes, as every Python signal handler does:
a job blocked in a long call answers when that call returns (the checkpoint waits up to its
``quiesce_timeout``, then goes on without the release).

The acknowledgement is /tmp/gpuckpt-quiesced.<pid> (the pid as this process sees it), written
atomically; gpuckpt.fleet reads it through /proc/<pid>/root. One file: copy it next to your script
or onto PYTHONPATH. Standard library only; PyTorch is used when the job has imported it.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import time

ACK_DIR = "/tmp"
_state = {"seq": 0}


def _torch_reserved():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))


def release_pytorch_cache():
    """Free what the job no longer references: Python garbage, PyTorch's cached GPU blocks, and the C
    heap's free pages (glibc's malloc_trim), which a dump would otherwise save too."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return {}


def _acknowledge(record):
    path = os.path.join(ACK_DIR, "gpuckpt-quiesced.%d" % os.getpid())
    tmp = "%s.%d.tmp" % (path, _state["seq"])
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def install(signum=signal.SIGUSR1, release=None):
    """Handle ``signum`` by running ``release`` (default: release_pytorch_cache) and acknowledging.
    Returns the previous handler."""
    release = release or release_pytorch_cache

    def handler(_signum, _frame):
        _state["seq"] += 1
        started = time.monotonic()
        before = _torch_reserved()
        extra = release() or {}
        after = _torch_reserved()
        record = {"seq": _state["seq"], "pid": os.getpid(), "seconds": round(time.monotonic() - started, 3)}
        if before is not None and after is not None:
            record.update(gpu_reserved_before=before, gpu_reserved_after=after, released_bytes=before - after)
        record.update(extra if isinstance(extra, dict) else {})
        _acknowledge(record)

    return signal.signal(signum, handler)
