"""Backends get everything they need when they are made (registry.make, or a copy from ``with_container``):
no code in plugins/ assigns an attribute of a backend from outside the backend's own methods, and no
backend changes its capabilities record."""
from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os

from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import base, registry

PLUGINS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "plugins")
RUNTIMES = os.path.join(PLUGINS, "module_utils", "runtimes")
PREFIX = "ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes."
# Assignments whose object is no backend, though its attribute has a backend attribute's name (each with why)
NOT_A_BACKEND = {
    ("module_utils/runtimes/containerd_api.py", "container.runtime.name"),  # a protobuf message's field
}
SETATTR_ON = {  # the objects that setattr() may set, by (file, its first argument): none is a backend
    ("module_utils/k8s/api.py", "cfg"),                  # the kubernetes client's Configuration
    ("module_utils/runtimes/containerd_api.py", "options"),  # a protobuf message of runc's options
}


def backend_classes():
    found = set()
    for path in glob.glob(os.path.join(RUNTIMES, "*.py")):
        mod = importlib.import_module(PREFIX + os.path.basename(path)[:-3])
        found |= {cls for cls in vars(mod).values() if inspect.isclass(cls) and issubclass(cls, base.Backend)}
    return found


def backend_attributes():
    """Every name a backend class has or sets on itself (``self.X =`` in its methods)."""
    names = set()
    for cls in backend_classes():
        names |= {a for a in dir(cls) if not a.startswith("__")}
        for node in ast.walk(ast.parse(inspect.getsource(cls))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _is_self(node):
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def pokes(source, rel, names):
    """``<obj>.<attr> = ...`` (and ``setattr(obj, ...)``) in ``source`` where obj is not the method's own
    ``self`` and attr is a backend attribute's name, less the allowed ones above."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and \
                not _is_self(node.value) and node.attr in names and (rel, ast.unparse(node)) not in NOT_A_BACKEND:
            out.append("%s:%d %s" % (rel, node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and not _is_self(node.args[0]) and (rel, ast.unparse(node.args[0])) not in SETATTR_ON:
            out.append("%s:%d %s" % (rel, node.lineno, ast.unparse(node)))
    return out


def test_no_backend_attribute_is_assigned_outside_its_class():
    names = backend_attributes()
    assert {"container", "tcp_established", "namespace", "capabilities", "sandbox_host_pid"} <= names
    found = []
    for path in sorted(glob.glob(os.path.join(PLUGINS, "**", "*.py"), recursive=True)):
        if "containerd_proto" in path:  # generated gRPC stubs
            continue
        rel = os.path.relpath(path, PLUGINS)
        with open(path) as fh:
            found += pokes(fh.read(), rel, names)
    assert not found, "give these as constructor arguments (registry.make) or use with_container(): %s" % found


def test_the_scan_catches_a_poke():
    names = backend_attributes()
    poked = "def f(backend, members):\n    backend.container = 'x'\n    members[0][1].tcp_established = True\n" \
            "    setattr(backend, 'timeout', 3)\n"
    assert len(pokes(poked, "x.py", names)) == 3
    assert not pokes("class B:\n    def f(self):\n        self.container = 1\n", "x.py", names)


def test_values_come_with_make_and_with_container_copies():
    backend = registry.make("runc", {"tcp_established": True})
    assert backend.tcp_established is True and registry.make("runc", {}).tcp_established is False
    bound = backend.with_container("job")
    assert (bound.container, backend.container) == ("job", None) and bound.tcp_established is True
    sandbox = registry.make("runsc", {}).with_container("sb", sandbox_host_pid=42)
    assert (sandbox.container, sandbox.sandbox_host_pid) == ("sb", 42)


def test_pod_members_are_made_with_the_pods_values():
    pod = registry.make("k8s_pod", {"tcp_established": True})
    member = pod._member("abc")
    assert (member.container, member.tcp_established, member.namespace) == ("abc", True, "k8s.io")


def test_capabilities_are_fixed_records():
    runsc = registry.backend_class("runsc")
    assert runsc.capabilities is registry.make("runsc", {}).capabilities
    for name in registry.RUNTIMES:
        assert isinstance(registry.backend_class(name).capabilities, base.Capabilities)


def test_a_restore_makes_the_backend_of_its_images_runtime_with_the_modules_values():
    from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import restore_backend_maker
    make = restore_backend_maker({"bundle": "/b", "runsc_cuda_stage": "runsc", "tcp_established": True})
    runsc = make({"runtime": {"backend": "runsc"}})
    assert (runsc.name, runsc.bundle, runsc.capabilities.owns_cuda_stage, runsc.tcp_established) == \
        ("runsc", "/b", True, True)
    assert make({}).name == "process", "an image of an older collection that recorded no runtime"
