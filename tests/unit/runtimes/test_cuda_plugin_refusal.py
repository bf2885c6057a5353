"""A runtime whose daemon runs CRIU with the node's own configuration (Docker, Podman, containerd, a pod) is refused
before anything is frozen when that CRIU would load CRIU's cuda plugin (issue 43, 10); the collection's own CRIU
commands (a bare process, runc) load no plugin, so they are not."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import base, registry


class FakeCriu(object):
    """CRIU's plugin facts as runtimes/criu.Criu.plugin_facts gives them."""

    def __init__(self, plugin_dir, cuda):
        self.facts = {"plugin_dir": plugin_dir, "default_plugin_dir": "/usr/lib/criu", "plugins": [],
                      "cuda_plugin": cuda, "plugins_loaded": False}

    def plugin_facts(self, env=None):
        assert env == {}  # the daemon's CRIU: the node's configuration, not this process's environment
        return self.facts


def test_a_cuda_plugin_in_the_directory_a_daemons_criu_loads_is_refused():
    with pytest.raises(InvalidTarget, match="cuda plugin /usr/lib/criu/cuda_plugin.so") as exc:
        base.refuse_cuda_plugin(FakeCriu("/usr/lib/criu", "/usr/lib/criu/cuda_plugin.so"), "docker")
    assert "nothing was frozen" in exc.value.msg and "libdir" in exc.value.hint


@pytest.mark.parametrize("plugin_dir, cuda", [
    (None, None),  # no plugin directory at all
    ("/var/lib/gpuckpt/criu-no-plugins", "/usr/lib/criu/cuda_plugin.so"),  # configured away from it
    ("/usr/lib/criu", None),  # plugins, but not the cuda one
])
def test_a_daemons_criu_that_would_not_load_it_is_not_refused(plugin_dir, cuda):
    base.refuse_cuda_plugin(FakeCriu(plugin_dir, cuda), "podman")


@pytest.mark.parametrize("runtime, refused", [("process", False), ("runc", False), ("docker", True), ("podman", True),
                                              ("containerd", True), ("k8s_pod", True)])
def test_each_runtime_declares_whether_its_criu_is_kept_from_plugins(runtime, refused):
    assert registry.make(runtime, {}).capabilities.keeps_criu_plugins_off is not refused
