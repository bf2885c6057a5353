"""A target pod that will never come: settle_target(abandon_pod_restore=True) tells the waiting restore to give up
through the image's backend (Backend.abandon_restore_wait), never through the pod runtime's module itself."""
from __future__ import annotations

import os

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.fsutil import identity
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import restore_protocol
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import transaction
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import registry


class Journal(object):
    def __init__(self, doc):
        self.doc = doc

    def read(self):
        return self.doc


def _pod_image(tmp_path):
    image_dir = str(tmp_path / "img")
    os.mkdir(image_dir)
    restore_protocol.write_restore_ticket(image_dir, "default/p", "tok", [{"name": "a"}, {"name": "b"}, {"name": "c"}])
    for name in ("a", "b", "c"):
        os.makedirs(restore_protocol.container_path(image_dir, name))
    restore_protocol.take_claim(restore_protocol.container_path(image_dir, "a"))
    restore_protocol.set_claim(restore_protocol.container_path(image_dir, "a"), restore_protocol.RESTORED)
    restore_protocol.take_claim(restore_protocol.container_path(image_dir, "b"))
    doc = {"phase": "restoring", "restore_pod": "default/p", "image_dir": image_dir,
           "image_dir_identity": identity(os.lstat(image_dir))}
    return image_dir, doc


def test_the_pod_backend_marks_the_containers_not_yet_restored(tmp_path):
    image_dir, doc = _pod_image(tmp_path)
    assert transaction.abandon_pod_restore_wait(Journal(doc), registry.make("k8s_pod", {})) == ["b", "c"]
    claims = [restore_protocol.read_claim(restore_protocol.container_path(image_dir, n)) for n in ("a", "b", "c")]
    assert claims == ["restored", "failed", "failed"]


def test_another_runtime_or_another_phase_marks_nothing(tmp_path):
    image_dir, doc = _pod_image(tmp_path)
    assert transaction.abandon_pod_restore_wait(Journal(doc), registry.make("process", {})) == []
    assert transaction.abandon_pod_restore_wait(Journal(dict(doc, phase="restored")), registry.make("k8s_pod", {})) == []
    assert restore_protocol.read_claim(restore_protocol.container_path(image_dir, "c")) is None


def test_the_transaction_reaches_no_pod_runtime_by_its_module():
    with open(transaction.__file__) as fh:
        assert "k8s" not in fh.read()
