# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Runs gpuckpt.fleet.gpu_checkpoint: a ``push`` that names its target by inventory host (``push.to``)
gets that host's ssh address, port, user, key, Python and become from the inventory; then the module
runs and its progress is printed while it runs (see plugin_utils/progress_display.py)."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.inventory_target import inventory_connection, merge_connection
from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.progress_display import ProgressActionBase

OPTIONS = {"host": "host", "port": "port", "user": "user", "ssh_args": "ssh_args", "python": "python", "become": "become"}


class ActionModule(ProgressActionBase):
    def _derive_args(self, args, task_vars):
        push = args.get("push")
        if not isinstance(push, dict) or not push.get("to"):
            return args
        return dict(args, push=merge_connection(push, inventory_connection(task_vars, self._templar, push["to"]), OPTIONS))
