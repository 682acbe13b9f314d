"""The documentation: every config option documented, the generated references complete, the site built strictly.

The configuration and CLI references are generated from the code (`dilocox/tools/docgen.py`); the site is built with
`mkdocs build --strict` (mkdocs.yml), which fails on a broken link, a missing anchor or an unresolved API reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dilocox.cli import COMMANDS
from dilocox.compress.config import CODEC_KINDS, RANK_RULES, REDUCTIONS
from dilocox.config import PRESETS, flat_settings, options, read_preset
from dilocox.sync.config import MERGE_RULES, SYNC_KINDS
from dilocox.sync.faults import FAULT_KINDS
from dilocox.tools import docgen

REPO = Path(__file__).resolve().parents[2]


def test_every_config_option_has_a_one_line_docstring():
    undocumented = [name for name, _, _, doc in options() if not doc.strip()]
    assert not undocumented, f"config options without a docstring under the field: {undocumented}"
    multi_line = [name for name, _, _, doc in options() if "\n" in doc.strip()]
    assert not multi_line, f"config options whose docstring is not one line: {multi_line}"


def test_allowed_values_are_read_from_the_choice_types():
    assert docgen.allowed_values("sync.kind") == SYNC_KINDS == ("allreduce", "cocktail", "diloco", "dilocox")
    assert docgen.allowed_values("sync.merge") == ("auto", *MERGE_RULES)  # a rule, or its auto rule
    assert docgen.allowed_values("compression.kind") == CODEC_KINDS
    assert docgen.allowed_values("compression.reduction") == REDUCTIONS
    assert docgen.allowed_values("compression.rank_rule") == RANK_RULES
    assert docgen.allowed_values("faults.kind") == FAULT_KINDS
    assert docgen.allowed_values("train.dtype") == ("fp32", "bf16")
    assert docgen.allowed_values("run.out_dir") is None  # free text
    assert docgen.allowed_values("network.bandwidth") is None  # parsed, not a choice
    assert docgen.allowed_values("train.steps") is None  # not a string


def test_config_reference_has_a_row_for_every_option():
    page = docgen.config_reference()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| <a id=")}
    assert list(rows) == [name for name, *_ in options()]
    for name, typ, default, doc in options():
        row = rows[name]
        assert f"| {typ.__name__} |" in row, row
        assert f"`{docgen._show(default)}`" in row, row
        assert " ".join(doc.split()).replace("|", "\\|") in row, row
    assert all(f"`{kind}`" in rows["sync.kind"] for kind in SYNC_KINDS)
    assert "sync.kind =" not in "".join(rows.values())  # no default that depends on the kind


def test_config_reference_lists_every_preset_with_every_setting():
    page = docgen.config_reference().split("## Options that do not work together")[0]
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    assert list(rows) == list(PRESETS)
    for name in PRESETS:
        for key, value in flat_settings(read_preset(name)).items():
            assert f"`{key} = {docgen._show(value)}`" in rows[name], (name, key)


def test_cli_reference_has_every_command_with_its_help():
    page = docgen.cli_reference()
    for command in COMMANDS:
        assert f"## `dilocox {command}`" in page
        first_line = docgen.command_help(command).splitlines()[0]
        assert first_line.startswith("usage: dilocox") and first_line in page, command
    assert "--sync.kind=" not in page  # train's options are the configuration reference, not repeated here


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_site_builds_strictly_with_generated_references(tmp_path):
    result = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    configuration = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    for name, *_ in options():
        assert f"<code>{name}</code>" in configuration, name
    assert "OuterSync" in (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "dilocox prepare-data" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert (tmp_path / "site" / "img" / "round.svg").is_file()


@pytest.mark.slow
def test_site_build_fails_on_a_broken_link_or_anchor(tmp_path):
    """The project's strict settings on two small pages: a link to a missing page and to a missing anchor fail."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a page](other.md#no-such-heading) and [another](missing.md)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    config.update(docs_dir=str(docs), nav=["index.md", "other.md"], hooks=[str(REPO / "dilocox/tools/docgen.py")])
    config["plugins"] = ["search"]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "missing.md" in result.stderr and "no-such-heading" in result.stderr, result.stderr


def test_the_api_pages_codec_list_is_every_codec():
    """docs/api.md's `compression` row names every codec OuterSync takes, no more."""
    row = next(
        line for line in (REPO / "docs" / "api.md").read_text().splitlines() if line.startswith("| `compression`")
    )
    listed = re.search(r"a codec name \(([^;]+);", row).group(1)
    assert [name.strip(" `") for name in listed.split(",")] == list(CODEC_KINDS)
