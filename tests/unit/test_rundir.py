"""Which directory a run writes to: a finished run's, another setting's or anything else's is never written into;
the same command run again after an interruption goes on where it stopped."""

from types import SimpleNamespace

import pytest

from dilocox.config import load_config, to_toml
from dilocox.launch.rundir import choose_run_dir, prepare_run_dir


def make_run(run_dir, cfg, *, step=None, finished=False):
    """A run directory as a run of `cfg` leaves it: config.toml, a checkpoint of `step`, summary.json if finished."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    if step is not None:
        checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "meta.json").write_text("{}")
    if finished:
        (run_dir / "summary.json").write_text("{}")


def tree(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def config(run_dir, *flags):
    return load_config(None, [f"--run.out_dir={run_dir}", "--train.steps=400", *flags])


def test_a_new_or_empty_directory_and_an_unfinished_run_of_the_same_settings_are_used_as_named(tmp_path):
    base = tmp_path / "runs" / "dilocox"
    cfg = config(base)
    assert choose_run_dir(cfg) is None and cfg.run.out_dir == str(base)
    base.mkdir(parents=True)
    assert choose_run_dir(cfg) is None and cfg.run.out_dir == str(base)
    (base / "config.toml").write_text(to_toml(config(base, "--metrics.progress=false", "--checkpoint.keep=5")))
    checkpoint = base / "checkpoints" / "step_00000200"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text("{}")
    assert choose_run_dir(cfg) is None and cfg.run.out_dir == str(base)  # watching it differently: the same run


@pytest.mark.parametrize("finished_by", ["summary", "last checkpoint"])
def test_a_finished_run_is_never_resumed_the_same_command_makes_a_new_run_beside_it(tmp_path, finished_by):
    base = tmp_path / "runs" / "dilocox"
    make_run(base, config(base), step=400, finished=finished_by == "summary")
    before = tree(base)
    cfg = config(base)
    note = choose_run_dir(cfg)
    assert cfg.run.out_dir == str(base.with_name("dilocox-2"))
    assert note == (
        f"dilocox: {base} holds a finished run (400 of 400 steps), so this run is a new one in {base}-2 (--run.out_dir "
        f"names another; to continue that run, raise --train.steps and add --checkpoint.resume=latest "
        f"--run.out_dir={base})"
    )
    assert tree(base) == before and not base.with_name("dilocox-2").exists()


def test_another_setting_goes_to_the_first_free_numbered_directory_and_names_what_differs(tmp_path):
    base = tmp_path / "runs" / "dilocox"
    make_run(base, config(base), step=400, finished=True)
    second = base.with_name("dilocox-2")
    make_run(second, config(second, "--preset=allreduce"), step=400, finished=True)
    (base.with_name("dilocox-3")).write_text("a file in the way")
    cfg = config(base, "--topology.num_clusters=4", "--network.bandwidth=100Mbps")
    note = choose_run_dir(cfg)
    assert cfg.run.out_dir == str(base.with_name("dilocox-4"))
    assert note == (
        f"dilocox: {base} holds a run of other settings (network.bandwidth: '1Gbps' -> '100Mbps'; "
        f"topology.num_clusters: 2 -> 4), so this run is a new one in {base}-4 (--run.out_dir names another)"
    )


def test_the_same_command_after_an_interruption_goes_on_in_its_own_numbered_directory(tmp_path):
    base = tmp_path / "runs" / "dilocox"
    make_run(base, config(base), step=400, finished=True)
    second = base.with_name("dilocox-2")
    make_run(second, config(second), step=96)  # the second run, stopped at step 96
    cfg = config(base)
    assert choose_run_dir(cfg) == f"dilocox: {base} holds a finished run (400 of 400 steps), so this run goes on in " \
        f"{second}, where it stopped"  # fmt: skip
    assert cfg.run.out_dir == str(second)
    never = config(base, "--checkpoint.resume=")  # never resume: a directory of its own
    assert "so this run is a new one in" in choose_run_dir(never) and never.run.out_dir == str(base) + "-3"


@pytest.mark.parametrize("flags", [["--checkpoint.resume=latest"], ["--run.overwrite=true"]])
def test_a_run_named_to_continue_or_replace_keeps_its_directory(tmp_path, flags):
    base = tmp_path / "runs" / "dilocox"
    make_run(base, config(base), step=400, finished=True)
    cfg = config(base, *flags)
    assert choose_run_dir(cfg) is None and cfg.run.out_dir == str(base)


def test_a_run_resumed_with_other_settings_keeps_the_settings_its_earlier_steps_ran_with(tmp_path, capsys):
    """--checkpoint.resume=latest with another link: config.toml says what the next steps run with, and
    config.until_step_N.toml, byte for byte the old config.toml, what the steps before ran with."""
    base = tmp_path / "run"
    make_run(base, config(base), step=200)
    old = (base / "config.toml").read_bytes()
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = config(base, "--checkpoint.resume=latest", "--network.bandwidth=100Mbps")
    lock = prepare_run_dir(cfg, SimpleNamespace(tokenizer_path=str(tmp_path / "tokenizer.json")),
                           base / "checkpoints" / "step_00000200")  # fmt: skip
    lock.release()
    assert (base / "config.until_step_00000200.toml").read_bytes() == old
    assert (base / "config.toml").read_text() == to_toml(cfg)
    assert capsys.readouterr().out == (
        f"dilocox: resuming from {base / 'checkpoints' / 'step_00000200'} (checkpoint.resume = latest)\n"
        "dilocox: resuming at step 200 with other settings (network.bandwidth: '1Gbps' -> '100Mbps'); the steps "
        "before ran with config.until_step_00000200.toml\n"
    )


def test_the_same_run_stopped_before_its_first_checkpoint_starts_again_in_place(tmp_path, capsys):
    base = tmp_path / "run"
    make_run(base, config(base))
    (base / "metrics.jsonl").write_text('{"step": 10}\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = config(base)
    assert choose_run_dir(cfg) is None
    prepare_run_dir(cfg, SimpleNamespace(tokenizer_path=str(tmp_path / "tokenizer.json")), None).release()
    assert sorted(p.name for p in base.iterdir()) == ["config.toml", "tokenizer.json"]
    assert (
        capsys.readouterr().out
        == f"dilocox: {base} has no checkpoint: starting its run again (checkpoint.resume = auto)\n"
    )
