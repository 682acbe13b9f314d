"""`check_same_settings` on 3 real gloo ranks: every rank raises the same one-line error, naming the ranks that differ,
or that cannot read their key file; ranks that agree go on."""

import pytest
import torch.distributed as dist

from dilocox.agreement import SettingsMismatch, check_same_settings
from dilocox.config import load_config
from tests.e2e.helpers import DEBUG
from tests.multiproc import run_ranks


def _worker(rank: int, world_size: int, key_dir: str) -> dict:
    out = {}
    check_same_settings(load_config(DEBUG, []), group=dist.group.WORLD)  # the same on every rank: nothing raised
    flags = ["--train.lr=0.03"] if rank == 2 else []
    with pytest.raises(SettingsMismatch) as info:
        check_same_settings(load_config(DEBUG, flags), group=dist.group.WORLD, node=str(rank // 2))
    out["mismatch"] = str(info.value)
    key = f"{key_dir}/{'missing' if rank == 1 else 'wan'}.key"
    cfg = load_config(DEBUG, ["--compression.kind=int4", f"--network.auth_key_file={key}"])
    with pytest.raises(ValueError) as info:
        check_same_settings(cfg, group=dist.group.WORLD)
    out["unreadable"] = (type(info.value).__name__, str(info.value))
    return out


@pytest.mark.dist
def test_every_rank_raises_the_same_line_naming_what_differs_where(tmp_path):
    (tmp_path / "wan.key").write_bytes(b"k" * 32)
    results = run_ranks(_worker, 3, args=(str(tmp_path),))
    assert len({r["mismatch"] for r in results}) == 1
    assert results[0]["mismatch"].startswith(
        "the ranks of this run were started with other settings: train.lr: 0.003 on ranks 0-1 (node 0), 0.03 on "
        "rank 2 (node 1); start every node with the same config file and flags"
    )
    assert {r["unreadable"] for r in results} == {
        ("ValueError", f"rank 1: network.auth_key_file = {tmp_path}/missing.key: no such file; create one with "
                       f"`head -c 32 /dev/urandom > {tmp_path}/missing.key` and copy it to every cluster")
    }  # fmt: skip
