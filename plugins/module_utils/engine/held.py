# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A held source (a checkpoint left stopped, its GPU memory in host RAM): resumed when its migration
rolls back, released (killed, by identity) when it commits. Both only ever act on the processes that
are still the checkpointed ones: a pid reused since is not ours."""
from __future__ import annotations

from ..core import procfs
from ..core.errors import TransactionError
from ..core.journal import same_process
from ..runtimes.process import ProcessBackend
from .cooperative import resume
from .steps import DEAD, STOPPED


def _mine(target):
    """The pids of a checkpointed tree that are still those processes (by identity)."""
    idents = target.get("identities") or {}
    return [p for p in target["pids"] if same_process(idents.get(str(p)))]


def _resume_gpu(backend, drv, libcuda_path, cuda_pids):
    """CUDA restore, then unlock, of every pid still checkpointed or locked; returns whether any was.
    Raises when one does not run afterwards."""
    if drv is None:
        drv, problem = backend.load_cuda(libcuda_path)
        if drv is None:
            raise problem
    changed = False
    for p in cuda_pids:
        if drv.cuda_state(p) == "checkpointed":
            drv.restore(p)
            changed = True
    for p in cuda_pids:
        if drv.cuda_state(p) == "locked":
            drv.unlock(p)
            changed = True
    bad = [p for p in cuda_pids if drv.cuda_state(p) != "running"]
    if bad:
        raise TransactionError("source pid %d is %s after resume" % (bad[0], drv.cuda_state(bad[0])),
                               stage="resume-source", pid=bad[0])
    return changed


def resume_stopped(manifest, backend=None, drv=None, libcuda_path=None):
    """Roll a stopped source back to running: SIGCONT to what was not stopped before the checkpoint
    (the driver's restore thread must run), then CUDA restore and unlock. Idempotent; returns
    (changed, pids that run)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    mine = _mine(target)
    if not mine:
        raise TransactionError("none of the source's processes %s exists any more; restore from the image instead"
                               % target["pids"], stage="resume-source")
    states = target.get("states") or {}
    changed = backend.is_held(mine)
    backend.resume([p for p in mine if states.get(str(p)) not in STOPPED])
    # (a sandbox's CUDA pids are its own, not host pids: they live while the sandbox does)
    cuda_pids = (list(target["cuda_pids"]) if backend.capabilities.cuda_in_sandbox
                 else [p for p in target["cuda_pids"] if p in mine])
    if cuda_pids and _resume_gpu(backend, drv, libcuda_path, cuda_pids):
        changed = True
    coop = manifest.get("cooperative")
    if coop:  # a cooperative job's ranks wait for their resume (engine/cooperative.py): after the GPU is theirs again
        ranks = list(coop.get("ranks") or {}) or coop.get("pids") or []  # (a manifest's record, or a journal's plan)
        resume([int(p) for p in ranks if int(p) in mine], coop["request"])
    return changed, mine


def release_stopped(manifest, backend=None):
    """Commit: kill the source's held processes (only those that are still the same processes)."""
    backend = backend or ProcessBackend()
    backend.bind(manifest)
    target = manifest["target"]
    mine = _mine(target)
    states = target.get("states") or {}
    running = [] if backend.is_held(mine) else \
        [p for p in mine if (procfs.read_stat(p) or {}).get("state") not in STOPPED + DEAD
         and states.get(str(p)) not in STOPPED] or []
    if running:
        raise TransactionError("source pid %d runs again (it is not stopped): refusing to kill it; the migration "
                               "was rolled back or resumed by hand" % running[0], stage="release-source",
                               pid=running[0])
    if mine:
        backend.kill(mine)
    return bool(mine), mine
