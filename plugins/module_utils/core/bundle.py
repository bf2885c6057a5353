# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Modules of this package and a main as one Python program that needs nothing of ours installed where it runs:
the transfer's receiver (transfer/streams.receiver_program, sent as the first bytes of each ssh stream) and the pod
restore's runtime handler (k8s/restore_handler.handler_program, installed on a node).

The program carries the sources of the modules that the main imports of this package, and of the modules those
import, in a dict by their full names, and installs an importer over it at the front of ``sys.meta_path`` (as
AnsiballZ carries a module's module_utils in a zip): each module runs as it does in the package, with its own
imports, and the parent packages are made empty. Standard library only; the program runs with the target's
python3 (3.7 or later: the modules use ``from __future__ import annotations``).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re

# The package whose modules a program carries: this collection's module_utils, by the name it was imported under.
PACKAGE = __name__.rsplit(".", 2)[0]
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.M)

_IMPORTER = '''
import importlib.abc
import importlib.util
import sys


class _BundledModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The modules this program carries, imported by their names in the package (gpuckpt.fleet's core/bundle.py)."""

    def __init__(self, sources):
        self.sources = sources
        self.packages = set()
        for name in sources:
            parts = name.split(".")
            self.packages.update(".".join(parts[:i]) for i in range(1, len(parts)))

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.sources or fullname in self.packages:
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname in self.packages)
        return None

    def is_package(self, fullname):
        return fullname in self.packages

    def get_source(self, fullname):
        return self.sources.get(fullname, "")

    def get_filename(self, fullname):
        # A name no file has (a traceback's lines come from get_source), and no "<...>", which linecache skips.
        return "/<gpuckpt bundle>/" + fullname.replace(".", "/") + ("/__init__.py" if self.is_package(fullname) else ".py")

    def exec_module(self, module):
        exec(compile(self.get_source(module.__name__), self.get_filename(module.__name__), "exec"), module.__dict__)


sys.meta_path.insert(0, _BundledModules(_SOURCES))
'''


def module_source(mod):
    """The source of one of our modules, also from inside an AnsiballZ zip or through Ansible's collection loader
    on the controller (whose ``get_source`` returns bytes)."""
    loader = getattr(mod, "__loader__", None)
    if loader is not None and hasattr(loader, "get_source"):
        src = loader.get_source(mod.__name__)
        if src:
            return src.decode("utf-8") if isinstance(src, bytes) else src
    with open(mod.__file__) as fh:
        return fh.read()


def _ours(name):
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _imported_modules(source, package):
    """The modules of this package that ``source`` imports (at any depth of its code), imported here: a module named
    by ``from X import name`` where X is a package, X itself otherwise. ``package``: the package of the source, for
    its relative imports (None for a main)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(importlib.import_module(a.name) for a in node.names if _ours(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            if not _ours(base):
                continue
            mod = importlib.import_module(base)
            if hasattr(mod, "__path__"):  # a package: its names are its modules
                found.extend(importlib.import_module(base + "." + a.name) for a in node.names)
            else:
                found.append(mod)
    return [m for m in found if not hasattr(m, "__path__")]


def bundled_sources(main_source):
    """{module name: source} of every module of this package that ``main_source`` needs, directly or through
    another module of it."""
    sources, todo = {}, _imported_modules(main_source, None)
    while todo:
        mod = todo.pop()
        if mod.__name__ in sources:
            continue
        sources[mod.__name__] = source = module_source(mod)
        todo.extend(_imported_modules(source, mod.__package__))
    return sources


def _literal(text):
    """``text`` as a Python string literal of the same lines, so the program reads as its modules do."""
    return '"""' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r") + '"""'


def program(main_source, header=""):
    """One Python program: ``header`` (comments), the sources of this package's modules that ``main_source`` needs
    and their importer, then ``main_source`` (less its ``from __future__`` imports, which a program takes only at
    its start), run as the program's ``__main__``."""
    main_source = _FUTURE.sub("", main_source)
    sources = bundled_sources(main_source)
    parts = [header, "_SOURCES = {}\n"]
    for name in sorted(sources):
        parts.append("_SOURCES[%r] = %s\n" % (name, _literal(sources[name])))
    parts.append(_IMPORTER)
    parts.append("# ---- main ----\n")
    parts.append(main_source)
    return "".join(parts)
