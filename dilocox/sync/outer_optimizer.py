"""The outer optimizer: how phi steps on the clusters' averaged pseudo-gradient (docs/design.md §3).

Any `torch.optim.Optimizer` over phi, as torchft's DiLoCo takes one: the averaged pseudo-gradient is phi's
gradient and `optimizer.step()` moves phi. phi is a flat fp32 vector that the outer loop creates (on
`sync.outer.state_device`), so the optimizer is passed as a factory, `Callable[[list[Tensor]], Optimizer]`, called
once with `[phi]`; `sync.outer.optimizer` names the built-in ones (`outer_optimizer_factory`). Nothing else in the
outer loop knows which optimizer it is: what a merge rule predicts, what the state costs and what a checkpoint must
match are read from the optimizer itself.

    outer = OuterOptimizer(phi, lambda params: torch.optim.AdamW(params, lr=0.02), lr_at=lambda base, k: base)
    outer.step(avg_pseudo_grad, update=k)        # the learning rate of outer update k, then one step of phi
    start = outer.predict(estimate, update=k)    # phi after that step: on a scratch copy, phi and state unchanged
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the list it is given: `[phi]`, one flat fp32 tensor (numel,)."""

_IMPLEMENTATION_KEYS = frozenset({"params", "lr", "foreach", "fused", "differentiable", "capturable"})
"""Param-group entries a resumed state need not match: the parameters, the learning rate (the schedule sets it
every update) and how torch runs the step, which does not change its result's meaning."""


def outer_optimizer_factory(cfg: Any) -> OuterOptimizerFactory:
    """The outer optimizer of `sync.outer.optimizer` (a `SyncConfig`): `torch.optim.SGD` with `outer.lr`,
    `outer.momentum` and Nesterov (dropped at momentum 0, which torch refuses), or `torch.optim.AdamW` with
    `outer.lr`, `(outer.beta1, outer.beta2)` and `outer.weight_decay`."""
    if cfg.outer.optimizer == "sgd":
        return functools.partial(
            torch.optim.SGD,
            lr=cfg.outer.lr,
            momentum=cfg.outer.momentum,
            nesterov=cfg.outer.nesterov and cfg.outer.momentum > 0,
        )
    if cfg.outer.optimizer == "adamw":
        return functools.partial(
            torch.optim.AdamW,
            lr=cfg.outer.lr,
            betas=(cfg.outer.beta1, cfg.outer.beta2),
            weight_decay=cfg.outer.weight_decay,
        )
    raise ValueError(f"sync.outer.optimizer = {cfg.outer.optimizer!r} is not one of: sgd, adamw")


def outer_lr_schedule(cfg: Any, num_updates: int | None) -> Callable[[float, int], float]:
    """`lr_at(base_lr, update)` of `sync.outer.lr_schedule` (a `SyncConfig`) over a run of `num_updates` outer
    updates (None: unknown, so only a constant schedule or the warm-up apply): `OuterConfig.lr_at` with
    `outer.lr` replaced by the param group's own learning rate, so a factory's optimizer follows the same shape."""

    def lr_at(base_lr: float, update: int) -> float:
        return dataclasses.replace(cfg.outer, lr=base_lr).lr_at(update, num_updates or update + 1)

    return lr_at


class OuterOptimizer:
    """The outer optimizer of one rank's phi, with the outer learning-rate schedule.

    `lr_at(base_lr, update)` gives the learning rate of 0-based outer update `update` for a param group whose
    learning rate was `base_lr` when the factory built it (`sync.outer.lr_schedule`: warm-up, then constant or
    cosine); `set_lr` writes it into `param_groups[...]["lr"]`, which every torch optimizer reads at `step()`.

        outer = OuterOptimizer(phi, torch.optim.Adam, lr_at=lambda base, k: base)
        outer.set_lr(k); outer.step(avg)                # phi.grad = avg; optimizer.step()
        predicted = outer.predict(avg, update=k)        # the same step on copies of phi and the state
    """

    def __init__(
        self, outer_params: torch.Tensor, factory: OuterOptimizerFactory, *, lr_at: Callable[[float, int], float]
    ) -> None:
        if not callable(factory) or isinstance(factory, torch.optim.Optimizer):
            raise ValueError(
                f"outer_optimizer must build a torch.optim.Optimizer from the list it is given (phi, the flat outer "
                f"params, which the outer loop creates), e.g. lambda params: torch.optim.Adam(params, lr=0.01); got "
                f"{type(factory).__name__}"
            )
        optimizer = factory([outer_params])
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"outer_optimizer built a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if len(held) != 1 or held[0] is not outer_params:
            raise ValueError(
                f"outer_optimizer built an optimizer over {len(held)} other tensors: it must optimize exactly the "
                "list it is given (pass it through: lambda params: torch.optim.Adam(params, ...))"
            )
        self.optimizer = optimizer
        self.outer_params = outer_params
        self.lr_at = lr_at
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        """Each param group's learning rate as built: what the schedule scales."""

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__

    @property
    def lr(self) -> float:
        """The learning rate of the update set last (of the first param group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def takes_plain_steps(self) -> bool:
        """Whether, with no state, a step on g moves phi by exactly -lr g (SGD): what the drain of the residual
        assumes when it adds it at the outer learning rate (`sync.drain_residual`)."""
        return isinstance(self.optimizer, torch.optim.SGD)

    def set_lr(self, update: int) -> None:
        """Set the learning rate of the 0-based outer update `update` in every param group."""
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = self.lr_at(base, update)

    def step(self, avg_pseudo_grad: torch.Tensor) -> None:
        """One outer step: the averaged pseudo-gradient is the gradient of phi."""
        self.outer_params.grad = avg_pseudo_grad
        self.optimizer.step()
        self.outer_params.grad = None

    def predict(self, estimate: torch.Tensor, *, update: int) -> torch.Tensor:
        """phi after outer update `update` if its averaged pseudo-gradient were `estimate` (a new tensor): the
        optimizer's own step, bit for bit, taken by a deep copy of it on a copy of phi, so phi and the optimizer's
        state (momentum, moments, step count) stay the agreed ones."""
        scratch = self.outer_params.detach().clone()
        shadow = copy.deepcopy(self.optimizer, memo={id(self.outer_params): scratch})
        for group, base in zip(shadow.param_groups, self.base_lrs, strict=True):
            group["lr"] = self.lr_at(base, update)
        scratch.grad = estimate
        shadow.step()
        scratch.grad = None
        return scratch

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors at their full size: those it holds, or before its first step
        those one step allocates, measured by a copy stepped on a meta tensor (which allocates nothing)."""
        state = self.optimizer.state.get(self.outer_params)
        if not state:
            state = _state_after_one_step(self.optimizer, self.outer_params)
        return sum(value.numel() * value.element_size() for value in state.values() if torch.is_tensor(value))

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a saved optimizer state, refusing one of another optimizer or other settings (one line)."""
        self.check_matches(state)
        self.optimizer.load_state_dict(state)

    def check_matches(self, state: dict[str, Any]) -> None:
        """Refuse a saved state whose param groups hold other settings than this optimizer's (momentum, betas,
        weight decay, ...; another optimizer has other keys): loading it would silently replace them."""
        saved_groups = state.get("param_groups", [])
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"this outer-optimizer state has {len(saved_groups)} param groups, the {self.name} of this run "
                f"{len(self.optimizer.param_groups)}: resume with the outer optimizer it was saved with"
            )
        for saved, mine in zip(saved_groups, self.optimizer.param_groups, strict=True):
            keys = (set(saved) | set(mine)) - _IMPLEMENTATION_KEYS
            changed = [
                f"{key} = {saved.get(key)!r} (now {mine.get(key)!r})"
                for key in sorted(keys)
                if _setting(saved.get(key)) != _setting(mine.get(key))
            ]
            if changed:
                raise ValueError(
                    f"this outer-optimizer state was saved with {', '.join(changed)}: resume with the outer optimizer "
                    "and settings it was saved with"
                )


def outer_state_bytes(factory: OuterOptimizerFactory, numel: int) -> int:
    """Bytes of the state of the optimizer `factory` builds over a flat fp32 phi of `numel` values (at full size,
    measured on a meta tensor: nothing is allocated)."""
    phi = torch.empty(numel, device="meta")
    state = _state_after_one_step(factory([phi]), phi)
    return sum(value.numel() * value.element_size() for value in state.values() if torch.is_tensor(value))


def _state_after_one_step(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """The state a copy of `optimizer` holds for `param` after one step, taken on a meta tensor; an optimizer that
    cannot step on one reports the state it holds now."""
    meta = torch.empty_like(param, device="meta")
    probe = copy.deepcopy(optimizer, memo={id(param): meta})
    probe.state.clear()
    meta.grad = torch.empty_like(meta)
    try:
        probe.step()
    except (RuntimeError, NotImplementedError):
        return dict(optimizer.state.get(param, {}))
    return dict(probe.state.get(meta, {}))


def _setting(value: Any) -> Any:
    """A param-group setting as compared: tuples and lists alike (a saved state may hold either)."""
    return list(value) if isinstance(value, tuple) else value
