"""The recipes of README.md and the guides run as a user runs them: one after another, in one directory, after the
first run, each at a small size. None may fail on another's run directory (each says where it went instead), and
the first run's record stays as it was."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGES = ["README.md", "docs/getting-started.md", "docs/guides/elastic.md"]
"""The pages whose recipes run here, in this order (the README's first)."""
SMALL = ["--train.steps=24", "--model.flavor=debug", "--data.vocab_size=512", "--train.seq_len=64",
         "--eval.interval=0", "--eval.max_batches=2", "--eval.final_max_batches=4",
         "--metrics.progress=false"]  # fmt: skip
"""Appended to every `dilocox train`: two rounds of H = 12 of the debug model, so the recipes take seconds."""
NOT_HERE = {
    "--run.device=cuda": "needs a GPU",
    "$ELASTIC": "one launcher per machine, meeting at a Lighthouse on another host",
    "dilocox lighthouse --bind": "serves until it is stopped (the elastic tests run one)",
    "--data.path=my_corpus.jsonl": "the user's own corpus",
    "prepare-data corpus/": "the user's own corpus",
    "--data.path=data/corpus": "the user's own corpus, prepared",
    "--model.init_from=hf/": "a local Hugging Face model",
    "torchrun": "several machines",
}
"""Recipes that cannot run on one CPU machine without the user's files, and why."""


def recipes(page: str) -> list[str]:
    """The `dilocox ...` commands of a page's bash blocks, in order: continuation lines joined, comments and a
    leading `pip install ... &&` dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", (REPO / page).read_text(), flags=re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" && ")[-1].split("  #")[0].strip()
            if line.startswith("dilocox "):
                commands.append(" ".join(line.split()))
    return commands


@pytest.mark.timeout(1800)  # about 20 runs of a few seconds each, and an elastic one
def test_every_recipe_runs_after_the_first_run_and_after_each_other(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dilocox").write_text(f'#!/bin/sh\nexec {sys.executable} -m dilocox "$@"\n')
    (bin_dir / "dilocox").chmod(0o755)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ran, skipped, run_dirs = [], [], []
    for page in PAGES:
        for command in recipes(page):
            why = next((why for pattern, why in NOT_HERE.items() if pattern in command), None)
            if why is not None:
                skipped.append((command, why))
                continue
            full = command + (" " + " ".join(SMALL) if command.startswith("dilocox train") else "")
            result = subprocess.run(["bash", "-c", full], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                                    env=env)  # fmt: skip
            assert result.returncode == 0, f"{page}: {command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            ran.append(command)
            print(f"ran: {command}", flush=True)
            # a slow cluster makes the others wait for it, not for the link: no advice about the link
            assert "the slow link cannot keep up" not in result.stdout + result.stderr, command
            found = re.search(r"^  run dir     (\S+)$", result.stdout, flags=re.MULTILINE)
            if found:
                assert found.group(1) not in run_dirs, f"{command} wrote into {found.group(1)} again"
                run_dirs.append(found.group(1))
                if len(run_dirs) == 1:
                    first = json.loads((tmp_path / found.group(1) / "summary.json").read_text())
    assert ran[0] == "dilocox train" and len(run_dirs) >= 15, ran
    # the README's one-box recipes all ran, each in a directory of its own; the first run's record is untouched
    assert "runs/dilocox-2" in run_dirs and "runs/debug" in run_dirs and "runs/debug-2" in run_dirs, run_dirs
    assert json.loads((tmp_path / "runs" / "dilocox" / "summary.json").read_text()) == first
    assert {why for _, why in skipped} <= set(NOT_HERE.values())
    assert not any(cmd.startswith("dilocox train --topology") for cmd, _ in skipped)
    print(f"{len(ran)} recipes ran, {len(skipped)} need what one machine lacks:")
    for command, why in skipped:
        print(f"  {command[:90]}: {why}")
    assert (tmp_path / "plots").is_dir() and (tmp_path / "hf" / "dilocox" / "config.json").is_file()
