# -*- coding: utf-8 -*-
"""Test helper: append every task result of a playbook run to $GPUCKPT_RECORD as JSON lines,
so the integration tests can assert on `changed`, `failed`, `msg`, `stage` and the rest."""
from __future__ import annotations

import hashlib
import json
import os
import time

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


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "record_results"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("GPUCKPT_TEST_ANSIBALLZ_CACHE"):
            share_module_payloads(os.environ["GPUCKPT_TEST_ANSIBALLZ_CACHE"])

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
