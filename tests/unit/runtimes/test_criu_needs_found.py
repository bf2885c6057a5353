"""runtimes/tree_plan.criu_needs on real processes: what CRIU must be told, or cannot dump, found before anything is frozen
(issue 45, seen on the GPU machine with a 2-rank NCCL job): a deleted file larger than CRIU's ghost limit that the
tree maps (NCCL's /dev/shm/nccl-* segments), and an io_uring (libuv's, in torchrun's agent)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend

DELETED = r"""
import mmap, os, sys, tempfile, time
fd, path = tempfile.mkstemp(dir=sys.argv[1])
os.ftruncate(fd, int(sys.argv[2]))
m = mmap.mmap(fd, int(sys.argv[2]))
os.unlink(path)
print("up", flush=True)
time.sleep(60)
"""
IO_URING = r"""
import ctypes, time
params = ctypes.create_string_buffer(120)
fd = ctypes.CDLL(None, use_errno=True).syscall(425, 4, params)  # io_uring_setup
print("up" if fd >= 0 else "no %d" % ctypes.get_errno(), flush=True)
time.sleep(60)
"""


def start(code, *args):
    p = subprocess.Popen([sys.executable, "-c", code] + [str(a) for a in args], stdout=subprocess.PIPE)
    return p, p.stdout.readline().decode().strip()


def test_a_deleted_file_larger_than_crius_ghost_limit_raises_it(tmp_path):
    p, said = start(DELETED, tmp_path, 3 << 20)
    try:
        assert said == "up"
        assert procfs.largest_deleted_file([p.pid]) == 3 << 20
        flags = ProcessBackend().plan_tree([p.pid])
        assert "--ghost-limit=%d" % ((3 << 20) + procfs.GHOST_LIMIT) in flags, flags
    finally:
        p.kill()
        p.wait()


SHARED = """
import mmap, os, sys, time
anon = mmap.mmap(-1, 8 << 20, mmap.MAP_SHARED)  # shared anonymous memory: /proc says "/dev/zero (deleted)"
anon.write(b"x" * (8 << 20))
fd = os.memfd_create("cuda-like")  # a memfd: "/memfd:cuda-like (deleted)"
os.ftruncate(fd, 8 << 20)
m = mmap.mmap(fd, 8 << 20)
print("up", flush=True)
time.sleep(60)
"""


def test_shared_anonymous_memory_and_memfds_are_no_ghost_files():
    """CRIU dumps shared anonymous memory and memfds as shared memory, whatever their size: /proc's "(deleted)" on
    them is no ghost file, and a runtime that cannot raise the ghost limit (runc) must not be refused for them."""
    p, said = start(SHARED)
    try:
        assert said == "up"
        with open("/proc/%d/maps" % p.pid) as fh:
            maps = fh.read()
        assert "/dev/zero (deleted)" in maps and "/memfd:cuda-like (deleted)" in maps
        # (pytest's own captured stderr, an unlinked temporary file the child inherits, may be listed: it is empty)
        assert [f for f in procfs.deleted_files([p.pid]) if f[0]] == [] and procfs.largest_deleted_file([p.pid]) == 0
        assert not [f for f in ProcessBackend().plan_tree([p.pid]) if f.startswith("--ghost-limit")]
    finally:
        p.kill()
        p.wait()


def test_the_refusal_names_the_deleted_file(tmp_path):
    p, said = start(DELETED, tmp_path, 3 << 20)
    try:
        assert said == "up"
        size, name = procfs.deleted_files([p.pid])[0]
        assert size == 3 << 20 and name.startswith(str(tmp_path)), name
    finally:
        p.kill()
        p.wait()


def test_a_small_deleted_file_needs_no_flag(tmp_path):
    p, said = start(DELETED, tmp_path, 4096)
    try:
        assert said == "up" and procfs.largest_deleted_file([p.pid]) == 4096
        assert not [f for f in ProcessBackend().plan_tree([p.pid]) if f.startswith("--ghost-limit")]
    finally:
        p.kill()
        p.wait()


def test_a_process_holding_an_io_uring_is_refused_naming_it():
    p, said = start(IO_URING)
    try:
        if said != "up":
            pytest.skip("this kernel gives no io_uring here (%s)" % said)
        assert procfs.io_uring_users([p.pid]) == [p.pid]
        with pytest.raises(InvalidTarget, match="pid %d .* holds an io_uring" % p.pid) as exc:
            ProcessBackend().plan_tree([p.pid])
        assert "USE_LIBUV=0" in exc.value.hint
    finally:
        p.kill()
        p.wait()
