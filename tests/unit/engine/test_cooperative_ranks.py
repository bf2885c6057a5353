"""Which processes a cooperative checkpoint asks (engine/plan.py's cooperative_ranks): the tree's NCCL ranks and the
processes that announced the helper, among its CUDA processes; a launcher with a CUDA context of its own is locked
with them but never asked; with neither ranks nor announcements, every CUDA process, or the root of a tree without
one. The announcements are a TEST DOUBLE here (which pids say so), and once the real file a rank writes."""
from __future__ import annotations

import os
import subprocess

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import cooperative, plan

ROOT, AGENT, RANK0, RANK1 = 100, 101, 102, 103


@pytest.fixture
def announced(monkeypatch):
    """The pids that announced the helper (``gpuckpt-cooperative.<pid>`` in their /tmp), and what was asked."""
    said, asked = set(), []

    def announced_pids(pids):
        asked.append(list(pids))
        return [p for p in pids if p in said]
    monkeypatch.setattr(cooperative, "announced", announced_pids)
    return said, asked


def verdict(*rank_pids):
    return {"ranks": [{"pid": p, "rank": i} for i, p in enumerate(rank_pids)]}


def test_the_nccl_ranks_are_asked_and_the_launcher_is_not(announced):
    """torchrun's agent holds a CUDA context of its own: it is locked and checkpointed, but has nothing to release."""
    assert plan.cooperative_ranks(verdict(RANK0, RANK1), [AGENT, RANK0, RANK1], ROOT) == [RANK0, RANK1]


def test_a_process_that_announced_the_helper_is_asked_beside_the_ranks(announced):
    said, asked = announced
    said.add(RANK1)
    assert plan.cooperative_ranks(verdict(RANK0), [AGENT, RANK0, RANK1], ROOT) == [RANK0, RANK1]
    assert asked == [[AGENT, RANK0, RANK1]], "only the CUDA processes are looked at"


def test_announcements_alone_choose_the_ranks(announced):
    said, unused = announced
    said.update({RANK0, RANK1})
    assert plan.cooperative_ranks({}, [AGENT, RANK0, RANK1], ROOT) == [RANK0, RANK1]


def test_the_ranks_keep_the_cuda_processes_order(announced):
    assert plan.cooperative_ranks(verdict(RANK1, RANK0), [RANK0, AGENT, RANK1], ROOT) == [RANK0, RANK1]


def test_a_rank_that_is_no_cuda_process_is_not_asked(announced):
    """A rank the NCCL verdict names but the driver does not (it holds no GPU): nothing of it is checkpointed."""
    assert plan.cooperative_ranks(verdict(RANK0, 999), [AGENT, RANK0], ROOT) == [RANK0]


@pytest.mark.parametrize("found", [{}, {"ranks": None}, {"ranks": []}, verdict(999)])
def test_with_no_rank_among_them_every_cuda_process_is_asked(announced, found):
    assert plan.cooperative_ranks(found, [AGENT, RANK0], ROOT) == [AGENT, RANK0]


def test_a_tree_without_a_cuda_process_asks_its_root(announced):
    assert plan.cooperative_ranks(verdict(RANK0), [], ROOT) == [ROOT]


def test_the_announcement_a_rank_writes_is_what_chooses_it():
    """The real announcement (cooperative.ANNOUNCE in the process's own /tmp, as tools/gpuckpt_quiesce.py's
    Cooperative writes it), not a double: of two CUDA processes only the announcing one is asked."""
    procs = [subprocess.Popen(["sleep", "60"]) for unused in range(2)]
    mark = os.path.join("/tmp", cooperative.ANNOUNCE % procs[1].pid)
    try:
        with open(mark, "w") as fh:
            fh.write("{}")
        pids = [p.pid for p in procs]
        assert plan.cooperative_ranks({}, pids, ROOT) == [procs[1].pid]
    finally:
        os.unlink(mark)
        for p in procs:
            p.kill()
            p.wait()
