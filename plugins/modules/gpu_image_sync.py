#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_image_sync
short_description: Send a checkpoint image from this host to another host of the inventory
version_added: "0.1.0"
description:
  - Runs on the host that holds the image. It sends the image over ssh straight to the other host, so the
    data does not pass through the controller (as ansible.posix.synchronize does with delegate_to).
  - The same transfer as gpuckpt.fleet.gpu_checkpoint's C(push), over parallel ssh streams ending in a small
    Python receiver on the target (it needs Python 3 there and nothing else). It first asks the target for
    the checksums of what it already holds, and sends only the 64 MiB chunks that are missing or differ,
    so a cut transfer resumes and a repair after a checksum mismatch sends only what is bad. Then the
    files' sizes, then the manifest, last.
  - The target's files are created with mode 0600 in a 0700 directory, never through a symlink.
  - The copy is proven by gpuckpt.fleet.gpu_restore, which verifies every checksum of the manifest on the
    target before it restores anything.
  - It checks no signature and vouches for none. A signed image is checked by gpuckpt.fleet.gpu_restore on the
    target, given C(sign_key). Without the key, that restore refuses it unless told C(allow_unverified_signature).
  - With O(migration_id), the receivers write only into the directory that the migration's target journal says
    the migration created, and the source's journal records C(delivering) before the manifest goes.
  - With O(probe_mib), it measures the link instead (a drain's deadline estimates each move from it) with the
    very transfer an image takes. It writes a scratch image of that many MiB of random bytes in O(src), sends it
    to O(dest), timing the transfer alone, and returns the rate in RV(probe). Then it removes the scratch image
    on both hosts, also when the transfer failed; on the target, the receiver removes only the directory that
    it created for this probe.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  src:
    description:
      - The image directory on this host (a complete image, with its manifest).
      - With O(probe_mib), the directory to write the probe's scratch image in; it must not exist. It is created
        (mode 0700, and its missing parents too, as for an image) and removed after the probe.
    type: path
    required: true
  probe_mib:
    description:
      - When above 0, probe the link to the target with a scratch image of this many MiB instead of sending
        O(src) (see the description). 0 sends O(src).
      - The image goes as 64 MiB pieces spread over the streams, so a probe of at least 64 MiB per stream
        measures what all the streams together move.
      - O(dest) is then the scratch image's directory on the target, named C(.gpuckpt-probe-<something>) and new;
        missing parents are created as for an image, and kept.
      - It cannot be given with O(migration_id).
    type: int
    default: 0
  dest_inventory_host:
    description:
      - The target as an inventory host. The action plugin fills O(dest_host), O(dest_port), O(dest_user),
        O(python) and O(dest_become) from that host's C(ansible_host), C(ansible_port), C(ansible_user),
        C(ansible_python_interpreter) and C(ansible_become), and adds C(-i) with its C(ansible_ssh_private_key_file)
        (a path on the sending host) to O(ssh_args), as M(ansible.posix.synchronize) does.
      - Values given in the task win. A name that is not an inventory host is refused.
    type: str
  dest_host:
    description:
      - Address of the target as this host reaches it over ssh (usually its ansible_host); an IPv6 address may be bracketed.
      - Required unless O(dest_inventory_host) is given.
    type: str
  dest_become:
    description:
      - Run the receiver on the target through C(sudo -n) (a passwordless sudo), for a O(dest_user) other than root.
    type: bool
    default: false
  dest:
    description: The image directory on the target. Outside a migration it is created (mode 0700) and must not hold anything else.
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
  python:
    description: The Python 3 interpreter on the target that writes the received data (a command name or an absolute path).
    type: str
    default: python3
  bwlimit:
    description: Bandwidth limit in KiB/s for all streams together (0 is none).
    type: int
    default: 0
  retries:
    description: How many times to retry (and resume) a failed transfer.
    type: int
    default: 3
  io_timeout:
    description: Seconds without an answer from the target after which a stream is given up (and the transfer retried).
    type: int
    default: 120
  streams:
    description:
      - Parallel ssh streams. One ssh stream is bound by one core's cipher; several add up to what the link and disks allow.
      - 0 picks a quarter of this host's cores, 1 to 8 (each stream costs a core for its cipher on each end).
    type: int
    default: 0
  migration_id:
    description: The migration this transfer belongs to (see gpuckpt.fleet.gpu_migration).
    type: str
  journal_dir:
    description: Directory of the migration journals on this host (the source).
    type: path
    default: /var/lib/gpuckpt/journal
  dest_journal_dir:
    description: Directory of the migration journals on the target.
    type: path
    default: /var/lib/gpuckpt/journal
requirements:
  - "ssh from this host to O(dest_host), and python3 there."
attributes:
  check_mode:
    details: It reads the image and reports how many bytes it would send. With O(probe_mib), it probes nothing and returns RV(probe) null.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.progress
notes:
  - This host must reach the target over ssh non-interactively (a key, or agent forwarding).
  - Check mode reports what would be sent without sending it.
"""

EXAMPLES = r"""
- name: Send the image to gpu-node-2 (its address, port, user and key from the inventory)
  gpuckpt.fleet.gpu_image_sync:
    src: /var/lib/gpuckpt/images/job-1
    dest_inventory_host: gpu-node-2
    dest: /var/lib/gpuckpt/images/job-1

- name: Send the image to a host outside the inventory, over IPv6
  gpuckpt.fleet.gpu_image_sync:
    src: /var/lib/gpuckpt/images/job-1
    dest_host: "fd00::12"
    dest_port: 2222
    dest_user: ckpt
    dest_become: true
    dest: /var/lib/gpuckpt/images/job-1

- name: Measure the link to gpu-node-2 with 1 GiB, as an image would go there
  gpuckpt.fleet.gpu_image_sync:
    probe_mib: 1024
    src: /var/lib/gpuckpt/images/.gpuckpt-probe-gpu-node-2
    dest_inventory_host: gpu-node-2
    dest: /var/lib/gpuckpt/images/.gpuckpt-probe-gpu-node-1
  register: link
"""

RETURN = r"""
bytes_transferred:
  description: Bytes sent (0 when the target already held the whole image).
  returned: success
  type: int
bytes_total:
  description: Size of the image.
  returned: success
  type: int
bytes_already_there:
  description: Bytes the target held already, with the right checksums, and were not sent again.
  returned: success
  type: int
seconds:
  description: Time the transfer took, retries included.
  returned: success
  type: float
attempts:
  description: Attempts it took.
  returned: success
  type: int
streams:
  description: Parallel ssh streams used.
  returned: success
  type: int
probe:
  description:
    - With O(probe_mib), what the probe measured; null in check mode. The seconds are those of the transfer alone
      (its ssh connections, the target's answer of what it holds, the data, the manifest), retries included.
    - The throughput is taken over the data and the manifest alone (C(data_seconds)), as a migration opens its
      streams before anything is frozen.
  returned: when O(probe_mib) is above 0
  type: dict
  contains:
    bytes:
      description: Bytes sent (the scratch image and its manifest).
      type: int
    seconds:
      description: Time the transfer took, its ssh connections included.
      type: float
    data_seconds:
      description: Time from the streams' opening (the target having said what it holds) to the delivered manifest.
      type: float
    setup_seconds:
      description: The rest of C(seconds), opening the streams and asking the target.
      type: float
    bytes_s:
      description: The throughput, bytes over C(data_seconds) per second (what a drain's C(throughput) takes for the target).
      type: int
    streams:
      description: Parallel ssh streams used.
      type: int
    attempts:
      description: Attempts it took.
      type: int
  sample: {"bytes": 1073742201, "seconds": 1.52, "data_seconds": 1.1, "setup_seconds": 0.42, "bytes_s": 976129455,
           "streams": 4, "attempts": 1}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import link_probe
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import PROGRESS_ARGS, check_path_arg
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import (
    run_module, sync_image, transfer_target, transfer_target_spec)


def probe_link(params, check_mode):
    """probe_mib: the link's throughput, measured with a scratch image (link_probe.probe). The module's result."""
    p = params
    if check_mode:
        return dict(changed=False, probe=None, msg="check mode: no probe was sent")
    res = link_probe.probe(p["src"], transfer_target(p, "dest_"), p["dest"], p["probe_mib"], streams=p["streams"],
                           bwlimit_kbps=p["bwlimit"], retries=p["retries"], progress_file=p["progress_file"])
    return dict(changed=False, probe=res, msg="probe: sent %d bytes in %.2fs (%.0f MB/s) over %d stream(s), %d attempt(s)"
                % (res["bytes"], res["seconds"], (res["bytes_s"] or 0) / 1e6, res["streams"], res["attempts"]))


def main():
    module = AnsibleModule(argument_spec=dict(
        src=dict(type="path", required=True),
        probe_mib=dict(type="int", default=0),
        dest_inventory_host=dict(type="str"),
        bwlimit=dict(type="int", default=0),
        retries=dict(type="int", default=3),
        migration_id=dict(type="str"),
        journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
        dest_journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
        **transfer_target_spec("dest_"), **PROGRESS_ARGS
    ), required_one_of=[("dest_host", "dest_inventory_host")], supports_check_mode=True)
    p = module.params
    if not p["dest_host"]:
        module.fail_json(msg="dest_inventory_host %r was not resolved: run this module through its action plugin "
                         "(gpuckpt.fleet.gpu_image_sync), or give dest_host; nothing was sent" % p["dest_inventory_host"])
    check_path_arg(module, "dest", p["dest"])
    if not 0 <= p["streams"] <= 64:
        module.fail_json(msg="streams must be between 0 (automatic) and 64, got %d; nothing was sent" % p["streams"],
                         stage="transfer")
    if p["bwlimit"] < 0 or p["retries"] < 0 or p["probe_mib"] < 0:
        module.fail_json(msg="bwlimit, retries and probe_mib must not be negative; nothing was sent", stage="transfer")
    if p["probe_mib"] and p["migration_id"]:
        module.fail_json(msg="probe_mib measures the link outside any migration; it cannot be given with migration_id "
                         "(%s); nothing was sent" % p["migration_id"], stage="preflight")
    run_module(module, probe_link if p["probe_mib"] else sync_image, p, module.check_mode)


if __name__ == "__main__":
    main()
