"""CRIU's own zdtm static tests (built by tests/setup.sh from the CRIU source tarball) through
gpuckpt.fleet's gpu_checkpoint and gpu_restore, against plain CRIU on the same machine.

Each test sets up some kernel state (a zombie, a stopped task, a pending signal, file locks, sockets,
timers, sessions...), is dumped and restored, then checks its state and writes PASS or FAIL. A test
that plain CRIU passes must pass through the modules too: no validation that kills a restored tree
for holding a zombie or a stopped task, no flag the modules fail to find. A test whose result differs
is run again in both ways, so that a test that is flaky on this machine is told from a real difference.
The runner is tests/zdtm/zdtm_tests.py; the results are in .build/zdtm-results.json (docs/migration.md).

The whole selection (about 300 tests, each dumped and restored twice) takes 14 minutes on a 2-core CI machine,
a third of the suite's budget. CI runs every sixteenth test of the sorted selection (a fixed sixteenth, so a result
does not move from run to run); GPUCKPT_ZDTM_ALL=1 runs them all, as done before each release.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

SRC = os.path.join(REPO, ".build", "criu-4.2.1")
RUNNER = os.path.join(REPO, "tests", "zdtm", "zdtm_tests.py")
RESULTS = os.path.join(REPO, ".build", "zdtm-results.json")


EVERY = 1 if os.environ.get("GPUCKPT_ZDTM_ALL") == "1" else 16


def _selection():
    """The tests this run takes: the runner's selection, or every EVERY-th of it."""
    res = subprocess.run([sys.executable, RUNNER, "--src", SRC, "--mode", "list"], check=True, stdout=subprocess.PIPE,
                         universal_newlines=True, timeout=600)
    return json.loads(res.stdout)["selected"][::EVERY]


def _run(mode, out, names=()):
    subprocess.run([sys.executable, RUNNER, "--src", SRC, "--mode", mode, "--out", out] + list(names), check=True,
                   stdout=subprocess.DEVNULL, timeout=3600)
    with open(out) as fh:
        return {r["test"]: r["result"] for r in map(json.loads, fh)}


@pytest.mark.skipif(not os.path.exists(os.path.join(SRC, "test", "zdtm", "static", "env00")),
                    reason="tests/setup.sh builds the zdtm tests")
@pytest.mark.timeout(3600)
def test_zdtm_static_tests_pass_through_the_modules_as_with_plain_criu(tmp_path):
    chosen = _selection()
    plain = _run("plain", str(tmp_path / "plain.jsonl"), chosen)
    modules = _run("modules", str(tmp_path / "modules.jsonl"), chosen)
    differ = sorted(t for t in plain if (plain[t] == "PASS") != (modules.get(t) == "PASS"))
    again = {}
    if differ:  # told apart from flaky tests: both ways again
        again = {"plain": _run("plain", str(tmp_path / "plain2.jsonl"), differ),
                 "modules": _run("modules", str(tmp_path / "modules2.jsonl"), differ)}
    real = [t for t in differ if plain[t] == "PASS" and again["plain"][t] == "PASS" and again["modules"][t] != "PASS"]
    flaky = [t for t in differ if t not in real]
    summary = {"selected": len(plain), "plain_passed": sum(r == "PASS" for r in plain.values()),
               "modules_passed": sum(r == "PASS" for r in modules.values()), "flaky": flaky,
               "only_plain": real, "plain": plain, "modules": modules, "again": again}
    with open(RESULTS, "w") as fh:
        json.dump(summary, fh, indent=1, sort_keys=True)
    assert not real, "plain CRIU passes these, the modules fail them: %s" % {t: modules[t] for t in real}
    assert summary["plain_passed"] > 200 // EVERY, summary["plain_passed"]
