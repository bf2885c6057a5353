"""The user's case, end to end with real CRIU through ansible-playbook: a signed image whose manifest was
edited on the host that keeps it restored with rc 0 when gpu_restore was simply given no key. It must be
refused, before anything is restored, with the image kept; the right key restores the untouched image.

The GPU stage runs against the libcuda TEST DOUBLE (tests/fakecuda): CI has no GPU."""
from __future__ import annotations

import json
import os
import shutil

KEY = "s3cret-for-the-test"

# gpu_checkpoint and gpu_restore as a user calls them, each with the options the test passes.
PLAYBOOK = """---
- name: Signed images
  hosts: all
  gather_facts: false
  tasks:
    - name: Checkpoint signed
      gpuckpt.fleet.gpu_checkpoint:
        pid: "{{ pid }}"
        image_dir: "{{ image_dir }}"
        sign_key: "{{ key }}"
      when: op == 'checkpoint'

    - name: Restore
      gpuckpt.fleet.gpu_restore:
        image_dir: "{{ image_dir }}"
        sign_key: "{{ key | default(omit) }}"
        allow_unverified_signature: "{{ allow | default(false) | bool }}"
      when: op == 'restore'
"""


def _files(image_dir):
    return {name: os.path.getsize(os.path.join(image_dir, name)) for name in os.listdir(image_dir) if name != ".gpuckpt"}


def test_an_edited_signed_manifest_is_refused_without_the_key_and_with_it(tmp_path, playbook, workloads, fakecuda):
    book = tmp_path / "signed.yml"
    book.write_text(PLAYBOOK)

    def run(check=False, **extra):
        return playbook(str(book), extra, check=check, env=fakecuda.env)

    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    made = run(op="checkpoint", pid=w.pid, image_dir=image_dir, key=KEY)
    assert made.rc == 0, made.stdout
    stopped_at = w.counts()
    manifest_path = os.path.join(image_dir, "manifest.json")
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    assert manifest["signature"]["alg"] == "hmac-sha256"
    shutil.copy(manifest_path, str(tmp_path / "manifest.orig"))

    # What the user did on the target: edit the signed manifest (here, the states the restore's validation
    # compares with: every process now 'was stopped at the dump').
    edited = dict(manifest, target=dict(manifest["target"], states={str(p): "T" for p in manifest["target"]["pids"]}))
    assert edited != manifest
    with open(manifest_path, "w") as fh:
        json.dump(edited, fh)
    files = _files(image_dir)

    refused = run(op="restore", image_dir=image_dir)
    assert refused.rc != 0, "a signed image restored without its key: %s" % refused.stdout
    res = refused.task("Restore")
    assert res["_status"] == "failed" and res["stage"] == "preflight"
    assert "carries a signature, and no sign_key was given" in res["msg"]
    assert "Next: give the key it was signed with (sign_key)" in res["msg"] and "allow_unverified_signature" in res["msg"]
    assert res["signature"] == "no_key"

    wrong = run(op="restore", image_dir=image_dir, key=KEY)
    assert wrong.rc != 0, wrong.stdout
    assert "does not match the configured key" in wrong.task("Restore")["msg"]
    assert not w.alive(), "nothing was restored"
    assert _files(image_dir) == files, "the refused image is kept as it was"

    # Told by name, check mode takes it, and says its signature was not checked.
    checked = run(check=True, op="restore", image_dir=image_dir, allow=True)
    assert checked.rc == 0, checked.stdout
    assert checked.task("Restore")["signature"] == "not_checked"
    assert "NOT checked" in checked.task("Restore")["msg"]
    assert not w.alive()

    # The manifest as it was signed: the key restores it, and the workload goes on from where it stopped.
    shutil.copy(str(tmp_path / "manifest.orig"), manifest_path)
    ok = run(op="restore", image_dir=image_dir, key=KEY)
    assert ok.rc == 0, ok.stdout
    res = ok.task("Restore")
    assert res["changed"] is True and res["signature"] == "verified"
    after = w.wait_counting(beyond=stopped_at)
    for role in w.roles:
        assert stopped_at[role] < after[role] < stopped_at[role] + 200
    assert w.intact()
