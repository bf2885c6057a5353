# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The program that a node's runtime handler (gpuckpt-restore-runtime) runs, as the role
nvidia_container_runtime installs it: one Python file, bundled at install time (core/bundle.py) from the handler's
own code (roles/nvidia_container_runtime/files/gpuckpt_restore_runtime.py) and the modules of this collection it
imports: the restore protocol (restore_protocol.py) and the core modules it and the handler use. So the node's
restore and the handler speak the one protocol of this collection's version, and the node needs nothing but
python3, as transfer/streams.receiver_program does for the transfer's receiver. The handler's own code runs as the
program's ``__main__``, with its imports of the collection as they are written.
"""
from __future__ import annotations

from ..core import bundle

HEADER = ("# gpuckpt-restore-runtime, bundled by gpuckpt.fleet (plugins/module_utils/k8s/restore_handler.py)\n"
          "# from its restore protocol and the handler's own code: edit those, not this file.\n")


def handler_program(handler_source):
    """The runtime handler as one program: ``handler_source`` (the handler's own code) and the modules of this
    collection it imports."""
    return bundle.program(str(handler_source).rstrip("\n") + "\n", header=HEADER)
