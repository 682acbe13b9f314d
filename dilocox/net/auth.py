"""HMAC-SHA256 tags on slow-link payloads (`network.auth_key_file`; docs/design.md §5, docs/guides/security.md).

Every cluster holds the same secret key. A sender appends `tag(payload)` to each payload it puts on the slow link;
a receiver recomputes it and uses the payload only if the two match. The tag covers a domain string, the ranks of
the group the payload travels in, the transfer's sequence number on the channel, the sender's index in the group
and the payload's length and bytes, so a payload replayed from another transfer, another sender or another
group does not verify either.

    auth = PayloadAuth.from_file("/etc/dilocox/wan.key")        # the same file on every cluster
    tag = auth.tag(payload, seq=7, sender=1, group=(1, 3))      # 32 bytes, appended to the payload
    assert auth.verify(payload, tag, seq=7, sender=1, group=(1, 3))
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from pathlib import Path

TAG_BYTES = 32
"""An HMAC-SHA256 tag: sent after every authenticated payload, counted as slow-link bytes."""
MIN_KEY_BYTES = 16
"""The shortest key accepted (128 bits)."""
DOMAIN = b"dilocox/slow-link-payload/v1\x00"
"""Binds a tag to this use of the key: the same key used elsewhere never yields a valid payload tag."""
FINGERPRINT_LABEL = b"dilocox/auth-key-fingerprint/v1\x00"
"""The fixed message whose HMAC under the key is the key's fingerprint (never a payload: no tag input starts so)."""

Buffer = bytes | bytearray | memoryview  # or anything else exposing the buffer protocol (a numpy array)


def read_auth_key(path: str) -> bytes:
    """The key in the file at `path`: its bytes, a trailing newline removed (`openssl rand -hex 32 > FILE` and
    `head -c 32 /dev/urandom > FILE` both work). A ValueError naming `network.auth_key_file` and the fix when the
    file is missing, unreadable or shorter than `MIN_KEY_BYTES`; the key itself is never part of a message."""
    name = f"network.auth_key_file = {path}"
    create = f"create one with `head -c 32 /dev/urandom > {path}` and copy it to every cluster"
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(f"{name}: no such file; {create}")
    if not file.is_file():
        raise ValueError(f"{name} is not a regular file; point it to the file that holds the shared key")
    try:
        key = file.read_bytes().rstrip(b"\r\n")
    except OSError as exc:
        raise ValueError(f"{name} cannot be read ({exc.strerror}); make it readable by the user that trains") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{name} holds {len(key)} bytes, fewer than the {MIN_KEY_BYTES} a key needs; {create}")
    return key


class PayloadAuth:
    """Computes and checks the HMAC-SHA256 tag of one slow-link payload (RFC 2104 with SHA-256, Python's `hmac`).

        auth = PayloadAuth(key)
        tag = auth.tag(payload, seq=seq, sender=rank, group=ranks)
        ok = auth.verify(received, tag, seq=seq, sender=peer, group=ranks)   # constant-time comparison

    The key is kept in this object only: it has no repr of it and is never written anywhere.
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"an auth key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)

    @classmethod
    def from_file(cls, path: str) -> PayloadAuth:
        return cls(read_auth_key(path))

    def tag(self, payload: Buffer, *, seq: int, sender: int, group: Sequence[int]) -> bytes:
        """The 32-byte tag of `payload` sent by `sender` (its index in the group) as transfer `seq` of the group
        of global ranks `group`."""
        view = memoryview(payload).cast("B")  # a byte view of any contiguous buffer, without copying it
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(DOMAIN)
        mac.update(struct.pack(f"<I{len(group)}q", len(group), *group))
        mac.update(struct.pack("<qIQ", seq, sender, view.nbytes))
        mac.update(view)
        return mac.digest()

    def fingerprint(self) -> str:
        """16 hex digits that tell keys apart without revealing them: the HMAC-SHA256 of a fixed label under the key.
        Ranks compare it before training (`dilocox.agreement`); without the key it cannot be computed, and it gives
        nothing that helps to guess the key or to forge a payload tag (another message, another domain)."""
        return hmac.new(self._key, FINGERPRINT_LABEL, hashlib.sha256).hexdigest()[:16]

    def verify(self, payload: Buffer, tag: Buffer, *, seq: int, sender: int, group: Sequence[int]) -> bool:
        """Whether `tag` is the tag of this payload, transfer, sender and group (a constant-time comparison)."""
        return hmac.compare_digest(self.tag(payload, seq=seq, sender=sender, group=group), bytes(tag))

    def __repr__(self) -> str:
        return "PayloadAuth(key=<hidden>)"
