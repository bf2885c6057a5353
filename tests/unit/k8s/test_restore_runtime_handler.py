"""The runtime handler's own rules, without containerd (tests/integration/test_k8s_pods.py runs it under
containerd's runc shim), on the program the role installs (the handler's code assembled with the restore
protocol): runc's command line read right, a checkpoint refused unless it is root's under an image root and
its ticket names the pod and matches the token, one restore per container."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program

SOURCE = os.path.join(REPO, "roles", "nvidia_container_runtime", "files", "gpuckpt_restore_runtime.py")
with open(SOURCE) as fh:
    PROGRAM = handler_program(fh.read())
handler = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpuckpt_restore_runtime", loader=None))
_META_PATH = list(sys.meta_path)
exec(compile(PROGRAM, "gpuckpt_restore_runtime.py", "exec"), handler.__dict__)
sys.meta_path[:] = _META_PATH  # the program's importer is its own; this process imports the package itself


@pytest.mark.parametrize("argv, expected", [
    (["--root", "/run/r", "--log", "/b/log.json", "--log-format", "json", "--systemd-cgroup", "create", "--bundle",
      "/b", "--pid-file", "/b/init.pid", "abc"],
     (["--root", "/run/r", "--log", "/b/log.json", "--log-format", "json", "--systemd-cgroup"], "create",
      ["--bundle", "/b", "--pid-file", "/b/init.pid"], "abc")),
    (["start", "abc"], ([], "start", [], "abc")),
    (["--version"], (["--version"], None, [], None)),
])
def test_runc_command_lines_are_read_as_runc_reads_them(argv, expected):
    assert handler.split_args(argv) == expected


def ticket(tmp_path, pod="default/p", token="t0k"):
    root = tmp_path / "images"
    image = root / "m1"
    os.makedirs(str(image / "containers" / "c"), mode=0o700)
    os.chmod(str(root), 0o700)
    os.chmod(str(image), 0o700)
    with open(str(image / handler.TICKET), "w") as fh:
        json.dump({"pod": pod, "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                   "containers": [{"name": "c"}]}, fh)
    os.chmod(str(image / handler.TICKET), 0o600)
    return {"image_roots": [str(root)]}, str(image)


def test_a_checkpoint_is_taken_only_from_root_under_an_image_root_with_its_ticket(tmp_path):
    config, image = ticket(tmp_path)
    assert handler.checked_image(config, image) == image
    assert handler.read_ticket(image, "default/p", "t0k")["pod"] == "default/p"
    with pytest.raises(handler.Refused, match="not under the image roots"):
        handler.checked_image(config, "/etc")
    os.symlink(image, str(tmp_path / "images" / "link"))
    with pytest.raises(handler.Refused, match="free of symlinks"):
        handler.checked_image(config, str(tmp_path / "images" / "link"))
    with pytest.raises(handler.Refused, match="is for pod default/p, not default/q"):
        handler.read_ticket(image, "default/q", "t0k")
    with pytest.raises(handler.Refused, match="token"):
        handler.read_ticket(image, "default/p", "guess")
    os.chmod(image, 0o777)
    with pytest.raises(handler.Refused, match="writable by root alone"):
        handler.checked_image(config, image)


def test_a_create_waits_for_the_ticket_the_node_writes_and_then_checks_it(tmp_path):
    """The target pod is created as soon as the image has left the source; the node writes the ticket once
    the image is verified: the create waits for it (no kubelet back-off), within ticket_wait."""
    import threading
    config, image = ticket(tmp_path)
    path = os.path.join(image, handler.TICKET)
    os.rename(path, path + ".later")
    config = dict(config, ticket_wait=0.5)
    with pytest.raises(handler.Refused, match="no restore ticket"):
        handler.wait_for_ticket(config, handler.checked_image(config, image))
    timer = threading.Timer(0.3, os.rename, (path + ".later", path))
    timer.start()
    assert handler.wait_for_ticket(dict(config, ticket_wait=10), image) == image
    timer.join()
    os.chmod(path, 0o666)  # a ticket anyone may write is no ticket
    with pytest.raises(handler.Refused, match="writable by root alone"):
        handler.wait_for_ticket(config, image)


def test_each_container_is_restored_once(tmp_path):
    unused, image = ticket(tmp_path)
    cdir = os.path.join(image, "containers", "c")
    assert handler.take_claim(cdir) == (True, None)
    assert handler.take_claim(cdir) == (False, "restoring")  # a second create while the first restores
    handler.set_claim(cdir, "restored")
    assert handler.take_claim(cdir) == (False, "restored")


def test_the_installed_program_needs_only_the_standard_library_and_is_runc_but_for_a_restore(tmp_path):
    """As the node runs it (no Ansible, no collection on the path): a command that is no restore goes to runc as
    given; a create whose restore request is refused fails with the reason in runc's log, for the kubelet's
    events, and runc is not run."""
    d = tmp_path / "handler"
    d.mkdir()
    (d / "gpuckpt_restore_runtime.py").write_text(PROGRAM)
    runc = d / "runc"
    runc.write_text("#!/bin/sh\necho \"$@\" >> %s\n" % (tmp_path / "runc-calls"))
    runc.chmod(0o755)
    (d / "restore-runtime.json").write_text(json.dumps({"runc": str(runc), "image_roots": [str(tmp_path / "images")],
                                                        "state_dir": str(tmp_path / "state")}))

    def run(*argv):
        return subprocess.run([sys.executable, "-I", "-S", str(d / "gpuckpt_restore_runtime.py")] + list(argv),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                              env={"PATH": os.environ["PATH"]}, check=False)
    started = run("--root", "/run/r", "start", "abc")
    assert started.returncode == 0, started.stderr
    assert (tmp_path / "runc-calls").read_text() == "--root /run/r start abc\n"

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"annotations": {
        handler.RESTORE_ANNOTATION: json.dumps({"image": "/etc", "token": "t0k"}),
        handler.SANDBOX_NS: "default", handler.SANDBOX_NAME: "p", handler.CONTAINER_NAME: "c"}}))
    log = tmp_path / "log.json"
    refused = run("--log", str(log), "create", "--bundle", str(bundle), "def")
    assert refused.returncode == 1, refused.stderr
    assert "checkpoint /etc is not under the image roots" in json.loads(log.read_text())["msg"]
    assert (tmp_path / "runc-calls").read_text() == "--root /run/r start abc\n"  # runc was not run


def diff_tar(path, members):
    import io
    import tarfile
    with tarfile.open(path, "w") as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = tarfile.LNKTYPE, data
                tf.addfile(info)
    return path


def test_the_writable_layer_is_applied_inside_the_rootfs_only(tmp_path):
    """A symlink that the workload's image put where its layer has a file is replaced, not written through
    to the host file it names; a hard link to a host file is refused."""
    host_file = tmp_path / "host-file"
    host_file.write_text("host")
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    os.symlink(str(host_file), str(rootfs / "etc" / "passwd"))
    os.symlink(str(tmp_path), str(rootfs / "escape"))
    handler.apply_rootfs_diff(diff_tar(str(tmp_path / "d1.tar"), [("etc/passwd", "file", b"layer")]), str(rootfs))
    assert host_file.read_text() == "host"
    assert not os.path.islink(str(rootfs / "etc" / "passwd")) and (rootfs / "etc" / "passwd").read_text() == "layer"
    for members, says in [([("escape/host-file", "file", b"x")], "leaves the rootfs"),
                          ([("etc/shadow", "link", str(host_file))], "hard link"),
                          ([("etc/shadow", "link", "escape/host-file")], "hard link")]:
        with pytest.raises(handler.Refused, match=says):
            handler.apply_rootfs_diff(diff_tar(str(tmp_path / "d2.tar"), members), str(rootfs))
        assert host_file.read_text() == "host"
        assert os.stat(str(host_file)).st_nlink == 1


@pytest.mark.parametrize("path, expected", [
    ("kubepods-besteffort-pod0a1b.slice:cri-containerd:abc",
     "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a1b.slice/cri-containerd-abc.scope"),
    ("system.slice:docker:abc", "/system.slice/docker-abc.scope"),
    (":cri-containerd:abc", "/system.slice/cri-containerd-abc.scope"),
])
def test_the_systemd_drivers_cgroup_path_is_the_one_systemd_makes(path, expected):
    assert handler.systemd_cgroup_path(path) == expected


def test_on_cgroup_v2_criu_is_told_the_new_containers_cgroup(tmp_path, monkeypatch):
    """Else CRIU puts the restored processes back into the held source's cgroup, which is frozen."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(handler, "CGROUP_FS", str(tmp_path))
    spec = {"linux": {"cgroupsPath": "/k8s.io/new-container"}}
    assert handler.cgroup_root(spec) == "/k8s.io/new-container"
    conf = str(tmp_path / "criu.conf")
    flags = handler.criu_config(conf, {"auto_flags": ["--file-locks", "--link-remap"]}, handler.cgroup_root(spec))
    assert flags == ["--file-locks"]
    # (and, read last by CRIU, an empty plugin directory of its own: CRIU's cuda plugin is never loaded)
    assert open(conf).read() == "link-remap\ncgroup-root /k8s.io/new-container\nlibdir %s\n" % (tmp_path / "criu-no-plugins")
    assert os.listdir(str(tmp_path / "criu-no-plugins")) == []
    monkeypatch.setattr(handler, "CGROUP_FS", str(tmp_path / "v1"))
    assert handler.cgroup_root(spec) is None
