"""The examples run as a user runs them: `examples/custom_loop.py` under real torchrun, 2 ranks on gloo."""

import os
import re
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO, TORCHRUN, free_port

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


LOOP_THAT_FAILS = """
import torch, torch.distributed as dist, dilocox
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
inner_optimizer = torch.optim.AdamW(model.parameters())
# built outside `with` and never closed: its start check (and, on a slow link, a transfer) is in flight
sync = dilocox.OuterSync(model, inner_optimizer, cluster_group=dist.group.WORLD, inner_steps=2, bandwidth="1Mbps")
raise RuntimeError("the loop failed")
"""


def test_an_exception_in_a_loop_that_never_closes_its_sync_ends_with_the_exception_and_exit_1():
    """Not SIGABRT ("terminate called without an active exception"): the open channel is closed at exit."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}  # fmt: skip
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LOOP_THAT_FAILS],
            env={**env, "RANK": str(rank)},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=120)
        assert rank.returncode == 1, stderr[-3000:]
        assert stderr.rstrip().endswith("RuntimeError: the loop failed") and "terminate called" not in stderr
