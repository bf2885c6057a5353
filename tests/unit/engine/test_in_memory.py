"""engine/in_memory.py: the image's tmpfs is sized and the host's RAM checked before anything is frozen;
an unknown figure refuses, never counts as zero. Host figures are stubbed (no GPU here)."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import in_memory

GIB = 2**30


@pytest.fixture
def host(monkeypatch):
    figures = {"rss": 2 * GIB, "gpu": 20 * GIB, "avail": 100 * GIB, "total": 128 * GIB}

    def gpu_memory(pids, states):
        if figures["gpu"] is None:
            return {"gpu_bytes": None, "gpu_memory_source": None, "gpu_memory_unknown_reason": "nothing answered"}
        return {"gpu_bytes": figures["gpu"], "gpu_memory_source": "nvml", "gpu_memory_unknown_reason": None}
    monkeypatch.setattr(in_memory.procfs, "rss_bytes", lambda pid: figures["rss"])
    monkeypatch.setattr(in_memory.facts, "tree_gpu_memory", gpu_memory)
    monkeypatch.setattr(in_memory.procfs, "meminfo",
                        lambda: {"total_bytes": figures["total"], "available_bytes": figures["avail"]})
    return figures


def test_the_tmpfs_is_sized_to_rss_and_gpu_memory_with_a_margin(host):
    out = in_memory.plan([1], [1])
    assert out["size_bytes"] == int(22 * GIB * 1.10) + in_memory.OTHER_IMAGES
    assert out["stage1_bytes"] == 20 * GIB and out["reserve_bytes"] == int(128 * GIB * 0.05)


def test_stage1_brings_in_what_the_tree_holds_on_gpus(host):
    host["gpu"] = 0
    assert in_memory.plan([1], [])["stage1_bytes"] == 0
    host["gpu"] = 3 * GIB  # a runtime that runs stage 1 itself: no CUDA pids of the engine's, GPU memory all the same
    assert in_memory.plan([1], [])["stage1_bytes"] == 3 * GIB


def test_a_host_that_cannot_hold_it_is_refused_with_its_figures(host):
    host["avail"] = 40 * GIB
    with pytest.raises(InvalidTarget) as exc:
        in_memory.plan([1], [1])
    assert "has 40.0 GiB available; it needs 24.4 GiB for the image in memory, 20.0 GiB" in exc.value.msg
    assert "nothing was frozen" in exc.value.msg and exc.value.stage == "preflight"


def test_an_unknown_gpu_memory_refuses_unless_the_size_is_given(host):
    host["gpu"] = None
    with pytest.raises(InvalidTarget) as exc:
        in_memory.plan([1], [1])
    assert "GPU memory is unknown (nothing answered)" in exc.value.msg and "image_memory_bytes" in exc.value.hint
    out = in_memory.plan([1], [1], size_bytes=30 * GIB)
    assert out["size_bytes"] == 30 * GIB and out["stage1_bytes"] == 30 * GIB  # unknown: counted as the image


def test_an_unknown_free_memory_refuses(host):
    host["avail"] = None
    with pytest.raises(InvalidTarget) as exc:
        in_memory.plan([1], [1])
    assert "free memory is unknown" in exc.value.msg


def test_a_size_that_is_not_positive_is_refused(host):
    with pytest.raises(InvalidTarget):
        in_memory.plan([1], [1], size_bytes=-5)
