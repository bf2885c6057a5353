"""migrate.yml and recover.yml between two real sshd "hosts" on loopback (127.0.0.2, 127.0.0.3),
each in its own pid namespace, with real ssh and CRIU. The GPU stage runs against the libcuda
TEST DOUBLE (CI has no GPU); it keeps each process's CUDA state inside the process, so the state
travels with the image as it does with the real driver.

Every test ends by checking that exactly one copy of the workload runs, with its state intact.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from helpers import (COUNTER, FAKE_LIBCUDA, REPO, SKELETON_IMAGE, CountingWorkload, RuncOnLoopbackHosts,
                     bad_link_python, hanging_wrapper, podman_run_args, skeleton_tar, write_runc_bundle)
from loopback_workloads import MIGRATE, PODMAN_ROOT, PODMAN_RUNROOT, changed_tasks, migrate, processes


def test_migrate_moves_the_workload_and_a_rerun_changes_nothing(playbook, hosts, remote_workload):
    w = remote_workload()
    before = w.counts()
    run = migrate(playbook, hosts, w, "t-move")
    assert run.rc == 0, run.stdout
    ck = run.task("Stage 1/3")
    assert ck["leave_stopped"] is True and sorted(ck["cuda_pids"]) == [w.pid, w.pid + 1]
    assert run.task("Restore on hostb")["changed"] is True
    summary = "\n".join(run.task("Summary")["msg"])
    assert "Downtime" in summary and "moved from hosta to hostb" in summary
    assert w.one_copy_runs_intact()
    assert w.counts()["parent"] > before["parent"]
    # The copy that runs is the target's: it lives in hostb's pid namespace.
    ns_b = os.readlink("/proc/%d/ns/pid" % processes(w.dir)[0][0])
    assert ns_b == hosts.ssh("hostb", "readlink /proc/self/ns/pid").stdout.strip()
    # Images are removed on both hosts after a commit (the default); journals say committed.
    assert not os.path.exists(hosts.path("hosta", "images", "t-move"))
    assert not os.path.exists(hosts.path("hostb", "images", "t-move"))
    with open(hosts.path("hosta", "journal", "t-move.source.json")) as fh:
        assert json.load(fh)["phase"] == "committed"

    again = migrate(playbook, hosts, w, "t-move")
    assert again.rc == 0, again.stdout
    assert changed_tasks(again) == [], changed_tasks(again)
    assert w.one_copy_runs_intact()


def test_a_process_without_cuda_migrates_and_the_playbook_succeeds(playbook, hosts, remote_workload):
    """A job that never loaded libcuda has no driver timings: the summary says 0 s for them instead of
    failing the play after the commit (an AWX job marked failed for a migration that worked)."""
    w = remote_workload(cuda=False)
    before = w.counts()
    run = migrate(playbook, hosts, w, "t-nocuda")
    assert run.rc == 0, run.stdout
    assert run.task("Stage 1/3")["cuda_pids"] == []
    summary = "\n".join(run.task("Summary")["msg"])
    assert "moved from hosta to hostb" in summary and "GPU->RAM 0.00 s" in summary
    assert w.one_copy_runs_intact()
    assert w.counts()["parent"] > before["parent"]


def test_a_source_holding_a_socket_name_exits_so_that_its_copy_can_bind_it(playbook, hosts, remote_workload):
    """The loopback hosts are one kernel with one network namespace. A source held stopped would keep
    its abstract unix socket name (as CUDA and NCCL processes hold some) bound there, and its copy on
    hostb could not bind it again (CRIU: address in use). So the source exits instead (its image is the
    way back) and the copy on hostb listens on the name. (A TCP port is the same case, but CRIU 4.1.1
    cannot dump TCP sockets on this kernel: "Can't get 1:16 opt".)"""
    import socket
    import uuid
    name = "gpuckpt-test-" + uuid.uuid4().hex[:8]
    w = remote_workload(listen=name)
    run = migrate(playbook, hosts, w, "t-sock")
    assert run.rc == 0, run.stdout
    shown = "\n".join(run.task("Show the preflight")["msg"])
    assert "the workload holds unix @%s" % name in shown and "the source exits" in shown, shown
    assert run.task("Stage 1/3")["leave_stopped"] is False
    assert w.one_copy_runs_intact()
    with socket.socket(socket.AF_UNIX) as c:  # served by the copy on hostb
        c.connect("\0" + name)
    ns_b = os.readlink("/proc/%d/ns/pid" % processes(w.dir)[0][0])
    assert ns_b == hosts.ssh("hostb", "readlink /proc/self/ns/pid").stdout.strip()


def test_transfer_cut_midway_is_resumed(playbook, hosts, remote_workload, tmp_path):
    """The transfer after the dump (stage 2) loses its link after 80 MiB (a TEST DOUBLE of a bad link in
    front of the target's receiver). The retry asks the target what it holds and sends only the rest:
    the first 64 MiB chunk arrived whole and is not sent again."""
    w = remote_workload(mb=96)
    cut = bad_link_python(tmp_path / "cut-python", "cut", 80 * 2**20, tmp_path / "cut")
    run = migrate(playbook, hosts, w, "t-cut", gpuckpt_transfer_during_dump=False, gpuckpt_transfer_python=cut,
                  gpuckpt_transfer_streams=1)
    assert (tmp_path / "cut").exists(), "the transfer was never cut"
    assert run.rc == 0, run.stdout
    sync = run.task("Stage 2/3")
    assert sync["attempts"] == 2, sync
    assert sync["bytes_already_there"] == 64 * 2**20, sync  # what arrived before the cut stays
    assert w.one_copy_runs_intact() and w.no_count_twice()


def test_large_files_move_over_parallel_ssh_streams(playbook, hosts, remote_workload):
    """With the transfer after the dump (gpu_image_sync): the image goes as 64 MiB pieces over 4 real
    ssh streams to the other sshd host, the manifest last."""
    w = remote_workload(mb=24)
    run = migrate(playbook, hosts, w, "t-streams", gpuckpt_transfer_streams=4, gpuckpt_transfer_during_dump=False)
    assert run.rc == 0, run.stdout
    sync = run.task("Stage 2/3")
    assert sync["streams"] == 4 and sync["attempts"] == 1
    assert sync["bytes_transferred"] > sync["bytes_total"] > 2 * 24 * 2**20  # everything, then the manifest
    assert w.one_copy_runs_intact()


def test_progress_is_printed_while_the_stages_run(playbook, hosts, remote_workload):
    """A user watching a long migration in AWX sees it move: the action plugins poll the progress file
    each module writes on its host and print a line per change while the module still runs."""
    w = remote_workload(mb=24)
    run = migrate(playbook, hosts, w, "t-progress", gpuckpt_transfer_bwlimit=10000, gpuckpt_progress_interval=0.3)
    assert run.rc == 0, run.stdout
    lines = [line for line in run.stdout.splitlines() if line.startswith("  [hosta] Stage 2/3: sent ")]
    assert len(lines) >= 2, run.stdout
    assert "%)" in lines[-1] and "/s" in lines[0]
    done = [int(line.split("(")[1].split("%")[0]) for line in lines if "%)" in line]
    assert done == sorted(done) and done[-1] > done[0], lines  # it moves forward
    assert w.one_copy_runs_intact()
    # This run's own progress files (the modules' and the target's restore job's), named in its results: another
    # worker's migration may have its own in /tmp at this moment.
    ours = {(r.get("invocation") or {}).get("module_args", {}).get("progress_file") for r in run.results}
    ours |= {(r.get("ansible_facts") or {}).get("gpuckpt_restore_progress") for r in run.results}
    ours.discard(None)
    assert len(ours) >= 3, ours  # (the checkpoint's, the transfer's, the restore job's at least)
    left = sorted(p for p in ours if os.path.lexists(p))
    assert not left, "progress files left behind: %s" % left


def test_a_byte_changed_in_transit_is_found_and_repaired(playbook, hosts, remote_workload, tmp_path):
    """A lossy link during the transfer after the dump: one byte of a pages file flips on its way into
    the receiver. The restore's verification finds it before anything starts, only what differs is
    sent again, and the restore goes on."""
    w = remote_workload()
    marker = tmp_path / "flipped"
    lossy = bad_link_python(tmp_path / "lossy-python", "flip", 5000, marker)
    run = migrate(playbook, hosts, w, "t-flip", gpuckpt_transfer_python=lossy, gpuckpt_transfer_during_dump=False)
    assert marker.exists(), "the lossy link never changed a byte"
    assert run.rc == 0, run.stdout
    first = [r for r in run.results if r["_task"].startswith("Restore on hostb") and r["_status"] != "skipped"][0]
    assert first["_status"] == "failed" and first["stage"] == "verify" and "pages-" in first["msg"]
    repair = run.task("re-send only what differs")
    assert repair["changed"] is True and repair["bytes_already_there"] > 0, repair
    assert run.task("after the repair")["changed"] is True
    assert w.one_copy_runs_intact() and w.no_count_twice()


def test_the_image_is_pushed_while_it_is_written(playbook, hosts, remote_workload):
    """By default the checkpoint pushes the image to the target over persistent ssh streams while CRIU
    writes it (here 2 streams, 64 MiB pieces of a 2x96 MiB workload's pages), so stage 2 has nothing
    left to send and is skipped; the restore verifies every checksum of the pushed copy first."""
    w = remote_workload(mb=96)
    run = migrate(playbook, hosts, w, "t-push", gpuckpt_transfer_streams=2)
    assert run.rc == 0, run.stdout
    push = run.task("Stage 1/3")["push"]
    assert push["pushed"] is True and push["streams"] == 2, push
    assert push["bytes"] >= 2 * 96 * 2**20
    assert run.task("Stage 2/3")["_status"] == "skipped"
    assert run.task("Restore on hostb")["timings"]["verify"] > 0
    assert "pushed over 2 ssh stream(s) while the image was written" in "\n".join(run.task("Summary")["msg"])
    assert w.one_copy_runs_intact()


def test_a_byte_changed_in_the_push_is_found_and_repaired(playbook, hosts, remote_workload, tmp_path):
    """A lossy link during the push: one byte of a pages file flips in transit, on its way into the
    receiver (so before the manifest lands, when the target's restore may begin at once). The
    restore's verification finds it before anything starts, only what differs is sent again, and the
    restore goes on."""
    w = remote_workload(mb=24)
    marker = tmp_path / "flipped"
    lossy = bad_link_python(tmp_path / "lossy-python", "flip", 5000000, marker)
    run = migrate(playbook, hosts, w, "t-push-flip", gpuckpt_transfer_python=lossy)
    assert marker.exists(), "the lossy push never changed a byte"
    assert run.rc == 0, run.stdout
    assert run.task("Stage 1/3")["push"]["pushed"] is True
    first = [r for r in run.results if r["_task"].startswith("Restore on hostb") and r["_status"] != "skipped"][0]
    assert first["_status"] == "failed" and first["stage"] == "verify" and "pages-" in first["msg"]
    assert run.task("re-send only what differs")["changed"] is True
    assert run.task("after the repair")["changed"] is True
    assert w.one_copy_runs_intact() and w.no_count_twice()


def test_a_push_cut_midway_falls_back_to_the_transfer_after_the_dump(playbook, hosts, remote_workload, tmp_path):
    """The first push stream is cut after 3 MB (a TEST DOUBLE of a bad link): the checkpoint still
    succeeds, reports the push as failed, and stage 2 sends what the target lacks after the dump."""
    w = remote_workload(mb=24)
    cut = bad_link_python(tmp_path / "cut-python", "cut", 3 * 2**20, tmp_path / "cut")
    run = migrate(playbook, hosts, w, "t-push-cut", gpuckpt_transfer_python=cut, gpuckpt_transfer_streams=2)
    assert run.rc == 0, run.stdout
    push = run.task("Stage 1/3")["push"]
    assert push["pushed"] is False and "stream" in push["error"], push
    sync = run.task("Stage 2/3")
    assert sync["_status"] != "skipped" and sync["changed"] is True and sync["bytes_transferred"] > 0
    assert "after the push during the dump failed" in "\n".join(run.task("Summary")["msg"])
    assert w.one_copy_runs_intact() and w.no_count_twice()


def test_target_disk_full_is_refused_before_freezing(playbook, hosts, remote_workload):
    w = remote_workload()
    root = hosts.path("hostb", "images")
    hosts.ssh("hostb", "mkdir -p %s && mount -t tmpfs -o size=1m gpuckpt-full %s" % (root, root))
    try:
        run = migrate(playbook, hosts, w, "t-full")
        assert run.rc != 0
        res = run.task("Stop here if the hosts do not fit")
        text = "\n".join(res["msg"])
        assert "free disk for the image" in text and "DIFFERS" in text
        assert not os.path.exists(hosts.path("hosta", "journal", "t-full.source.json")), "nothing may be frozen"
    finally:
        hosts.ssh("hostb", "umount %s" % root, check=False)
    assert w.one_copy_runs_intact()


class NvidiaSmiAnswers(object):
    """What the nvidia-smi TEST DOUBLE of a loopback host answers, changed for one test and put back."""

    def __init__(self, hosts, host):
        self.path = hosts.host_vars[host]["gpuckpt_environment"]["GPUCKPT_FAKE_NVIDIA_SMI"]
        with open(self.path) as fh:
            self.saved = json.load(fh)

    def __enter__(self):
        return self

    def set(self, **changes):
        doc = dict(self.saved, **changes)
        with open(self.path, "w") as fh:
            json.dump(doc, fh)

    def __exit__(self, *exc):
        with open(self.path, "w") as fh:
            json.dump(self.saved, fh)


def test_an_image_larger_than_the_targets_disk_is_refused_without_nvml(playbook, hosts, remote_workload):
    """The regression measured on an H200: a node's Python without pynvml counted the job's GPU memory as 0,
    sized a 25.6 GB image at 1.3 GiB, and CRIU hit ENOSPC mid-dump. With no pynvml (the venv has none) the
    GPU memory now comes from nvidia-smi (its TEST DOUBLE: 64 TiB per CUDA process here), and an image that
    cannot fit on the target's disk is refused before anything is frozen."""
    w = remote_workload()
    with NvidiaSmiAnswers(hosts, "hosta") as smi:
        smi.set(apps_mapping=dict(smi.saved["apps_mapping"], used_memory=64 * 2**20))
        run = migrate(playbook, hosts, w, "t-bigimage")
    assert run.rc != 0
    text = "\n".join(run.task("Stop here if the hosts do not fit")["msg"])
    assert "free disk for the image (~1441" in text and "DIFFERS" in text, text
    assert not os.path.exists(hosts.path("hosta", "journal", "t-bigimage.source.json")), "nothing may be frozen"
    assert w.one_copy_runs_intact()


def test_gpu_memory_that_cannot_be_read_is_refused_unless_allowed_by_name(playbook, hosts, remote_workload):
    """Where nothing reports the workload's GPU memory, the image size is unknown, and so are the checks that
    need it (disk, host RAM): the preflight says so and how to make it readable, and refuses before any
    freeze; the user may accept each by name, and the workload then moves."""
    w = remote_workload()
    with NvidiaSmiAnswers(hosts, "hosta") as smi:
        smi.set(apps_mapping=None)  # nvidia-smi answers, but lists no compute app
        run = migrate(playbook, hosts, w, "t-unknown")
        assert run.rc != 0
        text = "\n".join(run.task("Stop here if the hosts do not fit")["msg"])
        assert "UNKNOWN" in text and "install nvidia-ml-py (NVML) or nvidia-smi on" in text, text
        assert "gpuckpt_allow_unknown=[gpu_memory,disk,host_ram]" in text, text
        assert not os.path.exists(hosts.path("hosta", "journal", "t-unknown.source.json")), "nothing may be frozen"
        assert w.one_copy_runs_intact()
        run = migrate(playbook, hosts, w, "t-unknown2", gpuckpt_allow_unknown=["gpu_memory", "disk", "host_ram"])
    assert run.rc == 0, run.stdout
    assert "UNKNOWN (allowed)" in "\n".join(run.task("Show the preflight")["msg"])
    assert w.one_copy_runs_intact()


def test_different_driver_on_target_is_refused_with_a_table(playbook, hosts, remote_workload):
    w = remote_workload()
    api = hosts.path("hostb", "fakecuda", "api_version")
    with open(api, "w") as fh:
        fh.write("12080\n")  # the stand-in reports a 570 driver (CUDA 12.8) on the target
    try:
        run = migrate(playbook, hosts, w, "t-driver")
    finally:
        os.unlink(api)
    assert run.rc != 0
    text = "\n".join(run.task("Stop here if the hosts do not fit")["msg"])
    assert "CUDA API version" in text and "13.0" in text and "12.8" in text and "DIFFERS" in text
    assert w.one_copy_runs_intact()


def test_pid_taken_on_target_is_refused(playbook, hosts, remote_workload):
    w = remote_workload()
    squatter = None
    for unused in range(20):
        out = hosts.ssh("hostb", "echo %d > /proc/sys/kernel/ns_last_pid; setsid sleep 300 >/dev/null 2>&1 </dev/null & "
                        "echo $!" % (w.pid - 1)).stdout.strip().splitlines()[-1]
        if int(out) == w.pid:
            squatter = int(out)
            break
        hosts.ssh("hostb", "kill -9 %s" % out, check=False)
    assert squatter, "could not take pid %d on hostb" % w.pid
    try:
        run = migrate(playbook, hosts, w, "t-pid")
        assert run.rc != 0
        text = "\n".join(run.task("Stop here if the hosts do not fit")["msg"])
        assert "pids free on target" in text and ("in use: %d" % w.pid) in text
    finally:
        # Move hostb's next pids far away, or its next ssh sessions would take the workload's pids.
        hosts.ssh("hostb", "kill -9 %d; echo 40000 > /proc/sys/kernel/ns_last_pid" % squatter, check=False)
    assert w.one_copy_runs_intact()


def test_restore_failing_on_target_rolls_back_to_the_source(playbook, hosts, remote_workload):
    w = remote_workload()
    inject = hosts.path("hostb", "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("restore 0 2\n")  # CUDA_ERROR_OUT_OF_MEMORY on every restore on the target only
    try:
        run = migrate(playbook, hosts, w, "t-restore-fails")
    finally:
        os.unlink(inject)
    assert run.rc != 0
    final = run.task("Migration failed and was rolled back")
    assert "runs on hosta" in final["msg"] and "CUDA_ERROR_OUT_OF_MEMORY" in final["msg"]
    assert run.task("Resume the source")["changed"] is True
    assert not os.path.exists(hosts.path("hostb", "images", "t-restore-fails"))
    assert w.one_copy_runs_intact()
    # Re-running with the same id finds it rolled back and changes nothing.
    again = migrate(playbook, hosts, w, "t-restore-fails")
    assert again.rc == 0, again.stdout
    assert changed_tasks(again) == []
    assert w.one_copy_runs_intact()


def test_a_checkpoint_failing_on_the_source_stops_the_restore_waiting_on_the_target(playbook, hosts, remote_workload):
    """The target's restore begins before the freeze and waits there for the image. When the checkpoint
    fails on the source, the target's rollback stops that wait: nothing is restored there, no restore
    is left waiting (it would wait an hour by default), and the source runs on."""
    w = remote_workload()
    inject = hosts.path("hosta", "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("checkpoint 0 2\n")  # CUDA_ERROR_OUT_OF_MEMORY on the source's checkpoint
    try:
        run = migrate(playbook, hosts, w, "t-ckpt-fails")
    finally:
        os.unlink(inject)
    assert run.rc != 0
    assert run.task("Begin the restore")["ansible_job_id"]
    assert "runs on hosta" in run.task("Migration failed and was rolled back")["msg"]
    with open(hosts.path("hostb", "journal", "t-ckpt-fails.target.json")) as fh:
        assert json.load(fh)["phase"] == "cleaned"

    def restores_running():
        out = []
        on_target = set(hosts.processes("hostb"))  # (other tests' restores run on their own hosts meanwhile)
        for d in os.listdir("/proc"):
            try:
                with open("/proc/%s/cmdline" % d, "rb") as fh:
                    cmd = fh.read()
            except OSError:
                continue
            if b"gpu_restore" in cmd and d.isdigit() and int(d) in on_target:
                out.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
        return out

    deadline = time.monotonic() + 10
    while restores_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    waiting = restores_running()
    assert not waiting, "a restore is still waiting on the target: %s" % waiting
    assert not os.path.exists(hosts.path("hostb", "images", "t-ckpt-fails"))
    assert w.one_copy_runs_intact()


def test_a_restore_job_that_cannot_start_falls_back_to_the_restore_after_the_transfer(playbook, hosts, remote_workload):
    """Ansible copies an async task's module file to the host (no pipelining for async); a controller
    without an sftp client, as on the GPU machine, cannot. The early restore then never starts, and
    stage 3 restores after the transfer, as it did before the early restore existed."""
    w = remote_workload()
    v = {"source": "hosta", "target": "hostb", "pid": w.pid, "migration_id": "t-nojob"}
    run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"),
                   env={"ANSIBLE_SSH_TRANSFER_METHOD": "sftp", "ANSIBLE_SFTP_EXECUTABLE": "/nonexistent/sftp"})
    assert run.rc == 0, run.stdout
    assert "ansible_job_id" not in run.task("Begin the restore")
    rs = run.task("Restore on hostb")
    assert rs["changed"] is True and rs["timings"]["wait_for_image"] < 1  # the image was there: no early start
    assert w.one_copy_runs_intact()


class RemoteRuncWorkload(RuncOnLoopbackHosts, CountingWorkload):
    """A runc container started on a loopback host (in its pid namespace), running counter.py with
    the libcuda test double; hostb gets the same bundle under its own path and cgroup."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        import uuid
        self.hosts, self.dir = hosts, workdir
        self.id = "gpuckpt-m-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        fc = hosts.path("hosta", "fakecuda")
        args = ["/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8", "--fakecuda", FAKE_LIBCUDA]
        env = ["GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, "FAKECUDA_STATE_DIR=%s" % fc]
        for name in ("hosta", "hostb"):
            write_runc_bundle(hosts.path(name, "bundle"), args, env, rw=[workdir, hosts.path()],
                              cgroup="/gpuckpt-test-%s-%s" % (name, self.id))
        self.runc("hosta", "run --detach --bundle %s %s" % (hosts.path("hosta", "bundle"), self.id), relay=True)
        self.wait_counting()

    cleanup = RuncOnLoopbackHosts.delete_everywhere


def test_runc_container_migrates_and_counts_on(playbook, hosts, tmp_path):
    """A runc container moves from hosta to hostb: paused (not killed) on hosta until it runs on
    hostb, the CUDA stage on its host pids, then hosta's copy is deleted. A re-run changes nothing."""
    w = RemoteRuncWorkload(hosts, str(tmp_path / "rw"))
    try:
        before = w.counts()
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.id, "migration_id": "t-runc"},
                       inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        ck = run.task("Stage 1/3")
        assert ck["leave_stopped"] is True and len(ck["cuda_pids"]) == 2
        assert "container %s moved from hosta to hostb" % w.id in "\n".join(run.task("Summary")["msg"])
        assert w.state("hostb")["status"] == "running"
        assert w.state("hosta") is None, "the source's paused container is deleted on commit"
        w.went_on_intact(before)
        again = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.id,
                                   "migration_id": "t-runc"}, inventory=hosts.path("inventory.yml"))
        assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
        assert w.is_counting()
    finally:
        w.cleanup()


def test_runc_container_restore_failing_on_target_resumes_the_paused_source(playbook, hosts, tmp_path):
    """hostb's bundle is missing: the restore fails, the target is cleaned and the paused container on
    hosta is resumed, its CUDA processes restored and unlocked: one copy runs."""
    w = RemoteRuncWorkload(hosts, str(tmp_path / "rw"))
    try:
        os.rename(hosts.path("hostb", "bundle", "config.json"), hosts.path("hostb", "bundle", "config.off"))
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.id,
                                 "migration_id": "t-runc-fail"}, inventory=hosts.path("inventory.yml"))
        assert run.rc != 0
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "has no config.json on this host" in run.stdout
        assert w.state("hosta")["status"] == "running" and w.state("hostb") is None
        assert w.is_counting()
        for r in w.roles:
            assert w.read(r)["digest"] == w.digest0(r)
    finally:
        w.cleanup()


class RemotePodmanWorkload(CountingWorkload):
    """A Podman container started on hosta (in its pid namespace), each host with its own Podman
    storage holding the skeleton image, running counter.py with the libcuda test double."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        import uuid
        self.hosts, self.dir = hosts, workdir
        self.name = "gpuckpt-pm-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        for host in ("hosta", "hostb"):  # each host's own storage, bound at the same paths in its mount namespace
            store = hosts.path(host, "podman-store")
            cmd = ("mkdir -p {s}/root {s}/run {r} {rr} && (mountpoint -q {r} || mount --bind {s}/root {r})"
                   " && (mountpoint -q {rr} || mount --bind {s}/run {rr})")
            self.hosts.ssh(host, cmd.format(s=store, r=PODMAN_ROOT, rr=PODMAN_RUNROOT))
        # One image, the same id on both hosts (as a registry pull gives): imported on hosta, copied to hostb.
        image = SKELETON_IMAGE
        if self.podman("hosta", ["image", "exists", image], check=False).returncode != 0:
            self.podman("hosta", ["import", skeleton_tar(hosts.path("skel.tar")), image])
        if self.podman("hostb", ["image", "exists", image], check=False).returncode != 0:
            self.podman("hosta", ["save", "--output", hosts.path("skel-image.tar"), image])
            self.podman("hostb", ["load", "--input", hosts.path("skel-image.tar")])
        args = ["/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8", "--fakecuda", FAKE_LIBCUDA]
        env = ["GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, "FAKECUDA_STATE_DIR=%s" % hosts.path("hosta", "fakecuda")]
        self.podman("hosta", podman_run_args(self.name, image, args, env, rw=[workdir, hosts.path()]))
        self.wait_counting()

    def storage(self, host):
        hv = self.hosts.host_vars[host]
        return ["--root", hv["gpuckpt_podman_root"], "--runroot", hv["gpuckpt_podman_runroot"]]

    def podman(self, host, args, check=True):
        import shlex
        return self.hosts.ssh(host, " ".join(shlex.quote(a) for a in ["podman"] + self.storage(host) + list(args)),
                              check=check)

    def status(self, host):
        res = self.podman(host, ["container", "inspect", "--format", "json", self.name], check=False)
        return json.loads(res.stdout)[0]["State"]["Status"] if res.returncode == 0 else None

    def cleanup(self):
        for host in ("hosta", "hostb"):
            self.podman(host, ["container", "rm", "--force", self.name], check=False)


def test_a_hung_runc_restore_on_the_target_is_killed_and_rolled_back(playbook, hosts, tmp_path):
    """runc's restore on hostb never ends (TEST DOUBLE: a runc whose restore hangs, with a child of its
    own; everything else goes to the real runc), as a runc restore did on the GPU machine. After
    gpuckpt_runtime_timeout the restore is killed with its child, the target is cleaned and the paused
    container on hosta is resumed: one copy runs, with its memory intact."""
    w = RemoteRuncWorkload(hosts, str(tmp_path / "rw"))
    child = tmp_path / "hung-child.pid"
    hung = hanging_wrapper(tmp_path / "runc", shutil.which("runc"), "restore", child)
    try:
        before = w.counts()
        t0 = time.monotonic()
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.id, "migration_id": "t-runc-hung",
                                 "gpuckpt_runc_path": hung, "gpuckpt_runtime_timeout": 5},
                       inventory=hosts.path("inventory.yml"))
        assert run.rc != 0
        assert time.monotonic() - t0 < 120
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "did not finish within runtime_timeout (5.0s)" in run.stdout, run.stdout
        # The pid is hostb's (its own pid namespace): look there.
        gone = hosts.ssh("hostb", "sleep 0.5; test ! -e /proc/%d" % int(child.read_text()), check=False)
        assert gone.returncode == 0, "the hung restore's child must be killed with it"
        assert w.state("hosta")["status"] == "running" and w.state("hostb") is None
        w.went_on_intact(before)
    finally:
        w.cleanup()


def test_podman_container_migrates_and_counts_on(playbook, hosts, tmp_path):
    """A Podman container moves from hosta to hostb. Podman cannot hold it stopped, so the source exits
    after its checkpoint (export) and its image is the way back. A re-run changes nothing."""
    w = RemotePodmanWorkload(hosts, str(tmp_path / "pw"))
    try:
        before = w.counts()
        v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "podman", "migration_id": "t-pm"}
        run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        ck = run.task("Stage 1/3")
        assert ck["leave_stopped"] is False and len(ck["cuda_pids"]) == 2
        assert "Podman cannot hold a container stopped" in "\n".join(run.task("Show the preflight")["msg"])
        assert w.status("hostb") == "running" and w.status("hosta") is None
        w.went_on_intact(before)
        again = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
    finally:
        w.cleanup()


def test_podman_restore_failing_on_target_restores_the_source_from_its_image(playbook, hosts, tmp_path):
    """The target's storage already holds a container of that name: the restore is refused there, the
    target is cleaned, and the source is restored from its own exported image. One copy runs."""
    w = RemotePodmanWorkload(hosts, str(tmp_path / "pw"))
    try:
        w.podman("hostb", ["create", "--name", w.name, SKELETON_IMAGE, "/usr/bin/true"])
        v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "podman",
             "migration_id": "t-pm-fail"}
        run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert run.rc != 0
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "already exists on this host" in run.stdout
        assert w.status("hosta") == "running"
        assert w.status("hostb") == "created", "hostb's own container of that name must be left alone"
        assert w.is_counting()
        for r in w.roles:
            assert w.read(r)["digest"] == w.digest0(r)
    finally:
        w.cleanup()


class RemoteDockerWorkload(CountingWorkload):
    """A Docker container on hosta. Each loopback host runs its own dockerd (own data root, exec
    root, socket and containerd namespace) inside its namespaces; the image is loaded into both
    with the same id."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        import uuid
        self.hosts, self.dir = hosts, workdir
        self.name = "gpuckpt-dm-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        for host in ("hosta", "hostb"):
            self.start_dockerd(host)
        if self.docker("hosta", ["image", "inspect", SKELETON_IMAGE], check=False).returncode != 0:
            self.docker("hosta", ["import", skeleton_tar(hosts.path("skel.tar")), SKELETON_IMAGE])
        if self.docker("hostb", ["image", "inspect", SKELETON_IMAGE], check=False).returncode != 0:
            self.docker("hosta", ["save", "--output", hosts.path("skel-docker.tar"), SKELETON_IMAGE])
            self.docker("hostb", ["load", "--input", hosts.path("skel-docker.tar")])
        args = ["run", "--detach", "--name", self.name, "--network", "none"]
        for src, opt in (("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (workdir, "rw"), (hosts.path(), "rw")):
            args += ["--volume", "%s:%s:%s" % (src, src, opt)]
        args += ["--env", "GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA,
                 "--env", "FAKECUDA_STATE_DIR=%s" % hosts.path("hosta", "fakecuda")]
        self.docker("hosta", args + [SKELETON_IMAGE, "/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8",
                                     "--fakecuda", FAKE_LIBCUDA])
        self.wait_counting()

    def start_dockerd(self, host):
        d = self.hosts.host_vars[host]["gpuckpt_docker_dir"]
        if self.docker(host, ["version"], check=False).returncode == 0:
            return
        cfg = {"experimental": True, "bridge": "none", "iptables": False, "ip6tables": False,
               "data-root": d + "/data", "exec-root": d + "/exec", "pidfile": d + "/docker.pid",
               "hosts": [self.hosts.host_vars[host]["gpuckpt_docker_host"]],
               "containerd-namespace": "gpuckpt-" + host, "containerd-plugins-namespace": "gpuckpt-p-" + host}
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "daemon.json"), "w") as fh:
            json.dump(cfg, fh)
        self.hosts.ssh(host, "setsid dockerd --config-file %s/daemon.json > %s/dockerd.log 2>&1 < /dev/null &" % (d, d))
        deadline = time.monotonic() + 60
        while self.docker(host, ["version"], check=False).returncode != 0:
            assert time.monotonic() < deadline, open(os.path.join(d, "dockerd.log")).read()[-3000:]
            time.sleep(0.3)

    def docker(self, host, args, check=True):
        import shlex
        cmd = ["/usr/bin/docker", "--host", self.hosts.host_vars[host]["gpuckpt_docker_host"]] + list(args)
        return self.hosts.ssh(host, " ".join(shlex.quote(a) for a in cmd), check=check)

    def state(self, host):
        res = self.docker(host, ["container", "inspect", self.name], check=False)
        return json.loads(res.stdout)[0]["State"]["Status"] if res.returncode == 0 else None

    def cleanup(self):
        for host in ("hosta", "hostb"):
            self.docker(host, ["rm", "--force", self.name], check=False)


def test_docker_container_migrates_and_counts_on(playbook, hosts, tmp_path):
    """A Docker container moves from hosta to hostb, where it is created again from its saved
    configuration and restored. Docker cannot hold it stopped: hosta's copy exits after its checkpoint
    and its image is the way back. A re-run changes nothing."""
    w = RemoteDockerWorkload(hosts, str(tmp_path / "dw"))
    try:
        before = w.counts()
        v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "docker", "migration_id": "t-dk"}
        run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        assert len(run.task("Stage 1/3")["cuda_pids"]) == 2
        assert w.state("hostb") == "running" and w.state("hosta") == "exited"
        w.went_on_intact(before)
        again = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
    finally:
        w.cleanup()


def test_docker_restore_refused_on_target_restores_the_source_from_its_image(playbook, hosts, tmp_path):
    """hostb already has another container of that name: the restore is refused there and that
    container is left alone; the source is restored from its own image. One copy runs, on hosta."""
    w = RemoteDockerWorkload(hosts, str(tmp_path / "dw"))
    try:
        w.docker("hostb", ["create", "--name", w.name, SKELETON_IMAGE, "/usr/bin/true"])
        v = {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "docker",
             "migration_id": "t-dk-fail"}
        run = playbook(MIGRATE, v, inventory=hosts.path("inventory.yml"))
        assert run.rc != 0
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert "a different docker container named" in run.stdout
        assert w.state("hosta") == "running" and w.state("hostb") == "created"
        assert w.is_counting()
        for r in w.roles:
            assert w.read(r)["digest"] == w.digest0(r)
    finally:
        w.cleanup()


def test_an_id_used_before_for_another_workload_is_refused_and_bad_numbers_before_any_freeze(
        playbook, hosts, remote_workload):
    """A migration id names one workload: re-used for another process it is refused, naming both, instead of
    being answered "committed" with the old result; a negative timeout is refused before anything is frozen."""
    first = remote_workload()
    run = migrate(playbook, hosts, first, "t-id-once")
    assert run.rc == 0, run.stdout
    second = remote_workload()
    again = migrate(playbook, hosts, second, "t-id-once")
    assert again.rc != 0, again.stdout
    assert "migration id t-id-once was used before for pid %d" % first.pid in again.stdout, again.stdout
    assert "this run names pid %d" % second.pid in again.stdout
    assert second.one_copy_runs_intact() and first.one_copy_runs_intact()
    bad = migrate(playbook, hosts, second, "t-bad-number", gpuckpt_runtime_timeout=-1)
    assert bad.rc != 0 and "Nothing was frozen: fix these options first" in bad.stdout, bad.stdout
    assert "gpuckpt_runtime_timeout=-1" in bad.stdout
    assert not os.path.exists(hosts.path("hosta", "journal", "t-bad-number.source.json"))
    # The same number set for the source host in the inventory is checked too, by the move itself.
    with open(hosts.path("inventory.yml")) as fh:
        inv = json.load(fh)
    inv["gpu_nodes"]["hosts"]["hosta"]["gpuckpt_lock_timeout"] = 0
    with open(hosts.path("inventory-bad-number.yml"), "w") as fh:
        json.dump(inv, fh)
    bad = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "pid": second.pid, "migration_id": "t-bad-inv"},
                   inventory=hosts.path("inventory-bad-number.yml"))
    assert bad.rc != 0 and "gpuckpt_lock_timeout=0 must be a number above 0" in bad.stdout, bad.stdout
    assert not os.path.exists(hosts.path("hosta", "journal", "t-bad-inv.source.json"))
    assert second.one_copy_runs_intact()
