"""HMAC tags of slow-link payloads (`dilocox.net.auth`) and the `network.auth_key_file` option."""

import os

import numpy as np
import pytest

from dilocox.config import Config, load_config, to_dict, to_toml
from dilocox.net.auth import MIN_KEY_BYTES, TAG_BYTES, PayloadAuth, read_auth_key
from dilocox.net.config import NetworkConfig

KEY = b"k" * 24
GROUP = (1, 3, 5)


def test_a_tag_verifies_only_for_its_payload_key_transfer_sender_and_group():
    auth = PayloadAuth(KEY)
    payload = bytes(range(200))
    tag = auth.tag(payload, seq=7, sender=1, group=GROUP)
    assert len(tag) == TAG_BYTES
    assert auth.verify(payload, tag, seq=7, sender=1, group=GROUP)
    # a numpy array is tagged as its bytes, without a copy (what the channel passes)
    assert auth.tag(np.frombuffer(payload, dtype=np.uint8), seq=7, sender=1, group=GROUP) == tag
    flipped = bytearray(payload)
    flipped[100] ^= 0x10
    assert not auth.verify(bytes(flipped), tag, seq=7, sender=1, group=GROUP)  # corrupted on the way
    assert not auth.verify(payload, bytes([tag[0] ^ 1]) + tag[1:], seq=7, sender=1, group=GROUP)
    assert not PayloadAuth(b"K" * 24).verify(payload, tag, seq=7, sender=1, group=GROUP)  # another key
    assert not auth.verify(payload, tag, seq=8, sender=1, group=GROUP)  # replayed in another transfer
    assert not auth.verify(payload, tag, seq=7, sender=2, group=GROUP)  # claimed by another sender
    assert not auth.verify(payload, tag, seq=7, sender=1, group=(0, 2, 4))  # replayed into another group
    assert not auth.verify(payload[:-1], tag, seq=7, sender=1, group=GROUP)
    empty = auth.tag(b"", seq=0, sender=0, group=GROUP)
    assert auth.verify(b"", empty, seq=0, sender=0, group=GROUP) and empty != tag
    assert "k" * 16 not in repr(auth) and "hidden" in repr(auth)


def test_read_auth_key_checks_the_file(tmp_path):
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")  # `openssl rand -hex 16 > FILE`
    assert read_auth_key(str(key_file)) == b"0123456789abcdef0123456789abcdef"
    with pytest.raises(ValueError, match=r"network\.auth_key_file = .*missing.key: no such file; create one"):
        read_auth_key(str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match=r"network\.auth_key_file = .* is not a regular file"):
        read_auth_key(str(tmp_path))
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * (MIN_KEY_BYTES - 1) + b"\n")
    with pytest.raises(ValueError, match=rf"holds {MIN_KEY_BYTES - 1} bytes, fewer than the {MIN_KEY_BYTES}"):
        read_auth_key(str(short))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PayloadAuth(b"short")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_key_file_is_refused(tmp_path):
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0)
    with pytest.raises(ValueError, match="cannot be read .*Permission denied"):
        read_auth_key(str(key_file))


def test_the_config_keeps_the_path_and_never_the_key(tmp_path):
    key_file = tmp_path / "wan.key"
    secret = b"do-not-print-this-secret-key-0123"
    key_file.write_bytes(secret)
    cfg = load_config(None, [f"--network.auth_key_file={key_file}", "--compression.kind=int4"])
    cfg.validate()
    assert cfg.network.auth_key_file == str(key_file)
    for text in (to_toml(cfg), repr(to_dict(cfg)), repr(cfg), repr(cfg.network.payload_auth())):
        assert secret.decode() not in text
    assert str(key_file) in to_toml(cfg)
    assert NetworkConfig().payload_auth() is None
    with pytest.raises(ValueError, match="network.auth_key_file = .*: no such file"):
        load_config(None, [f"--network.auth_key_file={tmp_path / 'nope'}"]).validate()


@pytest.mark.parametrize(
    ("overrides", "setting", "fix"),
    [
        (["--sync.kind=allreduce"], "sync.kind = 'allreduce'", "--preset dilocox"),
        (["--sync.kind=diloco"], "compression.kind = 'none'", "compression.reduction = gather"),  # diloco: fp32
        (["--compression.kind=none"], "compression.kind = 'none'", "compression.reduction = gather"),
        (
            ["--compression.kind=int4", "--compression.reduction=scalable"],
            "compression.reduction = 'scalable'",
            "compression.reduction = gather",
        ),
    ],
)
def test_summed_reductions_refuse_an_auth_key(tmp_path, overrides, setting, fix):
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(KEY)
    cfg = load_config(None, [f"--network.auth_key_file={key_file}", *overrides])
    with pytest.raises(ValueError, match=rf"network.auth_key_file does not work with {setting}: .*summed.*{fix}"):
        cfg.validate()


@pytest.mark.parametrize(
    "overrides",
    [["--preset=dilocox-lowrank"], ["--sync.kind=cocktail"], ["--sync.kind=diloco", "--compression.kind=fp16"]],
)
def test_gathered_payloads_accept_an_auth_key(tmp_path, overrides):
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(KEY)
    load_config(None, [f"--network.auth_key_file={key_file}", *overrides]).validate()
    Config().validate()  # and without a key nothing is refused
