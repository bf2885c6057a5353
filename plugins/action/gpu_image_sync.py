# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Runs gpuckpt.fleet.gpu_image_sync: the target's ssh address, port, user, key, Python and become come
from the inventory when the task names it (``dest_inventory_host``); then the module runs and its
progress is printed while it runs (see plugin_utils/progress_display.py)."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.inventory_target import inventory_connection, merge_connection
from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.progress_display import ProgressActionBase

OPTIONS = {"host": "dest_host", "port": "dest_port", "user": "dest_user", "ssh_args": "ssh_args", "python": "python",
           "become": "dest_become"}


class ActionModule(ProgressActionBase):
    def _derive_args(self, args, task_vars):
        name = args.get("dest_inventory_host")
        if not name:
            return args
        return merge_connection(args, inventory_connection(task_vars, self._templar, name), OPTIONS)
