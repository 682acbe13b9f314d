"""Verified checkpoints: sizes and sha256 in meta.json and meta.json's own digest, checked by every reader; a corrupt
checkpoint skipped for `latest` and refused by name in one line, and retention that never deletes the last good
checkpoint."""

import contextlib
import hashlib
import json
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dilocox.checkpoint import (
    CheckpointNotWritten,
    CorruptCheckpoint,
    checkpoint_step,
    elastic_resume_paths,
    find_checkpoint,
    find_step,
    list_checkpoints,
    load_rank_state,
    read_meta,
    save_checkpoint,
    verify_checkpoint,
    write_meta,
)


def save(run_dir, step, keep=5, keep_every=0):
    state = {"model": {"w": torch.full((64, 64), float(step))}, "step": step}
    return save_checkpoint(run_dir, step, state, rank=0, meta={"world_size": 1}, keep=keep, keep_every=keep_every)


DATA = "__0_0.distcp"
"""What rank 0 writes into a DCP checkpoint; `.metadata` beside it is DCP's index."""


def flip_a_bit(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_meta_records_size_and_sha256_and_nothing_else_is_left(tmp_path):
    path = save(tmp_path, 10)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "dcp" and sorted(meta["files"]) == [".metadata", DATA]
    for name in (".metadata", DATA):
        file = path / name
        assert meta["files"][name]["bytes"] == file.stat().st_size
        assert meta["files"][name]["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert sorted(p.name for p in path.iterdir()) == [".metadata", DATA, "meta.json"]  # digests moved into meta
    verify_checkpoint(path)
    state = load_rank_state(path, 0)
    assert state["step"] == 10 and torch.equal(state["model"]["w"], torch.full((64, 64), 10.0))


def test_pytorchs_own_dcp_tools_read_a_checkpoint(tmp_path):
    """`dcp_to_torch_save` (torch.distributed.checkpoint.format_utils) turns one into a torch.save file of every
    tensor under its path, as any DCP checkpoint."""
    path = save(tmp_path, 10)
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert sorted(whole) == ["rank0/model/w", "rank0/skeleton"]
    assert torch.equal(whole["rank0/model/w"], torch.full((64, 64), 10.0))


def test_a_checkpoint_written_before_dcp_still_loads_verified(tmp_path):
    """One `torch.save` file per rank and a meta.json without `format`: read as it was written."""
    path = tmp_path / "checkpoints" / "step_00000010"
    path.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(3)}, "step": 10}, path / "rank_00000.pt")
    data = (path / "rank_00000.pt").read_bytes()
    files = {"rank_00000.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    write_meta(path, {"step": 10, "world_size": 1, "files": files})
    assert find_checkpoint(tmp_path, "latest") == path
    assert load_rank_state(path, 0)["step"] == 10
    flip_a_bit(path / "rank_00000.pt")
    with pytest.raises(CorruptCheckpoint, match="rank_00000.pt does not match its sha256"):
        load_rank_state(path, 0)


def test_an_index_that_would_run_code_is_refused_even_when_its_digest_is_rewritten(tmp_path):
    """DCP's `.metadata` is a pickle: it is read with nothing but DCP's own classes, so one that names any other
    global (here `os.system`) is a corrupt checkpoint, not code run, whoever rewrote meta.json to match it."""
    path = save(tmp_path, 10)
    (path / ".metadata").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "owned").encode() + b"'\ntR.")
    meta = read_meta(path)
    meta["files"][".metadata"] = {"bytes": (path / ".metadata").stat().st_size,
                                  "sha256": hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()}  # fmt: skip
    write_meta(path, meta)  # with a digest that matches
    with pytest.raises(CorruptCheckpoint, match="its files cannot be read .UnpicklingError: os.system is not part"):
        load_rank_state(path, 0)
    assert not (tmp_path / "owned").exists()


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (flip_a_bit, "does not match its sha256"),
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "bytes,"),  # truncated
        (lambda f: f.write_bytes(b"\0" * f.stat().st_size), "does not match its sha256"),  # garbage, same size
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["bit-flip", "truncated", "garbage", "missing"],
)
def test_latest_skips_a_corrupt_checkpoint_and_a_named_one_is_refused(tmp_path, capsys, damage, why):
    good, bad = save(tmp_path, 10), save(tmp_path, 20)
    damage(bad / DATA)
    assert find_checkpoint(tmp_path, "latest") == good
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and str(bad) in warning and why in warning
    with pytest.raises(CorruptCheckpoint, match=why) as info:
        find_checkpoint(tmp_path, str(bad))
    assert "\n" not in str(info.value)
    assert load_rank_state(find_checkpoint(tmp_path, "latest"), 0)["step"] == 10


def test_every_checkpoint_corrupt_is_one_error(tmp_path):
    flip_a_bit(save(tmp_path, 10) / DATA)
    with pytest.raises(CorruptCheckpoint, match="every checkpoint"):
        find_checkpoint(tmp_path, "latest")


def test_retention_never_deletes_the_last_good_checkpoint(tmp_path):
    save(tmp_path, 10, keep=1)
    (tmp_path / "checkpoints" / "step_00000010" / DATA).write_bytes(b"short")  # corrupt, kept as evidence
    save(tmp_path, 20, keep=1)
    save(tmp_path, 30, keep=1)
    # keep = 1 counts good checkpoints only: 20 was pruned by 30, the corrupt 10 is not counted nor deleted
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000030"]
    assert find_checkpoint(tmp_path, "latest").name == "step_00000030"


def test_keep_every_keeps_the_first_checkpoint_of_every_span_for_good_and_the_newest_as_keep_says(tmp_path):
    # checkpoints at round boundaries that are not multiples of keep_every (H = 12): the first at or after each
    # multiple of 50 stays (12 for 0-49, 60, 108, 156), plus the newest 2
    for step in range(12, 204, 12):
        save(tmp_path, step, keep=2, keep_every=50)
    kept = [checkpoint_step(p) for p in list_checkpoints(tmp_path)]
    assert kept == [12, 60, 108, 156, 180, 192]
    save(tmp_path, 204, keep=2, keep_every=50)  # 204 starts the span 200-249: it and the newest 2 stay
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [12, 60, 108, 156, 192, 204]
    # a resume that turns the tier off prunes the old spans down to keep, as before
    save(tmp_path, 216, keep=2)
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [204, 216]


def test_a_kill_while_pruning_leaves_no_checkpoint_that_looks_complete_and_the_next_save_clears_it(
    tmp_path, monkeypatch
):
    save(tmp_path, 10, keep=1)
    root = tmp_path / "checkpoints"
    (root / ".step_00000015.partial").mkdir()  # a save killed midway
    killed = RuntimeError("killed while deleting")

    def kill(path, ignore_errors=False):
        raise killed

    monkeypatch.setattr("dilocox.checkpoint.shutil.rmtree", kill)
    with pytest.raises(RuntimeError):
        save(tmp_path, 20, keep=1)  # prunes 10, and is killed deleting it
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020"]  # 10 is hidden, not half there
    monkeypatch.undo()
    save(tmp_path, 30, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000030"]  # what the kills left is gone


def rewrite_meta(path, edit):
    """Apply `edit` to the JSON of `path`/meta.json and write it back as it is (no new digest)."""
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta, indent=2))


def test_meta_json_carries_the_digest_of_the_rest_of_it(tmp_path):
    path = save(tmp_path, 10)
    meta = json.loads((path / "meta.json").read_text())
    rest = {key: value for key, value in meta.items() if key != "digest"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert meta["digest"] == hashlib.sha256(canonical).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))  # the same entries laid out otherwise: still verifies
    assert verify_checkpoint(path) == meta and read_meta(path) == meta


def rename_files(meta):
    meta["checkpoint_files"] = meta.pop("files")


META_DAMAGE = {
    "files-renamed": (rename_files, "meta.json does not match its digest"),
    "files-renamed-no-digest": (lambda m: (rename_files(m), m.pop("digest", None)), "meta.json lists no rank files"),
    "digest-wrong": (lambda m: m.update(digest=hashlib.sha256(b"other").hexdigest()), "does not match its digest"),
    "step-edited": (lambda m: m.update(step=11), "meta.json does not match its digest"),
    "world-edited": (lambda m: (m.update(world_size=2), m.pop("digest", None)), "lists 1 rank files for a world of 2"),
}


@pytest.mark.parametrize("damage", META_DAMAGE.values(), ids=META_DAMAGE.keys())
def test_a_meta_json_that_does_not_verify_is_refused_by_every_reader_and_skipped_by_latest(tmp_path, capsys, damage):
    edit, why = damage
    good, bad = save(tmp_path, 10), save(tmp_path, 20)
    rewrite_meta(bad, edit)
    assert find_checkpoint(tmp_path, "latest") == good
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and f"skipping corrupt checkpoint {bad}: " in warning and why in warning
    readers = [
        lambda: find_checkpoint(tmp_path, str(bad)),
        lambda: find_step(tmp_path, None),
        lambda: find_step(tmp_path, 20),
        lambda: verify_checkpoint(bad),
        lambda: read_meta(bad),
        lambda: load_rank_state(bad, 0),
    ]
    for read in readers:
        with pytest.raises(CorruptCheckpoint, match=f"^checkpoint {bad} is corrupt: .*{why}") as info:
            read()
        assert "\n" not in str(info.value)
    with pytest.raises(CorruptCheckpoint, match=r"pass --step with another of its steps \(10\)$"):
        find_step(tmp_path, None)
    assert find_step(tmp_path, 10) == good


def test_an_unreadable_meta_json_is_refused_in_one_line(tmp_path):
    path = save(tmp_path, 10)
    (path / "meta.json").write_text('{"step": 10, "fi')  # cut short
    with pytest.raises(CorruptCheckpoint, match=r"meta.json is unreadable \(JSONDecodeError\)") as info:
        find_step(tmp_path, None)
    assert str(info.value).endswith("the run has no other checkpoint")


def test_a_checkpoint_saved_before_meta_had_a_digest_loads_with_its_files_verified(tmp_path, capsys):
    path = save(tmp_path, 10)
    rewrite_meta(path, lambda m: m.pop("digest"))
    assert find_checkpoint(tmp_path, "latest") == path
    assert find_step(tmp_path, None) == path
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "meta.json has no digest" in warning  # once per checkpoint and process
    assert load_rank_state(path, 0)["step"] == 10
    flip_a_bit(path / DATA)
    with pytest.raises(CorruptCheckpoint, match=f"{DATA} does not match its sha256"):
        load_rank_state(path, 0)
    with pytest.raises(CorruptCheckpoint, match="every checkpoint"):
        find_checkpoint(tmp_path, "latest")


def test_a_reader_verifies_the_files_it_reads(tmp_path):
    """load_rank_state checks the sha256 of the index and of the files that hold its rank's tensors; a full
    verification checks them all."""
    path = save(tmp_path, 10)
    meta = json.loads((path / "meta.json").read_text())
    (path / "__1_0.distcp").write_bytes(b"x" * 10)
    meta["files"]["__1_0.distcp"] = {"bytes": 10, "sha256": "0" * 64}
    meta["world_size"] = 2
    write_meta(path, meta)
    assert load_rank_state(path, 0)["step"] == 10
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp does not match its sha256"):
        verify_checkpoint(path)
    with pytest.raises(ValueError, match="has no state for rank 1: was it written by a different topology"):
        load_rank_state(path, 1)


# ---------------------------------------------------------------------------------------------- resume compatibility


def checkpoint_with(tmp_path, meta):
    """A checkpoint directory with only this meta.json (and its digest): what the resume checks read."""
    path = tmp_path / "run" / "checkpoints" / "step_00000010"
    path.mkdir(parents=True)
    files = {f"rank_{rank:05d}.pt": {"bytes": 0, "sha256": ""} for rank in range(meta.get("world_size", 1))}
    write_meta(path, {"step": 10, **meta, "files": files})
    return path


def test_resume_compares_the_fields_the_saved_state_depends_on(tmp_path):
    from dilocox.checkpoint import check_resume, run_identity
    from dilocox.config import load_config, to_dict

    saved = load_config(None, ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4", "--train.steps=20"])
    path = checkpoint_with(tmp_path, {**run_identity(saved), "config": to_dict(saved)})
    check_resume(saved, path)
    harmless = ["--compression.energy=0.5", "--train.lr=1e-3", "--run.seed=3", "--train.micro_batch_size=4"]
    check_resume(load_config(None, ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4", *harmless]), path)
    for flag, message in [
        ("--compression.group_size=32", "compression.group_size was 64 in the checkpoint, 32 now"),
        ("--sync.sync_delay=0", "sync.sync_delay was 1 in the checkpoint, 0 now; resume with --sync.sync_delay=1"),
        (
            "--sync.outer.nesterov=false",
            "sync.outer.nesterov was true in the checkpoint, false now; resume with --sync.outer.nesterov=true",
        ),
        ("--data.split_seed=0", "data.split_seed was -1 in the checkpoint, 0 now; resume with --data.split_seed=-1"),
    ]:
        cfg = load_config(None, ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4", flag])
        with pytest.raises(ValueError, match=f"^cannot resume {path}: {message}"):
            check_resume(cfg, path)
    # another pp degree is rebuilt from the saved stages (dilocox/reshape.py), but not with staggered fragments
    check_resume(
        load_config(None, ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4", "--topology.pp_degree=2"]),
        path,
    )
    cfg = load_config(None, ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4", "--topology.pp_degree=2",
                             "--sync.fragments=2"])  # fmt: skip
    with pytest.raises(ValueError, match=f"^cannot resume {path}: topology.pp_degree was 1 in it, 2 now: sync.frag"):
        check_resume(cfg, path)
    # the top-k codec's own settings are compared when it is the codec, and only then
    lowrank = ["--preset=dilocox-lowrank", "--compression.kind=lowrank_int4"]
    check_resume(load_config(None, [*lowrank, "--compression.density=0.5"]), path)
    topk = ["--preset=dilocox-lowrank", "--compression.kind=topk_int4"]
    path = checkpoint_with(tmp_path / "topk", {**run_identity(saved), "config": to_dict(load_config(None, topk))})
    with pytest.raises(ValueError, match=r"compression\.density was 0\.075 in the checkpoint, 0\.1 now"):
        check_resume(load_config(None, [*topk, "--compression.density=0.1"]), path)
    check_resume(load_config(None, [*topk, "--compression.energy=0.5"]), path)
    # a compression setting of a run without a codec does not matter; a missing field (older file) is not compared
    plain = load_config(None, ["--sync.kind=diloco"])
    config = to_dict(plain)
    del config["train"]["optimizer"]
    path = checkpoint_with(tmp_path / "plain", {**run_identity(plain), "config": config})
    check_resume(load_config(None, ["--sync.kind=diloco", "--compression.rank=2"]), path)


def test_a_checkpoint_without_a_recorded_config_is_compared_on_its_identity(tmp_path):
    from dilocox.checkpoint import check_resume, run_identity
    from dilocox.config import load_config

    old = load_config(None, [])
    path = checkpoint_with(tmp_path, run_identity(old))  # meta.json of an older version: no config
    check_resume(old, path)
    with pytest.raises(ValueError, match=r"model.flavor was 'tiny' in the checkpoint, 'debug' now; resume with"):
        check_resume(load_config(None, ["--model.flavor=debug"]), path)
    with pytest.raises(ValueError, match=r"data.shard was 'contiguous' in the checkpoint, 'mixed' now"):
        check_resume(old, checkpoint_with(tmp_path / "x", {**run_identity(old), "config": {"data": {}}}))


def test_the_model_and_tokenizer_of_a_checkpoint_are_compared_after_the_data_is_loaded(tmp_path):
    import dataclasses

    from dilocox.checkpoint import check_resume_model
    from dilocox.models import model_args

    args = model_args("debug", vocab_size=300)
    path = checkpoint_with(tmp_path, {"model_args": dataclasses.asdict(args), "tokenizer_vocab": "abc"})
    check_resume_model(path, args, tokenizer_vocab="abc", tokenizer_path="t.json")
    with pytest.raises(ValueError, match=r"its tokenizer maps ids to other tokens than this run's \(300 ids in the"):
        check_resume_model(path, args, tokenizer_vocab="abd", tokenizer_path="t.json")
    wider = dataclasses.replace(args, dim=args.dim * 2)
    with pytest.raises(ValueError, match=rf"the model's dim was {args.dim} in the checkpoint, {2 * args.dim} now"):
        check_resume_model(path, wider, tokenizer_vocab="abc", tokenizer_path="t.json")


def test_a_run_directory_that_holds_another_run_is_named_as_such_under_auto_resume(tmp_path):
    """checkpoint.resume = auto takes the newest checkpoint of run.out_dir: one trained on another corpus, or past
    this run's train.steps, belongs to another run, and the message says how to start this one elsewhere."""
    from dilocox.checkpoint import run_identity
    from dilocox.config import load_config, to_dict
    from dilocox.launch.preflight import resolve_resume

    run_dir = tmp_path / "default"
    one = ["--topology.num_clusters=1"]  # one rank file per checkpoint
    saved = load_config(None, [*one, f"--run.out_dir={run_dir}", "--train.steps=400"])  # the built-in corpus
    state = {"model": {"w": torch.zeros(2)}, "step": 400}
    meta = {"world_size": saved.world_size, **run_identity(saved), "config": to_dict(saved)}
    path = save_checkpoint(run_dir, 400, state, rank=0, meta=meta, keep=2)
    own = tmp_path / "own.txt"
    own.write_text("my own text\n")

    other_data = load_config(None, [*one, f"--run.out_dir={run_dir}", f"--data.path={own}", "--train.steps=400"])
    with pytest.raises(ValueError) as refused:
        resolve_resume(other_data)
    assert str(refused.value) == (
        f"run.out_dir = {run_dir} holds another run, trained on data.path = '' (the built-in Shakespeare plays) "
        f"(checkpoint step_00000400), not on {str(own)!r}: start the new run with another --run.out_dir, or replace "
        "that one with --run.overwrite=true (--checkpoint.resume=latest continues that run on this data)"
    )
    shorter = load_config(None, [*one, f"--run.out_dir={run_dir}", "--train.steps=200"])
    with pytest.raises(ValueError) as refused:
        resolve_resume(shorter)
    assert str(refused.value) == (
        f"run.out_dir = {run_dir} holds a run at step 400 (checkpoint step_00000400), past train.steps = 200: to "
        "continue that run raise --train.steps; otherwise start the new run with another --run.out_dir, or replace "
        "that one with --run.overwrite=true"
    )
    # every option the messages name exists, and each way out works
    assert resolve_resume(load_config(None, [*one, f"--run.out_dir={run_dir}", "--train.steps=800"])) == path
    continued = [*one, f"--run.out_dir={run_dir}", f"--data.path={own}", "--checkpoint.resume=latest"]
    continued.append("--train.steps=800")
    assert resolve_resume(load_config(None, continued)) == path  # asked for by name: fine-tuning on other data
    replaced = [*one, f"--run.out_dir={run_dir}", f"--data.path={own}", "--run.overwrite=true"]
    assert resolve_resume(load_config(None, replaced)) is None
    assert resolve_resume(load_config(None, [*one, f"--run.out_dir={tmp_path / 'new'}", f"--data.path={own}"])) is None


def save_cluster(run_dir, step, cluster, keep=2):
    """A checkpoint as an elastic cluster of one rank writes it: its own directory, its rank counted inside it."""
    state = {"model": {"w": torch.full((8,), float(step + cluster))}, "step": step}
    meta = {"world_size": 1, "elastic_cluster": cluster}
    return save_checkpoint(run_dir, step, state, rank=0, meta=meta, keep=keep, cluster=cluster)


def test_elastic_clusters_checkpoint_apart_are_pruned_apart_and_the_lowest_cluster_is_newest_at_a_step(tmp_path):
    for step in (10, 20, 30):
        for cluster in (1, 0):
            save_cluster(tmp_path, step, cluster)
    save_cluster(tmp_path, 40, 1)  # cluster 0 died before step 40
    names = [f"{p.parent.name}/{p.name}" for p in list_checkpoints(tmp_path)]
    # checkpoint.keep = 2 of each cluster's own: cluster 1's step 40 pruned its step 20, not cluster 0's
    assert names == ["cluster0/step_00000020", "cluster1/step_00000030", "cluster0/step_00000030",
                     "cluster1/step_00000040"]  # fmt: skip
    assert [p.name for p in list_checkpoints(tmp_path, cluster=0)] == ["step_00000020", "step_00000030"]
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoints" / "cluster1" / "step_00000040"
    assert find_step(tmp_path, 30) == tmp_path / "checkpoints" / "cluster0" / "step_00000030"
    assert all(verify_checkpoint(p)["world_size"] == 1 for p in list_checkpoints(tmp_path))


def test_an_elastic_resume_loads_each_clusters_own_checkpoint_of_the_step_and_skips_a_corrupt_one(tmp_path, capsys):
    for cluster in (0, 1, 2):
        save_cluster(tmp_path, 10, cluster)
    save_cluster(tmp_path, 20, 0)
    save_cluster(tmp_path, 20, 1)
    chosen = tmp_path / "checkpoints" / "cluster0" / "step_00000020"
    flip_a_bit(tmp_path / "checkpoints" / "cluster1" / "step_00000020" / DATA)
    # cluster 1's is corrupt and cluster 2 has none of step 20: both heal from cluster 0
    assert elastic_resume_paths(tmp_path, chosen, [0, 1, 2]) == {0: chosen}
    assert "cluster 1 heals from a peer, not from" in capsys.readouterr().err


def test_a_static_runs_checkpoint_is_not_resumed_as_an_elastic_run_in_one_line(tmp_path):
    """The rank files of a static run are numbered over the whole world and its sync state over the static group; an
    elastic run's are per cluster: neither kind resumes the other."""
    from dilocox.checkpoint import run_identity
    from dilocox.config import load_config, to_dict
    from dilocox.launch.preflight import resolve_resume

    run_dir = tmp_path / "run"
    flags = ["--topology.num_clusters=1", f"--run.out_dir={run_dir}", "--train.steps=400"]
    saved = load_config(None, flags)
    meta = {"world_size": saved.world_size, **run_identity(saved), "config": to_dict(saved)}
    path = save_checkpoint(run_dir, 200, {"step": 200}, rank=0, meta=meta, keep=2)
    with pytest.raises(ValueError) as refused:
        resolve_resume(load_config(None, [*flags, "--topology.elastic=true"]))
    assert str(refused.value) == (
        f"cannot resume {path}: topology.elastic was false in the checkpoint, true now; resume with "
        "--topology.elastic=false or start a new run directory"
    )


def test_a_full_disk_during_a_save_is_one_line_with_the_free_space_and_leaves_no_partial(tmp_path, monkeypatch):
    earlier = [save(tmp_path, 10), save(tmp_path, 20)]

    @contextlib.contextmanager
    def onto_a_full_disk(self, path, mode):  # what the kernel says when the disk is full: /dev/full
        with open("/dev/full", mode) as full:
            yield full

    monkeypatch.setattr(FileSystem, "create_stream", onto_a_full_disk)
    with pytest.raises(CheckpointNotWritten) as caught:
        save(tmp_path, 30)
    message = str(caught.value)
    root = tmp_path / "checkpoints"
    assert message.startswith(f"the disk is full: checkpoint step 30 could not be written to {root} (")
    assert re.search(r"\(\d+\.\d+ [MG]B free there\)", message) and "\n" not in message
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020"]  # no .partial left
    assert list_checkpoints(tmp_path) == earlier
    for path in earlier:
        verify_checkpoint(path)


def test_a_save_is_refused_before_writing_when_less_is_free_than_the_last_checkpoint_took(tmp_path, monkeypatch):
    earlier = save(tmp_path, 10)
    need = sum(entry["bytes"] for entry in read_meta(earlier)["files"].values())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    with pytest.raises(CheckpointNotWritten, match=r"^the disk is full: checkpoint step 20 could not be written"):
        save(tmp_path, 20)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000010"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need))
    later = save(tmp_path, 20)  # exactly as much free as it needs
    assert list_checkpoints(tmp_path) == [earlier, later]
