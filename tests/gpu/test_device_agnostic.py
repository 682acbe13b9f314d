"""The compression and reduction code on a CUDA device gives what it gives on the CPU (run where a GPU is lent).

The codecs and reducers allocate on the device of their input; these tests hold them to it. Elementwise codecs
are deterministic elementwise arithmetic, so their payloads must be the same bytes on both devices; the low-rank
ones run QR and matmuls whose rounding differs between CPU and GPU libraries, so they must agree closely and send
exactly as many bytes.
"""

import pytest
import torch

from dilocox.compress import CompressionConfig, build_codec
from dilocox.net.channel import WanChannel
from dilocox.sync import build_reducer

pytestmark = pytest.mark.gpu
SHAPES = [torch.Size(s) for s in [(64, 48), (48,), (3, 5, 7), (31, 17), (1, 100)]]


def tensors(device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(device) for shape in SHAPES]


@pytest.mark.parametrize("kind", ["none", "fp16", "bf16", "int4"])
def test_elementwise_codecs_send_the_same_bytes_on_gpu(kind):
    cpu, gpu = build_codec(kind), build_codec(kind)
    on_cpu, on_gpu = cpu.encode_list(tensors("cpu")), gpu.encode_list(tensors("cuda"))
    assert on_gpu.data.is_cuda
    assert torch.equal(on_gpu.data.cpu(), on_cpu.data)
    for a, b in zip(gpu.decode_list(on_gpu, SHAPES), cpu.decode_list(on_cpu, SHAPES), strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)


def test_topk_sends_the_same_bytes_on_gpu():
    """Top-k picks the same values on both devices (random inputs have no ties), and its Elias-Fano positions and
    int4 values are exact integer and elementwise arithmetic."""
    cpu, gpu = (
        build_codec("topk_int4", density=0.1, chunk_size=64),
        build_codec("topk_int4", density=0.1, chunk_size=64),
    )
    on_cpu, on_gpu = cpu.encode_list(tensors("cpu")), gpu.encode_list(tensors("cuda"))
    assert on_gpu.data.is_cuda and torch.equal(on_gpu.data.cpu(), on_cpu.data)
    for a, b in zip(gpu.decode_list(on_gpu, SHAPES), cpu.decode_list(on_cpu, SHAPES), strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)


@pytest.mark.parametrize("kind", ["lowrank", "lowrank_int4", "adaptive"])
def test_lowrank_codecs_agree_on_gpu(kind):
    cpu, gpu = build_codec(kind, rank=4), build_codec(kind, rank=4)
    on_cpu, on_gpu = cpu.encode_list(tensors("cpu")), gpu.encode_list(tensors("cuda"))
    assert on_gpu.nbytes == on_cpu.nbytes
    for a, b in zip(gpu.decode_list(on_gpu, SHAPES), cpu.decode_list(on_cpu, SHAPES), strict=True):
        assert a.is_cuda
        torch.testing.assert_close(a.cpu(), b, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    ("kind", "reduction"), [("none", "gather"), ("int4", "gather"), ("int4", "scalable"), ("lowrank", "scalable")]
)
def test_reducers_keep_the_pseudo_gradient_on_its_device(kind, reduction):
    """One cluster (no process group): the mean is the cluster's own decoded pseudo-gradient, on its device."""
    numel = sum(s.numel() for s in SHAPES)
    results = {}
    for device in ("cpu", "cuda"):
        with WanChannel(None, bandwidth=None, latency_s=0.0) as channel:
            cfg = CompressionConfig(kind=kind, rank=4, reduction=reduction)
            reducer = build_reducer(cfg, SHAPES, channel=channel, dp_group=None)
            pseudo_grad = torch.cat([t.reshape(-1) for t in tensors(device)])
            results[device] = [reducer.launch(pseudo_grad).wait().clone() for _ in range(2)]  # round 2: feedback
    for on_gpu, on_cpu in zip(results["cuda"], results["cpu"], strict=True):
        assert on_gpu.is_cuda and on_gpu.numel() == numel
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-4, atol=1e-4)
