# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Podman checkpoint export given this host's NVIDIA device numbers before ``podman container restore
--import``.

Podman does not make a restored container's spec again: it restores under the spec its export carries
(``spec.dump``, measured with Podman 4.3.1), which names the device numbers of the host it was checkpointed
on, and runc builds the device cgroup from them. On a host whose ``nvidia-uvm`` major (given by the kernel
when the module loads) or GPU nodes differ, the job's GPU would be denied. The export is left as it is (it
is the image, with its checksums); when its spec names numbers other than this host's, a copy of it in the
restore's work dir gets the spec with this host's numbers, by path, as containerd's recorded spec does
(gpus.retarget_spec_devices). The spec is JSON written indented, so the same spec written compactly fits in
the bytes it had, padded with spaces, and the copy keeps every other byte and offset of the export.
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile

from ..core.errors import GpuCkptError, InvalidTarget
from ..cuda import devices as gpu_devices

SPEC_MEMBER = "spec.dump"


def _spec_member(export):
    """(the spec.dump member, its spec) of an uncompressed export; (None, None) when it has none."""
    with tarfile.open(export, "r:") as tf:
        for member in tf:
            if member.name.lstrip("./") == SPEC_MEMBER and member.isfile():
                return member, json.loads(tf.extractfile(member).read().decode("utf-8"))
    return None, None


def _copy(src, dst):
    """A byte copy of ``src`` at ``dst``: copy_file_range lets the kernel (or a reflink) do it where it can."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except (AttributeError, OSError):
            fin.seek(done)
            fout.seek(done)
            shutil.copyfileobj(fin, fout, 16 << 20)


def retarget_export(export, work_dir):
    """(the export to import, ["path old -> new", ...]): ``export`` itself when its spec names this host's
    device numbers (or has no spec), else a copy in ``work_dir`` whose spec names this host's. Raises
    InvalidTarget when the spec gives a GPU this host's driver does not list."""
    member, spec = _spec_member(export)
    if member is None:
        return export, []
    moved = gpu_devices.retarget_spec_devices(spec)
    if not moved:
        return export, []
    data = json.dumps(spec, separators=(",", ":")).encode("utf-8")
    if len(data) > member.size:
        raise InvalidTarget("the export's spec.dump cannot be given this host's device numbers (%s) in place"
                            % ", ".join(moved), stage="preflight")
    copy = os.path.join(work_dir, os.path.basename(export))
    try:
        _copy(export, copy)
        with open(copy, "r+b") as fh:
            fh.seek(member.offset_data)
            fh.write(data + b" " * (member.size - len(data)))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        try:
            os.unlink(copy)  # a partial copy is of no use, and as large as what filled the disk
        except OSError:
            pass
        raise GpuCkptError("could not copy the Podman export to give its spec this host's device numbers (%s): %s; "
                           "nothing was restored" % (", ".join(moved), exc), stage="runtime-restore",
                           hint="the copy needs the image's size free in the restore's work dir")
    return copy, moved
