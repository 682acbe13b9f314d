"""The planner's arithmetic against hand-computed cases and the paper regime (`dilocox plan` is test_plan_cli.py)."""

from dataclasses import replace

import pytest

from dilocox.models import count_parameters, model_args
from dilocox.net.link import parse_bandwidth
from dilocox.tools.bench.planner import (
    GIB,
    INT4_COMPRESSION_RATIO,
    PAPER,
    GpuSpec,
    PlanInput,
    allreduce_transfer_s,
    calibrate_cpu_core,
    codec_compression_ratio,
    format_bandwidth,
    gpu_preset,
    paper_107b_input,
    paper_regime,
    paper_regime_bandwidth,
    paper_regime_ratio,
    plan,
    resolve_flavor,
)

# A round number GPU: 1 TFLOP/s peak, 80 GiB.
GPU = GpuSpec("test", peak_flops=1e12, memory_bytes=80 * GIB)


def base(**overrides) -> PlanInput:
    """1e9 params; 2 clusters x dp 1 x pp 2 = 4 GPUs; 4 microbatches of 1 x 1000 tokens; T = 8000 tokens/step."""
    fields = dict(
        num_params=1_000_000_000,
        seq_len=1000,
        num_microbatches=4,
        num_clusters=2,
        dp_degree=1,
        pp_degree=2,
        gpu=GPU,
        mfu=0.5,
        slow_link_bps=1e9,  # 1.25e8 bytes/s
        slow_latency_s=0.01,
        slow_link_scope="cluster",
        inner_steps=10,
        compression_ratio=8.0,
    )
    fields.update(overrides)
    return PlanInput(**fields)


# --- compute and bubble -------------------------------------------------------------------------------------------


def test_compute_time_and_pipeline_bubble():
    result = plan(base())
    allreduce = result.strategies["allreduce"]
    assert result.input.tokens_per_step == 8000
    # 6 * 1e9 * 8000 / (4 GPUs * 1e12 * 0.5) = 24 s; bubble (2-1)/(4+2-1) = 0.2 stretches it to 24 / 0.8 = 30 s.
    assert allreduce.step_ideal_compute_s == pytest.approx(24.0)
    assert allreduce.bubble_fraction == pytest.approx(0.2)
    assert allreduce.step_compute_s == pytest.approx(30.0)
    assert result.compute_only_tokens_per_s == pytest.approx(8000 / 30.0)


def test_global_batch_tokens_fixes_the_microbatches():
    inp = base(num_microbatches=None, global_batch_tokens=16000, dp_degree=2)
    # 16000 tokens / (2 clusters x 2 dp x 1 sequence x 1000 tokens) = 4 microbatches.
    assert inp.resolved_num_microbatches() == 4
    assert plan(inp).num_microbatches == 4


def test_data_parallel_diloco_has_no_bubble():
    diloco = plan(base()).strategies["diloco"]
    assert diloco.can_run and diloco.bubble_fraction == 0.0
    assert diloco.step_compute_s == pytest.approx(24.0)


# --- all-reduce bytes and times -----------------------------------------------------------------------------------


def test_intra_cluster_ring_all_reduce():
    inp = base(dp_degree=4, intra_link_bps=8e9, intra_latency_s=0.001)
    step = plan(inp).strategies["dilocox"]
    # A stage holds 1e9 / 2 = 5e8 params = 1e9 bytes in bf16; ring over 4: 2 * 3/4 * 1e9 = 1.5e9 bytes at 1e9 B/s.
    assert step.step_intra_comm_s == pytest.approx(1.5 + 0.001)


def test_allreduce_slow_link_per_step_cluster_uplink():
    allreduce = plan(base(num_clusters=4)).strategies["allreduce"]
    # The gradient, 1e9 x 2 bytes, ring across 4 clusters: 2 * 3/4 * 2e9 = 3e9 bytes per cluster uplink per step.
    assert allreduce.slow_bytes_per_round == pytest.approx(10 * 3e9)
    per_step = 3e9 / 1.25e8 + 0.01  # 24 s + one latency
    assert allreduce.slow_comm_per_round_s == pytest.approx(10 * per_step)
    assert allreduce.exposed_slow_comm_per_round_s == allreduce.slow_comm_per_round_s  # blocking
    # T = 4 clusters x 4 microbatches x 1000 = 16000 tokens over 8 GPUs: still 24 s ideal, 30 s with the bubble.
    assert allreduce.step_compute_s == pytest.approx(30.0)
    assert allreduce.tokens_per_s == pytest.approx(16000 / (30.0 + per_step))


def test_node_uplinks_are_shared_by_their_gpus_and_add_up():
    # 8 ranks per cluster (dp 4 x pp 2) on nodes of 4 GPUs: 2 node uplinks of 1 Gbps carry the cluster's bytes.
    node = plan(base(num_clusters=4, dp_degree=4, gpus_per_node=4, slow_link_scope="node")).strategies["allreduce"]
    assert node.slow_comm_per_round_s / 10 == pytest.approx(3e9 / 2.5e8 + 0.01)
    # One node's worth or less of ranks share a single uplink.
    small = plan(base(gpus_per_node=8, slow_link_scope="node")).strategies["allreduce"]
    assert small.slow_comm_per_round_s / 10 == pytest.approx(2e9 / 1.25e8 + 0.01)


def test_one_cluster_uses_no_slow_link():
    result = plan(base(num_clusters=1))
    for item in result.strategies.values():
        assert item.slow_comm_per_round_s == 0.0 and item.slow_bytes_per_round == 0.0


# --- DiLoCoX: compression and overlap ------------------------------------------------------------------------------


def test_dilocox_compressed_payload_and_exposed_comm():
    # Ratio 8 vs fp32: payload 1e9 * 4 / 8 = 5e8 bytes; ring over 4 clusters: 1.5 x 5e8 = 7.5e8 bytes -> 6 s + 10 ms.
    # Compute: T = 16000 tokens over 8 GPUs, 30 s per step. H = 10 -> a round of 300 s hides the transfer.
    result = plan(base(num_clusters=4))
    dilocox = result.strategies["dilocox"]
    assert dilocox.slow_bytes_per_round == pytest.approx(7.5e8)
    assert dilocox.slow_comm_per_round_s == pytest.approx(6.01)
    assert dilocox.exposed_slow_comm_per_round_s == 0.0
    assert dilocox.round_s == pytest.approx(300.0)
    no_overlap = result.strategies["dilocox_no_overlap"]
    assert no_overlap.exposed_slow_comm_per_round_s == pytest.approx(6.01)
    assert no_overlap.round_s == pytest.approx(306.01)
    assert no_overlap.exposed_comm_per_step_s == pytest.approx(0.601)


def test_one_step_delay_exposes_only_what_exceeds_the_round():
    # 10 Mbps = 1.25e6 B/s: the 7.5e8-byte transfer takes 600 s + 10 ms against a 300 s round.
    result = plan(base(num_clusters=4, slow_link_bps=1e7))
    dilocox = result.strategies["dilocox"]
    assert dilocox.exposed_slow_comm_per_round_s == pytest.approx(600.01 - 300.0)
    assert dilocox.round_s == pytest.approx(600.01)
    assert dilocox.tokens_per_s == pytest.approx(10 * 16000 / 600.01)
    off = plan(base(num_clusters=4, slow_link_bps=1e7, overlap=False)).strategies["dilocox"]
    assert off.round_s == pytest.approx(900.01)


def test_uncompressed_and_all_gather_variants():
    result = plan(base(num_clusters=4, compressed_reduce="all_gather"))
    # All-gather of 5e8-byte payloads: (C-1) x payload = 1.5e9 bytes.
    assert result.strategies["dilocox"].slow_bytes_per_round == pytest.approx(1.5e9)
    # No compression: fp32 pseudo-gradient 4e9 bytes, ring: 1.5 x 4e9 = 6e9 bytes -> 48 s + 10 ms.
    uncompressed = result.strategies["dilocox_no_compression"]
    assert uncompressed.slow_bytes_per_round == pytest.approx(6e9)
    assert uncompressed.slow_comm_per_round_s == pytest.approx(48.01)
    diloco = result.strategies["diloco"]
    assert diloco.slow_bytes_per_round == pytest.approx(6e9)
    assert diloco.exposed_slow_comm_per_round_s == pytest.approx(48.01)  # OpenDiLoCo blocks


def test_codec_compression_ratio_by_hand():
    square = [(64, 64)]
    # fp32 low rank 8: factors 64x8 + 8x64 = 1024 values vs 4096.
    assert codec_compression_ratio(square, rank=8, bits=None) == pytest.approx(4.0)
    # int4, groups of 64 with a 2-byte scale: 4096 values -> 2048 + 64 * 2 = 2176 bytes vs 16384.
    assert codec_compression_ratio(square, bits=4) == pytest.approx(16384 / 2176)
    assert codec_compression_ratio(square, bits=4) == pytest.approx(INT4_COMPRESSION_RATIO)
    # Both: two factors of 512 values, each 256 + 8 * 2 = 272 bytes.
    assert codec_compression_ratio(square, rank=8, bits=4) == pytest.approx(16384 / 544)
    # A rank that does not shrink the matrix, and 1-D tensors, go dense.
    assert codec_compression_ratio([(64, 64), (10,)], rank=32, bits=None) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="codec_rank"):
        codec_compression_ratio(square, rank=0)


# --- memory: DiLoCo cannot run at 107B -----------------------------------------------------------------------------


def test_diloco_cannot_run_107b_on_40gb_gpus():
    result = plan(paper_107b_input())
    diloco = result.strategies["diloco"]
    assert not diloco.can_run and diloco.tokens_per_s is None and diloco.breakdown() is None
    assert "data parallel only" in diloco.reason and "A800-40G" in diloco.reason
    assert diloco.memory_bytes_per_gpu == pytest.approx(16 * 107_132_971_008)
    assert result.to_dict()["diloco_tokens_per_s"] is None
    # The pipeline strategies shard the model over 80 GPUs per cluster and fit.
    assert result.strategies["dilocox"].fits_memory and result.strategies["allreduce"].fits_memory


def test_resolve_flavor_matches_count_parameters():
    assert resolve_flavor("tiny") == (count_parameters(model_args("tiny", vocab_size=2048)), 4)
    assert resolve_flavor("qwen1.5-107b") == (107_132_971_008, 77)


def test_paper_preset_orders_the_strategies_like_the_paper():
    result = plan(paper_107b_input())
    allreduce, dilocox = result.tokens_per_s("allreduce"), result.tokens_per_s("dilocox")
    assert dilocox > result.tokens_per_s("dilocox_no_overlap") > result.tokens_per_s("dilocox_no_compression")
    assert result.tokens_per_s("dilocox_no_compression") > allreduce
    assert dilocox / allreduce > 100


# --- calibration ---------------------------------------------------------------------------------------------------


def test_calibrated_cpu_core_gives_back_the_measured_rate():
    num_params, _ = resolve_flavor("tiny")
    gpu = calibrate_cpu_core(num_params, 5600.0)
    inp = PlanInput(num_params=num_params, seq_len=256, num_microbatches=1, microbatch_size=16, num_clusters=1, gpu=gpu)
    assert inp.effective_mfu == 1.0
    assert plan(inp).tokens_per_s("allreduce") == pytest.approx(5600.0)
    two = plan(replace(inp, num_clusters=2, slow_link_bps=None))
    assert two.tokens_per_s("dilocox") == pytest.approx(11200.0)


# --- the paper regime ----------------------------------------------------------------------------------------------


def test_paper_regime_ratios():
    assert paper_regime_ratio() == pytest.approx(3728 / 10.4 - 1)
    regime = paper_regime()
    assert regime.dilocox_comm_over_round_compute == pytest.approx(0.4 / 0.6)
    assert regime.uncompressed_comm_over_round_compute == pytest.approx(3728 / 1168)
    assert regime.implied_compression_ratio == pytest.approx((3728 / 1168) / (0.4 / 0.6))
    assert PAPER.dilocox_no_overlap_tokens_per_s == pytest.approx(0.6 * 3728)


@pytest.mark.parametrize(("num_clusters", "latency_s"), [(2, 0.0), (2, 0.01), (4, 0.05)])
def test_paper_regime_bandwidth_round_trip(num_clusters, latency_s):
    compute_s, grad_bytes = 0.73, 1_312_896 * 4
    bandwidth = paper_regime_bandwidth(compute_s, grad_bytes, num_clusters=num_clusters, latency_s=latency_s)
    transfer = allreduce_transfer_s(grad_bytes, bandwidth, num_clusters=num_clusters, latency_s=latency_s)
    assert transfer / compute_s == pytest.approx(paper_regime_ratio(), rel=1e-12)
    # Two clusters, no latency: the whole gradient crosses once, in ratio x compute seconds.
    if num_clusters == 2 and latency_s == 0.0:
        assert bandwidth == pytest.approx(grad_bytes / (paper_regime_ratio() * compute_s))
    assert parse_bandwidth(format_bandwidth(bandwidth)) == pytest.approx(bandwidth, rel=1e-15)


def test_paper_regime_bandwidth_rejects_bad_inputs():
    with pytest.raises(ValueError, match="latency"):
        paper_regime_bandwidth(1e-3, 1e6, latency_s=1.0)
    with pytest.raises(ValueError, match="compute_s_per_step"):
        paper_regime_bandwidth(0.0, 1e6)
    with pytest.raises(ValueError, match="num_clusters"):
        paper_regime_bandwidth(1.0, 1e6, num_clusters=1)


# --- inputs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"num_clusters": 0}, "--num-clusters"),
        ({"mfu": 1.5}, "--mfu"),
        ({"num_microbatches": None}, "--global-batch-tokens"),
        ({"num_microbatches": None, "global_batch_tokens": 1500}, "--global-batch-tokens"),
        ({"compression_ratio": 0.5}, "--compression-ratio"),
        ({"slow_link_bps": -1.0}, "--bandwidth"),
        ({"pp_degree": 8, "num_layers": 4}, "--pp-degree"),
    ],
)
def test_bad_plan_input_names_the_option(overrides, named):
    with pytest.raises(ValueError, match=named):
        plan(base(**overrides))


def test_gpu_presets():
    assert gpu_preset("a800-40g").peak_flops == 312e12 and gpu_preset("H100-80G").peak_flops == 989e12
    with pytest.raises(ValueError, match="--gpu"):
        gpu_preset("V100")
