#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: cuda_process_facts
short_description: Report whether a host can checkpoint GPU work, and its CUDA processes
version_added: "0.1.0"
description:
  - Reports the NVIDIA driver and whether its checkpoint API is there (570+), and whether it can restore onto other GPUs (580+).
  - Reports the GPUs (through NVML when nvidia-ml-py is installed, else nvidia-smi).
  - Reports the CUDA processes with their checkpoint state (running, locked, checkpointed, failed).
  - Reports CRIU's path and version and the output of C(criu check).
  - Sets C(ansible_facts['gpuckpt']); C(ready) is true when this host can checkpoint and restore.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  pids:
    description:
      - Only report these pids. By default, every process that holds a /dev/nvidia* device is reported.
        Every process that the driver knows as a CUDA process is reported too (checkpointed processes hold no device file).
    type: list
    elements: int
  paths:
    description: Report the free bytes of the filesystem that holds each of these paths (as C(disk)).
    type: list
    elements: path
  tree_of:
    description:
      - Report the process tree of this pid as C(tree) (pids, CUDA pids and states, RSS and GPU bytes).
      - C(tree) also names its network namespace and the socket addresses it holds bound (C(bound_sockets)).
    type: int
  container:
    description:
      - A container of O(runtime) whose process tree to report as C(tree), its root pid found through the
        runtime (instead of O(tree_of)); C(container) names it, with its C(pid).
    type: str
  runtime:
    description:
      - The runtime of O(container).
      - V(k8s_pod) takes a Kubernetes pod on this node as O(container) (C(<namespace>/<name>)), whose containers
        containerd runs in namespace C(k8s.io); C(tree) is then the union of its containers' trees, and
        C(container.pid) the first one's root.
    type: str
    choices: [runc, podman, docker, containerd, runsc, k8s_pod]
    default: runc
  list_containers:
    description:
      - The runtimes whose containers holding CUDA processes to report as C(gpu_containers) (each with its
        runtime, id, C(namespace) for containerd, host pid of its init, and its CUDA processes with their host
        and in-container pids; each such entry of C(cuda_processes) gets its C(container) too).
      - A gVisor sandbox (V(runsc)) hides its processes from the host; its CUDA processes are asked inside it with
        the cuda-checkpoint tool at O(cuda_checkpoint_path) there, and listed with the sandbox's own pids
        (C(in_sandbox) true). Paused sandboxes are not asked.
      - By default every runtime that is in use on this host (runc's state directory, runsc's, containerd's and
        dockerd's sockets, Podman's storage); V([]) lists none. containerd's namespace moby is left to C(docker).
      - A runtime that cannot be asked is named in C(container_errors); the facts do not fail for it.
    type: list
    elements: str
    choices: [runc, podman, docker, containerd, runsc]
  check_pids:
    description: Report which of these pids are in use on this host (as C(pids_in_use)).
    type: list
    elements: int
  check_criu:
    description: Run C(criu check). It takes about a second.
    type: bool
    default: true
  criu_path:
    description: Path of the criu binary.
    type: path
  workloads:
    description:
      - Report C(workloads), the GPU workloads of this host as a drain moves them (gpuckpt.fleet.drain) - one
        entry per container holding CUDA processes (of the runtimes of O(list_containers)) and one per bare process
        tree whose processes hold CUDA contexts, its root found by walking up through parents of the same process
        group that have no controlling terminal. Each has C(key), C(kind), C(runtime), C(container) or C(pid),
        C(root_pid) and C(tree) (as O(tree_of) reports it, with its GPU memory or unknown).
    type: bool
    default: false
  journal_dir:
    description:
      - The directory of this host's migration journals, where a drain keeps its mark (C(drain.json)). Its content
        is reported as C(drain) (null when this host is not draining); a planner places nothing on a draining host.
    type: path
    default: /var/lib/gpuckpt/journal
  protect_dir:
    description:
      - Where the role gpuckpt.fleet.protect keeps this node's protected jobs. When it holds a job's config, what a
        checkpoint run that died left frozen is given back first (C(protect_given_back)), then the
        fence check of gpuckpt.fleet.gpu_protect runs. A job that was failed over to another host (its replicas
        say so) has its copy here stopped, and its timer disabled, before the facts are read. C(protect_fenced)
        lists the fenced jobs.
    type: path
    default: /etc/gpuckpt/protect
notes:
  - Changes nothing, but for O(protect_dir) - a protected job a dead checkpoint run left frozen is given back, and a
    protected job's copy that was failed over elsewhere is stopped (neither in check mode).
requirements:
  - "Root to see other users' processes and to ask the driver about them."
attributes:
  check_mode:
    details: It only reads the host, and the fence check of O(protect_dir) stops no copy (C(protect_fenced) still names it).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.actiongroup_gpu
"""

EXAMPLES = r"""
- name: Is this node ready for checkpoints?
  gpuckpt.fleet.cuda_process_facts:

- name: Which containers on this node hold GPU processes?
  gpuckpt.fleet.cuda_process_facts:
    check_criu: false
    list_containers: [containerd]

- name: Show each CUDA process and its state
  ansible.builtin.debug:
    msg: "{{ item.pid }} {{ item.comm }} {{ item.cuda_state }}"
  loop: "{{ ansible_facts['gpuckpt']['cuda_processes'] }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts under the key C(gpuckpt).
  returned: always
  type: complex
  contains:
    gpuckpt:
      description:
        - driver, gpus, cuda_device_uuids, cuda_processes, criu, host (with boot_id, pid_namespace and net_namespace),
          memory (total_bytes, available_bytes from /proc/meminfo), gpu_source (null when nothing could list the GPUs), ready.
        - gpu_containers and container_errors (see O(list_containers)).
        - runtimes_present (the container runtimes that could restore a container here - a daemon that answers, or the binary
          of runc, runsc or Podman), drain (this host's drain mark, or null).
        - protect_fenced - the protected jobs of O(protect_dir) that are fenced here (failed over to another host), each with
          C(job), C(reason), C(epoch), C(replica_epoch), C(owner), C(stopped) (what the fence stopped; null in check mode)
          and C(already) (fenced before this run). Empty when no job is fenced or none is protected here.
        - protect_given_back - the protected jobs that a checkpoint run which died (SIGKILLed, an OOM kill) had left
          frozen, given back before the facts were read, each with C(job) and C(records) (per record C(id), C(phase), C(changed),
          C(given_back) (the pids that run again), C(msg), or C(error); C(would_give_back) in check mode).
        - disk, tree, pids_in_use and workloads when asked for. C(tree) has gpu_bytes (null when unknown, as when neither NVML nor
          nvidia-smi reports the memory of each of its CUDA processes; never 0 for unknown), gpu_bytes_by_gpu,
          gpu_memory_source and gpu_memory_unknown_reason.
      type: dict
      returned: always
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import DEFAULT_JOURNAL_DIR
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.run import find_binary
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import facts as host_facts
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import drain_mark, protect, workloads as node_workloads
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import RUNTIME_ARGS, make_backend
from ansible_collections.gpuckpt.fleet.plugins.module_utils._module_helpers import (
    container_backends, container_tree, run_module)

CONTAINER_RUNTIMES = ["runc", "podman", "docker", "containerd", "runsc"]
DAEMONLESS = ("runc", "runsc", "podman")  # their binary is all a restore needs; containerd and Docker need their daemon


def runtimes_available(p):
    """The runtimes this host could restore a container with: a daemon's socket answering to its path, or the
    binary of a runtime without a daemon (its state directory appears with its first container)."""
    found = []
    for name in CONTAINER_RUNTIMES:
        try:  # a runtime whose options are wrong here (say, runsc_flags) cannot restore here: not listed, not a failure
            b = make_backend(name, p)
            if b.present() or (name in DAEMONLESS and find_binary(name, p.get(name + "_path"), required=False)):
                found.append(name)
        except GpuCkptError:
            continue
    return found


def main():
    module = AnsibleModule(argument_spec=dict(
        pids=dict(type="list", elements="int"),
        paths=dict(type="list", elements="path"),
        tree_of=dict(type="int"),
        check_pids=dict(type="list", elements="int"),
        check_criu=dict(type="bool", default=True),
        criu_path=dict(type="path"),
        libcuda_path=dict(type="path"),
        container=dict(type="str"),
        runtime=dict(type="str", default="runc", choices=CONTAINER_RUNTIMES + ["k8s_pod"]),
        list_containers=dict(type="list", elements="str", choices=CONTAINER_RUNTIMES),
        workloads=dict(type="bool", default=False),
        journal_dir=dict(type="path", default=DEFAULT_JOURNAL_DIR),
        protect_dir=dict(type="path", default=protect.DEFAULT_PROTECT_DIR),
        **RUNTIME_ARGS
    ), mutually_exclusive=[("container", "tree_of")], supports_check_mode=True)
    p = module.params

    def gather():
        # A protected job failed over to another host is stopped here before anything else (never two copies).
        # A run of protect that died while it held a job frozen has it given back first (not in check mode).
        checks = protect.fence_check_all(p["protect_dir"], act=not module.check_mode)
        fence = [f for f in checks if f.get("fenced")]
        given_back = [{"job": f["job"], "records": f["given_back"]} for f in checks if f.get("given_back")]
        tree_of, container, tree_pids = container_tree(p)
        facts = host_facts.facts(pids=p["pids"], libcuda_path=p["libcuda_path"], criu_path=p["criu_path"],
                                 check_criu=p["check_criu"], paths=p["paths"], tree_of=tree_of,
                                 check_pids=p["check_pids"],
                                 tree_pids=tree_pids if p["runtime"] == "k8s_pod" else None)
        if container:
            facts["container"] = container
        facts["gpu_containers"], facts["container_errors"] = host_facts.gpu_containers(
            container_backends(p, CONTAINER_RUNTIMES), facts["cuda_processes"], p["libcuda_path"])
        facts["runtimes_present"] = runtimes_available(p)
        facts["drain"] = drain_mark.read(p["journal_dir"])
        facts["protect_fenced"] = fence
        facts["protect_given_back"] = given_back
        if p["workloads"]:
            facts["workloads"] = node_workloads.discover(facts, p["libcuda_path"])
        changed = any(f.get("changed") for f in fence) or any(r.get("changed") for g in given_back for r in g["records"])
        return {"changed": changed, "ansible_facts": {"gpuckpt": facts}}

    run_module(module, gather)


if __name__ == "__main__":
    main()
