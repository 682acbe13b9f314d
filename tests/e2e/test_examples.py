"""The examples run as a user runs them: `examples/custom_loop.py` under real torchrun, 2 ranks on gloo."""

import os
import re
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO, TORCHRUN

pytestmark = pytest.mark.e2e


def test_custom_loop_example_trains_and_ends_with_identical_parameters():
    result = subprocess.run(
        [*TORCHRUN, str(REPO / "examples" / "custom_loop.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "final parameters identical on all 2 ranks" in out  # the example asserts torch.equal across ranks
    rounds = re.findall(r"^step +(\d+) +loss ([\d.]+) +outer steps (\d+)(.*)$", out, flags=re.MULTILINE)
    assert [(int(step), int(outer)) for step, _, outer, _ in rounds] == [(10 * k, k) for k in range(1, 11)]
    # with the one-step delay nothing is applied at the first round's end, then one int4 sync every round
    assert "applied" not in rounds[0][3] and all("applied: " in tail for *_, tail in rounds[1:])
    sent = [int(m.replace(",", "")) for m in re.findall(r"applied: ([\d,]+) B sent \(fp32: ([\d,]+) B\)", out)[0]]
    assert sent[0] < sent[1] / 7  # int4 in groups of 64: 4.25 bits per value instead of 32
    initial, final = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert final < initial / 5


def test_custom_loop_example_without_torchrun_says_how_to_run_it_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "examples/custom_loop.py"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )
    assert result.returncode == 1
    assert result.stderr == (
        "examples/custom_loop.py: run it with torchrun: torchrun --standalone --nproc-per-node 2 "
        "examples/custom_loop.py\n"
    )
