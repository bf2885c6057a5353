"""The kubelet's containerd namespace and labels are named in k8s/names.py only; every other file imports them."""
from __future__ import annotations

import ast
import glob
import os

PLUGINS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "plugins")


def _is_kubelet_name(text):
    return text == "k8s.io" or text.startswith(("io.kubernetes.", "io.cri-containerd."))


def test_the_kubelets_names_are_defined_once():
    found = []
    for path in glob.glob(os.path.join(PLUGINS, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, PLUGINS)
        if rel == os.path.join("module_utils", "k8s", "names.py") or "containerd_proto" in rel:
            continue
        with open(path) as fh:
            tree = ast.parse(fh.read())
        found += ["%s:%d %r" % (rel, node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_kubelet_name(node.value)]
    assert not found, "import these from k8s/names.py: %s" % found
