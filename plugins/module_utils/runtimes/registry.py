# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The runtimes by name: which backend class each ``runtime`` names, and how a module's parameters
build one.

Each backend is imported only when it is built (a runtime's client libraries, gRPC for containerd,
load only where that runtime is used). The imports are written out, never computed from the name:
Ansible packs into a module exactly the module_utils its source imports.
"""
from __future__ import annotations


def _timeout(params):
    """runtime_timeout: seconds, or None (0, the default) for no limit."""
    return params.get("runtime_timeout") or None


def _tcp(params):
    """tcp_established: CRIU checkpoints the workload's established TCP connections."""
    return bool(params.get("tcp_established"))


def _process(params, bundle):
    from .process import ProcessBackend
    return ProcessBackend(params.get("criu_path"), params.get("criu_options"), timeout=_timeout(params), tcp_established=_tcp(params))


def _runc(params, bundle):
    from .runc import RuncBackend
    return RuncBackend(params.get("runc_path"), params.get("runc_root"), bundle, params.get("criu_path"),
                       params.get("criu_options"), timeout=_timeout(params), tcp_established=_tcp(params))


def _podman(params, bundle):
    from .podman import PodmanBackend
    return PodmanBackend(params.get("podman_path"), params.get("podman_root"), params.get("podman_runroot"),
                         params.get("criu_path"), params.get("criu_options"), timeout=_timeout(params), tcp_established=_tcp(params))


def _docker(params, bundle):
    from .docker import DockerBackend
    return DockerBackend(params.get("docker_path"), params.get("docker_host"), params.get("criu_path"),
                         params.get("criu_options"), timeout=_timeout(params), tcp_established=_tcp(params))


def _containerd(params, bundle):
    from .containerd import ContainerdBackend
    return ContainerdBackend(params.get("containerd_address"), params.get("containerd_namespace"),
                             params.get("runc_root"), params.get("criu_path"), params.get("criu_options"),
                             timeout=_timeout(params), tcp_established=_tcp(params))


def _runsc(params, bundle):
    from .runsc import RunscBackend
    return RunscBackend(params.get("runsc_path"), params.get("runsc_root"), bundle, params.get("runsc_flags"),
                        params.get("cuda_checkpoint_path"), timeout=_timeout(params),
                        cuda_stage=params.get("runsc_cuda_stage") or "engine", tcp_established=_tcp(params))


def _k8s_pod(params, bundle):
    from .k8s_pod import KubernetesPodBackend
    return KubernetesPodBackend(params.get("containerd_address"), params.get("runc_root"), params.get("criu_path"),
                                params.get("criu_options"), timeout=_timeout(params), pod_uid=params.get("pod_uid"),
                                containers=params.get("pod_containers"), restore_pod=params.get("restore_pod"),
                                restore_token=params.get("restore_token"), restore_wait=params.get("restore_wait"),
                                tcp_established=_tcp(params))


# name -> builder(params, bundle) of that runtime's backend, in the order the modules list them
BUILDERS = {
    "process": _process,
    "runc": _runc,
    "podman": _podman,
    "docker": _docker,
    "containerd": _containerd,
    "runsc": _runsc,
    "k8s_pod": _k8s_pod,
}
RUNTIMES = list(BUILDERS)
PROCESS_RUNTIME = "process"
POD_RUNTIME = "k8s_pod"
DEFAULT_CONTAINER_RUNTIME = "runc"


def runtime_of(container=None, pod=None, runtime=None):
    """The runtime of the workload named: a pod's, a container's (``runtime``, runc by default), else a process's
    (``runtime`` is what the user named; a pod or a bare pid decides it alone)."""
    if pod:
        return POD_RUNTIME
    if not container:
        return PROCESS_RUNTIME
    return runtime or DEFAULT_CONTAINER_RUNTIME


def backend_class(name):
    """The backend class of runtime ``name`` (a bare process tree for a name it does not know), imported only
    then: its declared ``capabilities`` are read without building it (a process backend finds CRIU at once)."""
    if name == "runc":
        from .runc import RuncBackend as cls
    elif name == "podman":
        from .podman import PodmanBackend as cls
    elif name == "docker":
        from .docker import DockerBackend as cls
    elif name == "containerd":
        from .containerd import ContainerdBackend as cls
    elif name == "runsc":
        from .runsc import RunscBackend as cls
    elif name == "k8s_pod":
        from .k8s_pod import KubernetesPodBackend as cls
    else:
        from .process import ProcessBackend as cls
    return cls


def make(name, params, bundle=None):
    """The backend of runtime ``name`` (a name it does not know: a bare process tree, as an image of an
    older collection that recorded none), made with everything it needs from a module's parameters.
    ``bundle``: an OCI bundle to restore into (runc, runsc)."""
    return BUILDERS.get(name, BUILDERS[PROCESS_RUNTIME])(params, bundle)
