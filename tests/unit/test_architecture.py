"""The rooms of plugins/module_utils and what each may import (docs/architecture.md), checked on the source:
a room imports only the rooms below it, core/ only the standard library, and no file grows past 500 lines."""
from __future__ import annotations

import ast
import os
import sys

import pytest

from helpers import REPO

MU = os.path.join(REPO, "plugins", "module_utils")
# Each room and the rooms it may import (besides itself). Top-level files (module_common.py) may import all.
ALLOWED = {
    "core": set(),
    "cuda": {"core"},
    "k8s": {"core"},
    "replica": {"core"},
    "transfer": {"core", "replica"},
    "runtimes": {"core", "cuda", "k8s"},
    "engine": {"core", "cuda", "runtimes", "transfer"},
    "migration": {"core", "cuda", "runtimes", "engine"},
    "fleet": {"core", "cuda", "k8s", "replica", "transfer", "runtimes", "engine", "migration"},
}
# Third-party packages a room may import (lazily, where the host has them); the rest is the standard library.
THIRD_PARTY = {
    "cuda": {"pynvml"},
    "k8s": {"kubernetes", "urllib3"},
    "runtimes": {"grpc", "google"},
}
MAX_LINES = 500


def _sources():
    for root, unused, files in os.walk(MU):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, MU)
                if "containerd_proto" in rel:  # generated code (tools/gen_containerd_proto.sh)
                    continue
                yield rel, path


def _room(rel):
    parts = rel.split(os.sep)
    return parts[0] if len(parts) > 1 else None


def _imports(rel, path):
    """(room imported, line) for each relative import; (top-level package, line) for each absolute one."""
    tree = ast.parse(open(path).read(), path)
    pkg = rel.split(os.sep)[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            target = base + (node.module.split(".") if node.module else [])
            names = [target] if node.module else [target + [a.name] for a in node.names]
            for t in names:
                yield "rel", (t[0] if len(t) > 1 or t[0] in ALLOWED else None), node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield "abs", node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield "abs", a.name.split(".")[0], node.lineno


@pytest.mark.parametrize("rel,path", list(_sources()), ids=[rel for rel, unused in _sources()])
def test_room_imports_only_rooms_below_it(rel, path):
    room = _room(rel)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for kind, target, line in _imports(rel, path):
        if kind == "rel" and room is not None and target not in (None, room) and target not in ALLOWED[room]:
            bad.append("line %d imports room %s" % (line, target))
        if kind == "abs" and room is not None and target not in stdlib and target not in THIRD_PARTY.get(room, ()):
            bad.append("line %d imports %s (not the standard library)" % (line, target))
    assert not bad, "%s (room %s may import %s): %s" % (rel, room, sorted(ALLOWED.get(room, ())) or "nothing",
                                                        "; ".join(bad))


def test_no_module_utils_file_is_too_long():
    long_files = ["%s (%d lines)" % (rel, n) for rel, path in _sources()
                  for n in [len(open(path).readlines())] if n > MAX_LINES]
    assert not long_files


def test_every_room_is_known():
    rooms = {d for d in os.listdir(MU) if os.path.isdir(os.path.join(MU, d)) and d != "__pycache__"}
    assert rooms <= set(ALLOWED), rooms - set(ALLOWED)


def test_no_import_falls_back_in_the_rooms_that_programs_carry():
    """The receiver and the pod restore handler are bundled with an importer (core/bundle.py): their modules import
    as in the package, so none catches ImportError (third-party imports of the rooms above may)."""
    fallbacks = ["%s:%d" % (rel, node.lineno) for rel, path in _sources() if _room(rel) in ("core", "replica", "transfer")
                 for node in ast.walk(ast.parse(open(path).read(), path))
                 if isinstance(node, ast.ExceptHandler) and "ImportError" in ast.dump(node.type or ast.Pass())]
    assert not fallbacks
