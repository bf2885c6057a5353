# -*- coding: utf-8 -*-
"""Test helper: append every task result of a playbook run to $GPUCKPT_RECORD as JSON lines,
so the integration tests can assert on `changed`, `failed`, `msg`, `stage` and the rest."""
from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: record_results
type: aggregate
short_description: write task results to a JSON lines file (tests only)
description: [Writes every task result to the file named by GPUCKPT_RECORD.]
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "record_results"
    CALLBACK_NEEDS_ENABLED = True

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
