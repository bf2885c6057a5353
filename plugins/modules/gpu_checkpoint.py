#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_checkpoint
short_description: Checkpoint a running CUDA process tree to disk (GPU memory, host memory, CPU state)
version_added: "0.1.0"
description:
  - Two stages. Stage 1 locks every CUDA process of the tree, then moves each one's GPU memory into
    host RAM through the NVIDIA driver's checkpoint API (C(cuCheckpointProcess*), driver 570+).
    Stage 2 dumps the whole process tree with CRIU into O(image_dir).
  - All CUDA processes are locked before any is checkpointed, so a multi-process workload is frozen
    consistently.
  - Any failure after the first lock is rolled back (CUDA restore and unlock on the source, CRIU thaws
    the tree), so the workload runs on; the error names the stage, the pid, and the driver error or
    the command with its rc, stdout and stderr.
  - Processes without a CUDA context (or hosts without a GPU) are checkpointed with CRIU alone; the
    result's C(gpu_stage) says the GPU stage was skipped and why.
  - The image is a directory (mode 0700) with C(manifest.json) holding host facts, processes, sizes,
    stage timings and chunked SHA-256 checksums of every file. The manifest is written last.
  - Idempotent. If O(image_dir) already holds a complete image of the same O(pid), nothing is done
    and C(changed) is false. Any other non-empty O(image_dir) is refused.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  pid:
    description:
      - Root pid of the process tree to checkpoint (the host's pid). Its descendants are included.
      - Required with O(runtime=process).
    type: int
  runtime:
    description:
      - What the workload runs in. V(process) is a bare process tree, dumped by CRIU. V(runc) is a runc
        container named by O(container), dumped by runc (which drives CRIU). V(podman) is a Podman
        container, exported by C(podman container checkpoint --export) into O(image_dir). For a
        container the CUDA stage works on its host pids. V(docker) is a Docker container, checkpointed by
        C(docker checkpoint create --checkpoint-dir) into O(image_dir) (dockerd needs experimental features).
      - With O(runtime=runc) and O(leave_stopped=true), the container is paused (cgroup freezer).
      - V(containerd) is a containerd task (runtime C(io.containerd.runc.v2)) in namespace O(containerd_namespace),
        checkpointed through containerd's API. CRIU's images go to C(checkpoint/) in O(image_dir), the container's
        writable layer to C(rootfs-diff.tar), and its record (spec, runtime options, image) to the manifest.
        With O(leave_stopped=true) the task is paused. Needs Python's grpc and protobuf modules (python3-grpcio, python3-protobuf 4.21+) on the host.
      - V(runsc) is a gVisor sandbox, checkpointed by C(runsc checkpoint) into O(image_dir). Its CUDA stage runs inside
        the sandbox through the cuda-checkpoint tool at O(cuda_checkpoint_path) there, on the sandbox's own pids.
        With O(leave_stopped=true) the sandbox is paused. O(quiesce_signal) cannot reach its processes;
        O(quiesce_command) runs inside it.
      - V(podman) and V(docker) do not support O(leave_stopped=true), because they checkpoint only running containers.
      - V(k8s_pod) is a Kubernetes pod on this node, named by O(pod), whose containers containerd runs in namespace
        C(k8s.io). All of its containers' CUDA processes are locked and checkpointed, and all of its containers
        paused, before the first container is dumped; each container goes to C(containers/<name>/) in O(image_dir).
        It needs O(leave_stopped=true) or O(leave_running=true), because the kubelet would start exited containers
        again from their entrypoint. Such an image is restored by the pod migration, not by M(gpuckpt.fleet.gpu_restore).
      - Left out, the workload named decides it - V(process) for O(pid), V(runc) for O(container), V(k8s_pod)
        for O(pod).
    type: str
    choices: [process, runc, podman, docker, containerd, runsc, k8s_pod]
  container:
    description: The container's id or name. Required with a container O(runtime).
    type: str
  pod:
    description:
      - The pod to checkpoint with O(runtime=k8s_pod), as C(<namespace>/<name>) (a bare name is in namespace
        C(default)). Its containers are found by the labels the kubelet gives them.
      - Exactly one of O(pid), O(container) and O(pod) names the workload.
    type: str
  pod_uid:
    description:
      - The pod's uid (M(gpuckpt.fleet.gpu_pod_info) returns it). It tells two pods of the same name apart while
        one of them is being deleted.
    type: str
  pod_containers:
    description:
      - The names of the pod's containers that must all run here (M(gpuckpt.fleet.gpu_pod_info) lists them).
        A missing one is refused before anything is frozen.
    type: list
    elements: str
  image_dir:
    description: Directory to write the image to. Created with mode 0700; must be new or empty.
    type: path
    required: true
  image_in_memory:
    description:
      - Keep the image in memory, off the disk. A tmpfs of the image's own, sized to it, is
        mounted on O(image_dir), which must not exist yet. It is mounted before anything is frozen,
        and only when this host's RAM holds three things on top of what runs now. These are the
        image, the GPU memory that stage 1 brings into host RAM, and a reserve of 5 % of the RAM
        (at least 1 GiB). Otherwise it is refused, and nothing is frozen.
      - The tmpfs is sized to the tree's host RSS plus its GPU memory, times 1.10, plus 256 MiB, or to
        O(image_memory_bytes). A dump that outgrows it fails (no space) and is undone. When the GPU
        memory cannot be read (no NVML, no nvidia-smi), it is refused unless O(image_memory_bytes) is given.
      - Meant for a migration's source (gpuckpt.fleet.migrate with C(gpuckpt_image_in_memory)). The image
        is needed only until the target runs, and its settlement removes it. A kept image stays in
        memory until it is removed; removing its directory unmounts the tmpfs. A reboot loses it.
      - Needs root (mounting a tmpfs needs CAP_SYS_ADMIN).
    type: bool
    default: false
  image_memory_bytes:
    description:
      - With O(image_in_memory), the size of the image's tmpfs in bytes, instead of the estimate. The
        host RAM check counts it as the image's size, and as the GPU memory stage 1 brings in when
        that memory is unknown.
    type: int
  leave_running:
    description:
      - Keep the workload running after the checkpoint. It is frozen only while the image is being written.
        Its GPU memory is then restored and it is unlocked.
    type: bool
    default: false
  leave_stopped:
    description:
      - Leave the workload stopped after the dump, with its GPU memory in host RAM, neither running nor
        killed. This is a migration's source. C(gpuckpt.fleet.gpu_migration) later releases it (commit)
        or resumes it (rollback).
    type: bool
    default: false
  lock_timeout:
    description: Seconds to wait for in-flight CUDA work to finish when locking each process.
    type: float
    default: 30
  quiesce_signal:
    description:
      - Before anything is frozen, send this signal (V(SIGUSR1), V(USR1) or its number) to each CUDA process
        (the root process when none) so that the workload gives back memory it need not keep, such as a PyTorch
        caching allocator's free blocks, which would otherwise be copied, dumped, sent and restored.
      - The workload handles it and acknowledges by writing C(/tmp/gpuckpt-quiesced.<its pid>) in its own root.
        The collection's C(tools/gpuckpt_quiesce.py) does both for a PyTorch job (C(torch.cuda.empty_cache())).
      - A process that does not catch the signal is refused before anything is sent. Without an acknowledgement
        within O(quiesce_timeout) the checkpoint goes on, and the result's C(quiesce.warning) says so.
      - The workload runs on while it quiesces, so this adds no downtime.
    type: str
  quiesce_command:
    description:
      - Before anything is frozen, run this command inside the workload (its namespaces, root, working directory
        and environment, like an exec), for example a call to an inference server's endpoint that frees its cache.
        A string is split as a shell would split it (no shell runs it), or give a list.
      - A failure or a timeout fails the checkpoint before the freeze. Nothing is frozen, but whatever the
        command changed in the workload stays changed.
      - Excludes O(quiesce_signal).
    type: raw
  quiesce_timeout:
    description:
      - Seconds to wait for the acknowledgements of O(quiesce_signal), or for O(quiesce_command) to end.
      - With O(quiesce_mode=cooperative), for every rank's acknowledgement; a rank that does not acknowledge in time
        fails the checkpoint before anything is frozen.
    type: float
    default: 30
  quiesce_mode:
    description:
      - V(release) (the default) is what O(quiesce_signal) and O(quiesce_command) do, the workload giving back memory
        while it runs on.
      - V(cooperative) checkpoints a distributed job at full speed, NCCL's defaults kept between checkpoints. Each
        rank (each NCCL rank of the tree) imports C(tools/gpuckpt_quiesce.py) and calls
        C(Cooperative().step_boundary(step)) once a step (docs/multi_gpu.md). Other CUDA processes of the tree (a
        launcher with a context of its own) are frozen with the ranks but not asked. The checkpoint writes a request into each rank's C(/tmp) and sends it
        O(quiesce_signal) (V(SIGUSR1) when not given). The ranks agree on one step boundary, destroy their process
        groups and acknowledge. Only then is the job locked, checkpointed and dumped.
      - A rank that does not acknowledge within O(quiesce_timeout), that exits, or that still holds NCCL's
        shared memory fails the checkpoint before anything is frozen. Every rank is then told to resume, and the
        error names the rank.
      - The ranks are told to resume, re-creating their process groups on a fresh prefix of their rendezvous
        store, once the job runs again. That is after the GPU restore and unlock with O(leave_running), after
        M(gpuckpt.fleet.gpu_restore) restores the image, or when the checkpoint fails.
      - A job in NCCL's default configuration, refused otherwise, is accepted this way. Its rendezvous and
        inter-rank TCP connections within the tree are dumped without O(tcp_established).
      - V(auto) is V(cooperative) for a tree one of whose processes runs the helper (it announces itself in
        C(/tmp/gpuckpt-cooperative.<its pid>)), and V(release) for any other. A drain or a migration of many
        workloads can set it once for all.
      - Excludes O(quiesce_command) (with V(auto), where the helper runs).
    type: str
    choices: [release, cooperative, auto]
    default: release
  quiesce_lease:
    description:
      - With O(quiesce_mode=cooperative), the seconds of its own running time after which a rank that waits for
        its resume and was never told resumes by itself (a controller that died between the freeze and the
        resume). Time the rank spends frozen, and a restored process's clock jump, do not count.
      - At least twice O(quiesce_timeout).
    type: float
    default: 600
  hold_dir:
    description:
      - Where a cooperative (or V(auto)) O(leave_running) checkpoint (outside a migration and without O(push)) keeps
        a record
        while it holds the job. Should this module die between the freeze and the resume, the next
        M(gpuckpt.fleet.gpu_checkpoint) of the same runtime finds the record before anything else. It restores
        and unlocks the job as the checkpoint's own undo would, and tells its ranks to resume. The result's
        C(given_back) lists what it did.
    type: path
    default: /var/lib/gpuckpt/hold
  push:
    description:
      - Send the image to another host while it is being written, over parallel persistent ssh streams
        (the host's own ssh; the target needs Python 3). The page files go piece by piece during the
        dump, everything else right after it, the manifest last, so the target holds a complete image
        or none. C(gpuckpt.fleet.migrate) uses this to overlap the dump and the transfer.
      - A failed push does not fail the checkpoint. The result's C(push.pushed) is false with C(push.error),
        and M(gpuckpt.fleet.gpu_image_sync) sends what is missing.
      - The target's copy is checked against the manifest's checksums by M(gpuckpt.fleet.gpu_restore) before
        anything is restored.
    type: dict
    suboptions:
      to:
        description:
          - The target as an inventory host. The action plugin fills O(push.host), O(push.port), O(push.user),
            O(push.python) and O(push.become) from its C(ansible_host), C(ansible_port), C(ansible_user),
            C(ansible_python_interpreter) and C(ansible_become), and adds C(-i) with its C(ansible_ssh_private_key_file)
            (a path on this host) to O(push.ssh_args). Values given in the task win.
        type: str
      host:
        description: The target's address for ssh. Required unless O(push.to) is given.
        type: str
      become:
        description: Run the receiver on the target through C(sudo -n), for a O(push.user) other than root.
        type: bool
        default: false
      dest:
        description: The image directory on the target (created, mode 0700).
        type: path
        required: true
      user:
        description: The ssh user on the target.
        type: str
        default: root
      port:
        description: The ssh port of the target.
        type: int
        default: 22
      ssh_args:
        description: Extra ssh arguments (they come first, so they win).
        type: list
        elements: str
        default: []
      streams:
        description: Parallel ssh streams; V(0) picks a quarter of this host's cores, from 1 to 8.
        type: int
        default: 0
      python:
        description: The Python 3 interpreter on the target that writes the received data (a command name or an absolute path).
        type: str
        default: python3
      io_timeout:
        description: Seconds without an answer from the target after which a stream is given up.
        type: int
        default: 120
      journal_dir:
        description:
          - The migration journals' directory on the target. With O(migration_id), the receivers write only into
            the directory that this migration's journal on the target says it created (gpuckpt.fleet.gpu_migration
            C(begin)), and only while that journal is receiving this checkpoint's image (O(nonce)).
        type: path
        default: /var/lib/gpuckpt/journal
  nonce:
    description:
      - In a migration, the id that the target's journal expects of this checkpoint (gpuckpt.fleet.gpu_migration
        C(begin) returns it). It is recorded in the source's journal before anything is frozen and in the manifest;
        the target restores only an image that carries it. A new one is made when not given.
    type: str
requirements:
  - "Root on the managed host."
  - "CRIU 4.0 or newer (4.2 for TCP on kernel 6.16+), except with runtime runsc."
  - "NVIDIA driver 570 or newer for CUDA processes (580 to restore them onto other GPUs)."
  - "The runtime named by O(runtime) (runc, Podman, Docker with experimental features, containerd 2.x with python3-grpcio and python3-protobuf, gVisor runsc)."
attributes:
  check_mode:
    details: It validates the target, CRIU and the image directory, and reports what it would do.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.actiongroup_gpu
  - gpuckpt.fleet.common.operation
  - gpuckpt.fleet.common.progress
notes:
  - Needs root (CRIU and the driver's checkpoint API act on other processes).
  - NCCL jobs, CUDA IPC memory, MPS clients and MIG instances are not supported by the driver's checkpoint API.
  - Supports check mode. It validates the target, CRIU and the image directory and reports what it would do.
seealso:
  - module: gpuckpt.fleet.gpu_restore
  - module: gpuckpt.fleet.cuda_process_facts
"""

EXAMPLES = r"""
- name: Checkpoint a training job (it stops; gpu_restore brings it back)
  gpuckpt.fleet.gpu_checkpoint:
    pid: "{{ train_pid }}"
    image_dir: /var/lib/gpuckpt/images/train-0001

- name: Snapshot an inference server and keep it serving
  gpuckpt.fleet.gpu_checkpoint:
    pid: 4242
    image_dir: /var/lib/gpuckpt/images/infer-snap
    leave_running: true
    lock_timeout: 60

- name: Freeze a migration's source (gpuckpt.fleet.migrate does this)
  gpuckpt.fleet.gpu_checkpoint:
    pid: 4242
    image_dir: /var/lib/gpuckpt/images/m-42
    leave_stopped: true
    migration_id: m-42

- name: Checkpoint and send the image to gpu-node-2 while it is written (ssh details from the inventory)
  gpuckpt.fleet.gpu_checkpoint:
    pid: 4242
    image_dir: /var/lib/gpuckpt/images/job-1
    push:
      to: gpu-node-2
      dest: /var/lib/gpuckpt/images/job-1

- name: Hold a GPU pod on its node, all of its containers in one image (run on the pod's node)
  gpuckpt.fleet.gpu_checkpoint:
    runtime: k8s_pod
    pod: default/gpu-test-pod
    pod_uid: "{{ pod_info.pod.uid }}"
    pod_containers: "{{ pod_info.pod.containers | map(attribute='name') }}"
    image_dir: /var/lib/gpuckpt/images/gpu-test-pod
    leave_stopped: true
"""

RETURN = r"""
quiesce:
  description:
    - With O(quiesce_signal), C(signal), C(pids), C(seconds), C(acknowledged) (each process's acknowledgement, as
      it wrote it), and C(not_acknowledged) with C(warning) when some did not answer in time.
    - With O(quiesce_command), C(cmd), C(rc), C(seconds), C(stdout) and C(stderr) (their last 2000 characters).
    - With O(quiesce_mode=cooperative), C(mode), C(request) (its number), C(step) (the step boundary every rank
      stopped at), C(ranks) (each rank's pid, C(rank), C(step) and C(seconds) its release took), C(seconds), and
      C(resumed) (the pids told to resume, with O(leave_running)).
  returned: when O(quiesce_signal), O(quiesce_command) or O(quiesce_mode=cooperative) was given and the checkpoint
    was made
  type: dict
  sample: {"signal": "SIGUSR1", "pids": [4242], "seconds": 0.41,
           "acknowledged": {"4242": {"seq": 1, "pid": 4242, "released_bytes": 30064771072}}}
given_back:
  description:
    - What the give-back before this checkpoint did, one item per record a dead cooperative checkpoint left in
      O(hold_dir) (C(id), C(phase), C(given_back) pids, C(msg), or C(error)).
  returned: when there was something to give back
  type: list
  elements: dict
  sample: [{"id": "checkpoint-process-5f0c", "phase": "frozen", "given_back": [4242, 4243], "changed": true}]
huge_pages:
  description:
    - With O(host_huge_pages), what was done. C(mode) and C(previous) (the setting found), C(put_back) when
      this operation was the last to hold it, C(error) when it could not be set or put back.
    - Also returned, with C(note), when this operation put back a setting that a killed module had left.
  returned: when O(host_huge_pages) was set, or a setting was put back
  type: dict
  sample: {"requested": true, "mode": "always", "previous": "madvise", "put_back": "madvise"}
image_dir:
  description: Absolute path of the image.
  returned: always
  type: str
image_in_memory:
  description:
    - With O(image_in_memory), the image's tmpfs. C(size_bytes) is its size, and C(used_bytes) what the image
      took. Also returned are the figures the host RAM check used. These are C(rss_bytes) and C(gpu_bytes)
      (None when unknown), C(stage1_bytes), C(reserve_bytes) and C(available_bytes).
  returned: with O(image_in_memory)
  type: dict
  sample: {"size_bytes": 6710886400, "used_bytes": 5882181632, "rss_bytes": 1288490188, "gpu_bytes": 4399824896,
           "gpu_memory_source": "nvml", "stage1_bytes": 4399824896, "reserve_bytes": 6871947673,
           "available_bytes": 128849018880}
pids:
  description: Pids of the process tree, root first.
  returned: success
  type: list
  elements: int
cuda_pids:
  description: Pids that the driver knows as CUDA processes (locked and checkpointed).
  returned: success
  type: list
  elements: int
gpu_stage:
  description: C(done), or C(skipped) with the reason.
  returned: when changed
  type: str
timings:
  description: Seconds per stage (cuda_lock, cuda_checkpoint, runtime_dump, cuda_resume_source, checksum, manifest).
  returned: when changed
  type: dict
driver_call_seconds:
  description: Seconds spent inside the driver's own calls, per call, to compare with the stage timings.
  returned: when changed
  type: dict
driver_call_seconds_by_pid:
  description: The same for each CUDA process (its pid), e.g. each rank's own stage 1 in a multi-GPU job.
  returned: when changed
  type: dict
image_bytes:
  description: Size of the image.
  returned: when changed
  type: int
manifest_id:
  description: Unique id of the image (manifest.json's id).
  returned: success
  type: str
stage:
  description: On failure, the stage that failed (preflight, lock, checkpoint, criu-dump, ...).
  returned: failure
  type: str
rolled_back:
  description: On failure after the first lock, whether the workload was brought back to running.
  returned: failure
  type: bool
nonce:
  description: The checkpoint's id in a migration (see O(nonce)).
  returned: with O(migration_id)
  type: str
frozen_at:
  description: When the workload was frozen (seconds since the epoch), the start of its downtime.
  returned: when changed
  type: float
push:
  description:
    - With O(push), its report. C(pushed) is true when the whole image and its manifest are on the target.
      C(bytes), C(bytes_sent_during_dump), C(seconds) (from the streams' start), C(streams), and C(error)
      when it failed.
  returned: when O(push) was given and the checkpoint was made
  type: dict
"""

import re

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import checkpoint as engine_checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import give_back as engine_give_back
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.registry import runtime_of
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import (
    WORKLOAD_ARGS, check_path_arg, command_argv, journal_for, make_backend, run_engine)
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import (
    operation_spec, or_fail, push_sender, transfer_target_spec)

NONCE_RE = re.compile(r"^[A-Za-z0-9]{8,64}\Z")


def main():
    spec = operation_spec(
        pod_uid=dict(type="str"),
        pod_containers=dict(type="list", elements="str"),
        image_dir=dict(type="path", required=True),
        image_in_memory=dict(type="bool", default=False),
        image_memory_bytes=dict(type="int"),
        leave_running=dict(type="bool", default=False),
        leave_stopped=dict(type="bool", default=False),
        lock_timeout=dict(type="float", default=30),
        quiesce_signal=dict(type="str"),
        quiesce_command=dict(type="raw"),
        quiesce_timeout=dict(type="float", default=30),
        quiesce_mode=dict(type="str", choices=["release", "cooperative", "auto"], default="release"),
        quiesce_lease=dict(type="float", default=600),
        hold_dir=dict(type="path", default="/var/lib/gpuckpt/hold"),
        nonce=dict(type="str"),
        push=dict(type="dict", required_one_of=[("host", "to")], options=dict(
            to=dict(type="str"),
            journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
            **transfer_target_spec(""))),
        **WORKLOAD_ARGS
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True,
                           required_one_of=[("pid", "container", "pod")],
                           mutually_exclusive=[("leave_running", "leave_stopped"), ("pid", "container", "pod"),
                                               ("quiesce_signal", "quiesce_command")],
                           required_if=[("runtime", "process", ["pid"]), ("runtime", "runc", ["container"]),
                                        ("runtime", "podman", ["container"]), ("runtime", "docker", ["container"]),
                                        ("runtime", "runsc", ["container"]), ("runtime", "k8s_pod", ["pod"])])
    p = module.params
    p["runtime"] = runtime_of(p["container"], p["pod"], p["runtime"])
    check_path_arg(module, "image_dir", p["image_dir"])
    if p["nonce"] is not None and not NONCE_RE.match(p["nonce"]):
        module.fail_json(msg="nonce must be 8-64 letters or digits, got %r; nothing was frozen" % p["nonce"])
    journal = or_fail(module, journal_for, p, "source")
    sender = push_sender(module, p, engine_checkpoint.push_hooks(journal))
    options = {k: p[k] for k in ("leave_running", "leave_stopped", "lock_timeout", "libcuda_path", "sign_key",
                                 "parallel", "progress_file", "nonce", "host_huge_pages", "quiesce_signal",
                                 "quiesce_timeout", "image_in_memory", "image_memory_bytes", "quiesce_mode",
                                 "quiesce_lease")}
    options["quiesce_command"] = command_argv(module, "quiesce_command", p["quiesce_command"])
    target = p["pid"] if p["runtime"] == "process" else p["pod"] if p["runtime"] == "k8s_pod" else p["container"]
    held = p["quiesce_mode"] != "release" and p["leave_running"] and journal is None and sender is None
    run_engine(module, _checkpoint, module, target, options, journal, sender, held)


def _checkpoint(module, target, options, journal, sender, held):
    """The engine's checkpoint; a cooperative leave_running one under a give-back record (engine/give_back.py),
    after giving back what a dead one of this runtime left."""
    p = module.params
    prefix = "%s%s-" % (engine_give_back.MODULE_PREFIX, p["runtime"])
    given_back = [] if module.check_mode else engine_give_back.give_back_all(
        p["hold_dir"], lambda: make_backend(p["runtime"], p), prefix=prefix, libcuda_path=p["libcuda_path"])

    def run(record):
        return engine_checkpoint.checkpoint(target, p["image_dir"], backend=make_backend(p["runtime"], p),
                                            journal=record, sender=sender, check_mode=module.check_mode, **options)

    res = engine_give_back.held_run(p["hold_dir"], run, prefix) if held and not module.check_mode else run(journal)
    if given_back:
        res["given_back"] = given_back
    return res


if __name__ == "__main__":
    main()
