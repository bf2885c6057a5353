# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""TEMPORARY: the names plugins/modules/gpu_checkpoint.py and gpu_restore.py still import from here.
The engine lives in steps, plan, checkpoint, delivery, restore and held; this file goes once the modules
import those directly."""
from __future__ import annotations

from .checkpoint import checkpoint  # noqa: F401
from .restore import restore  # noqa: F401
