"""The sparse codecs end to end: `dilocox train` on the debug config with the `dilocox` preset's sync (delay, local
residual, drain) and each codec, real ranks over gloo: the slow link carries each round's payload and the drained
residual to the byte, and the agreed model learns."""

import json

import pytest
import torch

from dilocox.compress import build_codec
from dilocox.compress.config import CompressionConfig, drain_config
from dilocox.models import Decoder, model_args
from tests.e2e.helpers import DEBUG, dilocox, metrics

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "kind, density, drained",
    [("randk_sign", 0.1, "sign"), ("topk_int2", 0.05, "int2"), ("lowrank_topk", 0.02, "int4")],
)
def test_a_codec_trains_and_the_link_carries_its_exact_bytes(tmp_path, kind, density, drained):
    run_dir = tmp_path / kind
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox",
                     f"--compression.kind={kind}", f"--compression.density={density}", "--compression.rank=2",
                     "--sync.inner_steps=10", "--sync.overlap_steps=2", "--checkpoint.interval=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.device("meta"):
        shapes = [p.shape for p in Decoder(model_args("debug", vocab_size=512)).parameters()]
    cfg = CompressionConfig(kind=kind, density=density, rank=2)
    assert drain_config(cfg).kind == drained
    payload = build_codec(cfg).expected_nbytes_list(shapes)
    drain = build_codec(drain_config(cfg)).expected_nbytes_list(shapes)
    # 2 clusters of one rank: each round's all-gather sends this rank's payload to the other cluster once
    assert [r["round_bytes_sent"] for r in metrics(run_dir) if "round_bytes_sent" in r] == [payload] * 4
    assert f"drain: sent the held-back residual ({drained}, {drain:,} bytes from this rank" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer_steps"] == 4
    assert summary["wan_bytes_total"] == 2 * (4 * payload + drain)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
