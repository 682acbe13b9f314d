"""`[sync]` in sub-sections: `[sync.outer]` (the outer optimizer), `[sync.guard]` (the numeric guard), `[sync.round]`
(what makes a round). The flat keys of earlier versions (`sync.outer_lr`, `sync.guard`, `sync.round`, ...) load into
their new place with one warning line each, from a flag, a config file, a run directory's config.toml or a
checkpoint's saved config; a layer that spells one option both ways is refused in one line."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from dilocox.checkpoint import check_resume, run_identity, write_meta
from dilocox.config import (
    MOVED_KEYS,
    ConfigWarning,
    flat_settings,
    load_config,
    option_value,
    options,
    to_dict,
    to_toml,
)
from dilocox.launch.rundir import settings_changed
from dilocox.sync.config import GuardConfig, OuterConfig, RoundConfig, SyncConfig
from dilocox.tools import docgen

SUB_SECTIONS = ("sync.outer", "sync.guard", "sync.round")
OLD_SYNC_KEYS = {old: new for old, new in MOVED_KEYS.items() if old.startswith("sync.")}
VALUES = {  # a value other than the default preset's of every moved option, as a flag writes it
    "sync.outer_optimizer": "adamw",
    "sync.outer_lr": "0.5",
    "sync.outer_momentum": "0.5",
    "sync.nesterov": "false",
    "sync.outer_beta1": "0.8",
    "sync.outer_beta2": "0.99",
    "sync.outer_weight_decay": "0.01",
    "sync.outer_lr_schedule": "cosine",
    "sync.outer_warmup_rounds": "2",
    "sync.outer_min_lr_ratio": "0.2",
    "sync.outer_state_device": "cpu",
    "sync.guard": "false",
    "sync.guard_max_ratio": "5.0",
    "sync.guard_peers": "false",
    "sync.guard_peer_ratio": "2.5",
    "sync.guard_max_bad_rounds": "5",
    "sync.round": "time",
    "sync.round_seconds": "2.0",
    "sync.fit_link": "true",
    "sync.fit_link_max_steps": "200",
}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def toml_value(text: str) -> str:
    """A flag's value as a TOML file writes it."""
    try:
        float(text)
        return text
    except ValueError:
        return text if text in ("true", "false") else f'"{text}"'


def old_toml(text: str) -> str:
    """A config.toml as an earlier version wrote it: the sub-sections' options flat in [sync], by their old names."""
    old_name = {new: old for old, new in OLD_SYNC_KEYS.items()}
    lines, section = [], ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            if section in SUB_SECTIONS:
                continue  # its options follow [sync]'s own, so they land in [sync]
        elif section in SUB_SECTIONS and not line.startswith("#") and " = " in line:
            key, _, value = line.partition(" = ")
            line = f"{old_name[f'{section}.{key}'].split('.', 1)[1]} = {value}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_the_sync_section_holds_three_parts_each_validating_its_own_values():
    cfg = SyncConfig()
    assert (type(cfg.outer), type(cfg.guard), type(cfg.round)) == (OuterConfig, GuardConfig, RoundConfig)
    names = {name for name, *_ in options()}
    assert {"sync.outer.lr", "sync.guard.enabled", "sync.round.mode", "sync.round.fit_link"} <= names
    assert not names & set(OLD_SYNC_KEYS)  # no option keeps its old name
    for section, message in [
        (OuterConfig(lr=-1.0), "sync.outer.lr = -1.0 must be > 0"),
        (GuardConfig(max_ratio=1.0), "sync.guard.max_ratio = 1.0 must be a finite number > 1"),
        (SyncConfig(round=RoundConfig(seconds=-1.0)), "sync.round.seconds = -1.0 must be >= 0"),
        (SyncConfig(outer=OuterConfig(optimizer="lion")), "sync.outer.optimizer = 'lion' is not one of: sgd, adamw"),
    ]:
        with pytest.raises(ValueError, match=message):
            section.validate()


def test_the_moved_keys_table_names_every_option_of_the_sub_sections_once():
    """Every option of a sub-section was a flat [sync] key: the one table maps each old name to it."""
    sub_options = {name for name, *_ in options() if name.rpartition(".")[0] in SUB_SECTIONS}
    assert set(OLD_SYNC_KEYS.values()) == sub_options
    assert len(OLD_SYNC_KEYS) == len(sub_options) == len(VALUES)
    assert set(VALUES) == set(OLD_SYNC_KEYS)
    reference = docgen.config_reference()  # the configuration reference lists the table
    for old, new in OLD_SYNC_KEYS.items():
        assert f"| `{old}` | [`{new}`](#{new.replace('.', '-').replace('_', '-')}) |" in reference, old


@pytest.mark.parametrize("old", list(VALUES))
def test_an_old_flag_sets_the_new_option_with_one_warning_naming_it(old):
    new = OLD_SYNC_KEYS[old]
    with pytest.warns(ConfigWarning) as warned:
        by_old = load_config(None, [f"--{old}={VALUES[old]}"])
    assert [str(w.message) for w in warned] == [f"{old} is now {new}; update the config or flag"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # the new spelling loads without a word
        by_new = load_config(None, [f"--{new}={VALUES[old]}"])
    assert to_dict(by_old) == to_dict(by_new)
    assert option_value(by_new, new) != option_value(load_config(None, []), new)  # the value arrived


@pytest.mark.parametrize("old", list(VALUES))
def test_an_old_key_in_a_config_file_sets_the_new_option_with_one_warning(tmp_path, old):
    new = OLD_SYNC_KEYS[old]
    section, _, key = new.rpartition(".")
    old_file = tmp_path / "old.toml"
    old_file.write_text(f"[sync]\n{old.split('.', 1)[1]} = {toml_value(VALUES[old])}\n")
    new_file = tmp_path / "new.toml"
    new_file.write_text(f"[{section}]\n{key} = {toml_value(VALUES[old])}\n")
    with pytest.warns(ConfigWarning) as warned:
        by_old = load_config(old_file)
    assert [str(w.message) for w in warned] == [f"{old} is now {new}; update the config or flag"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert to_dict(load_config(new_file)) == to_dict(by_old)


def test_the_new_spelling_sets_each_part_and_a_typo_is_named():
    cfg = load_config(None, ["--sync.outer.lr=0.7", "--sync.outer.momentum=0.9", "--sync.guard.enabled=false"])
    assert (cfg.sync.outer.lr, cfg.sync.outer.momentum, cfg.sync.guard.enabled) == (0.7, 0.9, False)
    assert load_config(None, ["--sync.guard.peers"]).sync.guard.peers is True  # a bare boolean flag
    with pytest.raises(ValueError, match=r"unknown config key 'sync.outer.lrr'; did you mean sync.outer.lr\?"):
        load_config(None, ["--sync.outer.lrr=0.7"])


def test_one_layer_that_spells_an_option_both_ways_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(None, ["--sync.outer_lr=0.5", "--sync.outer.lr=0.6"])
    assert str(error.value) == (
        "the flags: sync.outer_lr and sync.outer.lr are the same option (the old name and the new); set sync.outer.lr "
        "only"
    )
    path = tmp_path / "both.toml"
    path.write_text("[sync]\nguard_peers = true\n\n[sync.guard]\npeers = false\n")
    with pytest.raises(ValueError, match=f"^{path}: sync.guard_peers and sync.guard.peers are the same option"):
        load_config(path)
    # in two layers the later one wins, as for any option: the file's old name, then the flag's new one
    path.write_text("[sync]\nouter_lr = 0.5\n")
    with pytest.warns(ConfigWarning):
        assert load_config(path, ["--sync.outer.lr=0.6"]).sync.outer.lr == 0.6
    with pytest.warns(ConfigWarning) as warned:  # the old key in the file and in a flag: one line
        assert load_config(path, ["--sync.outer_lr=0.7"]).sync.outer.lr == 0.7
    assert [str(w.message) for w in warned] == ["sync.outer_lr is now sync.outer.lr; update the config or flag"]
    result = cli("train", "--print-config", "--sync.guard=false", "--sync.guard.enabled=true", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("dilocox: error: the flags: sync.guard and sync.guard.enabled are the same option")


def test_print_config_writes_the_sub_sections_as_tables_and_an_old_flag_warns_once(tmp_path):
    result = cli("train", "--print-config", "--sync.outer_lr=0.5", "--sync.round_seconds=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "dilocox: warning: sync.outer_lr is now sync.outer.lr; update the config or flag",
        "dilocox: warning: sync.round_seconds is now sync.round.seconds; update the config or flag",
    ]
    for table in ("[sync]", "[sync.outer]", "[sync.guard]", "[sync.round]"):
        assert f"\n{table}\n" in result.stdout, table
    printed = tomllib.loads(result.stdout)
    assert printed["sync"]["outer"]["lr"] == 0.5 and printed["sync"]["guard"]["enabled"] is True
    assert printed["sync"]["round"] == {"mode": "steps", "seconds": 0.0, "fit_link": False, "fit_link_max_steps": 96}
    assert not set(OLD_SYNC_KEYS) & set(flat_settings(printed)) and "outer_lr" not in result.stdout
    help_text = cli("train", "--help", cwd=tmp_path).stdout
    outer = help_text.split("\n[sync.outer]\n", 1)[1].split("\n[sync.guard]\n", 1)[0]
    assert "  --sync.outer.lr=FLOAT|auto  (1.4, preset dilocox)" in outer
    assert '\n[sync.round]\n  --sync.round.mode={steps,time}  ("steps")' in help_text


def test_an_old_run_directory_and_its_checkpoint_resume_under_the_new_names(tmp_path):
    """A run directory written before the sub-sections (its config.toml and its checkpoints' saved config spell the
    flat keys) is the same run as the same settings now: it goes on in its directory and its checkpoint resumes;
    another value of a moved option is named by its new key."""
    cfg = load_config(None, ["--sync.outer.lr=0.5", "--sync.guard.enabled=false", f"--run.out_dir={tmp_path}"])
    old_text = old_toml(to_toml(cfg))
    assert "\nouter_lr = 0.5\n" in old_text and "\nguard = false\n" in old_text and "[sync.outer]" not in old_text
    (tmp_path / "config.toml").write_text(old_text)
    assert settings_changed(tmp_path, cfg) == []  # the same run: it resumes in its own directory
    assert "sync.outer.lr: 0.5 -> 0.6" in settings_changed(
        tmp_path, load_config(None, ["--sync.outer.lr=0.6", "--sync.guard.enabled=false", f"--run.out_dir={tmp_path}"])
    )
    with pytest.warns(ConfigWarning) as warned:  # evaluate and export read a run's config.toml: it loads, as it was
        loaded = load_config(tmp_path / "config.toml")
    assert to_dict(loaded) == to_dict(cfg)
    assert len(warned) == len(OLD_SYNC_KEYS)  # one line per old key
    checkpoint = tmp_path / "checkpoints" / "step_00000012"
    checkpoint.mkdir(parents=True)
    old_config = tomllib.loads(old_text)
    assert "outer" not in old_config["sync"] and old_config["sync"]["outer_lr"] == 0.5
    files = {f"rank_{rank:05d}.pt": {"bytes": 0, "sha256": ""} for rank in range(cfg.world_size)}
    write_meta(checkpoint, {"step": 12, **run_identity(cfg), "config": old_config, "files": files})
    check_resume(cfg, checkpoint)  # the saved outer optimizer's settings agree under their new names
    other = load_config(None, ["--sync.outer.lr=0.6"])
    with pytest.raises(ValueError, match="sync.outer.lr was 0.5 in the checkpoint, 0.6 now; resume with "):
        check_resume(other, checkpoint)
