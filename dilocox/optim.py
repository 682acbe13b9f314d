"""MuLoCo's inner optimizer: Muon on the hidden matrices of the transformer blocks, AdamW on everything else.

MuLoCo (Thérien et al. 2025, arXiv 2505.23725) runs DiLoCo with Muon (Jordan et al. 2024) as the inner optimizer:
Muon's orthogonalized steps give pseudo-gradients that point the same way across clusters more often than
AdamW's. Muon only knows 2-D matrices, and the embedding and the output head are not hidden layers, so as in
the paper and in `torch.optim.Muon`'s own example they, the norms and the biases stay with AdamW.

    muon, adamw = split_muon_parameters(model)
    optimizer = MuonAdamW([p for _, p in muon], [p for _, p in adamw], lr=2e-3, muon_lr=4e-3)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

This module never imports torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dilocox.topology import fsdp_rows, local_shard

if TYPE_CHECKING:
    from dilocox.config import Config

MUON_LR_CONVENTION = "match_rms_adamw"
"""`torch.optim.Muon`'s `adjust_lr_fn`: each matrix's step is scaled by 0.2 x sqrt(max(rows, cols)), so that its RMS
is that of a typical AdamW step at the same learning rate (Liu et al. 2025, arXiv 2502.16982). AdamW's learning
rate and weight decay are then a good start for Muon's, and the decoupled weight decay (lr x weight_decay per
step) means the same on both."""


def split_muon_parameters(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) named parameters of a `Decoder` or one of its pipeline stages: Muon gets the 2-D weight
    matrices inside the transformer blocks (`model.layers`), AdamW every other parameter of the stage (the token
    embedding and the output head, tied or not, the norms and the biases). Both in `named_parameters` order, so
    two builds of the same stage split alike."""
    blocks = {id(p) for p in model.layers.parameters()}
    muon, adamw = [], []
    for name, param in model.named_parameters():
        (muon if id(param) in blocks and param.ndim == 2 else adamw).append((name, param))
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `muon_params` and `torch.optim.AdamW` over `adamw_params`, stepped as one optimizer.

        optimizer = MuonAdamW(matrices, others, lr=2e-3, muon_lr=4e-3)   # train.optimizer = muon
        optimizer.muon.param_groups[0]["lr"] = ...                        # Muon's group comes first in param_groups
        state = optimizer.state_dict(); optimizer.load_state_dict(state)  # one state dict for both

    A `torch.optim.Optimizer` in its own right, so that whatever drives an inner optimizer (`OuterSync`'s step
    hook, gradient clipping before `step`, `state.clear()` when the guard heals a cluster, checkpoints) sees one:
    its `param_groups` are Muon's group followed by AdamW's two (2-D and larger decayed, the rest not: the trainer's
    rule for AdamW), the very dicts the two optimizers step with, and its `state` is the one both write to.
    `weight_decay` is decoupled on both: each step multiplies a decayed parameter by 1 - lr x weight_decay, with
    its own optimizer's lr. `fused` is AdamW's (one kernel on CUDA); Muon steps one matrix at a time."""

    def __init__(
        self,
        muon_params: Iterable[torch.Tensor],
        adamw_params: Iterable[torch.Tensor],
        *,
        lr: float,
        muon_lr: float,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        muon_momentum: float = 0.95,
        fused: bool | None = None,
    ) -> None:
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if not muon_params:
            raise ValueError("MuonAdamW got no matrices for Muon; optimize these parameters with AdamW alone")
        sharded = any(hasattr(p, "to_local") for p in muon_params)  # FSDP2's DTensors: topology.dp_mode = shard
        self.muon = (ShardedMuon if sharded else torch.optim.Muon)(
            [{"params": muon_params}],
            lr=muon_lr,
            weight_decay=weight_decay,
            momentum=muon_momentum,
            adjust_lr_fn=MUON_LR_CONVENTION,
        )
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for p in adamw_params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in adamw_params if p.ndim < 2], "weight_decay": 0.0},  # norms and biases
            ],
            lr=lr,
            betas=betas,
            fused=fused,
        )
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._share_groups_and_state()

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer pickles and deep-copies only defaults, state and param_groups: keep the two
        # optimizers too, which hold the same group dicts and state (one copy shares them again)
        return {**super().__getstate__(), "muon": self.muon, "adamw": self.adamw}

    def _share_groups_and_state(self) -> None:
        """Point the two optimizers at this one's group dicts and state (after a load replaced them)."""
        num_muon = len(self.muon.param_groups)
        self.muon.param_groups = self.param_groups[:num_muon]
        self.adamw.param_groups = self.param_groups[num_muon:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        """One Muon step of the matrices and one AdamW step of the rest, on the gradients already there."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict()` of a MuonAdamW over parameters of the same shapes, in the same order."""
        super().load_state_dict(state_dict)
        self._share_groups_and_state()


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` over matrices sharded by rows (FSDP2's `DTensor`s, `topology.dp_mode = shard`): the same
    step as on the whole matrix. Momentum is elementwise and stays sharded; each step gathers a matrix's update once
    (`full_tensor`, one all-gather over the dp ranks), orthogonalizes the whole matrix with torch's Newton-Schulz, as
    every replica of a replicated stage does, and applies this rank's rows of the result. (Left to DTensor, the
    iteration's matmuls would all-reduce partial products about 11 times per matrix and round in another order.)"""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        if closure is not None:  # MuonAdamW.step evaluates it once, for both optimizers
            raise ValueError("ShardedMuon steps on the gradients already there; pass the closure to MuonAdamW.step")
        for group in self.param_groups:
            lr = group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - group["momentum"])
                update = param.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                whole = _zeropower_via_newtonschulz(
                    update.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                mine = param.to_local()
                start, _ = fsdp_rows(param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank())
                mine.mul_(1 - lr * group["weight_decay"])
                mine.add_(
                    whole[start : start + mine.shape[0]], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                )
        return None


def build_inner_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """`train.optimizer` over the stage's parameters: AdamW (norms and biases not decayed), plain SGD, or Muon on
    the blocks' matrices with AdamW on the rest (`MuonAdamW`, split per stage by `split_muon_parameters`)."""
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=t.lr)
    on_gpu = next(model.parameters()).device.type == "cuda"
    if t.optimizer == "muon":
        muon, adamw = split_muon_parameters(model)
        return MuonAdamW(
            [p for _, p in muon],
            [p for _, p in adamw],
            lr=t.lr,
            muon_lr=t.muon_lr,
            weight_decay=t.weight_decay,
            betas=(t.beta1, t.beta2),
            muon_momentum=t.muon_momentum,
            fused=True if on_gpu else None,
        )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms and biases are not decayed
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        fused=True if on_gpu else None,  # one kernel for all parameters on CUDA; the default (foreach) elsewhere
    )


def inner_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of `optimizer`'s per-parameter state at its full size (before the first step allocates it): two
    moments per AdamW parameter, one momentum buffer per Muon matrix or momentum SGD parameter, none for plain SGD;
    of a sharded parameter, its shard's."""
    optimizers = [optimizer.muon, optimizer.adamw] if isinstance(optimizer, MuonAdamW) else [optimizer]
    total = 0
    for inner in optimizers:
        for group in inner.param_groups:
            if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                copies = 2
            elif isinstance(inner, torch.optim.Muon) or group.get("momentum", 0):
                copies = 1
            else:
                copies = 0
            total += copies * sum(local_shard(p).numel() * p.element_size() for p in group["params"])
    return total
