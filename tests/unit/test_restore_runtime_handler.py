"""The runtime handler's own rules, without containerd (tests/integration/test_k8s_pods.py runs it under
containerd's runc shim): runc's command line read right, a checkpoint refused unless it is root's under an
image root and its ticket names the pod and matches the token, one restore per container."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "roles",
                    "nvidia_container_runtime", "files", "gpuckpt_restore_runtime.py")
spec = importlib.util.spec_from_file_location("gpuckpt_restore_runtime", PATH)
handler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(handler)


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


def test_each_container_is_restored_once(tmp_path):
    unused, image = ticket(tmp_path)
    cdir = os.path.join(image, "containers", "c")
    assert handler.claim(cdir) == (True, None)
    assert handler.claim(cdir) == (False, "restoring")  # a second create while the first restores
    handler.set_claim(cdir, "restored")
    assert handler.claim(cdir) == (False, "restored")
