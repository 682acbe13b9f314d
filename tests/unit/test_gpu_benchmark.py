"""The arithmetic of benchmarks/gpu.py that its CPU smoke run cannot reach: which bf16 peak a GPU's name gets, and
the steady-state tokens/s of a run's logged windows (the script is loaded from its file; it imports no torch)."""

import importlib.util
import sys

import pytest

from tests.e2e.helpers import REPO

_spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO / "benchmarks" / "gpu.py")
gpu = sys.modules["gpu_benchmark"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(gpu)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L40", 181.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
    ],
)
def test_the_bf16_peak_of_known_gpus(name, tflops):
    assert gpu.peak_bf16_tflops(name)[0] == tflops


def test_an_unknown_gpu_gets_no_peak_and_the_reason():
    peak, reason = gpu.peak_bf16_tflops("Tesla V100-SXM2-16GB")
    assert peak is None and "Tesla V100-SXM2-16GB" in reason and "--peak-tflops" in reason
    assert gpu.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_steady_tokens_per_s_leaves_out_start_up_and_the_final_flush():
    # windows of 10 steps x 100 tokens: 1,000 tokens each, at the tokens/s each record gives for its own window
    records = [
        {"step": 10 * i, "tokens": 1000 * i, "tokens_per_s": rate} for i, rate in enumerate([1, 50, 500, 250, 20])
    ]
    records = records[1:]  # metrics.jsonl starts at the first logged step
    windows = gpu.metrics_windows(records, drop_last=True)
    assert [r["step"] for r in windows] == [20, 30]  # not the first (start-up) nor the last (flush)
    # 2,000 tokens in 1000/500 + 1000/250 = 6 s
    assert gpu.steady_tokens_per_s(records, windows) == pytest.approx(2000 / 6)
    every = gpu.metrics_windows(records, drop_last=False)
    assert gpu.steady_tokens_per_s(records, every) == pytest.approx(3000 / (2 + 4 + 50))
    assert gpu.hidden_share_of_rounds([{"round_link_s": 4.0, "round_exposed_s": 1.0}, {}]) == 0.75
    assert gpu.hidden_share_of_rounds(windows) is None  # no round records: AllReduce


def test_the_run_sizes():
    quick = gpu.SIZES["quick"]
    assert quick["medium"].steps("dilocox", "on") == (50, 10)  # 5 rounds of H = 10, logged once a round
    assert quick["qwen1.5-0.5b"].steps("allreduce", "on") == (2, 1)
    # the qwen AllReduce over 1 Gbps: about 2 x 4 x 464M bytes / 2 / 125 MB/s = 15 s of link a step
    assert quick["qwen1.5-0.5b"].estimate_s("qwen1.5-0.5b", "allreduce", "on", 464_000_000) > 60 + 2 * 14.8
