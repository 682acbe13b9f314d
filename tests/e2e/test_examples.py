"""The examples run as a user runs them: `examples/custom_loop.py` and the script of `examples/nanogpt.md` under real
torchrun, 2 ranks on gloo; a user's loop that fails ends with its own exception."""

import os
import pickle
import re
import subprocess
import sys

import numpy as np
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


def test_an_exception_in_a_loop_that_never_closes_its_sync_ends_with_the_exception_and_exit_1(tmp_path):
    """Not SIGABRT ("terminate called without an active exception"): the open channel is closed at exit."""
    script = tmp_path / "loop_that_fails.py"
    script.write_text(LOOP_THAT_FAILS)
    result = subprocess.run([*TORCHRUN, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})  # fmt: skip
    # torchrun stops the other rank (SIGTERM) once one has failed: that one may not get to print its error
    assert result.returncode == 1 and "RuntimeError: the loop failed" in result.stderr, result.stderr[-3000:]
    assert "terminate called" not in result.stderr and "SIGABRT" not in result.stderr, result.stderr[-3000:]


def _nanogpt_script() -> str:
    """The script of examples/nanogpt.md, as its python block holds it."""
    text = (REPO / "examples" / "nanogpt.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    return next(block for block in blocks if block.startswith('"""nanoGPT'))


def _char_data(directory) -> None:
    """nanoGPT's shakespeare_char layout at a tiny size: train.bin and val.bin (uint16 ids), meta.pkl."""
    text = "".join(f"First Citizen: we are accounted poor citizens {i}.\nAll: speak, speak.\n" for i in range(300))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    directory.mkdir()
    split = int(0.9 * len(ids))
    ids[:split].tofile(directory / "train.bin")
    ids[split:].tofile(directory / "val.bin")
    (directory / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": len(chars)}))


@pytest.mark.slow
def test_the_nanogpt_port_trains_agrees_and_resumes_bit_for_bit(tmp_path):
    """examples/nanogpt.md's script at a tiny size on 2 ranks: the held-out loss falls, the clusters end with the
    same parameters, and a run resumed from the checkpoint of step 12 (a sync in flight, the data generator from
    before the prefetched batch) ends with the same parameters, bit for bit, and the same slow-link bytes."""
    script = tmp_path / "train_dilocox.py"
    script.write_text(_nanogpt_script())
    _char_data(tmp_path / "data")
    tiny = ["--data_dir=data", "--max_iters=24", "--inner_steps=6", "--eval_interval=12", "--eval_iters=2",
            "--n_layer=1", "--n_head=2", "--n_embd=32", "--batch_size=4", "--block_size=32",
            "--warmup_iters=2"]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

    def run(*args):
        result = subprocess.run([*TORCHRUN, str(script), *tiny, *args], capture_output=True, text=True, timeout=240,
                                cwd=tmp_path, env=env)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    straight = run("--out_dir=straight")
    (tmp_path / "resumed").mkdir()
    for cluster in (0, 1):  # the checkpoints of step 12, the last the straight run saved
        name = f"ckpt_cluster{cluster}.pt"
        (tmp_path / "resumed" / name).write_bytes((tmp_path / "straight" / name).read_bytes())
    resumed = run("--out_dir=resumed", "--init_from=resume")
    val = [float(v) for v in re.findall(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)$", straight, re.MULTILINE)]
    assert len(val) == 3 and val[-1] < val[0]
    assert "parameters identical on all 2 clusters" in straight
    done = [re.search(r"^done in [\d.]+ s: (.*)$", out, re.MULTILINE).group(1) for out in (straight, resumed)]
    assert done[0] == done[1] and "parameters sha256" in done[0]
    after_12 = [line for line in straight.splitlines() if line.startswith(("iter 18", "iter 24", "step 24"))]
    assert after_12 == [line for line in resumed.splitlines() if line.startswith(("iter 18", "iter 24", "step 24"))]
