"""A signed image is never taken without its key, unless the user says so by name; with a key, an image
without a signature or with another one is refused. Each refusal comes before anything is restored and
leaves the image as it was.

The restores here run the engine with the RecordingBackend TEST DOUBLE (tests/unit/conftest.py), which records
its calls and 'restores' this test's own process (no CRIU, no driver): what matters is whether the runtime was
reached at all."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image, image_signature
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import ImageError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore

KEY = "s3cret"


@pytest.fixture
def make_backend(recording_backend):
    """Makes runtime TEST DOUBLEs (tests/unit/conftest.py) whose restore 'brings up' this test's own process: no
    CRIU (so no dumped pid is waited for) and no host pids restored."""
    capabilities = recording_backend.capabilities._replace(uses_criu=False, restores_host_pids=False)
    return lambda: recording_backend(capabilities=capabilities)


@pytest.fixture
def backend(make_backend):
    return make_backend()


def _image(tmp_path, sign_key=None, name="img"):
    d = tmp_path / name
    image.prepare_dir(str(d))
    (d / "pages-1.img").write_bytes(os.urandom(4096))
    (d / "core-1.img").write_bytes(b"core")
    manifest = {"id": "img-1", "files": image.checksum_files(str(d)),
                "target": {"root_pid": os.getpid(), "pids": [os.getpid()], "cuda_pids": [], "states": {}}}
    image.write_manifest(str(d), manifest, sign_key=sign_key)
    return str(d)


def _edit_manifest(image_dir, **changes):
    """What a user (or an attacker) on the host that keeps the image does to its manifest."""
    path = os.path.join(image_dir, image.MANIFEST)
    with open(path) as fh:
        manifest = json.load(fh)
    manifest.update(changes)
    with open(path, "w") as fh:
        json.dump(manifest, fh)


def _snapshot(image_dir):
    """The image's files and their bytes (its state dir aside): a refusal must change none of them."""
    out = {}
    for rel in sorted(os.listdir(image_dir)):
        if rel != image.STATE_DIR:
            with open(os.path.join(image_dir, rel), "rb") as fh:
                out[rel] = fh.read()
    return out


def _restore(image_dir, backend, **options):
    return restore(image_dir, backend=backend, validate_wait=0, pid_wait=0, **options)


# -- the check itself (core/image) ----------------------------------------------------------------------

def test_check_signature_verdicts():
    signed = {"id": "x"}
    signed["signature"] = {"alg": "hmac-sha256", "value": image_signature.signature_of(signed, KEY)}
    assert image_signature.check_signature(signed, KEY) == "verified"
    assert image_signature.check_signature({"id": "x"}) == "unsigned"
    assert image_signature.check_signature(signed, None, allow_unverified_signature=True) == "not_checked"
    assert image_signature.check_signature(signed, KEY, allow_unverified_signature=True) == "verified", \
        "the option never turns off the check of a key that is given"
    with pytest.raises(ImageError, match="no sign_key was given") as exc:
        image_signature.check_signature(signed)
    assert exc.value.stage == "preflight" and exc.value.details == {"signature": "no_key"}
    assert "sign_key" in exc.value.hint and "allow_unverified_signature" in exc.value.hint
    with pytest.raises(ImageError, match="carries no signature") as exc:
        image_signature.check_signature({"id": "x"}, KEY)
    assert exc.value.details == {"signature": "missing"}
    with pytest.raises(ImageError, match="does not match") as exc:
        image_signature.check_signature(signed, "other")
    assert exc.value.details == {"signature": "mismatch"}


@pytest.mark.parametrize("signature", [None, {}, "abc", {"alg": "md5", "value": "x"}, {"alg": "hmac-sha256", "value": 7},
                                       {"alg": "hmac-sha256", "value": "\ud800\u00e9"}])
def test_a_malformed_signature_is_refused_with_a_key_and_without_one(signature):
    manifest = {"id": "x", "signature": signature}
    with pytest.raises(ImageError, match="does not match|carries no signature"):
        image_signature.check_signature(manifest, KEY)
    with pytest.raises(ImageError, match="no sign_key was given"):
        image_signature.check_signature(manifest)


def test_image_verify_applies_the_same_rules(tmp_path):
    signed = _image(tmp_path, KEY, "signed")
    unsigned = _image(tmp_path, None, "unsigned")
    image.verify(signed, sign_key=KEY)
    image.verify(unsigned)
    image.verify(signed, allow_unverified_signature=True)
    with pytest.raises(ImageError, match="no sign_key was given"):
        image.verify(signed)
    with pytest.raises(ImageError, match="carries no signature"):
        image.verify(unsigned, sign_key=KEY)
    with pytest.raises(ImageError, match="does not match"):
        image.verify(signed, sign_key="other")


# -- the restore (engine/restore): every case refused before the runtime is reached ---------------------

def test_signed_image_without_the_key_is_refused_before_anything_and_kept(tmp_path, backend):
    image_dir = _image(tmp_path, KEY)
    before = _snapshot(image_dir)
    with pytest.raises(ImageError, match="carries a signature, and no sign_key was given") as exc:
        _restore(image_dir, backend)
    assert "allow_unverified_signature" in exc.value.hint
    assert backend.calls == [], "refused before the runtime's preflight, let alone its restore"
    assert _snapshot(image_dir) == before
    with image.Image.open(image_dir) as img:
        assert img.restored_mark() is None
    # check mode says the same, and the refusal holds with the checksums turned off
    with pytest.raises(ImageError, match="no sign_key"):
        _restore(image_dir, backend, check_mode=True)
    with pytest.raises(ImageError, match="no sign_key"):
        _restore(image_dir, backend, verify=False)
    assert backend.calls == []


def test_the_users_edit_of_a_signed_manifest_restored_without_a_key_is_refused(tmp_path, backend):
    """The user's report: a signed image whose manifest was edited on the target restored with rc 0."""
    image_dir = _image(tmp_path, KEY)
    _edit_manifest(image_dir, id="img-edited")
    with pytest.raises(ImageError, match="no sign_key was given"):
        _restore(image_dir, backend)
    with pytest.raises(ImageError, match="does not match the configured key"):
        _restore(image_dir, backend, sign_key=KEY)
    assert backend.calls == []


def test_signed_image_without_the_key_restores_when_allowed_by_name_and_says_it_was_not_checked(tmp_path, backend, make_backend):
    image_dir = _image(tmp_path, KEY)
    res = _restore(image_dir, backend, allow_unverified_signature=True)
    assert res["changed"] is True and res["pids"] == [os.getpid()]
    assert res["signature"] == "not_checked"
    assert "NOT checked" in res["msg"]
    assert res["warnings"] and "not checked" in res["warnings"][0]
    # Already restored, and running: nothing to do, and still it says the signature was not checked.
    again = _restore(image_dir, make_backend(), allow_unverified_signature=True)
    assert again["changed"] is False and again["signature"] == "not_checked"
    # That the image was restored before is no reason to take it without its key now.
    with pytest.raises(ImageError, match="no sign_key"):
        _restore(image_dir, make_backend())


def test_signed_image_with_the_right_key_restores_and_says_verified(tmp_path, backend):
    image_dir = _image(tmp_path, KEY)
    res = _restore(image_dir, backend, sign_key=KEY)
    assert res["changed"] is True and res["signature"] == "verified"
    assert "warnings" not in res and "NOT" not in res["msg"]
    assert "runtime_restore" in backend.calls


def test_signed_image_with_a_wrong_key_is_refused(tmp_path, backend):
    image_dir = _image(tmp_path, KEY)
    before = _snapshot(image_dir)
    with pytest.raises(ImageError, match="does not match the configured key") as exc:
        _restore(image_dir, backend, sign_key="other")
    assert exc.value.stage == "verify"
    with pytest.raises(ImageError, match="does not match"):
        _restore(image_dir, backend, sign_key="other", allow_unverified_signature=True, verify=False)
    assert backend.calls == [] and _snapshot(image_dir) == before


def test_unsigned_image_with_a_key_is_refused(tmp_path, backend):
    image_dir = _image(tmp_path, None)
    before = _snapshot(image_dir)
    with pytest.raises(ImageError, match="carries no signature, and a sign_key is configured"):
        _restore(image_dir, backend, sign_key=KEY)
    assert backend.calls == [] and _snapshot(image_dir) == before


def test_a_signature_removed_on_the_way_is_refused_with_the_key(tmp_path, make_backend):
    image_dir = _image(tmp_path, KEY)
    path = os.path.join(image_dir, image.MANIFEST)
    with open(path) as fh:
        manifest = json.load(fh)
    del manifest["signature"]
    with open(path, "w") as fh:
        json.dump(manifest, fh)
    with pytest.raises(ImageError, match="carries no signature"):
        _restore(image_dir, make_backend(), sign_key=KEY)


def test_unsigned_image_without_a_key_restores_as_before(tmp_path, make_backend):
    image_dir = _image(tmp_path, None)
    res = _restore(image_dir, make_backend())
    assert res["changed"] is True and res["signature"] == "unsigned" and "warnings" not in res
