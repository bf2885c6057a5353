# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the modules' documentation shares, so that one option reads the same in every module that has it.

A module names in extends_documentation_fragment (as gpuckpt.fleet.common.<name>): ATTRIBUTES (with
ansible.builtin.action_common_attributes); ACTIONGROUP_GPU for the modules of the action group gpu, with
the options that group shares; OPERATION, which a checkpoint and a restore share; SIGNATURE_CHECK, a
restore's; PROGRESS; MIGRATION_HOSTS, the source and target options of the filters over one migration; RESTORABILITY, what the
filters that judge an image's host may accept; DRAIN_PLAN_INPUT, the input of the filters over a drain's plan. Each fragment is
a literal (ansible-test's yamllint reads them as such).
"""
from __future__ import annotations


class ModuleDocFragment(object):
    # With ansible.builtin.action_common_attributes, which describes them: the modules that act on a managed
    # host run on Linux and report no diff. Each module gives its check mode's details, and its support
    # where that is less than full.
    ATTRIBUTES = r"""
options: {}
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: linux
"""

    PROGRESS = r"""
options:
  progress_file:
    description:
      - A file on the managed host where the module writes its progress as JSON about every second
        (removed when it ends).
      - The collection's action plugin sets it and prints a line on the controller whenever the
        progress changes, every C(gpuckpt_progress_interval) seconds (a task or play variable,
        default 5; 0 turns the display off). Set it yourself only to poll the file another way.
    type: path
"""

    # The modules of the action group gpu (module_defaults: group/gpuckpt.fleet.gpu), and the options that group
    # shares: the driver library and the runtimes' paths and roots.
    ACTIONGROUP_GPU = r"""
attributes:
  action_group:
    description: Use C(group/gpuckpt.fleet.gpu) in C(module_defaults) to set the options the modules of this group share.
    support: full
    membership:
      - gpuckpt.fleet.gpu
options:
  libcuda_path:
    description: Path of libcuda.so.1 when the dynamic loader cannot find it.
    type: path
  runc_path:
    description: Path of runc (searched in PATH when not given). Used with the runc runtime.
    type: path
  runc_root:
    description:
      - runc's state directory (C(runc --root)); runc's default when not given.
      - With the containerd runtime, the runc root of the restored task (runc's C(root) option of
        C(io.containerd.runc.v2)); the source container's own when not given.
    type: path
  podman_path:
    description: Path of podman (searched in PATH when not given). Used with the podman runtime.
    type: path
  podman_root:
    description: Podman's storage root (C(podman --root)); Podman's default when not given.
    type: path
  podman_runroot:
    description: Podman's run root (C(podman --runroot)); Podman's default when not given.
    type: path
  docker_path:
    description: Path of the docker client (searched in PATH when not given). Used with the docker runtime.
    type: path
  docker_host:
    description: The dockerd socket, as C(unix:///path); C(DOCKER_HOST) or Docker's default when not given.
    type: str
  containerd_address:
    description: containerd's socket. Used with the containerd runtime.
    type: path
    default: /run/containerd/containerd.sock
  containerd_namespace:
    description:
      - The containerd namespace of the container. V(k8s.io) holds a Kubernetes node's pods.
      - V(moby) (Docker's containers) is refused; use the docker runtime for those.
      - When restoring an image, the namespace recorded in it is used.
    type: str
    default: default
  runsc_path:
    description: Path of gVisor's runsc (searched in PATH when not given). Used with the runsc runtime.
    type: path
  runsc_root:
    description:
      - runsc's state directory (C(runsc --root)); runsc's default when not given.
      - When restoring an image, the root recorded in it is used when not given.
    type: path
  runsc_flags:
    description:
      - runsc's global flags for every runsc command, as C(--name=value), for example C(--platform=systrap),
        C(--network=none) or C(--nvproxy=true). Give the ones the sandbox was created with; they are recorded
        in the image and given again to its restore when not set there.
    type: list
    elements: str
    default: []
  cuda_checkpoint_path:
    description:
      - With the runsc runtime, the path INSIDE the sandbox of a cuda-checkpoint tool (NVIDIA's, or the one the
        C(gpuckpt.fleet.cuda_checkpoint) role builds), bind-mounted read-only into the container. The CUDA stage
        runs there with C(runsc exec), on the sandbox's own pids, because the host cannot see a sandbox's processes.
      - A sandbox without that tool and without NVIDIA devices in its spec is a CPU sandbox; its GPU stage is skipped.
      - C(/usr/local/bin/cuda-checkpoint) when not given (or what the image recorded).
    type: path
  runsc_cuda_stage:
    description:
      - Who runs the CUDA stage of a gVisor sandbox. V(engine) runs it here, through O(cuda_checkpoint_path) inside
        the sandbox, with the collection's order (every process locked before any is checkpointed) and rollback.
      - V(runsc) lets runsc do it (C(runsc checkpoint --cuda-checkpoint-path), gVisor release-20260608 and later,
        which toggles each CUDA process and toggles them back on restore). A runsc without that flag is refused
        before anything is frozen. The order and the failure handling of that stage are then runsc's; the restore
        still checks that every CUDA process runs. Not yet run by the collection's tests (Debian's runsc lacks it).
      - A restore follows what the image was taken with.
    type: str
    choices: [engine, runsc]
    default: engine
"""

    # A restore's choice to take a signed image without its key (the sign_key above: OPERATION).
    SIGNATURE_CHECK = r"""
options:
  allow_unverified_signature:
    description:
      - Restore an image whose manifest carries a signature although no O(sign_key) is given to check it.
      - Without it such an image is refused before anything is restored. A forgotten key must not turn the check
        off unnoticed.
      - With it the result's C(signature) is C(not_checked), and the module warns that the signature was not checked.
      - It has no effect when O(sign_key) is given. The signature is then always checked.
    type: bool
    default: false
"""

    # What a checkpoint and a restore share besides the group's options: the tools, a migration's journal, and
    # the speed options (module_utils/_module_helpers.py's operation_spec).
    OPERATION = r"""
options:
  criu_path:
    description: Path of the criu binary. Found on PATH and in the sbin directories when not given.
    type: path
  criu_options:
    description:
      - Extra options for CRIU (C(criu dump) when checkpointing, C(criu restore) when restoring), for example C(--link-remap).
      - What the workload needs is found before anything is frozen and passed without being asked, and recorded in the
        image for its restore. That is C(--file-locks) when it holds file locks, C(--ext-unix-sk) when it holds a datagram
        unix socket connected to a named socket outside it (such as C(/dev/log)). One end of a unix stream connection
        to a process outside the workload cannot be checkpointed; that is refused, with nothing frozen.
    type: list
    elements: str
    default: []
  tcp_established:
    description:
      - Checkpoint established TCP connections (CRIU's C(--tcp-established)); they are restored with the same
        addresses, so the restored workload must be reachable there (the same host, or an address that moves with it).
      - Without it, a workload with established TCP connections is refused before anything is frozen. Listening
        sockets need nothing.
    type: bool
    default: false
  runtime_timeout:
    description:
      - Seconds that the runtime's own dump or restore (CRIU, or runc, Podman or Docker driving it) may take.
        When it runs longer it is killed, with the CRIU it started. The step then fails like any other failure
        of that stage. A checkpoint is rolled back. A restore leaves nothing running and keeps the image.
      - V(0) sets no limit. C(gpuckpt.fleet.migrate) sets 1800 by default, so that a hung restore rolls the
        migration back instead of holding the source forever.
    type: float
    default: 0
  sign_key:
    description:
      - Key of the manifest's signature (HMAC-SHA256).
      - A checkpoint signs the manifest with it. A restore given it refuses, before anything is restored, an
        image whose manifest carries no signature or one that does not match (an image altered, or signed with
        another key).
      - A restore not given it refuses an image whose manifest carries a signature, unless the restore's
        C(allow_unverified_signature) is set. The refused image is kept as it is.
      - Without a key nothing is checked against an image whose signature was removed. Configure the key on every
        host that restores the images it signs.
    type: str
  parallel:
    description:
      - Make the driver's checkpoint or restore calls for all CUDA processes of the workload at once (one thread each) rather than one after another.
      - Locks are always taken one after another, before any checkpoint.
    type: bool
    default: true
  migration_id:
    description: Record each phase in this migration's journal on the host (see gpuckpt.fleet.gpu_migration).
    type: str
  journal_dir:
    description: Directory of the migration journals.
    type: path
    default: /var/lib/gpuckpt/journal
  host_huge_pages:
    description:
      - Set the host's transparent huge pages to C(always) while this operation runs, and put back what
        was there afterwards. Neither the driver nor CRIU asks for huge pages for the memory they fill,
        and with the C(madvise) default of many hosts they get none.
      - Measured on an H200 VM (docs/benchmarks), the driver's checkpoint and CRIU's restore ran 1.5-1.8x
        faster with it. While it holds, other processes' new memory gets huge pages too.
      - Operations that overlap on one host share the setting; the last one to end puts it back. If a
        module is killed, the next operation of the collection on that host (or
        a migration's settlement or recover.yml) puts it back. A change an administrator makes meanwhile is kept.
      - A host where it cannot be set does not fail the operation; the result's C(huge_pages.error) says why.
    type: bool
    default: false
"""

    # The filters over one migration (migration_plan, migration_summary, migration_outcome, migration_ending) each
    # take its two hosts by name.
    MIGRATION_HOSTS = r"""
options:
  source:
    description: The source host.
    type: str
    required: true
  target:
    description: The target host.
    type: str
    required: true
"""

    # The filters that judge whether an image can be restored on a host (image_restorability, failover_plan).
    RESTORABILITY = r"""
options:
  allow_driver_mismatch:
    description: Accept another driver and CUDA API version on the host than the image was taken with.
    type: bool
    default: false
  same_kernel:
    description: Refuse a host whose kernel release is not the one the image was taken on.
    type: bool
    default: false
"""

    # The filters over a drain's plan and what its moves said (drain_report, drain_end).
    DRAIN_PLAN_INPUT = r"""
options:
  _input:
    description: The plan (gpuckpt.fleet.drain_plan's result).
    type: dict
    required: true
"""
