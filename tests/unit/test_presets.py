"""Presets and the layers of a config: field defaults < preset < --config file < flags, every shipped preset and
config file valid, `dilocox train --print-config` and `--help` showing what a run will use."""

import dataclasses
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from dilocox.cli import train_help
from dilocox.config import (
    DEFAULT_PRESET,
    PRESETS,
    Config,
    ConfigWarning,
    flat_settings,
    from_dict,
    load_config,
    option_value,
    options,
    read_preset,
    to_dict,
    to_toml,
)
from dilocox.tools.bench.spec import load_bench, run_overrides

REPO = Path(__file__).resolve().parents[2]
BENCH_FILES = sorted((REPO / "benchmarks" / "configs").glob("*.toml"))


FLAGS_OF = {
    name: [
        f"--{section}.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for section, values in read_preset(name).items()
        for key, value in values.items()
        if f"{section}.{key}" != "sync.kind"
    ]
    for name in PRESETS
}
"""Each preset's settings but its kind, as flags."""


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`dilocox ARGS` in a subprocess, run in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "dilocox", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_every_preset_is_shipped_in_the_package_and_validates():
    shipped = {path.stem for path in (REPO / "dilocox" / "presets").glob("*.toml")}
    assert shipped == set(PRESETS) and DEFAULT_PRESET in PRESETS
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "presets/*.toml" in pyproject["tool"]["setuptools"]["package-data"]["dilocox"]  # in a wheel too
    for name in PRESETS:
        cfg = load_config(None, [f"--preset={name}"])
        cfg.validate()
        for key, value in flat_settings(read_preset(name)).items():  # the preset's values are what the run gets
            assert option_value(cfg, key) == value, (name, key)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse_and_validate(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # no renamed key, no kind without its preset
        load_config(path).validate()


@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.name)
def test_every_bench_row_parses_and_validates(path):
    """Every row of every committed bench file, as it runs and under --quick, resolves to a valid config."""
    spec = load_bench(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        for quick in (False, True):
            for run in spec.runs:
                try:
                    load_config(spec.base, run_overrides(spec, run, quick)).validate()
                except ValueError as exc:
                    raise AssertionError(f"{path.name} run {run.name} (quick={quick}): {exc}") from None


def test_a_preset_is_under_the_file_and_the_file_under_the_flags(tmp_path):
    path = write(tmp_path, 'preset = "dilocox"\n[sync]\ninner_steps = 24\n[train]\nlr = 1e-3\n')
    cfg = load_config(path, ["--train.lr=5e-4"])
    assert cfg.sync.inner_steps == 24  # the file beats the preset (12)
    assert cfg.train.lr == 5e-4  # a flag beats the file and the preset
    assert cfg.compression.kind == "topk_int4" and cfg.sync.sync_delay == 1  # from the preset
    assert cfg.compression.rank == 8  # neither sets it: the field default
    # --preset replaces the file's preset; the file's own values stay above it; the last --preset wins
    other = load_config(path, ["--preset=paper", "--preset", "diloco"])
    assert (other.sync.kind, other.compression.kind, other.sync.inner_steps, other.train.lr) == (
        "diloco",
        "none",
        24,
        1e-3,
    )
    # without a preset named anywhere a file starts from the default preset; `preset=` is load_config's fallback
    plain = write(tmp_path, "[sync]\ninner_steps = 24\n", "plain.toml")
    assert to_dict(load_config(plain)) == to_dict(load_config(None, ["--sync.inner_steps=24"]))
    assert load_config(plain, preset="paper").sync.merge == "keep_local"
    assert load_config(path, preset="paper").compression.kind == "topk_int4"  # the file names its own


@pytest.mark.parametrize(
    ("path_text", "overrides", "message"),
    [
        ("", ["--preset=dilocx"], "--preset 'dilocx' is not a preset; did you mean dilocox? presets: dilocox, "),
        ("preset = 3\n", [], "preset = 3 must be the name of a preset"),
        ('preset = "nope"\n', [], "--preset 'nope' is not a preset"),
        ("", ["--preset=dilocoX"], "--preset 'dilocoX' is not a preset; did you mean dilocox? presets: dilocox, "),
        ('preset = "paper"\n[sync]\nkind = "diloco"\n', [], "contradict: a kind is its preset's identity"),
    ],
)
def test_a_bad_preset_is_one_error_naming_the_fix(tmp_path, path_text, overrides, message):
    with pytest.raises(ValueError, match=message.replace("?", r"\?").replace("(", r"\(")):
        load_config(write(tmp_path, path_text), overrides)


def test_a_kind_runs_its_own_preset_and_never_mixes_two(tmp_path):
    """A kind is its preset's identity: a sync.kind other than the preset's runs that kind's own preset, whatever
    layer chose the preset before it; the same kind keeps the preset; a file without a preset starts from the default
    preset, so `--config x.toml --sync.kind=dilocox` compresses as `dilocox train` does."""
    for kind in ("diloco", "allreduce", "cocktail", "dilocox"):
        assert to_dict(load_config(None, [f"--sync.kind={kind}"])) == to_dict(load_config(None, [f"--preset={kind}"]))
        for preset in PRESETS:  # the last word on the command line wins
            switched = load_config(None, [f"--preset={preset}", f"--sync.kind={kind}"])
            kept = preset if read_preset(preset)["sync"]["kind"] == kind else kind
            assert to_dict(switched) == to_dict(load_config(None, [f"--preset={kept}"])), (preset, kind)
    plain = write(tmp_path, "[sync]\ninner_steps = 24\n", "plain.toml")
    over_file = load_config(plain, ["--sync.kind=dilocox"])
    assert to_dict(over_file) == to_dict(load_config(None, ["--sync.inner_steps=24"]))
    assert over_file.compression.kind == "topk_int4" and over_file.sync.sync_delay == 1
    in_file = write(tmp_path, "[sync]\nkind = 'allreduce'\n", "kind.toml")
    assert to_dict(load_config(in_file)) == to_dict(load_config(None, ["--preset=allreduce"]))
    assert load_config(in_file, ["--preset=paper"]).sync.kind == "dilocox"  # the flag's preset, the file's kind gone
    for args in (["--sync.kind=allreduce"], ["--preset=dilocox-lowrank", "--sync.kind=cocktail"]):
        load_config(None, args).validate()  # no outer-loop setting of the preset stays behind


def test_an_older_run_directory_config_loads_and_means_what_it_meant(tmp_path):
    """A run's config.toml holds every resolved option; one written before compression.rank_rule was named so, with
    `kind = "dilocox"`, loads to the same settings (with a warning for the renamed key), and so does the config
    recorded in a checkpoint's meta.json when it is resumed."""
    from dilocox.checkpoint import check_resume, run_identity, write_meta

    cfg = load_config(None, ["--preset=dilocox-lowrank", "--compression.rank_rule=pooled"])
    old_text = to_toml(cfg).replace("rank_rule = ", "aggregate = ")
    assert 'kind = "dilocox"' in old_text and 'aggregate = "pooled"' in old_text
    with pytest.warns(ConfigWarning, match="compression.aggregate is now compression.rank_rule"):
        loaded = from_dict(tomllib.loads(old_text))
    assert to_dict(loaded) == to_dict(cfg)
    with pytest.warns(ConfigWarning) as warned:
        assert to_dict(load_config(write(tmp_path, old_text))) == to_dict(cfg)
    # the renamed key only: every option is set, so not the warning of a dilocox kind that sets nothing else
    assert [str(w.message) for w in warned] == [
        "compression.aggregate is now compression.rank_rule; update the config or flag"
    ]
    old_config = to_dict(cfg)
    old_config["compression"]["aggregate"] = old_config["compression"].pop("rank_rule")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000010"
    checkpoint.mkdir(parents=True)
    files = {f"rank_{rank:05d}.pt": {"bytes": 0, "sha256": ""} for rank in range(cfg.world_size)}
    write_meta(checkpoint, {"step": 10, **run_identity(cfg), "config": old_config, "files": files})
    check_resume(loaded, checkpoint)  # the resumed run's settings agree with the old checkpoint's


def test_print_config_of_the_default_preset_is_the_preset_file_over_the_field_defaults_resolved(tmp_path):
    """`dilocox train --print-config` (no preset, no config: the default preset) prints every option, exits 0 and
    writes nothing; its values are the preset file's where it sets them, the auto rules' where an option is auto and
    the field defaults elsewhere."""
    result = cli("train", "--print-config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing
    printed = tomllib.loads(result.stdout)
    preset = flat_settings(read_preset(DEFAULT_PRESET))
    defaults, flat_resolved = flat_settings(to_dict(Config())), flat_settings(to_dict(load_config(None, [])))
    resolved = to_dict(load_config(None, []))
    for name, *_ in options():
        want = preset.get(name, defaults[name])
        assert flat_settings(printed)[name] == (flat_resolved[name] if want == "auto" else want), name
    assert printed["sync"]["outer"] == resolved["sync"]["outer"]  # a sub-section is a table of its own: [sync.outer]
    assert "\n[sync.outer]\n" in result.stdout and "\n[sync.guard]\n" in result.stdout
    assert "auto" not in result.stdout.split("\n#")[0] and printed == resolved
    assert (printed["sync"]["overlap_steps"], printed["sync"]["merge"], printed["checkpoint"]["interval"]) == (
        7,
        "own_payload",
        96,
    )  # the values the preset file wrote out before they were auto
    # a combination that cannot work is one line and exit 2, before anything is printed; it is the real one: the
    # preset's auto overlap does not complain about time rounds
    bad = cli("train", "--print-config", "--sync.round.mode=time", "--sync.round.fit_link=true", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith(
        "dilocox: error: sync.round.mode = 'time' does not work with sync.round.fit_link = true: a time round's length "
        "is its budget"
    )


@pytest.mark.parametrize("args", [[], ["--preset=diloco", "--sync.inner_steps=4"]], ids=["default", "diloco-h4"])
def test_help_shows_the_values_the_run_uses_and_every_preset_in_full(args):
    """Each option's line shows the value `dilocox train ARGS` runs with: the preset's, an auto option's resolved
    value, the field default; and every preset in full."""
    text = train_help([*args, "--help"])
    values = flat_settings(to_dict(load_config(None, args)))
    for name, *_ in options():
        value = values[name]
        shown = ("true" if value else "false") if isinstance(value, bool) else f'"{value}"' if isinstance(
            value, str) else str(value)  # fmt: skip
        lines = [line for line in text.splitlines() if line.startswith(f"  --{name}=")]
        assert len(lines) == 1, (name, lines)
        assert lines[0].endswith((f"({shown})", f"(auto: {shown})", f"({shown}, preset {values['sync.kind']})")), (
            name,
            lines,
        )
    assert '  --sync.kind={allreduce,cocktail,diloco,dilocox}  ("' in text  # a choice: its values
    presets = text.split("Presets (", 1)[1].split("\n[run]\n", 1)[0]
    for name in PRESETS:
        assert f"\n  {name}" in presets, name
        for key in flat_settings(read_preset(name)):
            assert f"{key}=" in " ".join(presets.split()), (name, key)
    if not args:  # the first run's values: what the preset file used to spell out, now resolved by the rules
        for line in (
            "--sync.overlap_steps=INT|auto  (auto: 7)",
            "--checkpoint.interval=INT|auto  (auto: 96)",
            "--sync.inner_steps=INT  (12, preset dilocox)",
            "--sync.outer.lr=FLOAT|auto  (1.4, preset dilocox)",
        ):
            assert f"  {line}" in text, line


def test_help_imports_no_torch():
    """`dilocox train --help` reads the config dataclasses only: torch (seconds to import) stays out."""
    code = "import sys; from dilocox.cli import main; main(['train', '--help']); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_the_default_preset_trains_what_its_bench_row_measured():
    """The dilocox preset claims the measured gaps of a bench row on three workloads (its header, docs/results.md):
    `dilocox train` with no arguments syncs exactly as that row did on workload (a), its auto options resolving to
    the values the row resolved to; only the run's length, its schedule's warm-up and the held-out share differ."""
    spec = load_bench(REPO / "benchmarks" / "configs" / "workloads.toml")
    plays = spec.on_workload(next(w for w in spec.workloads if w.name == "a-qwen-plays"))
    row = next(r for r in plays.runs if r.name == "dilocox-outer-lr1.4")
    measured = to_dict(load_config(plays.base, run_overrides(plays, row, False)))
    embedded = to_dict(load_config(None, []))
    for section in ("model", "topology", "sync", "compression"):
        assert measured[section] == embedded[section], section
    for section, length in (("train", {"steps", "warmup_steps"}), ("data", {"val_fraction"})):
        differ = {key for key in embedded[section] if measured[section][key] != embedded[section][key]}
        assert differ <= length, (section, differ)


def test_configs_paper_toml_is_the_paper_preset_on_the_default_setting():
    paper = load_config(REPO / "configs" / "paper.toml")
    default = load_config(None, ["--preset=paper", "--train.steps=400"])  # the benchmarks' length, not the first run's
    assert to_dict(dataclasses.replace(paper, run=default.run)) == to_dict(default)
    assert (paper.sync.outer.lr, paper.sync.outer.momentum, paper.sync.merge) == (0.7, 0.9, "keep_local")
    assert (paper.sync.local_residual, paper.sync.drain_residual, paper.sync.overlap_steps) == (False, False, 0)
