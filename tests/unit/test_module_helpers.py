"""The thin modules end to end (module_utils/_module_helpers.py behind them): each module runs as Ansible runs
it, from its arguments to its JSON result, and a refusal leaves nothing behind."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import transaction as migration
from ansible_collections.gpuckpt.fleet.plugins.modules import (
    cuda_process_facts, gpu_checkpoint, gpu_image_sync, gpu_migration)


def _run(module, capsys, **args):
    """The module's result as Ansible reads it from its stdout."""
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


def _image(tmp_path, nonce=None):
    src = tmp_path / "src"
    image.prepare_dir(str(src))
    (src / "pages-1.img").write_bytes(os.urandom(5000))
    manifest = {"id": "img-1", "files": image.checksum_files(str(src))}
    if nonce:
        manifest["migration"] = {"id": "m-1", "nonce": nonce}
    return src, image.write_manifest(str(src), manifest)


@pytest.fixture
def local_ssh(tmp_path, monkeypatch):
    """TEST DOUBLE: an ``ssh`` that runs the remote command on this host (as test_transfer.py's)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text("#!%s\nimport subprocess, sys\nsys.exit(subprocess.call(['sh', '-c', sys.argv[-1]]))\n"
                   % sys.executable)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", "%s:%s" % (bindir, os.environ["PATH"]))


def test_image_sync_delivers_a_migration_image_and_records_it_on_both_ends(tmp_path, capsys, local_ssh):
    target_journal = Journal(str(tmp_path / "journal-b"), "m-1", "target")
    unused, begun = migration.begin_target(target_journal, str(tmp_path / "images-b" / "m-1"))
    source_journal = Journal(str(tmp_path / "journal-a"), "m-1", "source")
    with source_journal.hold(wait=5, purpose="the checkpoint this test stands for"):
        for phase in ("planned", "freezing", "frozen"):
            source_journal.transition(phase)
        source_journal.transition("checkpointed", nonce=begun["nonce"])
    src, manifest = _image(tmp_path, nonce=begun["nonce"])
    res = _run(gpu_image_sync, capsys, src=str(src), dest_host="hostb", dest=begun["image_dir"], streams=2,
               python=sys.executable, migration_id="m-1", journal_dir=str(tmp_path / "journal-a"),
               dest_journal_dir=str(tmp_path / "journal-b"))
    assert res["changed"] and not res.get("failed"), res
    assert res["bytes_total"] == image.image_bytes(manifest) and "sent" in res["msg"]
    assert image.load_manifest(begun["image_dir"])["id"] == "img-1"
    assert source_journal.phase == "delivered" and target_journal.phase == "received"


def test_image_sync_in_check_mode_reports_the_size_and_sends_nothing(tmp_path, capsys):
    src, manifest = _image(tmp_path)
    res = _run(gpu_image_sync, capsys, src=str(src), dest_host="hostb", dest=str(tmp_path / "dest"),
               _ansible_check_mode=True)
    assert res["changed"] and not res.get("failed")
    assert res["bytes_total"] == image.image_bytes(manifest)
    assert not os.path.exists(tmp_path / "dest")


def test_image_sync_of_a_migration_without_a_checkpoint_here_is_refused(tmp_path, capsys):
    src, unused = _image(tmp_path)
    res = _run(gpu_image_sync, capsys, src=str(src), dest_host="hostb", dest=str(tmp_path / "dest"),
               migration_id="m-1", journal_dir=str(tmp_path / "journal"))
    assert res["failed"] and res["stage"] == "transfer"
    assert "no checkpoint to send" in res["msg"] and "nothing was sent" in res["msg"]
    assert not os.path.exists(tmp_path / "dest")


@pytest.mark.parametrize("push,words", [
    ({"host": "hostb", "dest": "/var/lib/gpuckpt/images/x", "streams": 65}, "push.streams must be 0 (automatic) to 64"),
    ({"to": "gpu-node-2", "dest": "/var/lib/gpuckpt/images/x"}, "push.to 'gpu-node-2' was not resolved"),
    ({"host": "hostb", "dest": "relative/x"}, "push.dest must be an absolute path"),
    ({"host": "-oProxyCommand=x", "dest": "/var/lib/gpuckpt/images/x"}, "is not a host name or address"),
])
def test_a_bad_push_is_refused_before_anything_is_frozen(tmp_path, capsys, push, words):
    image_dir = tmp_path / "img"
    res = _run(gpu_checkpoint, capsys, pid=os.getpid(), image_dir=str(image_dir), push=push)
    assert res["failed"] and words in res["msg"], res
    assert not os.path.exists(image_dir)


def test_a_migration_action_of_the_target_is_refused_on_the_source(tmp_path, capsys):
    res = _run(gpu_migration, capsys, migration_id="m-1", role="source", action="begin",
               journal_dir=str(tmp_path / "journal"), image_dir=str(tmp_path / "img"))
    assert res["failed"] and res["stage"] == "preflight" and "action of the target's journal" in res["msg"]
    assert not os.path.exists(tmp_path / "img")


def test_a_migration_cannot_begin_in_a_directory_that_exists(tmp_path, capsys):
    victim = tmp_path / "someones-data"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    res = _run(gpu_migration, capsys, migration_id="m-1", role="target", action="begin",
               journal_dir=str(tmp_path / "journal"), image_dir=str(victim))
    assert res["failed"] and "exists already" in res["msg"] and "nothing was frozen" in res["msg"]
    assert (victim / "keep.txt").read_text() == "mine\n"
    assert Journal(str(tmp_path / "journal"), "m-1", "target").read() is None


def test_a_rollback_of_an_unknown_migration_touches_nothing(tmp_path, capsys):
    victim = tmp_path / "someones-data"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    for role in ("target", "source"):
        res = _run(gpu_migration, capsys, migration_id="t-unrelated", role=role, action="rollback",
                   journal_dir=str(tmp_path / "journal"), image_dir=str(victim))
        assert not res.get("failed"), res
        assert "phase" in res and "journal" in res
    assert (victim / "keep.txt").read_text() == "mine\n"


def test_every_migration_action_in_check_mode_only_reports_the_journal(tmp_path, capsys):
    res = _run(gpu_migration, capsys, migration_id="m-1", role="target", action="begin",
               journal_dir=str(tmp_path / "journal"), image_dir=str(tmp_path / "img"), _ansible_check_mode=True)
    assert res["changed"] is False and res["msg"] == "phase None"
    assert not os.path.exists(tmp_path / "img")


def test_facts_report_the_tree_asked_for_and_no_containers_when_none_are_listed(capsys):
    res = _run(cuda_process_facts, capsys, tree_of=os.getpid(), check_criu=False, list_containers=[])
    facts = res["ansible_facts"]["gpuckpt"]
    assert res["changed"] is False
    assert os.getpid() in facts["tree"]["pids"]
    assert facts["gpu_containers"] == [] and "container" not in facts
