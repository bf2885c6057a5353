"""runsc_cuda_stage=runsc: the CUDA stage left to runsc's own --cuda-checkpoint-path (gVisor
release-20260608 and later). No runsc with that flag runs here (Debian ships 20240729, which the
integration tests use), so this drives the engine against a TEST DOUBLE of the newer runsc: a script
that answers state/ps/exec/checkpoint/restore as runsc does and logs every command line."""
from __future__ import annotations

import json
import os
import stat

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.runsc import RunscBackend

FAKE_RUNSC = r"""#!/bin/sh
# TEST DOUBLE of runsc release-20260608+: logs its arguments; the sandbox's CUDA state in $D/cuda
D=%(dir)s
echo "$*" >> $D/log
while [ "${1#--}" != "$1" ] && [ "$1" != --version ]; do [ "$1" = --root ] && shift; shift; done  # global flags
cmd=$1; shift
case $cmd in
  --version|-version) echo "runsc version release-20260608.0"; exit 0 ;;
  help) echo "  -cuda-checkpoint-path string"; exit 0 ;;
  state) [ -f $D/gone ] && exit 1; echo '{"id": "sbx", "status": "running", "pid": %(pid)d, "bundle": "%(dir)s"}' ;;
  ps) echo '[1]' ;;
  exec) cat $D/cuda ;;
  checkpoint) for a in "$@"; do case $a in --cuda-checkpoint-path=*) echo checkpointed > $D/cuda ;; esac; done
              img=$(echo "$@" | sed 's/.*-image-path \([^ ]*\).*/\1/'); echo image > $img/checkpoint.img; touch $D/gone ;;
  restore) rm -f $D/gone; echo running > $D/cuda ;;
  delete) touch $D/gone ;;
esac
exit 0
"""


@pytest.fixture
def fake_runsc(tmp_path):
    path = tmp_path / "runsc"
    path.write_text(FAKE_RUNSC % {"dir": str(tmp_path), "pid": os.getpid()})
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "cuda").write_text("running\n")
    (tmp_path / "config.json").write_text(json.dumps({"linux": {}}))
    return tmp_path


def test_runsc_runs_the_cuda_stage_and_the_engine_only_checks_it(fake_runsc, fakecuda):
    d = fake_runsc
    backend = RunscBackend(str(d / "runsc"), str(d / "root"), cuda_stage="runsc", tool="/opt/cc")
    res = checkpoint("sbx", str(d / "img"), backend=backend)
    assert res["cuda_pids"] == [1] and res["gpu_stage"] == "done by the runsc runtime itself", res
    # (the host cannot read whether the sandbox's CUDA processes are NCCL ranks: the result says it was not checked)
    assert any("NCCL" in w and "not checked" in w for w in res.get("warnings") or []), res
    log = (d / "log").read_text()
    assert "checkpoint -image-path %s --cuda-checkpoint-path=/opt/cc sbx" % (d / "img") in log, log
    assert "--action" not in log, "the engine ran no CUDA step of its own"
    manifest = json.loads((d / "img" / "manifest.json").read_text())
    assert manifest["runtime"]["cuda_stage"] == "runsc"

    res = restore(str(d / "img"), backend=RunscBackend(str(d / "runsc"), str(d / "root"), bundle=str(d)))
    assert res["cuda_pids"] == [1], res
    log = (d / "log").read_text()
    assert "--action" not in log and "--get-state --pid 1" in log, "the restore checked the state, did nothing else"


def test_runsc_without_the_flag_is_refused_before_anything_is_frozen(fake_runsc):
    d = fake_runsc
    (d / "runsc").write_text((d / "runsc").read_text().replace("-cuda-checkpoint-path string", "-compression value"))
    backend = RunscBackend(str(d / "runsc"), str(d / "root"), cuda_stage="runsc")
    with pytest.raises(InvalidTarget) as exc:
        checkpoint("sbx", str(d / "img"), backend=backend)
    assert "no --cuda-checkpoint-path" in exc.value.msg
    assert "checkpoint -image-path" not in (d / "log").read_text()


def test_the_image_decides_who_restores_its_cuda_processes(tmp_path):
    """A target whose inventory sets runsc_cuda_stage (migrate.yml hands every host's runtime options to
    its modules) still restores an image made with the engine's CUDA stage through the engine, and
    the other way round."""
    engine_image = {"runtime": {"backend": "runsc", "cuda_stage": "engine"}}
    runsc_image = {"runtime": {"backend": "runsc", "cuda_stage": "runsc"}}
    b = RunscBackend(str(tmp_path / "runsc"), str(tmp_path / "root"), cuda_stage="runsc")
    b.bind(engine_image)
    assert b.capabilities.owns_cuda_stage is False
    b = RunscBackend(str(tmp_path / "runsc"), str(tmp_path / "root"))
    b.bind(runsc_image)
    assert b.capabilities.owns_cuda_stage is True
