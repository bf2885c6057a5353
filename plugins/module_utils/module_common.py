# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the modules share: the argument specs of the tools, the runtimes, a migration's journal, progress and
speed; the runtime backend from the options; checked path and command options; and run_engine, which turns
engine errors into fail_json. Module-specific steps are in _module_helpers.py."""
from __future__ import annotations

import shlex

from .core.errors import GpuCkptError
from .runtimes import registry

TOOL_ARGS = dict(
    criu_path=dict(type="path"),
    criu_options=dict(type="list", elements="str", default=[]),
    libcuda_path=dict(type="path"),
    runtime_timeout=dict(type="float", default=0),
    tcp_established=dict(type="bool", default=False),
)

RUNTIME_ARGS = dict(
    runc_path=dict(type="path"),
    runc_root=dict(type="path"),
    podman_path=dict(type="path"),
    podman_root=dict(type="path"),
    podman_runroot=dict(type="path"),
    docker_path=dict(type="path"),
    docker_host=dict(type="str"),
    containerd_address=dict(type="path", default="/run/containerd/containerd.sock"),
    containerd_namespace=dict(type="str", default="default"),
    runsc_path=dict(type="path"),
    runsc_root=dict(type="path"),
    runsc_flags=dict(type="list", elements="str", default=[]),
    cuda_checkpoint_path=dict(type="path"),
    runsc_cuda_stage=dict(type="str", choices=["engine", "runsc"], default="engine"),
)
RUNTIMES = list(registry.RUNTIMES)


def make_backend(name, params, bundle=None):
    """The runtime backend ``name`` built from a module's parameters (see runtimes/registry.py)."""
    return registry.make(name, params, bundle)


def backend_of_image(image_dir):
    """The backend an image was taken with (its manifest's runtime.backend); process by default."""
    from .core import image
    try:
        return (image.load_manifest(image_dir).get("runtime") or {}).get("backend") or registry.PROCESS_RUNTIME
    except Exception:  # noqa: BLE001 - the engine reports a bad image itself, with its reason
        return registry.PROCESS_RUNTIME


PROGRESS_ARGS = dict(
    progress_file=dict(type="path"),  # set by the action plugin of the same name (plugins/action)
)

SPEED_ARGS = dict(
    host_huge_pages=dict(type="bool", default=False),
)


# The workload a module acts on: exactly one of pid, container, pod; the runtime is inferred where not named
# (runtimes.registry.runtime_of).
WORKLOAD_ARGS = dict(
    pid=dict(type="int"),
    container=dict(type="str"),
    pod=dict(type="str"),
    runtime=dict(type="str", choices=RUNTIMES),
)

MIGRATION_ARGS = dict(
    migration_id=dict(type="str"),
    journal_dir=dict(type="path", default="/var/lib/gpuckpt/journal"),
)


def journal_for(params, role):
    """The migration journal for this host's role, or None outside a migration: the one place a module turns a
    migration's id and journal directory into its Journal (the receiver, a program of its own on the target, opens
    the target's from the same two values, which the sender hands it with the nonce)."""
    if not params.get("migration_id"):
        return None
    from .core.journal import Journal
    return Journal(params["journal_dir"], params["migration_id"], role)


def command_argv(module, name, value):
    """A command option (a probe, a quiesce command) as an argument vector: a list as given, a string
    split as a shell would split it (no shell runs it). None when not given."""
    if value is None or value == "" or value == []:
        return None
    argv = None
    if isinstance(value, (list, tuple)):
        argv = [str(v) for v in value]
    elif isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            module.fail_json(msg="%s %r cannot be split into arguments: %s; nothing was done" % (name, value, exc),
                             stage="preflight")
    else:
        module.fail_json(msg="%s must be a string or a list of strings, got %s; nothing was done"
                         % (name, type(value).__name__), stage="preflight")
    if not argv or any("\0" in a for a in argv):
        module.fail_json(msg="%s %r is empty or holds a NUL byte; nothing was done" % (name, value), stage="preflight")
    return argv


def check_path_arg(module, name, value):
    """An absolute path without control characters (it may reach a remote command), or fail."""
    if value is None:
        return None
    if not value.startswith("/") or any(ord(c) < 32 for c in value):
        module.fail_json(msg="%s must be an absolute path without control characters, got %r; nothing was done"
                         % (name, value), stage="preflight")
    return value


def run_engine(module, fn, *args, **kwargs):
    """Call an engine function; exit_json with its result, or fail_json with an error for people."""
    try:
        result = fn(*args, **kwargs)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    except Exception as exc:  # noqa: BLE001 - an engine bug must still reach the user as a failure
        import traceback
        module.fail_json(msg="gpuckpt engine error: %s" % exc, exception=traceback.format_exc())
    module.exit_json(**result)
