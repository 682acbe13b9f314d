import re
import tomllib
from pathlib import Path

import pytest

from dilocox.agreement import settings_fingerprint
from dilocox.config import Config, field_docs, from_dict, load_config, options, to_dict, to_toml
from dilocox.sync import SyncConfig
from dilocox.sync.config import OuterConfig

REPO = Path(__file__).resolve().parents[2]
LOWRANK = ["--preset=dilocox-lowrank"]
"""The dilocox-lowrank preset: the one-step delay, the adaptive codec with error feedback, the residual options."""
LOWRANK_PLAIN = [*LOWRANK, "--sync.merge=eager", "--sync.local_residual=false", "--sync.drain_residual=false"]
"""The same without the options that need a codec's residual: what an elastic run or a codec without one can use."""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_precedence_defaults_then_preset_then_file_then_flags(tmp_path):
    path = write(tmp_path, "[sync]\ninner_steps = 20\n[sync.outer]\nlr = 0.5\n[train]\nlr = 1e-3\n")
    cfg = load_config(path, ["--sync.inner_steps=10", "--train.steps", "77", "--run.overwrite"])
    assert cfg.sync.inner_steps == 10  # flag beats file
    assert cfg.sync.outer.lr == 0.5  # file beats the preset (1.4)
    assert cfg.train.lr == 1e-3
    assert cfg.train.steps == 77  # "--key value" form
    assert cfg.run.overwrite is True  # bare boolean flag
    assert cfg.sync.outer.momentum == 0.0  # a file without a preset starts from the default preset, dilocox
    assert cfg.compression.rank == 8  # no layer sets it: the field default


def test_int_in_toml_accepted_for_float_field(tmp_path):
    cfg = load_config(write(tmp_path, "[sync.outer]\nlr = 1\n"))
    assert cfg.sync.outer.lr == 1.0 and isinstance(cfg.sync.outer.lr, float)


@pytest.mark.parametrize(
    ("toml", "overrides", "message"),
    [
        ("[sync]\ninner_step = 3\n", [], "sync.inner_step"),
        ("[synk]\nkind = 'diloco'\n", [], "unknown section"),
        ("[sync]\ninner_steps = 'ten'\n", [], "sync.inner_steps"),
        ("[run]\noverwrite = 1\n", [], "run.overwrite"),
        ("", ["--sync.inner_stepz=3"], "did you mean sync.inner_steps"),
        ("", ["--train.steps=many"], "train.steps"),
        ("", ["--run.overwrite=maybe"], "run.overwrite"),
        ("", ["train.steps=3"], "--section.key=value"),
        ("", ["--train.lr"], "needs a value"),
        ("", ["--sync.overlap_steps=soon"], "sync.overlap_steps = 'soon' is not a valid int"),
        ("[sync]\noverlap_steps = 'soon'\n", [], "sync.overlap_steps = 'soon' must be a int"),
    ],
)
def test_load_errors_name_the_field(tmp_path, toml, overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(write(tmp_path, toml), overrides)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(write(tmp_path, "[sync\n"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.steps=0"], "train.steps = 0 must be > 0"),
        (["--topology.num_clusters=0"], "topology.num_clusters"),
        (["--sync.kind=gossip"], "sync.kind = 'gossip' is not one of: allreduce, cocktail, diloco, dilocox"),
        (["--compression.kind=zip"], "compression.kind"),
        (["--compression.rank_max=1"], "compression.rank_max = 1 is below"),
        (["--compression.schedule=sometimes"], "compression.schedule"),
        (["--compression.reduction=tree"], "compression.reduction"),
        (
            [*LOWRANK, "--sync.round.fit_link=true", "--sync.round.fit_link_max_steps=10"],
            "sync.round.fit_link_max_steps = 10 is below sync.inner_steps = 50",
        ),
        ([*LOWRANK, "--sync.alpha=1.5"], "sync.alpha = 1.5 must be between 0 and 1"),
        ([*LOWRANK, "--sync.overlap_steps=50"], "sync.overlap_steps = 50 must be below sync.inner"),
        ([*LOWRANK, "--sync.overlap_steps=-1"], "sync.overlap_steps = -1 must be >= 0"),
        (["--compression.kind=topk_int4", "--compression.density=0"], "compression.density = 0.0 must be in"),
        (["--cocktail.topk_ratio=0.5"], "cocktail.topk_ratio = 0.5 must be <= cocktail.sample_ratio = 0.1"),
        (["--compression.kind=lowrank", "--compression.factor_dtype=int8"], "compression.factor_dtype"),
        (["--compression.energy=0.4"], "compression.energy_floor = 0.5 must be in (0.0, 0.4]"),
        (["--train.optimizer=lion"], "train.optimizer"),
        (["--train.lr=-1"], "train.lr"),
        (["--train.lr=nan"], "finite"),
        (["--sync.outer.momentum=1.0"], "sync.outer.momentum"),
        (["--data.val_fraction=0.9"], "data.val_fraction"),
        (["--data.split_seed=-2"], "data.split_seed = -2 must be >= 0, or -1"),
        (["--data.shard=blocks"], "data.shard = 'blocks' is not one of: mixed, contiguous"),
        (["--sync.sync_delay=2"], "sync.sync_delay = 2 must be 0"),
        (
            ["--sync.merge=greedy"],
            "sync.merge = 'greedy' is not one of: auto, reset, keep_local, eager, lookahead, own_payload",
        ),
        (["--sync.outer.lr_schedule=linear"], "sync.outer.lr_schedule = 'linear' is not one of: constant, cosine"),
        (["--sync.outer.warmup_rounds=-1"], "sync.outer.warmup_rounds = -1 must be >= 0"),
        (["--sync.outer.min_lr_ratio=1.5"], "sync.outer.min_lr_ratio = 1.5 must be in"),
        (["--topology.pp_degree=4", "--train.num_microbatches=2"], "fewer than the 4 pipeline stages"),
        (["--train.num_microbatches=3"], "does not divide train.micro_batch_size = 8"),
        (["--train.pipeline_schedule=zb"], "train.pipeline_schedule"),
        (["--train.warmup_steps=400"], "train.warmup_steps = 400 must be smaller than train.steps = 96"),
        (["--metrics.wandb=cloud"], "metrics.wandb = 'cloud' is not one of: off, offline, online"),
        (["--network.bandwidth=fast"], "network.bandwidth"),
        (["--network.latency=-3ms"], "network.latency"),
    ],
)
def test_validate_errors_name_the_field(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


def test_moved_keys_are_read_where_they_live_now(tmp_path):
    """Options that moved or were renamed (compression.fit_link -> sync.round.fit_link, compression.aggregate ->
    compression.rank_rule, ...) still load, with a warning, so an older run's config.toml or command line keeps
    working."""
    with pytest.warns(UserWarning, match="compression.fit_link is now sync.round.fit_link"):
        cfg = load_config(None, [*LOWRANK, "--compression.fit_link=true"])
    assert cfg.sync.round.fit_link is True
    with pytest.warns(UserWarning, match="cocktail.topk_ratio"):
        cfg = load_config(write(tmp_path, "[compression]\ntopk_ratio = 0.02\n"))
    assert cfg.cocktail.topk_ratio == 0.02
    with pytest.warns(UserWarning, match="compression.aggregate is now compression.rank_rule"):
        cfg = load_config(None, [*LOWRANK, "--compression.aggregate=pooled"])
    assert cfg.compression.rank_rule == "pooled"
    # a flag under the new name beats the old name in the file: both are the same option
    with pytest.warns(UserWarning, match="compression.aggregate"):
        path = write(tmp_path, "[compression]\nkind = 'adaptive'\naggregate = 'max'\n")
        assert load_config(path, ["--compression.rank_rule=budget"]).compression.rank_rule == "budget"


def test_each_section_validates_itself():
    """A component's config is checked where it is defined, so one built in Python fails the same way."""
    from dilocox.compress import CocktailConfig, CompressionConfig
    from dilocox.net.config import NetworkConfig

    for section, message in [
        (SyncConfig(kind="gossip"), "sync.kind"),
        (CompressionConfig(rank="8"), "compression.rank = '8' must be a int"),
        (CocktailConfig(sample_ratio=float("inf")), "cocktail.sample_ratio = inf must be a finite number"),
        (NetworkConfig(bandwidth="fast"), "network.bandwidth"),
    ]:
        with pytest.raises(ValueError, match=message):
            section.validate()


def test_world_size_contradiction():
    cfg = load_config(None, ["--topology.num_clusters=2", "--topology.dp_degree=2"])
    cfg.validate(world_size=4)
    with pytest.raises(ValueError, match=r"started 3 ranks but .* = 2 x 2 x 1 = 4"):
        cfg.validate(world_size=3)


def test_allreduce_does_not_need_round_aligned_checkpoints():
    cfg = load_config(None, ["--sync.kind=allreduce", "--checkpoint.interval=75"])
    cfg.validate()
    assert cfg.notes() == []


def test_checkpoint_interval_off_the_round_grid_is_a_note_not_an_error():
    """Checkpoints are taken at the next round boundary (Trainer._checkpoint_due); the user is told once."""
    cfg = load_config(None, ["--sync.inner_steps=50", "--checkpoint.interval=75"])
    cfg.validate()
    assert cfg.notes() == [
        "note: checkpoint.interval = 75 is not a multiple of sync.inner_steps = 50: checkpoints are taken at the "
        "first round boundary at or after each multiple of 75 (and at the end)"
    ]
    assert load_config(None, ["--sync.inner_steps=50", "--checkpoint.interval=100"]).notes() == []
    # fit_link changes H as it goes: checkpoints follow the rounds anyway, nothing to say
    assert load_config(None, ["--sync.round.fit_link=true", "--checkpoint.interval=75"]).notes() == []


def test_a_reduction_that_sums_in_transit_says_once_that_the_peer_check_cannot_run():
    """The all-reduce of compression.kind = none (and the scalable reduction) delivers only the clusters' sum: with
    3 or more clusters the peer check the guard would run has nothing to compare, and the user is told at the start."""
    summed = load_config(None, ["--topology.num_clusters=3", "--compression.kind=none"])
    [note] = summed.notes()
    assert "compression.kind = none" in note and "the peer check (sync.guard.peers) cannot compare them" in note
    scalable = ["--topology.num_clusters=3", "--compression.kind=int4", "--compression.reduction=scalable"]
    assert len(load_config(None, scalable).notes()) == 1
    for quiet in (
        ["--topology.num_clusters=3"],  # the dilocox preset: top-k, gathered, judged
        ["--topology.num_clusters=2", "--compression.kind=none"],  # 2 clusters: no peer check to miss
        ["--topology.num_clusters=3", "--compression.kind=none", "--sync.guard.peers=false"],  # asked for none
    ):
        assert load_config(None, quiet).notes() == [], quiet


def test_warmup_default_shrinks_for_short_runs_but_an_explicit_value_is_kept(tmp_path):
    assert load_config(None, []).train.warmup_steps == 9  # the default run: 96 steps, a tenth of them
    assert load_config(None, ["--train.steps=400"]).train.warmup_steps == 20
    assert load_config(None, ["--train.steps=1000"]).train.warmup_steps == 20
    assert load_config(None, ["--train.steps=150"]).train.warmup_steps == 15
    short = load_config(None, ["--train.steps=30"])
    assert short.train.warmup_steps == 3
    short.validate()
    tiny = load_config(None, ["--train.steps=10"])  # fewer steps than the default 20 warm-up steps: failed before
    assert tiny.train.warmup_steps == 1
    tiny.validate()
    assert load_config(None, ["--train.steps=5"]).train.warmup_steps == 0
    # set in a file (e.g. a run's config.toml) or by a flag, it is the user's and too large is an error
    assert load_config(write(tmp_path, "[train]\nsteps = 30\nwarmup_steps = 7\n")).train.warmup_steps == 7
    explicit = load_config(None, ["--train.steps=30", "--train.warmup_steps=40"])
    with pytest.raises(ValueError) as error:
        explicit.validate()
    assert (
        str(error.value)
        == "train.warmup_steps = 40 must be smaller than train.steps = 30; use e.g. --train.warmup_steps=auto (3)"
    )
    assert (
        load_config(
            None, ["--train.steps=30", "--train.warmup_steps=40", "--train.warmup_steps=auto"]
        ).train.warmup_steps
        == 3
    )


def test_toml_round_trip_keeps_every_field():
    cfg = load_config(None, ["--sync.inner_steps=7", '--data.path=some dir/with "quotes"', "--run.overwrite"])
    again = from_dict(tomllib.loads(to_toml(cfg)))
    assert to_dict(again) == to_dict(cfg)


def test_every_field_has_a_docstring():
    assert options(), "no options found"
    missing = [name for name, _, _, doc in options() if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert "H: local inner steps" in field_docs(type(Config().sync))["inner_steps"]


def test_outer_lr_schedules():
    """Warm-up reaches outer.lr at update W - 1; cosine ends at outer.lr x rho on the last update; constant stays."""
    constant = OuterConfig(lr=0.8, warmup_rounds=4)
    assert [constant.lr_at(k, 10) for k in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    cosine = OuterConfig(lr=1.0, lr_schedule="cosine", warmup_rounds=2, min_lr_ratio=0.25)
    lrs = [cosine.lr_at(k, 13) for k in range(13)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # warm-up, then the cosine's start
    assert lrs[-1] == pytest.approx(0.25) and lrs[7] == pytest.approx(0.25 + 0.75 * 0.5)  # the middle of 2 ... 12
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))
    assert OuterConfig(lr=0.7).lr_at(29, 30) == 0.7  # the default: constant, no warm-up


def test_every_option_has_a_one_line_docstring():
    """--help and config.toml show each option's docstring as one line (STYLE: a one-line docstring per field)."""
    for name, _, _, doc in options():
        assert doc and "\n" not in doc, name


ELASTIC = ["--topology.elastic=true", *LOWRANK_PLAIN, "--topology.num_clusters=4"]
ACROSS = ["--network.lighthouse=http://lh:29510", "--network.advertise_host=10.0.0.2"]


@pytest.mark.parametrize("shape", [["--topology.pp_degree=2"], ["--topology.dp_degree=2", "--topology.pp_degree=2"]])
def test_elastic_clusters_may_hold_a_pipeline_and_replicas(shape):
    cfg = load_config(None, [*ELASTIC, *shape])
    cfg.validate()
    assert cfg.topology.elastic and cfg.topology.dp_degree * cfg.topology.pp_degree > 1


@pytest.mark.parametrize(
    ("local", "clusters"),
    [("", (0, 1, 2, 3)), ("2", (2,)), ("0,1", (0, 1)), ("2-3", (2, 3)), (" 3, 0-1 ", (0, 1, 3))],
)
def test_local_clusters_name_the_clusters_this_machine_starts(local, clusters):
    cfg = load_config(None, [*ELASTIC, *ACROSS, f"--topology.local_clusters={local}"])
    cfg.validate()
    assert cfg.topology.launched_clusters() == clusters


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*ELASTIC, *ACROSS, "--topology.local_clusters=4"], "'4' is not a cluster or a range of clusters of 0..3"),
        ([*ELASTIC, *ACROSS, "--topology.local_clusters=2-1"], "'2-1' is not a cluster or a range"),
        ([*ELASTIC, *ACROSS, "--topology.local_clusters=one"], "'one' is not a cluster"),
        ([*ELASTIC, *ACROSS, "--topology.local_clusters=0,0-1"], "names a cluster twice"),
        (
            [*ELASTIC, "--network.advertise_host=10.0.0.2", "--topology.local_clusters=0"],
            "start `dilocox lighthouse` on a host they all reach",
        ),
        (
            [*ELASTIC, "--network.lighthouse=http://lh:29510", "--topology.local_clusters=0"],
            "the other machines need the address they reach this one at",
        ),
        ([*ELASTIC, "--network.lighthouse=lh:29510"], "must start with http://"),
    ],
)
def test_elastic_across_machines_errors_name_the_field_and_the_fix(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


def test_every_cluster_on_this_machine_needs_neither_a_lighthouse_nor_an_address():
    cfg = load_config(None, [*ELASTIC, "--topology.local_clusters=0-3"])
    cfg.validate()
    assert cfg.topology.launched_clusters() == (0, 1, 2, 3)


def fingerprint(cfg: Config) -> int:
    return settings_fingerprint(cfg.shared_settings())


def test_the_shared_fingerprint_sees_what_clusters_must_share_and_ignores_what_machines_may_differ_in():
    base = load_config(None, ELASTIC)
    same = [
        "--run.out_dir=elsewhere", "--data.path=/mnt/other/corpus.txt", "--topology.local_clusters=2",
        "--topology.max_cluster_restarts=9", "--network.advertise_host=10.0.0.9", "--metrics.progress=false",
        "--checkpoint.interval=7", "--eval.interval=3", "--run.num_threads=2",
    ]  # fmt: skip
    assert fingerprint(load_config(None, [*ELASTIC, *same])) == fingerprint(base)
    for differs in ["--train.lr=1e-3", "--run.seed=1", "--sync.inner_steps=10", "--compression.energy=0.9",
                    "--model.flavor=small", "--data.val_fraction=0.1", "--topology.num_clusters=3"]:  # fmt: skip
        assert fingerprint(load_config(None, [*ELASTIC, differs])) != fingerprint(base), differs
    assert 0 <= fingerprint(base) < 2**63  # it travels in an int64 tensor


@pytest.mark.parametrize(
    ("local", "shape", "world", "message"),
    [
        ("", [], 1, "under torchrun an elastic run's job is one cluster; name it"),
        ("0,1", [], 1, "under torchrun an elastic run's job is one cluster; name it"),
        ("2", ["--topology.dp_degree=2"], 4, "torchrun started 4 ranks for cluster 2, which has dp x pp = 2 x 1 = 2"),
        ("2", ["--topology.dp_degree=2", "--topology.pp_degree=2"], 4, None),
    ],
)
def test_an_elastic_torchrun_job_is_one_named_cluster_of_its_ranks(local, shape, world, message):
    from dilocox.launch.preflight import check_elastic_job

    cfg = load_config(None, [*ELASTIC, *ACROSS, *shape, f"--topology.local_clusters={local}"])
    cfg.validate()
    if message is None:
        check_elastic_job(cfg, world)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        check_elastic_job(cfg, world)
