#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_image_sync
short_description: Push a checkpoint image from this host to another host of the inventory
version_added: "0.1.0"
description:
  - Runs on the host that holds the image. It copies the image with rsync over ssh straight to the
    other host, so the data does not pass through the controller (as ansible.posix.synchronize does with delegate_to).
  - Partial files are kept and resumed when a transfer is cut, and the transfer is retried.
  - With O(repair), only the blocks that differ are sent again. Use it after the target found a checksum mismatch.
  - The copy is proven by gpuckpt.fleet.gpu_restore, which verifies every checksum of the manifest on the target before it restores anything.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  src:
    description: The image directory on this host.
    type: path
    required: true
  dest_host:
    description: Address of the target as this host reaches it over ssh (usually its ansible_host).
    type: str
    required: true
  dest:
    description: The image directory on the target. It is created with the image's mode (0700).
    type: path
    required: true
  dest_user:
    description: User on the target.
    type: str
    default: root
  dest_port:
    description: ssh port of the target.
    type: int
    default: 22
  ssh_args:
    description: Extra ssh arguments, for example C(["-i", "/root/.ssh/migrate_key"]) or C(["-F", "/etc/gpuckpt/ssh_config"]).
    type: list
    elements: str
    default: []
  rsync_path:
    description: Program to run as rsync on the target (rsync's --rsync-path).
    type: str
  repair:
    description: Compare full checksums and re-send only what differs, instead of resuming partial files.
    type: bool
    default: false
  bwlimit:
    description: Bandwidth limit in KiB/s (0 is none).
    type: int
    default: 0
  retries:
    description: How many times to retry (and resume) a failed transfer.
    type: int
    default: 3
  io_timeout:
    description: Seconds without I/O after which rsync gives up (and the transfer is retried).
    type: int
    default: 120
  streams:
    description:
      - Parallel ssh streams for files of at least O(stream_min_bytes) (the pages of GPU memory and RAM).
      - One ssh stream is bound by one core's cipher; several add up to what the link and disks allow.
      - Each stream writes its byte range in place on the target with C(dd). 1 sends everything through rsync.
      - A O(bwlimit), or O(repair=true), sends everything through rsync.
      - 0 picks a quarter of this host's cores, 1 to 8 (each stream costs a core for its cipher on each end).
    type: int
    default: 0
  stream_min_bytes:
    description: Files at least this large go over the parallel streams; smaller ones through rsync.
    type: int
    default: 268435456
extends_documentation_fragment:
  - gpuckpt.fleet.common.progress
notes:
  - This host must reach the target over ssh non-interactively (a key, or agent forwarding).
  - Needs rsync 3.2.3 or newer (--mkpath) on both hosts.
  - Check mode reports what would be sent without sending it.
"""

EXAMPLES = r"""
- name: Send the image to the target
  gpuckpt.fleet.gpu_image_sync:
    src: /var/lib/gpuckpt/images/job-1
    dest_host: "{{ hostvars['gpu-node-2']['ansible_host'] }}"
    dest: /var/lib/gpuckpt/images/job-1
"""

RETURN = r"""
bytes_transferred:
  description: Bytes sent (0 when the target already held the image).
  returned: success
  type: int
bytes_total:
  description: Size of the image.
  returned: success
  type: int
seconds:
  description: Time the transfer took, retries included.
  returned: success
  type: float
attempts:
  description: rsync runs it took.
  returned: success
  type: int
streams:
  description: Parallel ssh streams used for the large files (1 when everything went through rsync).
  returned: success
  type: int
bytes_streamed:
  description: Bytes sent over the parallel streams.
  returned: success
  type: int
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils import image, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.errors import GpuCkptError


def main():
    module = AnsibleModule(argument_spec=dict(
        src=dict(type="path", required=True),
        dest_host=dict(type="str", required=True),
        dest=dict(type="path", required=True),
        dest_user=dict(type="str", default="root"),
        dest_port=dict(type="int", default=22),
        ssh_args=dict(type="list", elements="str", default=[]),
        rsync_path=dict(type="str"),
        repair=dict(type="bool", default=False),
        bwlimit=dict(type="int", default=0),
        retries=dict(type="int", default=3),
        io_timeout=dict(type="int", default=120),
        streams=dict(type="int", default=0),
        stream_min_bytes=dict(type="int", default=transfer.STREAM_MIN_BYTES),
        progress_file=dict(type="path"),
    ), supports_check_mode=True)
    p = module.params
    if p["streams"] < 0 or p["streams"] > 64:
        module.fail_json(msg="streams must be between 0 (automatic) and 64, got %d; nothing was sent" % p["streams"],
                         stage="transfer")
    if not image.has_manifest(p["src"]):
        module.fail_json(msg="%s is not a complete gpuckpt image (no manifest.json); nothing was sent" % p["src"],
                         stage="transfer")
    if module.check_mode:
        size = sum(os.path.getsize(os.path.join(p["src"], f)) for f in image.list_files(p["src"]))
        module.exit_json(changed=True, bytes_total=size, msg="would send %d bytes" % size)
    try:
        res = transfer.push(p["src"], p["dest_host"], p["dest"], user=p["dest_user"], port=p["dest_port"],
                            ssh_args=p["ssh_args"], rsync_path=p["rsync_path"], repair=p["repair"],
                            bwlimit=p["bwlimit"], io_timeout=p["io_timeout"], retries=p["retries"],
                            streams=p["streams"], stream_min_bytes=p["stream_min_bytes"],
                            progress_file=p["progress_file"])
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    rate = res["bytes_transferred"] / res["seconds"] if res["seconds"] else 0
    module.exit_json(changed=res["bytes_transferred"] > 0, msg="sent %d of %d bytes in %.2fs (%.0f MB/s), %d attempt(s)"
                     % (res["bytes_transferred"], res["bytes_total"], res["seconds"], rate / 1e6, res["attempts"]),
                     **{k: v for k, v in res.items() if k != "cmd"})


if __name__ == "__main__":
    main()
