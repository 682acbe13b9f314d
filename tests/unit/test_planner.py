"""The planner's arithmetic against hand-computed cases and the paper regime (`dilocox plan` is test_plan_cli.py)."""

from dataclasses import replace

import pytest

from dilocox.models import count_parameters, model_args
from dilocox.net.link import parse_bandwidth
from dilocox.tools.bench.planner import (
    GIB,
    GPU_PRESETS,
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
    # The planner's default DiLoCoX payload is that int4 format: 16384 / 2176 = 7.5294 (any tensor whose size is a
    # multiple of 64 values gives the same, 32 bits / 4.25 bits).
    assert INT4_COMPRESSION_RATIO == pytest.approx(7.5294, abs=1e-4)
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
    # OpenDiLoCo's state per parameter: bf16 weights 2 + bf16 grads 2 + fp32 master 4 + AdamW moments 8 = 16 bytes.
    assert diloco.memory_bytes_per_gpu == pytest.approx(16 * 107_132_971_008)
    assert result.to_dict()["diloco_tokens_per_s"] is None
    # The pipeline strategies shard the model over 80 GPUs per cluster and fit.
    assert result.strategies["dilocox"].fits_memory and result.strategies["allreduce"].fits_memory


def test_resolve_flavor_matches_count_parameters():
    assert resolve_flavor("tiny") == (count_parameters(model_args("tiny", vocab_size=2048)), 4)
    # Qwen1.5-107B by hand: dim 8192, 64 heads of 128 (8 kv heads: 1024), ffn 49152, vocab 152064, 77 layers.
    attention = 8192 * 8192 + 8192 + 2 * (8192 * 1024 + 1024) + 8192 * 8192  # q (+bias), k and v (+bias), o
    mlp = 3 * 8192 * 49152  # gate, up, down
    layer = attention + mlp + 2 * 8192  # two RMSNorms
    total = 77 * layer + 2 * 152064 * 8192 + 8192  # embedding and untied head, final norm
    assert total == 107_132_971_008
    assert resolve_flavor("qwen1.5-107b") == (total, 77)


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


def test_paper_regime_ratios_by_hand():
    regime = paper_regime()
    # AllReduce 10.4 tokens/s, DiLoCoX 3,728 with its sync hidden: the same compute t per step, so AllReduce's step is
    # t + transfer = 3728 / 10.4 t = 358.4615 t, and its transfer is 357.4615 t.
    assert paper_regime_ratio() == pytest.approx(357.4615, abs=1e-4)
    assert regime.allreduce_comm_over_compute == pytest.approx(357.4615, abs=1e-4)
    # Without the overlap DiLoCoX loses 40%: a round of compute c plus the sync s runs at 0.6 of c alone, so
    # c + s = c / 0.6 = 1.6667 c and s = 0.6667 c.
    assert regime.dilocox_comm_over_round_compute == pytest.approx(0.6667, abs=1e-4)
    # Uncompressed, the overlapped sync is longer than the round and sets the pace: 3728 / 1168 = 3.1918 rounds.
    assert regime.uncompressed_comm_over_round_compute == pytest.approx(3.1918, abs=1e-4)
    # So the compressed payload is 3.1918 / 0.6667 = 4.7877 times smaller, and H = 357.4615 / 3.1918 = 111.99 steps
    # if a gradient element and a pseudo-gradient element take the same bytes.
    assert regime.implied_compression_ratio == pytest.approx(4.7877, abs=1e-4)
    assert regime.implied_inner_steps == pytest.approx(111.99, abs=0.01)
    # The paper gives the no-overlap drop, not the figure: 3,728 x (1 - 0.40) = 2,236.8 tokens/s.
    assert PAPER.dilocox_no_overlap_tokens_per_s == pytest.approx(2236.8)


def test_the_round_model_reproduces_the_papers_throughputs_at_the_implied_ratios():
    # A toy setting built from what the paper implies; the planner's round model must give back the paper's measured
    # throughput ratios AllReduce 10.4 : DiLoCoX 3,728 : no overlap 2,236.8 : no compression 1,168.
    # 1e6 params, 2 clusters of one GPU (1 TFLOP/s at MFU 0.5), 1000 tokens each per step: T = 2000 tokens, and
    # compute 6 x 1e6 x 2000 / (2 x 1e12 x 0.5) = 0.012 s per step; H = 112 (the implied 111.99) -> a round of
    # 112 x 0.012 = 1.344 s. Gradients and pseudo-gradients in fp32: 4e6 bytes, a ring of 2 sends them once.
    regime = paper_regime()
    inner_steps = round(regime.implied_inner_steps)
    assert inner_steps == 112
    # The link: the uncompressed pseudo-gradient takes 3728 / 1168 rounds of compute.
    link_bytes_per_s = 4e6 / (3728 / 1168 * 1.344)
    inp = base(
        num_params=1_000_000,
        num_microbatches=1,
        pp_degree=1,
        slow_link_bps=8 * link_bytes_per_s,
        slow_latency_s=0.0,
        inner_steps=inner_steps,
        compression_ratio=regime.implied_compression_ratio,
        grad_bytes_per_element=4.0,
    )
    result = plan(inp)
    assert result.strategies["dilocox"].step_compute_s == pytest.approx(0.012)
    dilocox = result.tokens_per_s("dilocox")
    assert dilocox == pytest.approx(2000 / 0.012)  # the compressed sync (0.896 s) hides behind the 1.344 s round
    assert result.tokens_per_s("dilocox_no_overlap") / dilocox == pytest.approx(2236.8 / 3728)
    assert result.tokens_per_s("dilocox_no_compression") / dilocox == pytest.approx(1168 / 3728)
    # H = 112 instead of 111.99: AllReduce's transfer is 357.48 instead of 357.46 steps of compute.
    assert result.tokens_per_s("allreduce") / dilocox == pytest.approx(10.4 / 3728, rel=1e-3)


def test_allreduce_transfer_by_hand():
    # 1e6 gradient bytes in a ring of 4 clusters: each uplink sends 2 x 3/4 x 1e6 = 1.5e6 bytes, 1.5 s at 1e6 B/s.
    assert allreduce_transfer_s(1e6, 1e6, num_clusters=4, latency_s=0.01) == pytest.approx(1.51)
    assert allreduce_transfer_s(1e6, 1e6, num_clusters=2) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("num_clusters", "latency_s", "bandwidth"),
    [
        # The tiny flavor's fp32 gradient, 1,312,896 x 4 = 5,251,584 bytes, 0.73 s of compute per step: the transfer
        # must take 357.4615 x 0.73 = 260.9469 s, less the latency; a ring of C clusters sends 2 (C-1)/C x the bytes.
        (2, 0.0, 5_251_584 / 260.946923),  # 20,125.10 B/s
        (2, 0.01, 5_251_584 / 260.936923),  # 20,125.88 B/s
        (4, 0.05, 1.5 * 5_251_584 / 260.896923),  # 30,193.44 B/s
    ],
)
def test_paper_regime_bandwidth_by_hand(num_clusters, latency_s, bandwidth):
    compute_s, grad_bytes = 0.73, 1_312_896 * 4
    found = paper_regime_bandwidth(compute_s, grad_bytes, num_clusters=num_clusters, latency_s=latency_s)
    assert found == pytest.approx(bandwidth, rel=1e-6)
    # At that rate one AllReduce step's ring transfer (latency + 2 (C-1)/C x bytes / rate) is 357.46 steps of compute.
    transfer_s = latency_s + 2 * (num_clusters - 1) / num_clusters * grad_bytes / found
    assert transfer_s / compute_s == pytest.approx(357.4615, abs=1e-4)
    # The `network.bandwidth` string reads back as the same rate.
    assert parse_bandwidth(format_bandwidth(found)) == pytest.approx(found, rel=1e-15)


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


def test_gpu_presets_are_found_whatever_the_case():
    assert gpu_preset("a800-40g") is GPU_PRESETS["A800-40G"]
    assert gpu_preset(" h100-80G ") is GPU_PRESETS["H100-80G"]
    with pytest.raises(ValueError, match="--gpu") as info:
        gpu_preset("V100")
    assert all(name in str(info.value) for name in GPU_PRESETS)  # the error lists what exists
