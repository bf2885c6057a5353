"""core/bundle.py: modules of this package and a main as one program that runs where nothing of ours is installed, each
module with its own package imports (the receiver's and the pod restore handler's programs are made so)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import bundle

CORE = bundle.PACKAGE + ".core"
MAIN = """import json, os, sys, traceback
from %s import procfs
from %s.wait import wait_for
mods = {n: m.__file__ for n, m in sys.modules.items() if n.startswith("ansible_collections.") and not hasattr(m, "__path__")}
print(json.dumps({"modules": mods, "state": procfs.read_stat(os.getpid())["state"]}))
sys.stdout.flush()
try:
    wait_for(lambda: False, 0.01, "a thing that never comes")
except Exception:
    traceback.print_exc()  # (Python's own report of an uncaught exception reads lines from files only)
    sys.exit(3)
""" % (CORE, CORE)


def _run(program, tmp_path):
    """The program in an interpreter that knows no path to this collection (-I: no PYTHONPATH, no user site)."""
    return subprocess.run([sys.executable, "-I", "-c", program], cwd=str(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, check=False)


def test_the_program_carries_what_its_main_imports_and_their_imports(tmp_path):
    proc = _run(bundle.program(MAIN, header="# a test program\n"), tmp_path)
    out = json.loads(proc.stdout.splitlines()[0])
    # procfs imports errors and wait; nothing else of ours comes with it
    assert sorted(out["modules"]) == [CORE + ".errors", CORE + ".procfs", CORE + ".wait"], proc.stderr
    assert all(f.startswith("/<gpuckpt bundle>/ansible_collections/") for f in out["modules"].values())
    assert out["state"] == "R"
    # a failure in a carried module reads as in the package: its file and its line of source
    assert "WaitTimeout" in proc.stderr and "core/wait.py" in proc.stderr, proc.stderr
    assert "raise WaitTimeout(" in proc.stderr, proc.stderr


def test_a_program_without_the_bundle_would_not_import(tmp_path):
    """The check above means something: the same main, without its modules, finds none of ours."""
    proc = _run(MAIN, tmp_path)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize("text", ['plain', 'a "quoted" word', 'ends in a quote"', '"""triple"""', "back\\slash\\",
                                  "line\\\ncontinued", "\r\n windows", "tab\tand \\n escaped", "non-ascii: é ü"])
def test_each_source_is_carried_exactly(text):
    assert ast.literal_eval(bundle._literal(text)) == text


def test_future_imports_of_the_main_leave_the_program_valid(tmp_path):
    proc = _run(bundle.program("from __future__ import annotations\nprint('ok')\n"), tmp_path)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_a_loader_that_gives_bytes_is_read_as_text():
    """Ansible's collection loader, which loads this package for a filter on the controller (the role's
    k8s_restore_handler filter), gives a module's source as bytes: the bundle reads it as text."""
    class BytesLoader(object):
        def get_source(self, name):
            return ("# the source of %s\n" % name).encode("utf-8")

    class Module(object):
        __name__ = CORE + ".something"
        __loader__ = BytesLoader()

    assert bundle.module_source(Module()) == "# the source of %s.something\n" % CORE
