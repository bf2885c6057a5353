# -*- coding: utf-8 -*-
"""Test helper: append every task result of a playbook run to $GPUCKPT_RECORD as JSON lines,
so the integration tests can assert on `changed`, `failed`, `msg`, `stage` and the rest."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import time
import zipfile

from ansible import constants as C
from ansible.plugins.callback import CallbackBase
from ansible.release import __version__ as ANSIBLE_VERSION

DOCUMENTATION = """
name: record_results
type: aggregate
short_description: write task results to a JSON lines file (tests only)
description: [Writes every task result to the file named by GPUCKPT_RECORD.]
"""


def share_module_payloads(shared_root):
    """Every ansible-playbook run builds each module's payload (AnsiballZ) once, in a cache under its own temporary
    directory: it parses the module and every module_util it imports, the collection's 20,000 lines included. The
    tests' runs (about 650 in the suite) share one cache instead; one migration test's CPU fell from 19.3 to 13.5 s.
    This run's cache directory becomes a link to ``shared_root``/<ansible-core version>-<collections path> (what a
    payload is built from; the module's name, compression and extensions name each entry). Ansible writes
    each entry under a lock and renames it into place, so concurrent runs share it safely; its clean-up at exit
    removes only the link. Tests only: a user's runs build their payloads as Ansible does."""
    key = hashlib.sha256(os.environ.get("ANSIBLE_COLLECTIONS_PATH", "").encode()).hexdigest()[:16]
    shared = os.path.join(shared_root, "%s-%s" % (ANSIBLE_VERSION, key))
    os.makedirs(shared, exist_ok=True)
    link = os.path.join(C.DEFAULT_LOCAL_TMP, "ansiballz_cache")
    if not os.path.lexists(link):
        os.symlink(shared, link)


def _with_bytecode(zip_data):
    """The payload (base64 of a zip) with each .py beside its bytecode, as zipimport takes it: a .pyc stamped with
    the .py entry's time and size. A payload without them is compiled again at every module run, about 0.6 s of
    CPU for each of this collection's modules (1.19 s against 0.55 s for cuda_process_facts on the CI machine)."""
    src = zipfile.ZipFile(io.BytesIO(base64.b64decode(zip_data)))
    names = set(src.namelist())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            body = src.read(info)
            dst.writestr(info, body)
            if not info.filename.endswith(".py") or info.filename + "c" in names:
                continue
            try:
                code = compile(body, info.filename, "exec", dont_inherit=True, optimize=0)
            except (SyntaxError, ValueError):
                continue  # left to the host's Python, which says what is wrong as it would without this
            # zipimport reads the entry's DOS time as local time, as mktime does here (the hosts are this machine)
            mtime = int(time.mktime(info.date_time + (0, 0, -1)))
            pyc = importlib._bootstrap_external._code_to_timestamp_pyc(code, mtime, len(body))  # pylint: disable=protected-access
            dst.writestr(zipfile.ZipInfo(info.filename + "c", info.date_time), bytes(pyc),
                         compress_type=zipfile.ZIP_DEFLATED)
    return base64.b64encode(out.getvalue())


def precompile_module_payloads():
    """Each payload Ansible caches gets its modules' bytecode (``_with_bytecode``): the hosts run the same sources,
    without compiling them again at every task. Only where this ansible-core caches payloads as 2.19 does
    (``_CachedModule``); another one's payloads stay as it builds them. The hosts' Python is this machine's, the
    one the controller compiles with; a host of another Python finds a bytecode it does not take and compiles the
    source as usual. Tests only, as ``share_module_payloads``."""
    try:
        from ansible.executor import module_common  # pylint: disable=import-outside-toplevel
        cached_module = module_common._CachedModule  # pylint: disable=protected-access
    except (ImportError, AttributeError):
        return
    dump = cached_module.dump
    if getattr(dump, "gpuckpt_precompiled", False):
        return

    def dump_with_bytecode(self, path):
        try:
            with_bytecode = dataclasses.replace(self, zip_data=_with_bytecode(self.zip_data))
        except (zipfile.BadZipFile, ValueError, TypeError, OSError):
            with_bytecode = self  # a payload this cannot read is cached as Ansible made it
        return dump(with_bytecode, path)
    dump_with_bytecode.gpuckpt_precompiled = True
    cached_module.dump = dump_with_bytecode


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "record_results"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("GPUCKPT_TEST_ANSIBALLZ_CACHE"):
            share_module_payloads(os.environ["GPUCKPT_TEST_ANSIBALLZ_CACHE"])
            precompile_module_payloads()

    def _write(self, result, status):
        path = os.environ.get("GPUCKPT_RECORD")
        if not path:
            return
        data = dict(result._result)
        data["_task"] = result._task.get_name()
        data["_host"] = result._host.get_name()
        data["_status"] = status
        data["_t"] = time.time()  # when it ended: the gaps tell where a slow test's time goes
        with open(path, "a") as fh:
            fh.write(json.dumps(data, default=str) + "\n")

    def v2_runner_on_ok(self, result):
        self._write(result, "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._write(result, "failed")

    def v2_runner_on_skipped(self, result):
        self._write(result, "skipped")
