# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Runs gpuckpt.fleet.gpu_restore and prints its progress while it runs; with ``attach``, waits for the
restore started earlier with async instead (see plugin_utils/progress_display.py)."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.progress_display import ProgressActionBase


class ActionModule(ProgressActionBase):
    pass
