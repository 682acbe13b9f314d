"""`MuonAdamW` on a CUDA device (run where a GPU is lent): the trainer's build (fused AdamW on CUDA) steps as on the
CPU, and its state dict, saved and loaded as a checkpoint is (to the CPU and back), resumes bit for bit."""

import dataclasses
import io

import pytest
import torch

from dilocox.config import load_config
from dilocox.models import Decoder, model_args
from dilocox.trainer import build_inner_optimizer, set_inner_lr

pytestmark = pytest.mark.gpu
CFG = load_config(None, ["--train.optimizer=muon", "--train.steps=8", "--train.warmup_steps=2"])


def model_on(device: str) -> Decoder:
    return Decoder(dataclasses.replace(model_args("debug", vocab_size=300), max_seq_len=32)).to(device)


def train(model: Decoder, optimizer: torch.optim.Optimizer, steps: range) -> None:
    device = next(model.parameters()).device
    for step in steps:
        tokens = torch.randint(0, 300, (4, 17), generator=torch.Generator().manual_seed(step)).to(device)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 300), tokens[:, 1:].reshape(-1)).backward()
        set_inner_lr(optimizer, CFG, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_muon_adamw_on_gpu_steps_as_on_cpu_and_resumes_exactly():
    on_cpu, on_gpu = model_on("cpu"), model_on("cuda")
    cpu_optimizer, gpu_optimizer = build_inner_optimizer(CFG, on_cpu), build_inner_optimizer(CFG, on_gpu)
    assert all(group["fused"] for group in gpu_optimizer.adamw.param_groups)
    initial = torch.cat([p.detach().reshape(-1) for p in on_cpu.parameters()])
    train(on_cpu, cpu_optimizer, range(4))
    train(on_gpu, gpu_optimizer, range(4))
    assert all(p.is_cuda for p in on_gpu.parameters())
    after_cpu, after_gpu = (torch.cat([p.detach().cpu().reshape(-1) for p in m.parameters()]) for m in (on_cpu, on_gpu))
    # cuBLAS and the CPU round differently (Newton-Schulz runs in bf16 on both): far closer than the steps moved them
    assert (after_gpu - after_cpu).norm() < 1e-2 * (after_cpu - initial).norm()

    saved = io.BytesIO()
    torch.save({"model": on_gpu.state_dict(), "optimizer": gpu_optimizer.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, map_location="cpu", weights_only=True)  # as a checkpoint is read
    train(on_gpu, gpu_optimizer, range(4, 8))
    resumed = model_on("cuda")
    resumed.load_state_dict(state["model"])
    optimizer = build_inner_optimizer(CFG, resumed)
    optimizer.load_state_dict(state["optimizer"])
    assert all(s["step"].is_cuda for s in optimizer.adamw.state.values())  # fused AdamW keeps its steps on the GPU
    train(resumed, optimizer, range(4, 8))
    for (name, a), b in zip(resumed.named_parameters(), on_gpu.parameters(), strict=True):
        assert torch.equal(a, b), name
