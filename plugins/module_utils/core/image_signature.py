# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""An image manifest's signature: an HMAC-SHA256 of the manifest under the user's sign_key, written by
core/image.py's write_manifest, and its check, read before anything else of the image. Standard library only
(the receiving end of a transfer carries core/image.py, and so this module)."""
from __future__ import annotations

import hashlib
import hmac
import json

from .errors import ImageError


def signature_of(manifest, key):
    """The HMAC-SHA256 of ``manifest`` (less its own signature) under ``key``, as hex."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(key.encode() if isinstance(key, str) else key, body, hashlib.sha256).hexdigest()


def check_signature(manifest, sign_key=None, allow_unverified_signature=False, where="the image"):
    """The manifest's signature against the configured key, read before anything else of the image.
    Returns "verified" (it matches the key), "unsigned" (neither key nor signature) or "not_checked"
    (signed, no key, and the user allowed that by name). Raises ImageError otherwise: a signed image is
    never taken without its key (a forgotten key must not silently turn the check off), and with a key an
    image without a signature is refused like one with a wrong one (stripping it must not get past)."""
    if not sign_key:
        if "signature" not in manifest or allow_unverified_signature:
            return "not_checked" if "signature" in manifest else "unsigned"
        raise ImageError("the manifest of %s carries a signature, and no sign_key was given to check it; refusing the "
                         "image unchecked (it is kept as it is)" % where, stage="preflight", details={"signature": "no_key"},
                         hint="give the key it was signed with (sign_key), or set allow_unverified_signature=true "
                         "to take it without checking its signature")
    sig = manifest.get("signature")
    value = sig.get("value") if isinstance(sig, dict) and sig.get("alg") == "hmac-sha256" else None
    if sig is None or not isinstance(value, str) or not hmac.compare_digest(
            value.encode("utf-8", "surrogatepass"), signature_of(manifest, sign_key).encode()):
        missing = sig is None
        raise ImageError("the manifest of %s %s; refusing it (it is kept as it is)" % (where, "carries no signature, and a sign_key "
                         "is configured" if missing else "has a signature that does not match the configured key"),
                         stage="verify", details={"signature": "missing" if missing else "mismatch"},
                         hint="the image was altered or signed with another key (or none): restore only an image "
                         "checkpointed with this sign_key, or give the key it was signed with")
    return "verified"
