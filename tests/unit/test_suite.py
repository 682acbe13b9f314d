"""The README's test command runs every test file: pytest skips directories that match its `norecursedirs` (by
default `dist`, `build`, `venv`, ...), which once left every multi-rank test out of CI without a word."""

from fnmatch import fnmatch
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_directory_matches_a_pattern_pytest_does_not_recurse_into(pytestconfig):
    patterns = pytestconfig.getini("norecursedirs")
    skipped = [
        str(directory.relative_to(TESTS))
        for directory in TESTS.rglob("*")
        if directory.is_dir()
        and any(fnmatch(directory.name, pattern) for pattern in patterns)
        and any(directory.rglob("test_*.py"))
    ]
    assert skipped == [], f"pytest never collects the tests under {skipped}: rename the directories"


def test_ci_runs_exactly_the_readmes_test_command_which_includes_the_slow_tier(pytestconfig):
    """The README's test command is what .ci/run runs, slow tier included (`-m ""`); plain `python -m pytest` leaves
    the tests marked slow out, for a quicker loop."""
    addopts = pytestconfig.getini("addopts")
    assert addopts[addopts.index("-m") + 1] == "not slow"
    readme = (TESTS.parent / "README.md").read_text()
    command = next(line.split("#")[0].strip() for line in readme.splitlines() if "'.[dev]'" in line)
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert command.endswith('python -m pytest -m ""') and command in ci, command
