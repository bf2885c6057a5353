"""The provisioning roles, run for real on this machine (Debian 12) through ansible-playbook."""
from __future__ import annotations

import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROLE_CRIU = os.path.join(HERE, "playbooks", "role_criu.yml")
TARBALL = "/var/cache/criu_4.2.1.orig.tar.xz"  # kept by tests/setup.sh


def _recap_changed(run):
    return sum(1 for r in run.results if r.get("changed"))


# The criu role's build from CRIU's release tarball (the version, the parallel page reads patch, `criu check`, and
# a second run that changes nothing) is its molecule scenario's (roles/criu/molecule/default, test_molecule.py):
# one build of CRIU in the suite, not two.


def test_criu_role_rejects_a_bad_argument(playbook, tmp_path):
    run = playbook(ROLE_CRIU, {"criu_install_method": "bogus", "criu_prefix": str(tmp_path)})
    assert run.rc != 0
    text = run.stdout
    assert "criu_install_method" in text and "bogus" in text and "one of" in text


def test_criu_role_sets_huge_pages_for_good_only_when_they_differ(playbook, tmp_path):
    """criu_thp_mode: probed, written only when it differs, kept for the next boots by a tmpfiles entry
    (on a stand-in of the sysfs file: this host's own setting is not touched)."""
    sysfs, tmpfiles = tmp_path / "enabled", tmp_path / "gpuckpt-thp.conf"
    sysfs.write_text("always [madvise] never\n")
    v = {"criu_thp_mode": "always", "criu_thp_sysfs": str(sysfs), "criu_thp_tmpfiles": str(tmpfiles),
         "criu_run_check": False}
    run = playbook(ROLE_CRIU, v)
    assert run.rc == 0, run.stdout
    assert run.task("Set transparent huge pages now to always")["changed"] is True
    assert sysfs.read_text() == "always"
    assert "w %s - - - - always" % sysfs in tmpfiles.read_text()
    sysfs.write_text("[always] madvise never\n")  # as the kernel shows it once set
    again = playbook(ROLE_CRIU, v)
    assert again.rc == 0, again.stdout
    assert again.task("Set transparent huge pages now to always")["_status"] == "skipped"
    assert again.task("Keep it at every boot (systemd-tmpfiles)")["changed"] is False
    assert sysfs.read_text() == "[always] madvise never\n"


ROLE_CUDA_CHECKPOINT = os.path.join(HERE, "playbooks", "role_cuda_checkpoint.yml")


def test_cuda_checkpoint_role_fails_clearly_without_a_driver(playbook, tmp_path):
    """CI has no NVIDIA driver: the role must say so, not pass."""
    run = playbook(ROLE_CUDA_CHECKPOINT, {"cuda_checkpoint_path": str(tmp_path / "cuda-checkpoint")},
                   env={"GPUCKPT_LIBCUDA": str(tmp_path / "no-libcuda.so.1")})
    assert run.rc != 0
    msg = run.task("Require the checkpoint API")["msg"]
    assert "not found" in msg and "570 or newer" in msg
    assert not (tmp_path / "cuda-checkpoint").exists()


def test_cuda_checkpoint_role_installs_the_binary_then_changes_nothing(playbook, tmp_path):
    # TEST DOUBLE of the cuda-checkpoint binary (NVIDIA's is not reachable here): answers --help.
    fake = tmp_path / "cuda-checkpoint-src"
    fake.write_text("#!/bin/sh\necho 'CUDA checkpoint and restore utility: --action lock|checkpoint|restore|unlock'\n")
    dest = tmp_path / "bin" / "cuda-checkpoint"
    dest.parent.mkdir()
    v = {"cuda_checkpoint_require_driver": False, "cuda_checkpoint_source_file": str(fake),
         "cuda_checkpoint_path": str(dest)}
    run = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert run.rc == 0, run.stdout
    assert dest.exists() and os.access(str(dest), os.X_OK)
    assert _recap_changed(run) == 1
    again = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert again.rc == 0 and _recap_changed(again) == 0


def test_cuda_checkpoint_role_builds_the_collection_s_tool_then_changes_nothing(playbook, tmp_path):
    """Without NVIDIA's binary, the role builds the collection's own cuda-checkpoint on the node (a
    real build with the node's compiler), installs it, and rebuilds it only when its source changes."""
    dest = tmp_path / "bin" / "cuda-checkpoint"
    v = {"cuda_checkpoint_require_driver": False, "cuda_checkpoint_path": str(dest),
         "cuda_checkpoint_build_dir": str(tmp_path / "src")}
    run = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert run.rc == 0, run.stdout
    res = subprocess.run([str(dest), "--version"], stdout=subprocess.PIPE, universal_newlines=True, check=True)
    assert res.stdout.startswith("gpuckpt-cuda-checkpoint ")
    again = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert again.rc == 0 and _recap_changed(again) == 0, again.stdout
    (tmp_path / "src" / "cuda_checkpoint.c").write_text("/* an older source */\n")
    third = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert third.rc == 0 and third.task("Build and install it")["changed"], third.stdout


ROLE_NCR = os.path.join(HERE, "playbooks", "role_nvidia_container_runtime.yml")

USER_DAEMON_JSON = {"data-root": "/srv/docker", "log-driver": "json-file", "log-opts": {"max-size": "10m"},
                    "runtimes": {"crun": {"path": "/usr/bin/crun"}}, "default-runtime": "crun"}

USER_CONFIG_TOML = '''version = 2
root = "/srv/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
'''


def _ncr_vars(tmp_path, **extra):
    v = {"nvidia_container_runtime_install": False, "nvidia_container_runtime_restart": False,
         "nvidia_container_runtime_configure": ["docker", "containerd"],
         "nvidia_container_runtime_docker_config": str(tmp_path / "daemon.json"),
         "nvidia_container_runtime_containerd_config": str(tmp_path / "config.toml")}
    v.update(extra)
    return v


def test_container_runtime_role_adds_only_what_is_missing(playbook, tmp_path):
    import json
    import tomllib
    (tmp_path / "daemon.json").write_text(json.dumps(USER_DAEMON_JSON, indent=4))
    (tmp_path / "config.toml").write_text(USER_CONFIG_TOML)
    v = _ncr_vars(tmp_path, nvidia_container_runtime_docker_default=True)
    run = playbook(ROLE_NCR, v)
    assert run.rc == 0, run.stdout
    assert _recap_changed(run) == 2
    daemon = json.loads((tmp_path / "daemon.json").read_text())
    for key, value in USER_DAEMON_JSON.items():
        if key != "runtimes":
            assert daemon[key] == value, "the user's %s was changed" % key
    assert daemon["default-runtime"] == "crun", "a user's default runtime wins over ours"
    assert daemon["runtimes"]["crun"] == {"path": "/usr/bin/crun"}
    assert daemon["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    conf = tomllib.loads((tmp_path / "config.toml").read_text())
    assert conf["root"] == "/srv/containerd" and conf["grpc"]["address"] == "/run/containerd/containerd.sock"
    runtimes = conf["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True
    assert runtimes["nvidia"]["options"]["BinaryName"] == "nvidia-container-runtime"
    again = playbook(ROLE_NCR, v)
    assert again.rc == 0 and _recap_changed(again) == 0, [r["_task"] for r in again.results if r.get("changed")]


def test_container_runtime_role_keeps_a_users_own_nvidia_entries(playbook, tmp_path):
    import json
    mine = {"runtimes": {"nvidia": {"path": "/opt/nvidia/bin/nvidia-container-runtime", "runtimeArgs": ["--debug"]}}}
    (tmp_path / "daemon.json").write_text(json.dumps(mine))
    toml = USER_CONFIG_TOML + '''
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
'''
    (tmp_path / "config.toml").write_text(toml)
    run = playbook(ROLE_NCR, _ncr_vars(tmp_path))
    assert run.rc == 0, run.stdout
    assert _recap_changed(run) == 0
    assert json.loads((tmp_path / "daemon.json").read_text()) == mine
    assert (tmp_path / "config.toml").read_text() == toml


def test_container_runtime_role_rejects_a_bad_argument(playbook, tmp_path):
    run = playbook(ROLE_NCR, _ncr_vars(tmp_path, nvidia_container_runtime_configure=["bogus"]))
    assert run.rc != 0
    assert "nvidia_container_runtime_configure" in run.stdout and "bogus" in run.stdout


def test_container_runtime_role_uses_containerd_2_section_names(playbook, tmp_path):
    """containerd 2.x (config schema version 3) names the CRI runtime plugin io.containerd.cri.v1.runtime; the
    runtime goes into a conf.d drop-in (as nvidia-ctk --drop-in writes it), config.toml only gains the imports
    line it lacked, and a second run changes nothing."""
    import tomllib
    (tmp_path / "config.toml").write_text('version = 3\nroot = "/srv/containerd"\n')
    v = _ncr_vars(tmp_path, nvidia_container_runtime_configure=["containerd"])
    run = playbook(ROLE_NCR, v)
    assert run.rc == 0, run.stdout
    conf = tomllib.loads((tmp_path / "config.toml").read_text())
    assert conf == {"version": 3, "root": "/srv/containerd", "imports": [str(tmp_path / "conf.d" / "*.toml")]}
    drop_in = tomllib.loads((tmp_path / "conf.d" / "gpuckpt-nvidia.toml").read_text())
    nvidia = drop_in["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["nvidia"]
    assert drop_in["version"] == 3 and nvidia["options"]["BinaryName"] == "nvidia-container-runtime"
    again = playbook(ROLE_NCR, v)
    assert again.rc == 0 and _recap_changed(again) == 0


def test_roles_in_check_mode_change_nothing(playbook, tmp_path):
    """--check on a node with nothing installed yet: no error, and not one file written."""
    import json
    (tmp_path / "daemon.json").write_text(json.dumps(USER_DAEMON_JSON))
    before = (tmp_path / "daemon.json").read_text()
    prefix = tmp_path / "prefix"
    (prefix / "sbin").mkdir(parents=True)
    run = playbook(ROLE_CRIU, {"criu_install_method": "source", "criu_source_file": TARBALL, "criu_prefix": str(prefix),
                               "criu_build_dir": str(tmp_path / "build")}, check=True)
    assert run.rc == 0, run.stdout
    assert not (tmp_path / "build").exists() and not (prefix / "sbin" / "criu").exists()
    run = playbook(ROLE_NCR, _ncr_vars(tmp_path, nvidia_container_runtime_configure=["docker"]), check=True)
    assert run.rc == 0, run.stdout
    assert (tmp_path / "daemon.json").read_text() == before


def test_container_runtime_role_installs_the_pod_restore_handler_once(playbook, tmp_path):
    """The pod migration's runtime handler: its files and settings, the RuntimeClass to apply, and its runtime
    entry in containerd's config.toml (passing the pods' gpuckpt.fleet/* annotations, runc's systemd cgroup
    setting as the node's runc entry has it); the node's own settings kept, and a second run changes nothing."""
    import json
    import tomllib
    (tmp_path / "config.toml").write_text(USER_CONFIG_TOML)
    d = tmp_path / "gpuckpt"
    v = _ncr_vars(tmp_path, nvidia_container_runtime_configure=[], nvidia_container_runtime_k8s_restore=True,
                  nvidia_container_runtime_k8s_restore_dir=str(d),
                  nvidia_container_runtime_k8s_restore_image_roots=["/srv/gpuckpt/images"])
    run = playbook(ROLE_NCR, v)
    assert run.rc == 0, run.stdout
    assert os.access(str(d / "gpuckpt-restore-runtime"), os.X_OK) and (d / "gpuckpt_restore_runtime.py").exists()
    settings = json.loads((d / "restore-runtime.json").read_text())
    assert settings["image_roots"] == ["/srv/gpuckpt/images"] and settings["runc"] == "runc"
    assert "handler: gpuckpt-restore" in (d / "runtimeclass.yaml").read_text()
    conf = tomllib.loads((tmp_path / "config.toml").read_text())
    assert conf["root"] == "/srv/containerd"
    runtimes = conf["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True
    entry = runtimes["gpuckpt-restore"]
    assert entry["runtime_type"] == "io.containerd.runc.v2" and entry["pod_annotations"] == ["gpuckpt.fleet/*"]
    assert entry["options"] == {"BinaryName": str(d / "gpuckpt-restore-runtime"), "SystemdCgroup": True}
    again = playbook(ROLE_NCR, v)
    assert again.rc == 0 and _recap_changed(again) == 0, [r["_task"] for r in again.results if r.get("changed")]


OLD_RESTORE_BLOCK = '''# BEGIN gpuckpt.fleet.nvidia_container_runtime k8s_restore
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.gpuckpt-restore]
  runtime_type = "io.containerd.runc.v2"
  pod_annotations = ["gpuckpt.fleet/*"]
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.gpuckpt-restore.options]
    BinaryName = "/usr/local/lib/gpuckpt/gpuckpt-restore-runtime"
    SystemdCgroup = false
# END gpuckpt.fleet.nvidia_container_runtime k8s_restore
'''


def test_container_runtime_role_puts_the_pod_restore_handler_in_a_containerd_2_drop_in(playbook, tmp_path):
    """containerd 2.x (schema 3): the handler's runtime entry goes into its own conf.d drop-in, beside the nvidia
    runtime's, as containerd_config.py reads the node's config (runc's SystemdCgroup found in config.toml); the
    block that an older run wrote into config.toml is taken out, and a second run changes nothing."""
    import tomllib
    user = '''version = 3
root = "/srv/containerd"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  SystemdCgroup = true
'''
    (tmp_path / "config.toml").write_text(user + OLD_RESTORE_BLOCK)
    d = tmp_path / "gpuckpt"
    v = _ncr_vars(tmp_path, nvidia_container_runtime_configure=["containerd"], nvidia_container_runtime_k8s_restore=True,
                  nvidia_container_runtime_k8s_restore_dir=str(d))
    run = playbook(ROLE_NCR, v)
    assert run.rc == 0, run.stdout
    conf = tomllib.loads((tmp_path / "config.toml").read_text())
    assert "gpuckpt-restore" not in conf["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert conf["imports"] == [str(tmp_path / "conf.d" / "*.toml")] and conf["root"] == "/srv/containerd"
    drop_in = tomllib.loads((tmp_path / "conf.d" / "gpuckpt-restore.toml").read_text())
    entry = drop_in["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["gpuckpt-restore"]
    assert drop_in["version"] == 3 and entry["pod_annotations"] == ["gpuckpt.fleet/*"]
    assert entry["options"] == {"BinaryName": str(d / "gpuckpt-restore-runtime"), "SystemdCgroup": True}
    assert (tmp_path / "conf.d" / "gpuckpt-nvidia.toml").exists()
    again = playbook(ROLE_NCR, v)
    assert again.rc == 0 and _recap_changed(again) == 0, [r["_task"] for r in again.results if r.get("changed")]


def test_container_runtime_role_keeps_a_users_own_pod_restore_entry(playbook, tmp_path):
    """A runtime of the handler's name that the user wrote, in a file config.toml imports, is left as it is:
    no drop-in of ours beside it, and config.toml untouched."""
    user = 'version = 3\nimports = ["%s/*.toml"]\n' % (tmp_path / "mine")
    (tmp_path / "config.toml").write_text(user)
    (tmp_path / "mine").mkdir()
    own = '''version = 3
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.gpuckpt-restore]
  runtime_type = "io.containerd.runc.v2"
'''
    (tmp_path / "mine" / "restore.toml").write_text(own)
    v = _ncr_vars(tmp_path, nvidia_container_runtime_configure=[], nvidia_container_runtime_k8s_restore=True,
                  nvidia_container_runtime_k8s_restore_dir=str(tmp_path / "gpuckpt"))
    run = playbook(ROLE_NCR, v)
    assert run.rc == 0, run.stdout
    assert (tmp_path / "config.toml").read_text() == user and (tmp_path / "mine" / "restore.toml").read_text() == own
    assert sorted(os.listdir(str(tmp_path / "mine"))) == ["restore.toml"]
