"""The collection's own cuda-checkpoint tool (roles/cuda_checkpoint/files/cuda_checkpoint.c), built by
the role's recipe, against the libcuda TEST DOUBLE: NVIDIA's command line, the driver's state machine,
its errors and exit statuses, and a binary that needs only glibc's oldest symbol versions."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

import pytest

from helpers import REPO

FILES = os.path.join(REPO, "roles", "cuda_checkpoint", "files")
GPU_A, GPU_B = "GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tool") / "gpuckpt-cuda-checkpoint")
    subprocess.run(["sh", os.path.join(FILES, "build.sh"), os.path.join(FILES, "cuda_checkpoint.c"), out], check=True)
    return out


def _run(tool, *args, env=None):
    return subprocess.run([tool] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=dict(os.environ, **(env or {})), check=False)


def test_the_state_machine_through_the_tool(tool, fakecuda, cuda_child):
    pid = cuda_child
    assert _run(tool, "--get-state", "--pid", pid).stdout == "running\n"
    bad = _run(tool, "--action", "checkpoint", "--pid", pid)  # must be locked first
    assert bad.returncode == 1 and "CUDA_ERROR_ILLEGAL_STATE (401)" in bad.stderr, bad.stderr
    for action, state in (("lock", "locked"), ("checkpoint", "checkpointed"), ("restore", "locked"),
                          ("unlock", "running")):
        res = _run(tool, "--action", action, "--pid", pid, *(("--timeout", 5000) if action == "lock" else ()))
        assert res.returncode == 0 and res.stdout == "", (action, res.stderr)
        assert _run(tool, "--get-state", "--pid", pid).stdout.strip() == state
    assert _run(tool, "--toggle", "--pid", pid).returncode == 0
    assert _run(tool, "--get-state", "--pid", pid).stdout.strip() == "checkpointed"
    assert _run(tool, "--get-restore-tid", "--pid", pid).stdout.strip() == str(pid)
    assert _run(tool, "--toggle", "--pid", pid).returncode == 0
    assert _run(tool, "--get-state", "--pid", pid).stdout.strip() == "running"
    calls = [c for c in fakecuda.calls() if c[0] != "attach"]
    assert calls[-4:] == [("lock", str(pid)), ("checkpoint", str(pid)), ("restore", str(pid)), ("unlock", str(pid))]


def test_not_a_cuda_process_and_no_process_answer_like_the_driver(tool, fakecuda):
    res = _run(tool, "--get-state", "--pid", os.getpid())
    assert res.returncode == 1 and "CUDA_ERROR_NOT_INITIALIZED (3)" in res.stderr
    dead = subprocess.Popen(["true"])
    dead.wait()
    res = _run(tool, "--get-state", "--pid", dead.pid)
    assert res.returncode == 1 and "(304)" in res.stderr


def test_injected_driver_failure_is_reported_with_its_code(tool, fakecuda, cuda_child):
    fakecuda.inject("lock", cuda_child, 909)
    res = _run(tool, "--action", "lock", "--pid", cuda_child)
    assert res.returncode == 1 and "cuCheckpointProcessLock failed for pid %d: CUDA_ERROR_TIMEOUT (909)" % cuda_child \
        in res.stderr, res.stderr
    fakecuda.clear_injections()
    assert _run(tool, "--get-state", "--pid", cuda_child).stdout.strip() == "running"


def test_a_failed_toggle_leaves_the_process_running(tool, fakecuda, cuda_child):
    fakecuda.inject("checkpoint", cuda_child, 2)
    res = _run(tool, "--toggle", "--pid", cuda_child)
    assert res.returncode == 1 and "CUDA_ERROR_OUT_OF_MEMORY" in res.stderr
    assert _run(tool, "--get-state", "--pid", cuda_child).stdout.strip() == "running"


@pytest.mark.parametrize("args,words", [
    ([], "give exactly one of"),
    (["--get-state"], "give exactly one of"),
    (["--action", "freeze", "--pid", "5"], "unknown action"),
    (["--get-state", "--pid", "0"], "bad pid"),
    (["--get-state", "--pid", "12x"], "bad pid"),
    (["--action", "lock", "--pid", "5", "--timeout", "-1"], "bad timeout"),
    (["--action", "lock", "--pid", "5", "--device-map", "%s=%s" % (GPU_A, GPU_B)], "goes with --action restore"),
    (["--action", "restore", "--pid", "5", "--device-map", "GPU-1234=%s" % GPU_B], "bad --device-map entry"),
    (["--action", "restore", "--pid", "5", "--device-map", GPU_A], "bad --device-map entry"),
    (["--get-state", "--pid", "5", "--bogus"], "unknown option"),
])
def test_bad_usage_exits_2_with_the_reason(tool, args, words):
    res = _run(tool, *args)
    assert res.returncode == 2 and words in res.stderr, (args, res.stderr)


def test_help_names_what_criu_s_cuda_plugin_looks_for(tool):
    res = _run(tool, "-h")
    assert res.returncode == 0 and "--action" in res.stdout and "--get-restore-tid" in res.stdout


def test_driver_without_the_api_or_the_gpu_map_exits_3(tool, fakecuda, cuda_child):
    assert _run(tool, "--get-state", "--pid", 1, env={"GPUCKPT_LIBCUDA": "/nonexistent/libcuda.so.1"}).returncode == 3
    old = _run(tool, "--get-state", "--pid", cuda_child, env={"FAKECUDA_API_VERSION": "12040"})
    assert old.returncode == 3 and "older than 12.8" in old.stderr
    # restore onto other GPUs needs CUDA 13.0 (driver 580); on 12.8 it is refused before the call
    for step in ("lock", "checkpoint"):
        assert _run(tool, "--action", step, "--pid", cuda_child).returncode == 0
    res = _run(tool, "--action", "restore", "--pid", cuda_child, "--device-map", "%s=%s" % (GPU_A, GPU_B),
               env={"FAKECUDA_API_VERSION": "12080"})
    assert res.returncode == 3 and "needs driver 580" in res.stderr
    res = _run(tool, "--action", "restore", "--pid", cuda_child, "--device-map",
               "%s:%s,%s=%s" % (GPU_A, GPU_B, GPU_B, GPU_A))
    assert res.returncode == 0, res.stderr
    assert _run(tool, "--action", "unlock", "--pid", cuda_child).returncode == 0


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("objdump"), reason="x86_64 with objdump")
def test_the_binary_needs_only_glibc_2_2_5(tool):
    """It runs inside containers whose glibc is older than the build host's (CUDA images on Ubuntu 20.04)."""
    text = subprocess.run(["objdump", "-T", tool], stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
    versions = set(re.findall(r"\((GLIBC_[0-9.]+)\)", text))
    assert versions == {"GLIBC_2.2.5"}, versions
