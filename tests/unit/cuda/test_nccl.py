"""cuda/nccl.py and core/sockets.tcp_outside: which distributed (NCCL) jobs the driver can restore, decided before
anything is frozen from what /proc shows of real processes (issue 45): each "rank" here is a process that maps a
/dev/shm/nccl-* segment, as NCCL's shared memory shows, started with the environment under test; no GPU."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import sockets
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import nccl

RESTORABLE = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
RANK = r"""
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
print("up", flush=True)
time.sleep(60)
"""


@pytest.fixture
def ranks(tmp_path):
    """start(env, shm_prefix): a process mapping /dev/shm/<prefix><unique> with ``env`` on top of ours."""
    made, segments = [], []

    def start(env, prefix="nccl-"):
        seg = "/dev/shm/%sgpuckpt-test-%s" % (prefix, uuid.uuid4().hex[:8])
        segments.append(seg)
        p = subprocess.Popen([sys.executable, "-c", RANK, seg], stdout=subprocess.PIPE,
                             env=dict({k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}, **env))
        assert p.stdout.readline().strip() == b"up"
        made.append(p)
        return p.pid

    yield start
    for p in made:
        p.kill()
        p.wait()
    for seg in segments:
        if os.path.exists(seg):
            os.unlink(seg)


def test_no_nccl_rank_is_no_distributed_job(ranks):
    pid = ranks({"WORLD_SIZE": "2"}, prefix="other-")
    verdict = nccl.judge([pid])
    assert verdict == {"distributed": False, "restorable": False, "ranks": [], "refusal": None}


def test_ranks_started_with_the_restorable_environment_are_checkpointable(ranks):
    pids = [ranks(dict(RESTORABLE, RANK=str(r), WORLD_SIZE="2")) for r in range(2)]
    verdict = nccl.judge(pids)
    assert verdict["distributed"] and verdict["restorable"] and verdict["refusal"] is None, verdict
    assert [r["rank"] for r in verdict["ranks"]] == ["0", "1"]


@pytest.mark.parametrize("drop, value", [("NCCL_P2P_DISABLE", None), ("NCCL_CUMEM_ENABLE", "1"),
                                         ("NCCL_CUMEM_HOST_ENABLE", None), ("NCCL_NVLS_ENABLE", None),
                                         ("NCCL_P2P_DISABLE", "yes")])
def test_a_rank_without_one_setting_refuses_the_job_naming_it_and_the_fix(ranks, drop, value):
    env = dict(RESTORABLE, RANK="1", WORLD_SIZE="2")
    if value is None:
        del env[drop]
    else:
        env[drop] = value
    pids = [ranks(dict(RESTORABLE, RANK="0", WORLD_SIZE="2")), ranks(env)]
    verdict = nccl.judge(pids)
    assert verdict["distributed"] and not verdict["restorable"], verdict
    why = verdict["refusal"]
    assert "pid %d (rank 1 of 2)" % pids[1] in why and "%s=" % drop in why.split("started without")[1].split(":")[0]
    assert nccl.HOW in why and "19.7 GB/s" in why  # the way that makes it checkpointable, and its cost


def test_ncclss_defaults_are_refused(ranks):
    verdict = nccl.judge([ranks({"RANK": "0", "WORLD_SIZE": "2"})])
    assert not verdict["restorable"] and "NCCL_P2P_DISABLE=1" in verdict["refusal"]


def test_a_rank_with_cuda_ipc_memory_is_refused_whatever_its_environment(ranks):
    pid = ranks(dict(RESTORABLE, RANK="0", WORLD_SIZE="2"))
    ipc = ranks(dict(RESTORABLE, RANK="1", WORLD_SIZE="2"), prefix="cuda.shm.")
    with open("/dev/shm/nccl-gpuckpt-test-for-ipc", "w+b") as fh:  # the IPC consumer is a rank too
        fh.truncate(4096)
    try:
        both = subprocess.Popen([sys.executable, "-c", RANK.replace('print("up"', 'n = os.open("/dev/shm/nccl-gpuckpt-'
                                                                    'test-for-ipc", os.O_RDWR); m2 = mmap.mmap(n, 4096)'
                                                                    '\nprint("up"'),
                                 "/dev/shm/cuda.shm.gpuckpt-test-%s" % uuid.uuid4().hex[:6]], stdout=subprocess.PIPE,
                                env=dict(os.environ, **dict(RESTORABLE, RANK="1", WORLD_SIZE="2")))
        assert both.stdout.readline().strip() == b"up"
        verdict = nccl.judge([pid, ipc, both.pid])
        assert not verdict["restorable"] and "CUDA IPC" in verdict["refusal"] and str(both.pid) in verdict["refusal"]
    finally:
        both.kill()
        both.wait()
        os.unlink("/dev/shm/nccl-gpuckpt-test-for-ipc")


def test_connections_between_two_sockets_of_the_tree_are_inside_it_and_one_to_a_peer_outside_is_not():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    code = ("import socket, sys, time\n"
            "lst = socket.socket(); lst.bind(('127.0.0.1', 0)); lst.listen(1)\n"
            "a = socket.create_connection(lst.getsockname()); b, unused = lst.accept()\n"  # the rendezvous and a rank
            "c = socket.create_connection(('127.0.0.1', int(sys.argv[1]))) if sys.argv[1] != '0' else None\n"
            "print('up', flush=True); time.sleep(60)\n")
    inside = subprocess.Popen([sys.executable, "-c", code, "0"], stdout=subprocess.PIPE)
    outside = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE)
    try:
        for p in (inside, outside):
            assert p.stdout.readline().strip() == b"up"
        assert len(sockets.tcp_endpoints([inside.pid])) == 2
        assert sockets.tcp_outside([inside.pid]) == []
        out = sockets.tcp_outside([outside.pid])
        assert out == ["tcp port %d -> 127.0.0.1:%d" % (out and int(out[0].split()[2]), port)], out
    finally:
        for p in (inside, outside):
            p.kill()
            p.wait()
        server.close()


def test_ncclss_defaults_refusal_names_both_ways_and_the_cooperative_mode_accepts_them(ranks):
    pid = ranks({"RANK": "0", "WORLD_SIZE": "2"})
    why = nccl.judge([pid])["refusal"]
    assert nccl.HOW in why and "quiesce_mode: cooperative" in why and "gpuckpt_quiesce.py" in why
    verdict = nccl.judge([pid], cooperative=True)
    assert verdict["distributed"] and verdict["restorable"] and verdict["cooperative"] and verdict["refusal"] is None
    assert nccl.live_communicators(pid), "its NCCL shared memory is mapped: a rank that did not release it"


def test_the_cooperative_mode_does_not_accept_cuda_ipc_memory(ranks):
    ipc = ranks({"RANK": "1", "WORLD_SIZE": "2"}, prefix="cuda.shm.")
    rank = ranks({"RANK": "0", "WORLD_SIZE": "2"})
    verdict = nccl.judge([rank, ipc], cooperative=True)
    assert verdict["refusal"] is None or "CUDA IPC" in verdict["refusal"]  # (the IPC process alone is no NCCL rank)
    assert not nccl.live_communicators(ipc)
