"""engine/plan.py's CheckpointContext declares every field the checkpoint's steps share: the plan gives its
values when it is made, and a step that sets a name it does not declare fails."""
from __future__ import annotations

import ast
import dataclasses
import glob
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import plan

ENGINE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "plugins", "module_utils", "engine")
PLAN = dict(target=1, image_dir="/img", root=1, pids=[1], cuda_pids=[], drv=None, host={}, gpu_stage="none",
            runtime_facts={}, identities={}, states={}, cuda_gpus={}, after="exit", backend=None, opts=None)


def test_a_name_the_context_does_not_declare_cannot_be_set():
    ctx = plan.CheckpointContext(**PLAN)
    ctx.frozen_at = 1.5
    assert (ctx.frozen_at, ctx.locked, ctx.pid_map, ctx.calls0) == (1.5, [], {}, 0)
    with pytest.raises(AttributeError):
        ctx.undeclared = True
    with pytest.raises(TypeError):
        plan.CheckpointContext(undeclared=True, **PLAN)


def test_every_field_the_engine_sets_on_a_context_is_declared():
    declared = {f.name for f in dataclasses.fields(plan.CheckpointContext)}
    set_here = set()
    for path in glob.glob(os.path.join(ENGINE, "*.py")):
        with open(path) as fh:
            for node in ast.walk(ast.parse(fh.read())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                        isinstance(node.value, ast.Name) and node.value.id in ("c", "ctx"):
                    set_here.add((os.path.basename(path), node.attr))
    assert set_here and not {(f, a) for f, a in set_here if a not in declared}
