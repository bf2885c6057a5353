"""runtimes/cli.py: the one command-line client of podman, docker, runc and runsc: the binary, the runtime's
global options given when it is made, then the command; a failure is core/run.py's, naming the command."""
from __future__ import annotations

import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import CommandError, GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import registry
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.cli import RuntimeCli


def _tool(tmp_path, name, script):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_each_backend_puts_its_global_options_before_the_command(tmp_path):
    tool = _tool(tmp_path, "rt", "exit 0\n")
    cases = {
        "runc": ({"runc_path": tool, "runc_root": "/r"}, ["--root", "/r"]),
        "podman": ({"podman_path": tool, "podman_root": "/s", "podman_runroot": "/u"}, ["--root", "/s", "--runroot", "/u"]),
        "docker": ({"docker_path": tool, "docker_host": "unix:///d.sock"}, ["--host", "unix:///d.sock"]),
        "runsc": ({"runsc_path": tool, "runsc_root": "/g", "runsc_flags": ["--nvproxy=true"]},
                  ["--root", "/g", "--nvproxy=true"]),
    }
    for name, (params, options) in cases.items():
        backend = registry.make(name, params)
        assert isinstance(backend.cli, RuntimeCli) and not hasattr(backend, "_cmd")
        assert backend.cli.argv("state", "c") == [tool] + options + ["state", "c"], name
        assert backend.cli.installed()


def test_a_root_taken_from_the_image_goes_into_the_command_line(tmp_path):
    tool = _tool(tmp_path, "runc", "exit 0\n")
    backend = registry.make("runc", {"runc_path": tool})
    assert backend.cli.argv("list") == [tool, "list"]
    backend.bind({"runtime": {"runc_root": "/from/image"}})
    assert backend.cli.argv("list") == [tool, "--root", "/from/image", "list"]


def test_a_failed_command_says_which_and_a_missing_binary_says_how_to_get_it(tmp_path):
    cli = RuntimeCli("rt", _tool(tmp_path, "rt", "echo nope >&2; exit 3\n"), global_args=["--root", "/r"])
    with pytest.raises(CommandError) as err:
        cli.run("pause", "c", stage="runtime-dump")
    assert err.value.cmd[1:] == ["--root", "/r", "pause", "c"] and "nope" in err.value.stderr
    assert cli.run("pause", "c", check=False).rc == 3
    missing = RuntimeCli("no-such-runtime-here", None, "install it")
    assert not missing.installed()
    with pytest.raises(GpuCkptError):
        missing.argv("list")
    assert os.path.exists(cli.path)
