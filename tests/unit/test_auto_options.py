"""Options that follow from others are `auto` and resolve after the preset, the file and the flags: the shipped presets
resolve to the values they used to write out (bit-identical runs), one flag on the default works without touching
what follows from it, an explicit value is kept and judged, and the first error is the real one."""

import dataclasses
import tomllib

import pytest

from dilocox.config import Config, auto_options, load_config, to_dict, to_toml
from dilocox.sync.config import OuterConfig, SyncConfig

SPELLED_OUT = {
    # preset: the values its file set before they were auto (overlap, merge, local, drain, outer lr, checkpoint)
    "dilocox": (7, "own_payload", True, True, 1.4, 96),
    "dilocox-lowrank": (0, "own_payload", True, True, 1.0, 100),
    "paper": (0, "keep_local", False, False, 0.7, 100),
    "diloco": (0, "keep_local", False, False, 0.7, 100),
}


def resolved(cfg: Config) -> tuple:
    s = cfg.sync
    return (s.overlap_steps, s.merge, s.local_residual, s.drain_residual, s.outer.lr, cfg.checkpoint.interval)


@pytest.mark.parametrize("preset", sorted(SPELLED_OUT))
def test_the_shipped_presets_resolve_to_the_values_they_wrote_out(preset):
    cfg = load_config(None, [f"--preset={preset}"])
    assert resolved(cfg) == SPELLED_OUT[preset]
    assert (cfg.sync.round.fit_link_max_steps, cfg.sync.min_clusters, cfg.train.warmup_steps) == (
        8 * cfg.sync.inner_steps,
        2,
        min(20, cfg.train.steps // 10),  # 9 for the 96 steps of the first run
    )
    cfg.validate()


def test_one_flag_on_the_default_works_and_what_follows_from_it_follows():
    short = load_config(None, ["--sync.inner_steps=4"])
    short.validate()
    assert (short.sync.overlap_steps, short.checkpoint.interval) == (2, 100)  # 7/12 of 4, rounded; 25 rounds of 4
    plain = load_config(None, ["--compression.kind=none"])
    plain.validate()
    assert (plain.sync.overlap_steps, plain.sync.merge, plain.sync.local_residual, plain.sync.drain_residual) == (
        0,
        "eager",
        False,
        False,
    )
    elastic = load_config(None, ["--topology.elastic=true"])
    elastic.validate()
    # an elastic run runs the preset as it is (the overlap, own_payload and both residual options); it may go on
    # with 1 cluster
    assert (elastic.sync.overlap_steps, elastic.sync.merge, elastic.sync.local_residual, elastic.sync.min_clusters) == (
        7,
        "own_payload",
        True,
        1,
    )
    static = load_config(None, [])
    static.validate()
    assert {k: v for k, v in to_dict(static)["sync"].items() if k != "min_clusters"} == {
        k: v for k, v in to_dict(elastic)["sync"].items() if k != "min_clusters"
    }


def test_another_outer_optimizer_takes_its_own_learning_rate_not_the_presets_sgd_one():
    adamw = load_config(None, ["--sync.outer.optimizer=adamw"])
    adamw.validate()
    assert (adamw.sync.outer.lr, adamw.sync.drain_residual, adamw.sync.merge) == (0.01, False, "own_payload")
    assert load_config(None, ["--sync.outer.optimizer=adamw", "--sync.outer.lr=0.003"]).sync.outer.lr == 0.003
    assert load_config(None, ["--preset=diloco", "--sync.outer.optimizer=adamw"]).sync.outer.lr == 0.01
    # the preset's own optimizer keeps the preset's values
    assert load_config(None, ["--sync.outer.optimizer=sgd"]).sync.outer.lr == 1.4


@pytest.mark.parametrize("aggregate", ["median", "trimmed_mean", "norm_clip"])
def test_a_robust_aggregate_drains_no_residual_unless_asked(aggregate):
    robust = load_config(None, [f"--sync.aggregate={aggregate}"])
    robust.validate()
    assert (robust.sync.drain_residual, robust.sync.local_residual, robust.sync.merge) == (False, True, "own_payload")
    asked = load_config(None, [f"--sync.aggregate={aggregate}", "--sync.drain_residual=true"])
    asked.validate()
    assert asked.sync.drain_residual is True


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sync.overlap_steps=12"], "sync.overlap_steps = 12 must be below sync.inner_steps = 12"),
        (["--sync.alpha=0.5"], "sync.alpha = 0.5 does not work with sync.sync_delay = 1"),
        (
            ["--sync.overlap_steps=3", "--sync.round.fit_link=true"],
            "sync.overlap_steps = 3 does not work with sync.round.fit_link = true",
        ),
        (["--compression.kind=none", "--sync.local_residual=true"], "sync.local_residual = true does not work with"),
    ],
)
def test_an_explicit_value_is_kept_and_judged_and_the_first_error_is_the_users(flags, message):
    cfg = load_config(None, flags)
    with pytest.raises(ValueError) as error:
        cfg.validate()
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_auto_is_a_value_in_files_and_flags_and_resolving_twice_changes_nothing(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[sync]\noverlap_steps = "auto"\n[checkpoint]\ninterval = 40\n')
    cfg = load_config(path, ["--sync.inner_steps=24"])
    assert (cfg.sync.overlap_steps, cfg.checkpoint.interval) == (14, 40)
    again = load_config(path, ["--sync.overlap_steps=5", "--sync.overlap_steps=auto"])
    assert again.sync.overlap_steps == 7
    assert to_dict(dataclasses.replace(cfg).resolve()) == to_dict(cfg)
    written = load_config(None, []).resolve()
    assert to_dict(load_config(None, [])) == to_dict(written)
    printed = tomllib.loads(to_toml(written))  # what config.toml and --print-config hold: no auto left
    assert not [name for name in auto_options() if printed[name.split(".")[0]][name.split(".")[1]] == "auto"]


def test_a_sync_config_resolves_from_its_codec_alone():
    """The library path (`OuterSync.from_configs`, `DiLoCoSync`): a SyncConfig resolves against the codec it runs."""
    from dilocox.compress.config import CompressionConfig

    delayed = SyncConfig(kind="dilocox", inner_steps=24, sync_delay=1, outer=OuterConfig(lr=1.0, momentum=0.0))
    topk = delayed.resolved(CompressionConfig(kind="topk_int4"))
    assert (topk.overlap_steps, topk.merge, topk.local_residual, topk.drain_residual) == (14, "own_payload", True, True)
    fp32 = delayed.resolved(CompressionConfig())
    assert (fp32.overlap_steps, fp32.merge, fp32.local_residual, fp32.drain_residual) == (0, "eager", False, False)
    streamed = dataclasses.replace(delayed, sync_delay=0).resolved(CompressionConfig(kind="topk_int4"))
    assert (streamed.overlap_steps, streamed.merge, streamed.alpha) == (0, "keep_local", 0.0)  # blocking unless set
    nesterov = SyncConfig(sync_delay=1).resolved(CompressionConfig(kind="topk_int4"))
    assert (nesterov.merge, nesterov.local_residual, nesterov.outer.lr, nesterov.round.fit_link_max_steps) == (
        "keep_local",
        False,
        0.7,
        400,
    )
    assert SyncConfig().overlap_steps == "auto" and delayed.merge == "auto"  # resolved() never changes its source


def test_an_older_config_that_wrote_0_for_auto_loads_with_a_warning(tmp_path):
    """config.toml of earlier versions holds 0 where these options meant what auto means now."""
    from dilocox.config import ConfigWarning

    path = tmp_path / "old.toml"
    path.write_text("[sync]\nfit_link_max_steps = 0\nmin_clusters = 0\n[train]\nnum_microbatches = 0\n")
    with pytest.warns(ConfigWarning, match="sync.min_clusters = 0 is now sync.min_clusters = auto"):
        cfg = load_config(path, ["--sync.round.fit_link=true"])
    cfg.validate()
    assert (cfg.sync.round.fit_link_max_steps, cfg.sync.min_clusters, cfg.train.num_microbatches) == (96, 2, 1)
