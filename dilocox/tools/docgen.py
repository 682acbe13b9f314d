"""Reference pages of the documentation site, generated from the code: every config option and every command.

The configuration reference is read from the config dataclasses (`dilocox.config.options`: name, type, default and
the docstring under each field, the text `dilocox train --help` prints), the allowed values of every choice (its
`Literal[...]` type), the shipped presets (`dilocox/presets/*.toml`) and the compatibility table (`dilocox.compat`);
the CLI reference is each command's own `--help`. Nothing is copied by hand, so the pages cannot drift from the code.

It is also the MkDocs hook that puts them into the site (`mkdocs.yml`: `hooks: [dilocox/tools/docgen.py]`): a page
holding a marker line gets the generated text in its place.

    markdown = config_reference()                    # the presets and the [section] tables, as Markdown
    markdown = cli_reference()                       # every `dilocox <command> --help`
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

CONFIG_MARKER = "<!-- generated: config-reference -->"
"""The line of a docs page that `on_page_markdown` replaces by `config_reference()`."""
CLI_MARKER = "<!-- generated: cli-reference -->"
"""The line of a docs page that `on_page_markdown` replaces by `cli_reference()`."""
HELP_COLUMNS = "110"
"""Terminal width argparse wraps `--help` at while the CLI reference is generated (the same on every machine)."""

SECTION_SUMMARIES = {
    "run": "The run directory, seed, threads and device.",
    "model": "The model's shape, or a Hugging Face model to start from.",
    "data": "The training text, tokenizer and held-out split.",
    "train": "The inner loop: steps, batch, inner optimizer and its schedule, precision.",
    "topology": "Clusters and the parallel degrees inside each (world size = clusters x dp x pp), elastic membership.",
    "sync": "The strategy that keeps the clusters together and its round: H, delay, overlap, merge, fragments.",
    "sync.outer": "The outer optimizer of the agreed parameters and its learning-rate schedule.",
    "sync.guard": "The per-round numeric guard and the peer check: which clusters' updates are left out.",
    "sync.round": "What makes a round (H inner steps or a time budget) and fit_link's choice of H.",
    "compression": "The codec that encodes pseudo-gradients for the slow link, and how payloads are averaged.",
    "cocktail": "The CocktailSGD baseline's per-step gradient compression (`sync.kind = cocktail`).",
    "network": "The slow link (emulated bandwidth, latency), timeouts, failure detection, payload authentication.",
    "eval": "Evaluations of the agreed model during training and at the end.",
    "checkpoint": "Checkpoint interval, retention and resume.",
    "metrics": "metrics.jsonl, the progress line, TensorBoard and Weights & Biases.",
    "faults": "Injected faults for testing the guard and robust aggregation; never set for a model you want.",
}
"""One line under each section's heading of the configuration reference."""


def allowed_values(name: str) -> tuple[str, ...] | None:
    """The values a choice option accepts, from its `Literal[...]` type (None: not a choice)."""
    from dilocox.config import allowed_values as choices

    return choices(name)


def _show(value: Any) -> str:
    """A default as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '""' if value == "" else f'"{value}"'
    return repr(value) if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def presets_reference() -> str:
    """Markdown: every shipped preset, its first comment line and every setting it makes."""
    from dilocox.config import DEFAULT_PRESET, PRESETS, flat_settings, preset_summary, read_preset

    lines = [
        "## Presets",
        "",
        "A preset is a named set of options shipped with the package (`dilocox/presets/NAME.toml`). Settings come in",
        "layers, each overriding the one before: the field defaults below, then the preset (`--preset NAME`, or",
        '`preset = "NAME"` at the top of a `--config` file), then the `--config` file, then the `--section.key`',
        f"flags. With neither `--preset` nor `--config`, `dilocox train` uses the `{DEFAULT_PRESET}` preset.",
        "`dilocox train [--preset NAME] [--config FILE] --print-config` prints every option as it resolves.",
        "",
        "| preset | what it is | settings |",
        "| --- | --- | --- |",
    ]
    for name in PRESETS:
        settings = "<br>".join(f"`{key} = {_show(value)}`" for key, value in flat_settings(read_preset(name)).items())
        default = " (the default)" if name == DEFAULT_PRESET else ""
        lines.append(f"| `{name}`{default} | {_cell(preset_summary(name))} | {settings} |")
    return "\n".join(lines) + "\n"


def config_reference() -> str:
    """Markdown: the presets, then one table per config section with every option's type, default, allowed values
    and docstring."""
    from dilocox.compat import matrix_markdown
    from dilocox.config import MOVED_KEYS, options

    lines: list[str] = [
        presets_reference(),
        "## Options that do not work together",
        "",
        "Every pair of options that is refused, with the reason and the fix: one table (`dilocox/compat.py`), which",
        "`dilocox train` and `OuterSync` apply before anything starts, naming the first row a config meets in one",
        "line. An option left at `auto` never meets a row: its rule resolves it to a value that works with the rest.",
        "",
        matrix_markdown(),
        "",
        "## Keys of earlier versions",
        "",
        "Options that moved or were renamed: a config file, a flag, a run directory's config.toml or a checkpoint that",
        "spells the old key loads it into the new one, with one warning line (`MOVED_KEYS` in `dilocox/config.py`).",
        "",
        "| old key | now |",
        "| --- | --- |",
        *(f"| `{old}` | [`{new}`](#{new.replace('.', '-').replace('_', '-')}) |" for old, new in MOVED_KEYS.items()),
    ]
    section = None
    for name, typ, default, doc in options():
        head = name.rpartition(".")[0]
        if head != section:
            section = head
            lines += ["", f"## `[{section}]`", "", SECTION_SUMMARIES.get(section, ""), ""]
            lines += ["| option | type | default | allowed values | meaning |", "| --- | --- | --- | --- | --- |"]
        choices = allowed_values(name)
        allowed = ", ".join(f"`{c}`" for c in choices) if choices else ""
        anchor = name.replace(".", "-").replace("_", "-")
        meaning = _cell(doc) or "(undocumented)"
        lines.append(f'| <a id="{anchor}"></a>`{name}` | {typ.__name__} | `{_show(default)}` | {allowed} | {meaning} |')
    return "\n".join(lines).strip() + "\n"


def command_help(command: str) -> str:
    """What `dilocox COMMAND --help` prints (run in this process, argparse wrapped at `HELP_COLUMNS`)."""
    from dilocox.cli import main

    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(out):
            try:
                main([command, "--help"])
            except SystemExit:  # argparse's -h exits after printing
                pass
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue().rstrip() + "\n"


def cli_reference() -> str:
    """Markdown: every command with its `--help`; `train`'s option list is the configuration reference."""
    from dilocox.cli import COMMANDS, USAGE

    lines = ["```text", "$ dilocox --help", USAGE.rstrip(), "```"]
    for command in COMMANDS:
        text = command_help(command)
        if command == "train":  # the options that follow are every config option: the configuration reference
            text = (
                text.split("\nPresets (", 1)[0].rstrip()
                + "\n\n  --SECTION.KEY=VALUE  every option of the configuration reference, and the presets\n"
            )
        lines += ["", f"## `dilocox {command}`", "", "```text", f"$ dilocox {command} --help", text.rstrip(), "```"]
        if command == "train":
            lines += [
                "",
                "Every `--section.key` option, its default and allowed values, and every preset: "
                "[Configuration](configuration.md).",
            ]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: replace the marker lines by the generated references."""
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
