"""Verified checkpoints: sizes and sha256 in meta.json, a corrupt checkpoint skipped for `latest` and refused by
name in one line, and retention that never deletes the last good checkpoint."""

import hashlib
import json

import pytest
import torch

from dilocox.checkpoint import (
    CorruptCheckpoint,
    find_checkpoint,
    list_checkpoints,
    load_rank_state,
    save_checkpoint,
    verify_checkpoint,
)


def save(run_dir, step, keep=5):
    state = {"model": {"w": torch.full((64, 64), float(step))}, "step": step}
    return save_checkpoint(run_dir, step, state, rank=0, meta={"world_size": 1}, keep=keep)


def flip_a_bit(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_meta_records_size_and_sha256_and_nothing_else_is_left(tmp_path):
    path = save(tmp_path, 10)
    meta = json.loads((path / "meta.json").read_text())
    file = path / "rank_00000.pt"
    assert meta["files"]["rank_00000.pt"]["bytes"] == file.stat().st_size
    assert meta["files"]["rank_00000.pt"]["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rank_00000.pt"]  # digests moved into meta
    verify_checkpoint(path)
    assert load_rank_state(path, 0)["step"] == 10


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (flip_a_bit, "does not match its sha256"),
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "bytes,"),  # truncated
        (lambda f: f.write_bytes(b"\0" * f.stat().st_size), "does not match its sha256"),  # garbage, same size
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["bit-flip", "truncated", "garbage", "missing"],
)
def test_latest_skips_a_corrupt_checkpoint_and_a_named_one_is_refused(tmp_path, capsys, damage, why):
    good, bad = save(tmp_path, 10), save(tmp_path, 20)
    damage(bad / "rank_00000.pt")
    assert find_checkpoint(tmp_path, "latest") == good
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and str(bad) in warning and why in warning
    with pytest.raises(CorruptCheckpoint, match=why) as info:
        find_checkpoint(tmp_path, str(bad))
    assert "\n" not in str(info.value)
    assert load_rank_state(find_checkpoint(tmp_path, "latest"), 0)["step"] == 10


def test_every_checkpoint_corrupt_is_one_error(tmp_path):
    flip_a_bit(save(tmp_path, 10) / "rank_00000.pt")
    with pytest.raises(CorruptCheckpoint, match="every checkpoint"):
        find_checkpoint(tmp_path, "latest")


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path):
    save(tmp_path, 10, keep=1)
    (tmp_path / "checkpoints" / "step_00000010" / "rank_00000.pt").write_bytes(b"short")  # corrupt, kept as evidence
    save(tmp_path, 20, keep=1)
    save(tmp_path, 30, keep=1)
    # keep = 1 counts good checkpoints only: 20 was pruned by 30, the corrupt 10 is not counted nor deleted
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000030"]
    assert find_checkpoint(tmp_path, "latest").name == "step_00000030"


def test_a_checkpoint_from_before_digests_still_loads(tmp_path):
    path = save(tmp_path, 10)
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert find_checkpoint(tmp_path, "latest") == path
