"""runtimes/registry.py and the backends' declared capabilities: a module's ``runtime`` builds the backend
of that runtime with the user's options, and what each runtime can do is what the engine is told."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils import module_common
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import registry
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.base import Capabilities

# What a user can count on from each runtime (docs/runtimes.md): held stopped for a migration's source,
# CRIU or not, the CUDA processes inside a sandbox, the restored pids the dumped ones.
EXPECTED = {
    "process": dict(can_hold_stopped=True, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=True),
    "runc": dict(can_hold_stopped=True, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=False),
    "podman": dict(can_hold_stopped=False, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=False),
    "docker": dict(can_hold_stopped=False, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=False),
    "containerd": dict(can_hold_stopped=True, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=False),
    "runsc": dict(can_hold_stopped=True, uses_criu=False, cuda_in_sandbox=True, restores_host_pids=False),
    "k8s_pod": dict(can_hold_stopped=True, uses_criu=True, cuda_in_sandbox=False, restores_host_pids=False),
}


def test_the_modules_offer_every_runtime_the_registry_builds():
    assert module_common.RUNTIMES == registry.RUNTIMES == list(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_runtime_builds_its_backend_with_its_declared_capabilities(name):
    backend = registry.make(name, {"tcp_established": True, "runtime_timeout": 12.5})
    assert backend.name == name
    assert isinstance(backend.capabilities, Capabilities)
    assert {k: getattr(backend.capabilities, k) for k in EXPECTED[name]} == EXPECTED[name]
    assert backend.tcp_established is True and backend.timeout == 12.5


def test_a_runtime_timeout_of_zero_means_no_limit():
    assert registry.make("runc", {"runtime_timeout": 0}).timeout is None


def test_an_unknown_runtime_name_is_a_bare_process_tree():
    """An image whose manifest names no runtime (or one this collection does not know) is restored as a
    process tree, as before the registry."""
    assert registry.make("nonsense", {}).name == "process"
    assert module_common.make_backend("nonsense", {}).name == "process"


def test_runsc_runs_the_cuda_stage_itself_only_when_told_or_when_its_image_says_so():
    plain = registry.make("runsc", {})
    told = registry.make("runsc", {"runsc_cuda_stage": "runsc"})
    assert plain.capabilities.owns_cuda_stage is False and told.capabilities.owns_cuda_stage is True
    plain.bind({"runtime": {"backend": "runsc", "cuda_stage": "runsc"}})
    assert plain.capabilities.owns_cuda_stage is True
    assert registry.make("runsc", {}).capabilities.owns_cuda_stage is False, "one backend's image changes no other"


@pytest.mark.parametrize("given, runtime", [
    (dict(pid=42), "process"),
    (dict(pid=42, runtime="process"), "process"),
    (dict(container="c1"), "runc"),
    (dict(container="c1", runtime="podman"), "podman"),
    (dict(pod="ns/p", runtime="runc"), "k8s_pod"),
    (dict(pod="ns/p"), "k8s_pod"),
])
def test_the_runtime_is_named_from_the_workload(given, runtime):
    """What gpu_checkpoint and the migration's plan both infer where the user names no runtime."""
    assert registry.runtime_of(given.get("container"), given.get("pod"), given.get("runtime")) == runtime
