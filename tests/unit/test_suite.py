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


def test_the_slow_tier_is_left_out_of_the_readme_command_and_run_by_ci(pytestconfig):
    """`python -m pytest` (the README's command) leaves the tests marked slow out; .ci/run runs them too."""
    addopts = pytestconfig.getini("addopts")
    assert addopts[addopts.index("-m") + 1] == "not slow"
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert 'python -m pytest -m ""' in ci
