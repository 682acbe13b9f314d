"""Streaming DiLoCo's split and schedule (`dilocox.sync.streaming`) and what `sync.fragments` refuses."""

import pytest

from dilocox.config import Config
from dilocox.models import model_args
from dilocox.parallel import stage_tensor_counts
from dilocox.sync.base import RoundStats
from dilocox.sync.config import SyncConfig
from dilocox.sync.fragment import fragment_bounds, fragment_offset


def test_fragments_hold_every_tensor_once_balanced_by_numel():
    numels = [12, 3, 6, 2]
    assert fragment_bounds(numels, 1) == [(0, 4)]
    assert fragment_bounds(numels, 3) == [(0, 1), (1, 2), (2, 4)]
    assert fragment_bounds(numels, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a tensor larger than an equal share still leaves one tensor for every later fragment (no empty fragment)
    assert fragment_bounds([1000, 10, 10, 10], 3) == [(0, 1), (1, 2), (2, 4)]
    balanced = fragment_bounds([10] * 12, 4)
    assert balanced == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="sync.fragments = 5 is more than the 4 parameter tensors"):
        fragment_bounds(numels, 5)


def test_fragment_k_first_syncs_at_offset_k_plus_one_h_over_n():
    # fragment 0 first, the last at H: Streaming DiLoCo's and torchft's order
    assert [fragment_offset(k, 12, 4) for k in range(4)] == [3, 6, 9, 12]
    assert [fragment_offset(k, 10, 4) for k in range(4)] == [2, 5, 7, 10]
    assert [fragment_offset(k, 10, 3) for k in range(3)] == [3, 6, 10]


def test_stage_tensor_counts_count_each_stage_on_the_meta_device():
    args = model_args("debug", vocab_size=512)
    whole = stage_tensor_counts(args, 1)
    halves = stage_tensor_counts(args, 2)
    assert len(halves) == 2 and min(halves) > 0
    assert sum(halves) == whole[0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fragments": 0}, "sync.fragments = 0 must be > 0"),
        ({"inner_steps": 3, "fragments": 4}, "sync.fragments = 4 is more than sync.inner_steps = 3"),
        (
            {"inner_steps": 6, "overlap_steps": 2, "fragments": 3},
            "sync.overlap_steps = 2 must be below a fragment's shortest round, H // sync.fragments = 2",
        ),
    ],
)
def test_sync_config_refuses_impossible_fragments(fields, message):
    """The counts alone; fragments with other features: the compatibility table (tests/unit/test_compat.py)."""
    with pytest.raises(ValueError, match=message):
        SyncConfig(**fields).validate()
    SyncConfig(**(fields | {"fragments": 1, "overlap_steps": 0})).validate()


def test_fragments_compose_with_elastic_runs_faults_and_time_rounds():
    for elastic, faults, round_mode in ((True, "none", "steps"), (False, "diverge", "time"), (True, "nan", "time")):
        cfg = Config()
        cfg.sync.kind, cfg.sync.fragments, cfg.sync.round.mode = "diloco", 2, round_mode
        cfg.topology.elastic, cfg.faults.kind = elastic, faults
        cfg.validate()


def test_round_record_names_its_fragment():
    stats = RoundStats(link_s=1.0, exposed_s=0.0, bytes_sent=10)
    assert "round_fragment" not in stats.to_record()
    assert RoundStats(link_s=1.0, exposed_s=0.0, bytes_sent=10, fragment=2).to_record()["round_fragment"] == 2
