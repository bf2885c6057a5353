# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the role needs to know of containerd's config.toml, read as TOML (never edited here), printed as JSON:

    python3 containerd_config.py CONFIG DROP_IN_NAME RUNTIME [MARKER]

- ``version``: the config schema (3: containerd 2.x; 2, or 0 when absent: containerd 1.x's) and ``plugin``,
  the name of the CRI plugin whose runtimes it sets;
- ``drop_in_dir``: where a drop-in named DROP_IN_NAME is read by containerd, or null where the role must not
  use one. Only schema 3: containerd 2.x merges an imported file key by key, while containerd 1.6 and 1.7
  replace a whole plugin section with an imported one (containerd issue 5837), so a drop-in holding one
  runtime would wipe the node's CRI settings (its runc's SystemdCgroup, sandbox image, registries). The
  directory of an ``imports`` glob already there that the name matches, else ``conf.d`` beside CONFIG when
  the file has no ``imports`` at all (``add_import``: the role adds it);
- ``defined_in``: the files (CONFIG and those it imports) that define the CRI runtime RUNTIME, and
  ``marked``: CONFIG holds the role's own block of that runtime (an older run's, or schema 2's), the block
  blockinfile marks with MARKER (the nvidia runtime's by default);
- ``systemd_cgroup``: some runtime of the CRI plugin sets SystemdCgroup = true (the node's runc entry).

The TOML reader: Python's tomllib (3.11+), else tomli or toml where installed, else a reader of what these
answers need (top-level keys, table headers and SystemdCgroup lines), for older hosts without either.
"""
from __future__ import annotations

import ast
import fnmatch
import glob
import json
import os
import sys

NVIDIA_MARKER = "gpuckpt.fleet.nvidia_container_runtime"


def _loads():
    for name in ("tomllib", "tomli", "toml"):
        try:
            return __import__(name).loads
        except ImportError:
            continue
    return _minimal_loads


def _minimal_loads(text):
    """Top-level ``key = value`` pairs (strings, numbers, booleans, one-line arrays of them), every table a
    header names, and the SystemdCgroup keys: enough for these answers, not a TOML reader."""
    doc, table = {}, None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and not line.startswith("[["):
            table = _table(doc, _header_keys(line[1:].split("]", 1)[0].strip()))
            continue
        key, sep, value = line.partition("=")
        key = key.strip().strip('"')
        if not sep or (table is not None and key != "SystemdCgroup"):
            continue
        value = value.split(" #")[0].strip()
        try:
            parsed = {"true": True, "false": False}.get(value, None)
            parsed = ast.literal_eval(value) if parsed is None else parsed
        except (ValueError, SyntaxError):
            continue
        (doc if table is None else table)[key] = parsed
    return doc


def _header_keys(header):
    keys, cur, quoted = [], "", False
    for ch in header:
        if ch == '"':
            quoted = not quoted
        elif ch == "." and not quoted:
            keys.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return keys + [cur.strip()]


def _table(doc, keys):
    for key in keys:
        doc = doc.setdefault(key, {})
    return doc


def _runtimes(conf, plugin):
    return ((conf.get("plugins") or {}).get(plugin) or {}).get("containerd", {}).get("runtimes") or {}


def _read(path, loads):
    with open(path) as fh:
        text = fh.read()
    return text, loads(text)


def _drop_in_dir(config, imports, drop_in_name):
    """The directory of the first ``imports`` glob that a file named ``drop_in_name`` there matches; ``conf.d``
    beside ``config`` when it imports nothing; None when it imports only what such a file would not be."""
    for pattern in imports:
        directory = os.path.dirname(pattern)
        if "*" not in directory and fnmatch.fnmatch(os.path.join(directory, drop_in_name), pattern):
            return directory
    return None if imports else os.path.join(os.path.dirname(config), "conf.d")


def describe(config, drop_in_name, runtime, marker=NVIDIA_MARKER):
    loads = _loads()
    text, conf = _read(config, loads)
    version = int(conf.get("version") or 0)
    plugin = "io.containerd.cri.v1.runtime" if version == 3 else "io.containerd.grpc.v1.cri"
    imports = [p if os.path.isabs(p) else os.path.join(os.path.dirname(config), p) for p in conf.get("imports") or []]
    defined_in, systemd = [], False
    for path in [config] + sorted({f for p in imports for f in glob.glob(p)}):
        runtimes = _runtimes(conf if path == config else _read(path, loads)[1], plugin)
        if runtime in runtimes:
            defined_in.append(path)
        systemd = systemd or any((r.get("options") or {}).get("SystemdCgroup") is True for r in runtimes.values())
    return {"version": version, "plugin": plugin, "imports": imports,
            "drop_in_dir": _drop_in_dir(config, imports, drop_in_name) if version == 3 else None,
            "add_import": version == 3 and not imports, "defined_in": defined_in, "marked": ("# BEGIN %s\n" % marker) in text,
            "systemd_cgroup": systemd}


if __name__ == "__main__":
    json.dump(describe(*sys.argv[1:5]), sys.stdout)
