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

A distributed job at full speed (``quiesce_mode: cooperative``, docs/multi_gpu.md): NCCL's defaults between
checkpoints, its communicators released at a step boundary that every rank agrees on before the freeze:

    coop = gpuckpt_quiesce.Cooperative()          # after init_process_group
    for step in ...:
        ...one training step...
        if coop.step_boundary(step):              # True once the process group was re-created:
            ddp = DistributedDataParallel(model)  # re-wrap what holds the old group (DDP, FSDP)

Start it under ``python gpuckpt_quiesce.py --standalone --nproc-per-node N train.py`` (torchrun, its rendezvous
store without libuv, whose io_uring CRIU cannot dump), or torchrun with your own libuv-less store.
"""
from __future__ import annotations

import atexit
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


# -- the cooperative protocol (gpuckpt.fleet's engine/cooperative.py is the other side) ---------------------------
ANNOUNCE = "gpuckpt-cooperative.%d"
REQUEST = "gpuckpt-request.%d"
RESUME = "gpuckpt-resume.%d"


def _read_json(path):
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _remove(path):
    try:
        os.unlink(path)
    except OSError:
        pass


# every=None: the checks are spaced so that one comes about every CHECK_INTERVAL_S seconds. The ranks time their steps
# between their CALIBRATION boundaries (the first few, slower ones left out) and agree on the spacing at the last one.
CHECK_INTERVAL_S = 0.05
CALIBRATION = (10, 30)
MAX_EVERY = 10000


class Cooperative(object):
    """The rank's side of a cooperative checkpoint. Create it after ``torch.distributed.init_process_group`` (every
    rank), call ``step_boundary(step)`` after each step. The check is one all-reduce of one number, on the CPU, read a
    check later; it runs at every ``every``-th boundary, by default (``every=None``) at as many as take about
    ``check_interval`` seconds (50 ms), timed by the ranks over their first 30 boundaries and agreed on by all. A short
    step pays for the check no more than a long one, and an answer comes within about two intervals. When gpuckpt.fleet
    asks (its request file, then ``signum``), all ranks stop at the same boundary: ``on_release(step)`` callbacks, every
    process group destroyed (NCCL's communicators go with them: the driver cannot restore live ones), the cache given
    back, an acknowledgement with the step, and a wait. Once told to resume (or after ``lease_s`` seconds of its own
    running time without word: its controller died), the process group is created again on a fresh prefix of the
    rendezvous store it kept (a plain init_process_group would read the old NCCL unique id from the store and fail),
    then ``on_resume(step)`` callbacks, and ``step_boundary`` returns True: re-wrap what holds the old group
    (DistributedDataParallel, FSDP, your own subgroups).

    NCCL 2.29.7+ has ncclCommSuspend/ncclCommResume (PyTorch 2.12+ as a backend suspend), which would keep the
    communicators' setup; the PyTorch wheels this was written for ship NCCL 2.28.9, so the groups are destroyed."""

    def __init__(self, every=None, signum=signal.SIGUSR1, on_release=(), on_resume=(), timeout=None, poll=0.02,
                 check_interval=CHECK_INTERVAL_S):
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        if not dist.is_initialized():
            raise RuntimeError("Cooperative() comes after torch.distributed.init_process_group")
        self.torch, self.dist = torch, dist
        self.every = None if every is None else max(1, int(every))  # (None: still timing the steps)
        self.poll, self.timeout, self.check_interval = float(poll), timeout, float(check_interval)
        self._boundaries, self._timed_from = 0, None
        self.backend = dist.get_backend()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.store = c10d._get_default_store()  # the rendezvous, kept: each new group gets a fresh prefix of it
        self.device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(self.backend)
                       else torch.device("cpu"))
        self.on_release, self.on_resume = list(on_release), list(on_resume)
        self._group = self._agreement_group()
        self._work = self._flag = None  # the check started at the last boundary
        self.requested = 0  # the number of the request this rank has seen, 0 when none
        self.handled = 0  # the last request handled (a late signal for it is ignored)
        self.history = []  # one dict per cycle: request, step, release/wait/rejoin seconds, how it resumed
        self._pid = os.getpid()
        self._previous = signal.signal(signum, self._on_signal)
        self._announce()

    def _announce(self):
        """/tmp/gpuckpt-cooperative.<pid>: gpuckpt.fleet's ``quiesce_mode: auto`` checkpoints this job cooperatively
        (a drain or a migration of many workloads need not name it). Removed at exit."""
        path = self._file(ANNOUNCE)
        with open(path + ".tmp", "w") as fh:
            json.dump({"pid": self._pid, "rank": self.rank, "world_size": self.world_size}, fh)
        os.replace(path + ".tmp", path)
        atexit.register(_remove, path)

    def _file(self, pattern):
        return os.path.join(ACK_DIR, pattern % self._pid)

    def _on_signal(self, signum, frame):
        req = _read_json(self._file(REQUEST))
        number = int((req or {}).get("request") or 0)
        if number > self.handled:
            self.requested = max(self.requested, number)
        elif req is None and callable(self._previous):  # not ours: the handler that was there
            self._previous(signum, frame)

    def _agreement_group(self):
        """The group the flag is all-reduced in: the default one for a CPU (gloo) job; a gloo group of the same ranks
        for an NCCL job, so that the check never touches the GPU (no device sync, no kernel on its streams)."""
        return self.dist.new_group(backend="gloo") if self.device.type == "cuda" else None

    def step_boundary(self, step):
        """Call after every step. Returns True when the job was checkpointed here and its process group is new.

        The check (at every ``every``-th call) is an all-reduce (MAX) of one number on the CPU, started at one check
        and read at the next (pipelined: it runs meanwhile, on gloo's thread): every rank reads the same result at the
        same boundary, so all stop at the same step, one check after the request reached them."""
        self._boundaries += 1
        if self.every is None:
            self._calibrate()
        # (counted in boundaries, not in the job's step numbers: every rank has passed as many, and a job that calls
        # this every other step, or from an odd step on, is still checked)
        if self._boundaries % (self.every or 1):
            return False
        number = 0
        if self._work is not None:
            self._work.wait()
            number = int(self._flag.item())
        if self.requested > self.handled:  # (tells gpuckpt.fleet this rank is at its boundary: one not there is named)
            _acknowledge({"request": self.requested, "pid": self._pid, "rank": self.rank, "step": step,
                          "waiting": True, "released": False})
        if number <= self.handled:
            self._flag = self.torch.tensor([self.requested], dtype=self.torch.int64)
            self._work = self.dist.all_reduce(self._flag, op=self.dist.ReduceOp.MAX, group=self._group, async_op=True)
            return False
        self._work = self._flag = None
        self._cycle(number, step)
        return True

    def _calibrate(self):
        """Times the steps between the CALIBRATION boundaries; at the last one, every rank (each at that same boundary)
        takes the largest spacing any rank wants (an all-reduce MAX; the check still pending is ahead of it in the same
        group on every rank)."""
        first, last = CALIBRATION
        if self._boundaries == first:
            self._timed_from = time.monotonic()
        elif self._boundaries == last and self._timed_from is not None:
            per_step = (time.monotonic() - self._timed_from) / (last - first)
            want = MAX_EVERY if per_step <= 0 else max(1, min(MAX_EVERY, int(self.check_interval / per_step)))
            agreed = self.torch.tensor([want], dtype=self.torch.int64)
            self.dist.all_reduce(agreed, op=self.dist.ReduceOp.MAX, group=self._group)
            self.every = int(agreed.item())

    def _cycle(self, number, step):
        self._pid = os.getpid()
        if self.every is None:  # (a checkpoint while the steps were being timed: every rank times them again)
            self._boundaries, self._timed_from = 0, None
        t0 = time.monotonic()
        for fn in self.on_release:
            fn(step)
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.dist.destroy_process_group()  # every group: NCCL's communicators, their memory and shared memory
        release_pytorch_cache()
        released = time.monotonic()
        req = _read_json(self._file(REQUEST)) or {}
        lease = float(req.get("lease_s") or 600.0) if int(req.get("request") or 0) == number else 600.0
        _acknowledge({"seq": number, "request": number, "pid": self._pid, "rank": self.rank,
                      "world_size": self.world_size, "step": step, "released": True, "backend": str(self.backend),
                      "seconds": round(released - t0, 3)})
        how = self._wait(number, lease)
        if how == "lease":  # (no collection came back to take its request away)
            if int((_read_json(self._file(REQUEST)) or {}).get("request") or 0) == number:
                _remove(self._file(REQUEST))
        waited = time.monotonic()
        self._pid = os.getpid()  # (a restored process has its pid back; its /tmp may be another host's)
        self.handled = number  # (a next request may have come already: it stays asked)
        self.requested = self.requested if self.requested > number else 0
        kw = {} if self.timeout is None else {"timeout": self.timeout}
        self.dist.init_process_group(self.backend, store=self.dist.PrefixStore("gpuckpt/%d/" % number, self.store),
                                     rank=self.rank, world_size=self.world_size, **kw)
        self._group = self._agreement_group()
        for fn in self.on_resume:
            fn(step)
        self.history.append({"request": number, "step": step, "release_s": round(released - t0, 3),
                             "waited_s": round(waited - released, 3), "rejoin_s": round(time.monotonic() - waited, 3),
                             "resumed_by": how})

    def _wait(self, number, lease):
        """Until the resume for ``number`` comes ("resume"), or ``lease`` seconds of this process's own running
        time pass without it ("lease"). Each pause counts for at most a second: time spent frozen, or the clock
        jump a restored process sees, does not count."""
        ran, last = 0.0, time.monotonic()
        while True:
            doc = _read_json(self._file(RESUME))
            if doc is not None and int(doc.get("request") or 0) == number:
                _remove(self._file(RESUME))
                return "resume"
            now = time.monotonic()
            ran += min(max(now - last, 0.0), 1.0)
            last = now
            if ran >= lease:
                return "lease"
            time.sleep(self.poll)


def torchrun(argv=None):
    """torchrun (torch.distributed.run) whose rendezvous store does without libuv. torchrun 2.13 hosts its store
    (c10d and static rendezvous) with TCPStore's default, libuv, and libuv 1.45+ opens an io_uring that CRIU cannot
    dump (gpuckpt.fleet refuses the job: USE_LIBUV=0 does not reach that store). The ranks' own stores follow
    USE_LIBUV, set to 0 here."""
    os.environ.setdefault("USE_LIBUV", "0")
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, static_tcp_rendezvous
    tcp_store = dist.TCPStore

    def store(*args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        return tcp_store(*args, **kwargs)

    def server(unused_self, master_addr, master_port):  # (the store torchrun hands the ranks: --standalone's)
        return tcp_store(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True, use_libuv=False)

    c10d_rendezvous_backend.TCPStore = static_tcp_rendezvous.TCPStore = store
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = server
    from torch.distributed.run import main
    return main(argv)


if __name__ == "__main__":
    sys.exit(torchrun())
