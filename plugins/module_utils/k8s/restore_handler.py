# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The program that a node's runtime handler (gpuckpt-restore-runtime) runs, as the role
nvidia_container_runtime installs it: one Python file, assembled at install time from the restore protocol
(restore_protocol.py), the core modules it and the handler use, and the handler's own code
(roles/nvidia_container_runtime/files/gpuckpt_restore_runtime.py). So the node's restore and the handler speak
the one protocol of this collection's version, and the node needs nothing but python3, as
transfer/transfer.receiver_program does for the transfer's receiver.

The modules' package imports fail in the assembled program and fall back to the names defined before them; the
handler's imports of the collection are dropped, their names being defined above it.
"""
from __future__ import annotations

import inspect
import re

# The handler program's modules, imported here (not by name at run time), in the order their names are needed.
from ..core import errors
from ..core import fsutil
from ..core import wait
from . import restore_protocol

HANDLER_MODULES = (errors, fsutil, wait, restore_protocol)
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.M)
_COLLECTION_IMPORT = re.compile(r"^from ansible_collections\.gpuckpt\.fleet\.plugins\.module_utils\.[\w.]+ import "
                                r"(?:\([^)]*\)|[^\n]*)\n", re.M)


def handler_program(handler_source):
    """The runtime handler as one program: HANDLER_MODULES' sources, then ``handler_source`` (the handler's own
    code) without its imports of the collection."""
    parts = ["# gpuckpt-restore-runtime, assembled by gpuckpt.fleet (plugins/module_utils/k8s/restore_handler.py)\n"
             "# from its restore protocol and the handler's own code: edit those, not this file.\n"
             "from __future__ import annotations\n"]
    for mod in HANDLER_MODULES:
        name = mod.__name__.rsplit(".", 1)[-1]
        parts.append("# ---- %s.py ----\n%s\n" % (name, _FUTURE.sub("", inspect.getsource(mod))))
    handler = _COLLECTION_IMPORT.sub("", _FUTURE.sub("", str(handler_source)))
    parts.append("# ---- gpuckpt_restore_runtime.py ----\n%s\n" % handler.rstrip("\n"))
    return "".join(parts)
