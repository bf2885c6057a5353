#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_restore
short_description: Restore a CUDA process tree from a gpuckpt image and resume it
version_added: "0.1.0"
description:
  - Runs the checkpoint backwards. It verifies the image (manifest and every file's checksums) before it
    touches anything. Then CRIU restores the process tree (detached). The driver moves each CUDA
    process's memory back onto the GPU, every process is unlocked, and the processes are checked to be
    alive and running.
  - If any step fails, what was brought up is killed, so the host is left clean and the image untouched.
  - Idempotent. If this image was already restored and its processes still run, nothing is done and
    C(changed) is false. If a pid that the image needs is in use (for example, the original still
    runs after a checkpoint with leave_running), the restore is refused rather than starting a
    second copy.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  image_dir:
    description: The image directory written by gpuckpt.fleet.gpu_checkpoint.
    type: path
    required: true
  gpu_map:
    description:
      - Restore onto other GPUs of this host, as a mapping of GPU UUIDs, old UUID to new UUID (see EXAMPLES).
      - GPUs that are not named are paired with the remaining ones in order, so the map names every visible GPU, as the driver requires.
      - Needs driver 580+ (CUDA 13.0 API).
    type: dict
  force:
    description: Restore again an image whose earlier restore has since exited.
    type: bool
    default: false
  verify:
    description:
      - Verify every file's checksums before restoring. Turn it off only for an image that was just verified.
      - A bare process's page files of 256 MiB or more are verified beside CRIU's restore, which holds what it
        restored until they check out (RV(pages_verified_beside_restore)); nothing restored runs before then.
      - The manifest's signature (O(sign_key), O(allow_unverified_signature)) is checked even when it is off.
    type: bool
    default: true
  bundle:
    description:
      - For an image of a runc container or a runsc sandbox, the container's bundle (config.json and rootfs) on this host.
      - By default, the bundle path recorded in the image.
    type: path
  validate_wait:
    description: Seconds to wait after unlocking before checking that every process is still alive and running.
    type: float
    default: 0.5
  probe_command:
    description:
      - A command that must succeed inside the restored workload before the restore counts as done, such as
        C(nvidia-smi) (the seeds' check) or the job's own health check. A list is the argument vector; a
        string is split like a shell would split it (no shell runs it).
      - It runs once the GPU memory is back and before the CUDA processes are unlocked, in the namespaces,
        root directory, working directory and environment of the workload's root process (like C(exec) into a
        container), as root. So C(nvidia-smi) there sees the restored processes and their memory, while the
        workload cannot yet make GPU progress; a check that needs the workload itself to answer belongs after
        the restore.
      - A non-zero exit or a timeout fails the restore, which stops what it brought up before it did work of
        its own. In a migration (playbooks/migrate.yml, C(-e probe_command=...)), the source is then resumed.
    type: raw
  probe_timeout:
    description: Seconds O(probe_command) may take before it is killed and the restore fails.
    type: float
    default: 60
  restore_pod:
    description:
      - For an image of a Kubernetes pod (O(gpuckpt.fleet.gpu_checkpoint#module:runtime=k8s_pod)), the pod, as
        C(<namespace>/<name>), that the pod migration creates on this node for the restore (see docs/kubernetes.md).
        This module writes the image's restore ticket for it, waits until the runtime handler
        C(gpuckpt-restore-runtime) has restored each of its containers inside the pod, then brings their GPU
        memory back and unlocks them.
      - A pod image is refused without it, as its containers restored outside a pod would run unmanaged.
    type: str
  restore_token:
    description:
      - The secret the pod's annotation C(gpuckpt.fleet/restore) carries with O(restore_pod) - only its SHA-256
        is written on the node - and the runtime handler restores only into the pod that gives it.
    type: str
  restore_wait:
    description: Seconds to wait for O(restore_pod)'s containers to be restored on this node before giving up.
    type: float
    default: 600
  wait_for_image:
    description:
      - Seconds to wait for the image to be complete in O(image_dir) (its manifest, which a push or a transfer
        writes last) before restoring it; 0 does not wait.
      - For a migration, which starts this restore with C(async) before the source is frozen, so that it
        begins the moment the image is complete, with the driver already loaded (see playbooks/migrate.yml).
      - Needs O(migration_id). A rollback of the migration's target (gpuckpt.fleet.gpu_migration) stops the wait.
    type: float
    default: 0
  attach:
    description:
      - The job id of this module started earlier with C(async) (C(ansible_job_id)). Instead of running, the task
        waits for that job and returns its result, printing its progress (give the same O(progress_file)).
      - Handled by the action plugin; every other option is then ignored.
    type: str
requirements:
  - "Root on the managed host."
  - "CRIU 4.0 or newer, except with runtime runsc."
  - "NVIDIA driver 570 or newer for CUDA processes (580 for O(gpu_map))."
  - "The runtime the image was taken with."
attributes:
  check_mode:
    details: It verifies the image and the host, and reports what it would restore.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.actiongroup_gpu
  - gpuckpt.fleet.common.operation
  - gpuckpt.fleet.common.signature_check
  - gpuckpt.fleet.common.progress
notes:
  - Needs root. The pids recorded in the image must be free on this host (CRIU restores the same pids).
  - Supports check mode. It verifies the image and the host and reports what it would do.
  - Supports C(async), and O(attach) to wait for such a job without a retry loop.
seealso:
  - module: gpuckpt.fleet.gpu_checkpoint
"""

EXAMPLES = r"""
- name: Bring the training job back
  gpuckpt.fleet.gpu_restore:
    image_dir: /var/lib/gpuckpt/images/train-0001

- name: Bring it back on GPU 1 instead of GPU 0
  gpuckpt.fleet.gpu_restore:
    image_dir: /var/lib/gpuckpt/images/train-0001
    gpu_map:
      GPU-5a7e0c1b-0000-0000-0000-000000000000: GPU-9f3d2e44-0000-0000-0000-000000000000
"""

RETURN = r"""
huge_pages:
  description:
    - With O(host_huge_pages), what was done. C(mode) and C(previous) (the setting found), C(put_back) when
      this operation was the last to hold it, C(error) when it could not be set or put back.
    - Also returned, with C(note), when this operation put back a setting that a killed module had left.
  returned: when O(host_huge_pages) was set, or a setting was put back
  type: dict
  sample: {"requested": true, "mode": "always", "previous": "madvise", "put_back": "madvise"}
pids:
  description: Pids of the restored process tree, root first.
  returned: success
  type: list
  elements: int
cuda_pids:
  description: Restored CUDA pids (restored onto the GPU and unlocked).
  returned: success
  type: list
  elements: int
timings:
  description: Seconds per stage (wait_for_image, wait_pids_free, verify, preflight, runtime_restore, cuda_restore, cuda_unlock, validate).
  returned: when changed
  type: dict
driver_call_seconds:
  description: Seconds spent inside the driver's own calls.
  returned: when changed
  type: dict
driver_call_seconds_by_pid:
  description: The same for each CUDA process (its pid), e.g. each rank's own stage 1 in a multi-GPU job.
  returned: when changed
  type: dict
verify_seconds:
  description: Seconds spent on the image's checksums (null with O(verify=false)).
  returned: when changed
  type: float
pages_verified_beside_restore:
  description:
    - True when the image's page files (256 MiB or more of them) were checked beside CRIU's restore rather than
      before it. CRIU holds the restored processes, not yet run, at its post-restore action until they check out.
      Pages that differ make CRIU kill what it restored, and the restore fails naming them in RV(bad_files), as before.
    - The rest of the image (CRIU's metadata) is always checked before CRIU starts.
    - Only the bare process runtime restores this way, and only where a directory that allows exec holds CRIU's
      action script (the system temp dir, /run, /var/tmp or /dev/shm).
  returned: when changed
  type: bool
cooperative_resumed:
  description:
    - The restored ranks of a job checkpointed with O(gpuckpt.fleet.gpu_checkpoint#module:quiesce_mode=cooperative),
      told to resume once the restore and the unlock are done. Each re-creates its process group on a fresh prefix
      of its rendezvous store (docs/multi_gpu.md).
  returned: when the image is of a cooperative checkpoint and the restore was made
  type: list
  elements: int
  sample: [4242, 4243]
tcp_time_wait:
  description:
    - The wait before CRIU's restore for the TCP ports the image's tree listened on, where TIME_WAIT sockets of
      this network namespace still held them (they would fail the restore with "Address already in use"). Bounded
      by the kernel's TIME_WAIT length (60 s) and a margin; ports, left (those still held when it gave up),
      waited_s, cleared and msg.
  returned: when such a port had TIME_WAIT sockets
  type: dict
  sample: {"ports": [29500], "left": [], "waited_s": 41.2, "cleared": true, "msg": "waited 41.2 s for ..."}
gpu_pairs:
  description:
    - The (old, new) GPU UUID pairs passed to the driver.
    - A list when O(gpu_map) was given (the same pairs for every CUDA process).
    - A dict of restored pid to its pairs when the runtime put the processes onto other GPUs than they had
      (a pod whose new containers were given other GPUs by the device plugin).
    - Null when every process went back onto the GPUs it had.
  returned: when changed
  type: raw
probe:
  description: What O(probe_command) did (cmd, rc, seconds, and the tails of stdout and stderr).
  returned: when changed and O(probe_command) was given
  type: dict
resumed_at:
  description: Epoch seconds when the workload ran again (its CUDA processes unlocked).
  returned: when changed
  type: float
validation_notes:
  description: What validation noticed without failing (a process the workload ended itself since the dump).
  returned: when changed
  type: list
  elements: str
signature:
  description:
    - What became of the manifest's signature. V(verified) means it matches O(sign_key). V(unsigned) means the
      image carries none and no key was given. V(not_checked) means it carries one and no key was given, with
      O(allow_unverified_signature) set.
  returned: success
  type: str
  sample: verified
stage:
  description: On failure, the stage that failed (wait, verify, preflight, criu-restore, cuda-restore, unlock, validate, probe).
  returned: failure
  type: str
bad_files:
  description: On a verification failure, the files of the image that do not match the manifest.
  returned: failure
  type: list
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import restore as engine_restore
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import (
    check_path_arg, command_argv, journal_for, run_engine)
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import operation_spec, restore_backend_maker


def main():
    spec = operation_spec(
        image_dir=dict(type="path", required=True),
        gpu_map=dict(type="dict"),
        force=dict(type="bool", default=False),
        verify=dict(type="bool", default=True),
        validate_wait=dict(type="float", default=0.5),
        bundle=dict(type="path"),
        wait_for_image=dict(type="float", default=0.0),
        attach=dict(type="str"),
        probe_command=dict(type="raw"),
        probe_timeout=dict(type="float", default=60.0),
        restore_pod=dict(type="str"),
        restore_token=dict(type="str", no_log=True),
        restore_wait=dict(type="float", default=600.0),
        allow_unverified_signature=dict(type="bool", default=False),
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True,
                           required_together=[("restore_pod", "restore_token")])
    p = module.params
    if p["attach"]:
        module.fail_json(msg="attach is handled by the gpuckpt.fleet.gpu_restore action plugin; run this module as a task")
    if p["wait_for_image"] and not p["migration_id"]:
        module.fail_json(msg="wait_for_image needs migration_id: the image it waits for is the migration's")
    if p["wait_for_image"] < 0 or p["validate_wait"] < 0 or p["probe_timeout"] <= 0:
        module.fail_json(msg="wait_for_image and validate_wait must not be negative, probe_timeout must be positive")
    check_path_arg(module, "image_dir", p["image_dir"])
    probe = command_argv(module, "probe_command", p["probe_command"])

    def restore():
        # In a migration the image may not be there yet (wait_for_image): the backend is chosen from
        # the manifest once it has arrived.
        journal = journal_for(p, "target")
        options = {k: p[k] for k in ("gpu_map", "force", "verify", "libcuda_path", "sign_key", "validate_wait",
                                     "parallel", "progress_file", "wait_for_image", "host_huge_pages",
                                     "allow_unverified_signature")}
        return engine_restore.restore(p["image_dir"], make_backend=restore_backend_maker(p), journal=journal,
                                      check_mode=module.check_mode, probe_command=probe,
                                      probe_timeout=p["probe_timeout"], **options)

    run_engine(module, restore)


if __name__ == "__main__":
    main()
