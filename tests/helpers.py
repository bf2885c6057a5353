"""Helpers shared by the tests (plain functions; fixtures live in conftest.py)."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS = os.path.join(REPO, ".build", "collections")
VENV_BIN = os.path.join(REPO, ".venv", "bin")
# On the GPU machine there is no venv: tests/gpu/run_on_device.sh points this at the carried ansible.
ANSIBLE_PLAYBOOK = os.environ.get("GPUCKPT_ANSIBLE_PLAYBOOK") or os.path.join(VENV_BIN, "ansible-playbook")
FAKE_LIBCUDA = os.path.join(REPO, "tests", "fakecuda", "libcuda.so.1")
COUNTER = os.path.join(REPO, "tests", "workloads", "counter.py")
# Modules run on the managed host's system Python with the standard library alone.
MANAGED_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as fh:
                    data = fh.read()
                ppid = int(data[data.rindex(")") + 2:].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
        return data[data.rindex(")") + 2] not in "ZX"
    except OSError:
        return False
