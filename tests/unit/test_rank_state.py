"""A rank's nested state through one DCP checkpoint and back (`dilocox/rank_state.py`): the same tree, types and
values; a tied tensor as one; only what is asked for read."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dilocox.rank_state import checkpoint_items, load_state, replicated


def _save(path, state, shared=None):
    dcp.save(checkpoint_items(state, rank=3, shared=shared), storage_writer=FileSystemWriter(path), no_dist=True)


def test_a_state_comes_back_as_it_was_and_a_tied_tensor_as_one(tmp_path):
    embedding = torch.randn(8, 4)
    state = {
        "model": {"tok_embeddings.weight": embedding, "output.weight": embedding},
        "inner_optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "sync": {"fragments": [{"outer_params": torch.arange(5.0), "pending_sent": None, "seq": (1, "a", 2.5)}]},
        "empty": [torch.zeros(0), torch.zeros(0)],
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8),
    }
    _save(tmp_path, state, shared="cluster0/stage0")
    read: list[str] = []
    back = load_state(tmp_path, 3, verify=read.extend)
    assert read == [".metadata", "__0_0.distcp", "__0_0.distcp"]  # the index, then the files of what it loads
    assert back.keys() == state.keys()
    assert back["model"]["output.weight"] is back["model"]["tok_embeddings.weight"]
    assert torch.equal(back["model"]["output.weight"], embedding)
    assert back["inner_optimizer"]["state"][0]["step"].item() == 3.0 and 0 in back["inner_optimizer"]["state"]
    assert back["inner_optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    fragment = back["sync"]["fragments"][0]
    assert torch.equal(fragment["outer_params"], torch.arange(5.0)) and fragment["pending_sent"] is None
    assert fragment["seq"] == (1, "a", 2.5) and isinstance(fragment["seq"], tuple)
    assert back["empty"][0] is not back["empty"][1]
    assert torch.equal(back["rng"], state["rng"]) and back["rng"].dtype == torch.uint8


def test_what_replicas_hold_alike_goes_under_the_stage_and_the_rest_under_the_rank(tmp_path):
    state = {
        "model": {"w": torch.ones(2)},
        "sync": {"fragments": [{"outer_params": torch.ones(2), "reducer": {"residual": torch.ones(2)}}]},
    }
    keys = set(checkpoint_items(state, rank=3, shared="cluster1/stage0"))
    assert keys == {
        "cluster1/stage0/model/w",
        "cluster1/stage0/sync/fragments/0/outer_params",
        "rank3/sync/fragments/0/reducer/residual",
        "rank3/skeleton",
    }
    assert set(checkpoint_items(state, rank=3, shared=None)) == {  # a sharded stage: every tensor its rank's own
        "rank3/model/w",
        "rank3/sync/fragments/0/outer_params",
        "rank3/sync/fragments/0/reducer/residual",
        "rank3/skeleton",
    }
    assert replicated(("sync", "fragments", 1, "outer_optimizer", "state", 0, "momentum_buffer"))
    assert not replicated(("sync", "fragments", 1, "pending_sent"))


def test_only_the_tensors_asked_for_are_read(tmp_path):
    _save(tmp_path, {"model": {"w": torch.ones(3)}, "inner_optimizer": {"m": torch.ones(3)}})
    back = load_state(tmp_path, 3, verify=lambda files: None, wanted=lambda at: at[0] == "model")
    assert torch.equal(back["model"]["w"], torch.ones(3)) and back["inner_optimizer"]["m"] is None
