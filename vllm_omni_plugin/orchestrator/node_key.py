"""The node link's key: VLLM_OMNI_AUTHKEY, or on one host a random key in a private file.

- `VLLM_OMNI_AUTHKEY` set: that key, at least MIN_KEY_BYTES bytes (a shorter one is refused at
  start-up: it could be guessed offline from one recorded handshake).
- Unset (the head listens on, and nodes connect to, loopback only): a random 32-byte key in
  `node_link_key`, mode 0600, in the user's runtime or cache folder (private_files.py). The
  head or node that starts first creates it; the others read it. Another local user cannot
  read it, and nothing about it follows from public data (the pipeline's shape, its name).
"""

from __future__ import annotations

import os

from .private_files import PrivateFileError, shared_secret

AUTHKEY_ENV = "VLLM_OMNI_AUTHKEY"
MIN_KEY_BYTES = 32
KEY_FILE = "node_link_key"


def explicit_key() -> bytes | None:
    """$VLLM_OMNI_AUTHKEY as bytes (SystemExit when shorter than MIN_KEY_BYTES), or None."""
    value = os.environ.get(AUTHKEY_ENV)
    if not value:
        return None
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise SystemExit(
            f"{AUTHKEY_ENV} is {len(key)} bytes; at least {MIN_KEY_BYTES} are needed "
            f"(e.g. `export {AUTHKEY_ENV}=$(openssl rand -hex 32)`)"
        )
    return key


def same_host_key() -> bytes:
    """The key of this user's head and nodes on this host (created on first use)."""
    try:
        secret, _ = shared_secret(KEY_FILE)
    except PrivateFileError as exc:
        raise SystemExit(f"node link key: {exc}; or set {AUTHKEY_ENV}") from None
    return secret.encode()
