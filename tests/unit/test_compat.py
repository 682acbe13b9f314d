"""The compatibility table: every row refuses its example first, in its own line, and every fix it names is accepted;
the docs' matrix is generated from it; nothing else in the config refuses a pair of features."""

from pathlib import Path

import pytest

from dilocox import compat
from dilocox.config import load_config
from dilocox.tools.docgen import config_reference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("key") / "wan.key"
    path.write_bytes(bytes(range(32)))
    path.chmod(0o600)
    return str(path)


def flags_of(text: str, key_file: str) -> list[str]:
    return text.replace("{key_file}", key_file).split()


def fix_flags(alternative: list[str], key_file: str) -> list[str]:
    """One alternative of a row's fix as flags: `--preset NAME`, or `option = value` assignments."""
    if alternative[0].startswith("--preset "):
        return ["--preset=" + alternative[0].removeprefix("--preset ")]
    flags = []
    for assignment in alternative:
        option, _, value = assignment.partition(" = ")
        value = key_file if value == "FILE" else "" if value == '""' else value
        flags.append(f"--{option}={value}")
    return flags


@pytest.mark.parametrize("row", compat.ROWS, ids=lambda row: f"{row.a.option}-{row.b.option}-{row.example}")
def test_each_row_refuses_its_example_in_its_own_line_and_accepts_every_fix(row, key_file):
    example = flags_of(row.example, key_file)
    cfg = load_config(None, example)
    with pytest.raises(ValueError) as error:
        cfg.validate()
    assert str(error.value) == row.message(cfg)  # the first error is this row's, nothing an auto value caused
    assert row.a.describe(cfg) in str(error.value) and row.b.describe(cfg) in str(error.value)
    for alternative in row.fixes:
        fixed = load_config(None, [*example, *fix_flags(alternative, key_file)])
        assert not row.applies(fixed), alternative
        others = compat.refusals(fixed)
        if not others:  # fixed: valid (a fix may uncover a row that needs a second option, e.g. several machines)
            fixed.validate()
        assert row not in others


def test_every_pair_of_the_default_preset_with_one_feature_turned_on_works_or_meets_one_row(key_file):
    """Every flag of the rows' examples alone on the default preset: `dilocox train` accepts each one the table does
    not refuse, and where it refuses, the line is a row's (the auto options follow; no refusal elsewhere)."""
    singles = {flag for row in compat.ROWS for flag in flags_of(row.example, key_file) if "preset" not in flag}
    for flag in sorted(singles):
        cfg = load_config(None, [flag])
        rows = compat.refusals(cfg)
        if rows:
            with pytest.raises(ValueError) as error:
                cfg.validate()
            assert str(error.value) == rows[0].message(cfg), flag
        else:
            cfg.validate()


def test_the_docs_matrix_is_the_table():
    reference = config_reference()
    assert compat.matrix_markdown() in reference
    assert reference.count("\n| `") >= len(compat.ROWS)
    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    assert "<!-- generated: config-reference -->" in page


def test_no_other_module_refuses_a_pair_in_the_table_words():
    """The config modules hold per-option checks only: the sentence of a pair refusal lives in dilocox/compat.py."""
    for path in ("dilocox/config.py", "dilocox/sync/config.py", "dilocox/compress/config.py", "dilocox/sync/outer.py"):
        text = (REPO / path).read_text()
        assert "does not work with" not in text and "does not support" not in text, path
