"""Ranks that do not run the same settings stop before training, and a cluster whose payloads are all rejected stops
the run: real torchrun nodes and a real local run, each ending with one line and a non-zero exit."""

import re
import shutil

import numpy as np
import pytest

from tests.e2e.helpers import DEBUG, dilocox, torchrun_nodes

pytestmark = pytest.mark.e2e

AUTHENTICATED = ["--preset=dilocox-lowrank", "--compression.kind=int4"]  # a key tags gathered payloads of a codec


def _no_python_traceback_of_dilocox(stderr: str) -> bool:
    return not [line for line in stderr.splitlines() if line.strip().startswith('File "') and "/dilocox/" in line]


@pytest.mark.parametrize("differs", ["lr", "key"])
def test_torchrun_nodes_with_other_settings_stop_before_training_naming_the_setting_and_the_node(tmp_path, differs):
    run_dir = tmp_path / "run"
    flags = ["train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--topology.num_clusters=3", "--train.steps=20"]
    if differs == "lr":
        node2 = ["--train.lr=0.03", "--sync.outer.lr=1.5"]
        want = "train.lr: 0.003 on ranks 0-1 (nodes 0-1), 0.03 on rank 2 (node 2); sync.outer.lr: 0.7 on ranks 0-1 " \
            "(nodes 0-1), 1.5 on rank 2 (node 2); start every node"  # fmt: skip
    else:  # the same flags; node 2's key file holds another key
        keys = [tmp_path / "node01.key", tmp_path / "node2.key"]
        keys[0].write_bytes(b"secret-of-nodes-0-and-1-0123456789")
        keys[1].write_bytes(b"secret-that-node-2-was-given-98765")
        flags += AUTHENTICATED
        node2 = [f"--network.auth_key_file={keys[1]}"]
        flags_01 = [f"--network.auth_key_file={keys[0]}"]
        fingerprint = "key [0-9a-f]{16}"
        want = rf"network.auth_key_file: {fingerprint} on ranks 0-1 \(nodes 0-1\), {fingerprint} on rank 2 \(node 2\)"
    node_args = {2: node2} if differs == "lr" else {0: flags_01, 1: flags_01, 2: node2}
    nodes = torchrun_nodes(3, *flags, node_args=node_args)
    for node, result in enumerate(nodes):
        assert result.returncode != 0, f"node {node} exited 0: {result.stderr[-3000:]}"
        errors = [line for line in result.stderr.splitlines() if line.startswith("dilocox: error:")]
        assert len(errors) == 1, f"node {node}: {result.stderr[-3000:]}"
        assert errors[0].startswith("dilocox: error: the ranks of this run were started with other settings: ")
        if differs == "lr":
            assert want in errors[0]
        else:
            assert re.search(want, errors[0]), errors[0]
            assert "secret-" not in result.stdout + result.stderr  # the keys themselves never show
        assert "exitcode  : 2" in result.stderr  # torchrun's report of the worker: a user error
        assert _no_python_traceback_of_dilocox(result.stderr), result.stderr[-3000:]
    assert not run_dir.exists()  # nothing written: no run directory, no checkpoint


def _words(path, seed: int) -> None:
    """A one-document .txt corpus of ~12k random words (enough for the debug model's shards and one eval batch)."""
    words = np.random.default_rng(seed).choice("the king queen sword crown night day love death river".split(), 12_000)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)) + "\n")


def test_torchrun_nodes_on_other_data_stop_before_training_and_a_node_local_copy_runs(tmp_path):
    _words(tmp_path / "node0" / "corpus.txt", seed=0)
    _words(tmp_path / "node1" / "corpus.txt", seed=1)  # another text of the same size
    shutil.copytree(tmp_path / "node0", tmp_path / "copy")  # the same text at another path
    run_dir = tmp_path / "run"
    flags = ["train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=6", "--sync.inner_steps=3",
             "--checkpoint.interval=0", "--eval.interval=0", "--eval.final_max_batches=1"]  # fmt: skip

    nodes = torchrun_nodes(2, *flags, node_args={n: [f"--data.path={tmp_path / f'node{n}'}"] for n in (0, 1)})
    for node, result in enumerate(nodes):
        assert result.returncode != 0, f"node {node} exited 0: {result.stderr[-3000:]}"
        errors = [line for line in result.stderr.splitlines() if line.startswith("dilocox: error:")]
        assert len(errors) == 1, f"node {node}: {result.stderr[-3000:]}"
        assert re.search(
            r"data\.path: content [0-9a-f]{16} on rank 0 \(node 0\), content [0-9a-f]{16} on rank 1 \(node 1\); ",
            errors[0],
        ), errors[0]
        assert _no_python_traceback_of_dilocox(result.stderr), result.stderr[-3000:]
    assert not run_dir.exists()

    nodes = torchrun_nodes(2, *flags, node_args={0: [f"--data.path={tmp_path / 'node0'}"],
                                                 1: [f"--data.path={tmp_path / 'copy'}"]})  # fmt: skip
    for node, result in enumerate(nodes):
        assert result.returncode == 0, f"node {node}: {result.stderr[-3000:]}"
    assert (run_dir / "summary.json").is_file()


def test_a_cluster_whose_payloads_every_other_cluster_rejects_stops_a_local_run(tmp_path):
    key = tmp_path / "wan.key"
    key.write_bytes(b"k" * 32)
    run_dir = tmp_path / "run"
    result = dilocox(
        "train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--topology.num_clusters=3", *AUTHENTICATED,
        f"--network.auth_key_file={key}", "--train.steps=20", "--sync.inner_steps=5", "--checkpoint.interval=0",
        "--eval.interval=0", "--faults.kind=forge", "--faults.cluster=2", "--faults.rounds=1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("dilocox: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.match(
        r"dilocox: error: every other cluster rejected the slow-link payload of cluster 2 in exchange \d+ \(its "
        r"HMAC-SHA256 tag does not verify under network\.auth_key_file: .*\); a cluster whose payloads are refused "
        r"trains apart from the others, so the run stops",
        errors[0],
    ), errors[0]
    # each of the other clusters said what it rejected
    for rank in (0, 1):
        assert f"rank {rank} (cluster {rank}) rejected the slow-link payload of cluster 2" in result.stderr
    assert _no_python_traceback_of_dilocox(result.stderr), result.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "summary.json").exists()
