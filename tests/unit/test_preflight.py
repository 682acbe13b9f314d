"""Preflight limits checked without starting anything: 64-bit options, the BPE size, local rank counts."""

import pytest

from dilocox.config import load_config
from dilocox.data.tokenizer import MAX_VOCAB_SIZE, check_vocab_size
from dilocox.launch import preflight


@pytest.mark.parametrize("flag", ["--train.steps=9223372036854775808", "--run.seed=-9223372036854775809"])
def test_int_options_must_fit_in_int64(flag):
    name = flag[2:].split("=")[0]
    with pytest.raises(ValueError, match=rf"^{name} = -?\d+ does not fit in a 64-bit integer"):
        load_config(None, [flag]).validate()
    load_config(None, ["--train.steps=9223372036854775807"]).validate()


def test_the_bpe_size_is_bounded():
    check_vocab_size(MAX_VOCAB_SIZE)
    with pytest.raises(ValueError, match="larger than the 1,048,576 a BPE is trained with here"):
        check_vocab_size(MAX_VOCAB_SIZE + 1)


def test_local_ranks_must_fit_in_memory(monkeypatch):
    monkeypatch.setattr(preflight, "_available_memory", lambda: 10 * preflight._RANK_START_BYTES)
    preflight.check_local_ranks(load_config(None, ["--topology.num_clusters=2", "--topology.dp_degree=5"]))
    with pytest.raises(ValueError, match=r"2 x 3 x 2 = 12 local ranks would need about 2.5 GB just to start"):
        preflight.check_local_ranks(
            load_config(None, ["--topology.num_clusters=2", "--topology.dp_degree=3", "--topology.pp_degree=2"])
        )
    monkeypatch.setattr(preflight, "_available_memory", lambda: None)  # no /proc/meminfo: only the process limit
    preflight.check_local_ranks(load_config(None, ["--topology.num_clusters=64"]))
