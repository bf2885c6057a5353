# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The image's page files checked beside the runtime's restore, not before it.

A restore checks every file of its image against the manifest before anything runs; on a big image
that is mostly the page files (61.7 GB took 5.2 s of a 20.6 s restore on an H100), and CRIU's restore
reads the same pages right after. Where the runtime's restore takes a gate (runtimes/criu_gate.py,
capability gates_restore) the restore instead:

1. checks the signature, the listing and every file but the pages, before CRIU starts (what steers
   CRIU as root is never read unchecked);
2. checks the pages in a thread, while it waits for the dumped pids to be free and CRIU restores;
3. CRIU holds the restored tree, not yet run, at its post-restore action until the verdict: pages
   that do not check out fail the gate, and CRIU kills the tree it built. No restored process ever
   runs from an unchecked page, and the error is the verify's own (the file and bytes that differ).

Below ``min_bytes`` of pages, or without a gate (another runtime; no filesystem that lets CRIU exec
the gate's script), everything is checked first, as before.
"""
from __future__ import annotations

import os
import threading
import time

from ..core import image

# Below this much page data the checksums take under about 0.1 s: the gate's own cost (its script is
# run at every CRIU action) is not worth it.
MIN_BYTES = 256 * 2**20


def page_files(manifest):
    """The manifest's page files (CRIU's pages-*.img): the bulk of an image, data only."""
    return sorted(rel for rel in (manifest.get("files") or {}) if image.GROWING.match(os.path.basename(rel)))


def open_gate(img, opts, backend):
    """A RestoreGate for this restore, or None where the image is checked first (see the module doc)."""
    if not opts.verify or opts.check_mode or not backend.capabilities.gates_restore:
        return None
    files = img.manifest.get("files") or {}
    if sum(files[rel]["size"] for rel in page_files(img.manifest)) < opts.verify_beside_bytes:
        return None
    from ..runtimes.criu_gate import RestoreGate
    return RestoreGate.open()


class PagesBeside(object):
    """The page files' checksums in a thread (``start()``), whose verdict opens or fails ``gate``;
    ``result()`` waits for it and raises its ImageError."""

    def __init__(self, img, opts, gate):
        self.img, self.opts, self.gate = img, opts, gate
        self.files = page_files(img.manifest)
        self.seconds = None
        self.error = None
        self._thread = threading.Thread(target=self._check, name="gpuckpt-verify-pages")
        self._thread.daemon = True

    def start(self):
        self._thread.start()
        return self

    def _check(self):
        start = time.monotonic()
        try:
            self.img.verify(self.opts.sign_key, self.opts.allow_unverified_signature, files=self.files)
        except Exception as exc:  # noqa: BLE001 - any failure to check is a failed check
            self.error = exc
        finally:
            self.seconds = time.monotonic() - start
            self.gate.decide(self.error is None)

    def result(self):
        """The checksums' seconds, once they are taken; raises what failed them."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds

    def settle(self):
        """On any way out: wait for the thread (it reads the image) and fail the gate if it never decided."""
        if self._thread.ident is not None:
            self._thread.join()
        self.gate.close()
