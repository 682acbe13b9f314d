"""The outer optimizer seam (`dilocox.sync.outer_optimizer`): any torch optimizer over phi, read from itself.

The prediction a merge rule starts from is the optimizer's own step, bit for bit, on copies; the state's size is
that of the tensors it holds; a saved state of another optimizer or other settings is refused in one line."""

import copy
import math

import pytest
import torch

from dilocox.sync import SyncConfig
from dilocox.sync.config import OuterConfig
from dilocox.sync.outer_optimizer import (
    OuterOptimizer,
    outer_lr_schedule,
    outer_optimizer_factory,
    outer_state_bytes,
)

NUMEL = 1000
FACTORIES = {
    "nesterov": lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True),
    "heavy-ball": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.6),
    "averaging": lambda params: torch.optim.SGD(params, lr=1.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, betas=(0.9, 0.95), weight_decay=0.01),
    "adam": torch.optim.Adam,
}


def _outer(factory, numel: int = NUMEL) -> tuple[torch.Tensor, OuterOptimizer]:
    phi = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return phi, OuterOptimizer(phi, factory, lr_at=lambda base, update: base)


def _grad(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-2


@pytest.mark.parametrize("name", list(FACTORIES))
def test_the_prediction_is_the_optimizers_own_next_step_and_changes_nothing(name):
    phi, outer = _outer(FACTORIES[name])
    outer.step(_grad(1))  # a state to predict from (momentum, moments, step count)
    phi_before, state_before = phi.clone(), copy.deepcopy(outer.optimizer.state_dict())
    predicted = outer.predict(_grad(2), update=1)
    assert torch.equal(phi, phi_before)  # phi and the optimizer's state are the agreed ones still
    after = outer.optimizer.state_dict()
    for key, value in state_before["state"].get(0, {}).items():
        assert torch.equal(torch.as_tensor(after["state"][0][key]), torch.as_tensor(value)), key
    outer.step(_grad(2))
    assert torch.equal(predicted, phi)  # the step the real optimizer then takes, bit for bit
    assert not torch.equal(predicted, phi_before)


def test_with_plain_averaging_the_prediction_is_phi_minus_the_estimate_exactly():
    phi, outer = _outer(FACTORIES["averaging"])
    estimate = _grad(3)
    assert torch.equal(outer.predict(estimate, update=0), phi - estimate)


def test_the_prediction_uses_the_scheduled_learning_rate_of_its_update():
    phi = torch.zeros(4)
    outer = OuterOptimizer(phi, FACTORIES["averaging"], lr_at=lambda base, update: base / (update + 1))
    assert torch.equal(outer.predict(torch.ones(4), update=3), torch.full((4,), -0.25))
    assert outer.lr == 1.0  # the optimizer's own learning rate was not touched


def test_the_schedule_scales_every_optimizers_own_learning_rate():
    cfg = SyncConfig(outer=OuterConfig(lr=0.7, lr_schedule="cosine", warmup_rounds=2, min_lr_ratio=0.1))
    lr_at = outer_lr_schedule(cfg, 10)
    # the config's own optimizer gets exactly OuterConfig.lr_at
    assert [lr_at(0.7, k) for k in range(10)] == [cfg.outer.lr_at(k, 10) for k in range(10)]
    # an Adam of lr 0.01 from a factory follows the same shape around its own lr
    phi = torch.zeros(3)
    outer = OuterOptimizer(phi, lambda params: torch.optim.Adam(params, lr=0.01), lr_at=lr_at)
    lrs = []
    for update in range(10):
        outer.set_lr(update)
        lrs.append(outer.lr)
    assert lrs[0] == pytest.approx(0.005) and lrs[1] == pytest.approx(0.01)
    assert lrs[-1] == pytest.approx(0.001) and all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))
    assert [lr / 0.01 for lr in lrs] == pytest.approx([lr_at(0.7, k) / 0.7 for k in range(10)])


@pytest.mark.parametrize(
    ("name", "state_bytes"),
    [("nesterov", 4 * NUMEL), ("averaging", 0), ("adamw", 8 * NUMEL + 4)],  # Adam's step counter: one fp32 value
)
def test_the_state_is_counted_from_the_optimizers_own_tensors(name, state_bytes):
    phi, outer = _outer(FACTORIES[name])
    assert outer.state_bytes() == state_bytes  # before the first step: what one step allocates (on a meta tensor)
    assert not outer.optimizer.state  # measuring allocated nothing here
    outer.step(_grad(4))
    assert outer.state_bytes() == state_bytes
    assert outer_state_bytes(FACTORIES[name], NUMEL) == state_bytes


def test_the_configs_optimizers():
    sgd = outer_optimizer_factory(SyncConfig(outer=OuterConfig(lr=0.5, momentum=0.0)))([torch.zeros(2)])
    assert isinstance(sgd, torch.optim.SGD) and not sgd.defaults["nesterov"]  # torch refuses Nesterov without it
    cfg = SyncConfig(outer=OuterConfig(optimizer="adamw", lr=0.02, beta1=0.8, beta2=0.95, weight_decay=0.1))
    adamw = outer_optimizer_factory(cfg)([torch.zeros(2)])
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.defaults["lr"], adamw.defaults["betas"], adamw.defaults["weight_decay"]) == (0.02, (0.8, 0.95), 0.1)


@pytest.mark.parametrize(
    ("saved", "mine", "names"),
    [
        ("nesterov", "adamw", "betas"),  # another optimizer: other keys
        ("nesterov", "heavy-ball", "momentum = 0.9 (now 0.6), nesterov = True (now False)"),
        ("adamw", "adam", "weight_decay"),
    ],
)
def test_a_state_of_another_optimizer_or_settings_is_refused_in_one_line(saved, mine, names):
    _, source = _outer(FACTORIES[saved])
    source.step(_grad(5))
    _, target = _outer(FACTORIES[mine])
    with pytest.raises(ValueError, match="resume with the outer optimizer") as error:
        target.load_state_dict(source.state_dict())
    assert names in str(error.value) and "\n" not in str(error.value)


def test_a_state_saved_at_another_learning_rate_of_the_schedule_loads():
    _, source = _outer(FACTORIES["adamw"])
    source.optimizer.param_groups[0]["lr"] = 0.001  # the schedule's lr of the last update
    source.step(_grad(6))
    _, target = _outer(FACTORIES["adamw"])
    target.load_state_dict(source.state_dict())
    assert target.lr == 0.001 and target.optimizer.state


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (torch.optim.SGD([torch.zeros(1)], lr=1.0), "must build a torch.optim.Optimizer"),
        ("sgd", "must build a torch.optim.Optimizer"),
        (lambda params: torch.optim.SGD([torch.zeros(1)], lr=1.0), "exactly the list it is given"),
        (lambda params: params, "not a torch.optim.Optimizer"),
    ],
)
def test_a_factory_that_does_not_build_an_optimizer_over_phi_is_refused(factory, match):
    with pytest.raises(ValueError, match=match):
        OuterOptimizer(torch.zeros(3), factory, lr_at=lambda base, update: base)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"optimizer": "lion"}, "sync.outer.optimizer = 'lion' is not one of: sgd, adamw"),
        ({"optimizer": "adamw", "beta2": 1.0}, r"sync.outer.beta2 = 1.0 must be in \[0, 1\)"),
        ({"optimizer": "adamw", "weight_decay": -0.1}, "sync.outer.weight_decay = -0.1 must be >= 0"),
    ],
)
def test_the_outer_optimizer_settings_are_validated(fields, match):
    with pytest.raises(ValueError, match=match):
        SyncConfig(kind="dilocox", outer=OuterConfig(**fields)).validate()


def test_adamw_moves_phi_by_about_its_learning_rate_per_value():
    """Why adamw takes `outer_lr` as a step length: its first step is lr sign(g) wherever |g| >> eps."""
    phi, outer = _outer(lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.0))
    before = phi.clone()
    outer.step(_grad(7))
    assert (before - phi).abs().max().item() == pytest.approx(0.02, rel=1e-3)
    assert math.isclose((before - phi).abs().min().item(), 0.02, rel_tol=0.05)
