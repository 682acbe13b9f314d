"""`OuterSync`'s arguments (docs/api.md): the strategies' defaults by name, one ValueError naming each mistake and
its fix, and the one object the trainer also gets from `build_sync`. No process group: `cluster_group=None` is one
cluster (nothing crosses a link); the mistakes that need groups are in tests/distributed/test_outer_sync.py."""

import dataclasses

import pytest
import torch

import dilocox
from dilocox import CompressionConfig, OuterSync
from dilocox.config import load_config
from dilocox.net.channel import WanChannel
from dilocox.sync import build_sync


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def build(**options):
    model, optimizer = model_and_optimizer()
    return OuterSync(model, optimizer, **{"cluster_group": None, "inner_steps": 2, **options})


def test_public_names_are_exported_and_lazy():
    assert dilocox.__all__ == [
        "CompressionConfig",
        "OuterSync",
        "RoundStats",
        "SyncConfig",
        "Topology",
        "WanChannel",
        "build_process_groups",
    ]
    for name in dilocox.__all__:
        assert getattr(dilocox, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'DiLoCo'"):
        dilocox.DiLoCo  # noqa: B018


@pytest.mark.parametrize(
    "kind, options, want",
    [
        ("dilocox", {}, (1, "topk_int4", 1.4, 0.0)),  # the dilocox preset: what `dilocox train` runs
        ("diloco", {}, (0, "none", 0.7, 0.9)),  # the diloco preset: the field defaults
        ("dilocox", {"sync_delay": 0, "compression": "int4", "outer_momentum": 0.5}, (0, "int4", 1.4, 0.5)),
        ("diloco", {"compression": CompressionConfig(kind="lowrank_int4", rank=4)}, (0, "lowrank_int4", 0.7, 0.9)),
    ],
)
def test_kinds_fill_the_settings_left_out(kind, options, want):
    sync = build(kind=kind, **options)
    got = (sync.sync_config.sync_delay, sync.compression.kind, sync.sync_config.outer.lr)
    assert (*got, sync.sync_config.outer.momentum) == want
    assert sync.name == kind and sync.status().inner_steps == 2


@pytest.mark.parametrize("kind", ["dilocox", "diloco"])
def test_a_kind_is_the_setting_of_its_preset_as_dilocox_train_runs_it(kind):
    """`OuterSync(kind="dilocox")` and `dilocox train` are one setting: the preset's, resolved by the same rules
    (min_clusters aside: the trainer's membership reads it, an OuterSync has none)."""
    sync = build(kind=kind)
    cfg = load_config(None, [f"--preset={kind}", "--sync.inner_steps=2"])
    mine, cli = dataclasses.asdict(sync.sync_config), dataclasses.asdict(cfg.sync)
    assert {**mine, "min_clusters": None} == {**cli, "min_clusters": None}
    assert sync.compression == cfg.compression
    if kind == "dilocox":  # what the preset file wrote out before they were auto: here at H = 2
        assert (sync.sync_config.overlap_steps, sync.sync_config.merge, sync.compression.kind) == (
            1,
            "own_payload",
            "topk_int4",
        )


def test_dilocox_keeps_the_local_residual_where_its_codec_has_one():
    assert build(kind="dilocox").sync_config.local_residual  # adaptive, with error feedback
    assert not build(kind="dilocox", compression="none").sync_config.local_residual  # fp32 holds nothing back
    no_feedback = CompressionConfig(kind="int4", error_feedback=False)
    assert not build(kind="dilocox", compression=no_feedback).sync_config.local_residual
    assert not build(kind="diloco", compression="topk_int4").sync_config.local_residual  # diloco: opt-in
    assert build(kind="diloco", compression="topk_int4", local_residual=True).sync_config.local_residual
    assert not build(kind="dilocox", local_residual=False).sync_config.local_residual


def test_dilocox_drains_the_residual_where_its_codec_has_one():
    assert build(kind="dilocox").sync_config.drain_residual
    assert not build(kind="dilocox", compression="none").sync_config.drain_residual
    assert not build(kind="diloco", compression="topk_int4").sync_config.drain_residual  # diloco: opt-in
    assert build(kind="diloco", compression="topk_int4", drain_residual=True).sync_config.drain_residual
    assert not build(kind="dilocox", drain_residual=False).sync_config.drain_residual


def test_a_compression_config_is_used_as_given_and_never_changed():
    mine = CompressionConfig(kind="lowrank_int4", rank=4)
    sync = build(compression=mine)
    assert sync.compression == mine and sync.compression is not mine


@pytest.mark.parametrize(
    "options, words",
    [
        ({"cluster_group": [0, 1]}, ["cluster_group must be a torch.distributed ProcessGroup", "got list"]),
        ({"dp_group": 3}, ["dp_group must be a torch.distributed ProcessGroup", "replicas inside the cluster"]),
        ({"inner_steps": 0}, ["inner_steps = 0 must be an int >= 1"]),
        ({"inner_steps": 2.5}, ["inner_steps = 2.5 must be an int >= 1"]),
        ({"inner_steps": True}, ["inner_steps = True must be an int >= 1"]),
        ({"kind": "allreduce"}, ["kind = 'allreduce' is not an outer-loop strategy", "DistributedDataParallel"]),
        ({"kind": "dilocoxx"}, ["kind = 'dilocoxx' is not an outer-loop strategy", "'dilocox'"]),
        ({"compression": "int3"}, ["compression = 'int3' is not a codec", "lowrank_int4, adaptive"]),
        ({"compression": 4}, ["compression = 4 must be a codec name", "or a CompressionConfig"]),
        ({"compression": CompressionConfig(kind="int4", group_size=0)}, ["compression.group_size = 0 must be > 0"]),
        ({"sync_delay": 2}, ["sync.sync_delay = 2 must be 0 (blocking) or 1"]),
        ({"merge": "average"}, ["sync.merge = 'average' is not one of: auto, reset, keep_local"]),
        ({"outer_lr": 0.0}, ["sync.outer.lr = 0.0 must be > 0"]),
        ({"kind": "diloco", "local_residual": True}, ["compression.kind = 'none'", "holds nothing back", "topk_int4"]),
        (
            {"local_residual": True, "compression": CompressionConfig(kind="topk_int4", error_feedback=False)},
            ["compression.error_feedback = false (topk_int4)", "holds nothing back", "sync.local_residual = false"],
        ),
        ({"kind": "diloco", "drain_residual": True}, ["sync.drain_residual = true", "holds nothing back"]),
        (
            {
                "sync_delay": 1,
                "merge": "own_payload",
                "compression": CompressionConfig(kind="int4", error_feedback=False),
            },
            [
                "sync.merge = 'own_payload' does not work with compression.error_feedback = false (int4)",
                "holds nothing back",
                "sync.merge = eager",
            ],
        ),
        ({"outer_optimizer": "adagrad"}, ["sync.outer.optimizer = 'adagrad' is not one of: sgd, adamw"]),
        (
            {"outer_optimizer": "adamw", "drain_residual": True},
            ["sync.drain_residual = true does not work with sync.outer.optimizer = 'adamw'", "= false"],
        ),
        (
            {"outer_optimizer": torch.optim.Adam, "drain_residual": True},
            ["the outer optimizer is Adam", "drain_residual=False"],
        ),
        (
            {"outer_optimizer": torch.optim.Adam, "outer_lr": 0.5, "drain_residual": False},
            ["outer_lr configure the built-in outer optimizers", "set them in its factory"],
        ),
        (
            {"outer_optimizer": torch.optim.Adam([torch.zeros(1)])},
            ["outer_optimizer must be 'sgd', 'adamw' or a callable", "got Adam"],
        ),
        ({"bandwidth": "100"}, ["network.bandwidth = '100' is not a rate"]),
        ({"latency": "10ms"}, ["latency = '10ms' is only emulated together with a bandwidth"]),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(options, words):
    with pytest.raises(ValueError) as error:
        build(**options)
    for word in words:
        assert word in str(error.value)
    assert "\n" not in str(error.value)  # one line on the CLI


def test_the_outer_optimizer_is_a_name_or_a_factory():
    """A name or a factory; the auto options follow it: no drain (it adds at an SGD's learning rate), AdamW's own
    auto learning rate instead of the dilocox preset's SGD 1.4."""
    assert not build(outer_optimizer=torch.optim.Adam).sync_config.drain_residual
    auto = build(outer_optimizer="adamw")
    assert (auto.sync_config.outer.lr, auto.sync_config.drain_residual, auto.sync_config.local_residual) == (
        0.01,
        False,
        True,
    )
    adam = build(outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.01), drain_residual=False)
    outer = adam.diloco.fragments[0].outer
    assert isinstance(outer.optimizer, torch.optim.Adam) and outer.lr == 0.01
    adamw = build(outer_optimizer="adamw", outer_lr=0.02, drain_residual=False)
    outer = adamw.diloco.fragments[0].outer
    assert isinstance(outer.optimizer, torch.optim.AdamW) and adamw.sync_config.outer.optimizer == "adamw"
    sgd = build(kind="diloco")
    outer = sgd.diloco.fragments[0].outer
    assert type(outer.optimizer) is torch.optim.SGD and outer.optimizer.defaults["nesterov"]
    state = adam.state_dict()
    state["settings"] = adamw.state_dict()["settings"]  # the same settings, but another optimizer's state
    with pytest.raises(ValueError, match="saved with decoupled_weight_decay = False .now True.") as error:
        adamw.load_state_dict(state)
    assert "\n" not in str(error.value)


def test_bad_model_or_optimizer():
    model, optimizer = model_and_optimizer()
    other, other_optimizer = model_and_optimizer()
    cases = [
        ((model.state_dict(), optimizer), "model_or_params must be an nn.Module or an iterable of its parameters"),
        ((model.named_parameters(), optimizer), "model_or_params holds tuple, not parameters"),
        (([], optimizer), "has no parameter that requires grad"),
        ((model, model), "inner_optimizer must be a torch.optim.Optimizer"),
        ((model, other_optimizer), "it misses 4 of them and holds 4 others"),
        ((list(model.parameters())[:2], optimizer), "it misses 0 of them and holds 2 others"),
    ]
    for (model_or_params, inner_optimizer), message in cases:
        with pytest.raises(ValueError, match=message):
            OuterSync(model_or_params, inner_optimizer, cluster_group=None, inner_steps=2)
    # frozen parameters need not be synced, and an optimizer over the model may hold them
    model[0].bias.requires_grad_(False)
    assert OuterSync(model, optimizer, cluster_group=None, inner_steps=2).status().numel == 4 * 8 + 8 * 2 + 2


def test_a_state_of_other_settings_or_not_a_state_is_refused():
    state = build(inner_steps=2, compression="int4").state_dict()
    with pytest.raises(ValueError, match=r"saved with inner_steps = 2 \(now 3\), compression = 'int4' \(now 'none'\)"):
        build(inner_steps=3, compression="none").load_state_dict(state)
    with pytest.raises(ValueError, match="takes what OuterSync.state_dict\\(\\) returned"):
        build().load_state_dict(model_and_optimizer()[0].state_dict())


def test_build_sync_gives_the_trainer_an_outer_sync():
    """`dilocox train` and a user's loop share one object for diloco and dilocox."""
    for kind, preset in (("diloco", "diloco"), ("dilocox", "dilocox-lowrank")):
        cfg = load_config(None, [f"--preset={preset}", "--sync.inner_steps=4"])
        model, _ = model_and_optimizer()
        sync = build_sync(
            cfg, model.parameters(), channel=WanChannel(None, bandwidth=None, latency_s=0.0), dp_group=None
        )
        assert isinstance(sync, OuterSync)
        assert (sync.name, sync.status().inner_steps, sync.compression.kind) == (kind, 4, cfg.compression.kind)
