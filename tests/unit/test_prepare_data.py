"""`dilocox prepare-data` and prepared token directories: streaming tokenization, TokenFiles, loading for training."""

import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from dilocox.config import load_config
from dilocox.data import (
    EOS_TOKEN,
    ShardedTokenStream,
    Tokenizer,
    iter_eval_batches,
    load_documents,
    prepare_tokens,
    train_bpe,
    validation_document_indices,
)
from dilocox.data.corpus import iter_document_pieces
from dilocox.data.prepare import prepare_dataset
from dilocox.data.tokenfiles import INDEX_FILE, TokenFiles, read_index
from dilocox.launch.preflight import data_warnings, preflight
from dilocox.trainer import prepare_data

WORDS = "the king queen sword crown night day love death river stone fire hope fear bright dark".split()


def make_text(seed: int, num_lines: int, *, punctuation: bool = False) -> str:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=10)) + ("." if punctuation and i % 3 else "") for i in range(num_lines)]
    return f"document{seed}\n" + "\n".join(lines) + "\n"


def write_mixed_corpus(directory: Path, num_txt: int = 8, num_jsonl: int = 6) -> Path:
    """.txt files (one document each, one of them blank) and a .jsonl file (one document per line)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_txt):
        (directory / f"a{i:02d}.txt").write_text(make_text(i, 30 + 7 * i, punctuation=i % 2 == 1), encoding="utf-8")
    (directory / "blank.txt").write_text(" \n\n")
    records = [{"text": make_text(100 + i, 12), "id": i} for i in range(num_jsonl)] + [{"text": "   "}]
    (directory / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return directory


def assert_same_tokens(prepared, in_memory) -> None:
    assert isinstance(prepared.train, TokenFiles) and isinstance(prepared.val, TokenFiles)
    assert np.array_equal(prepared.train[:], in_memory.train[:]) and np.array_equal(prepared.val[:], in_memory.val[:])
    assert (prepared.vocab_size, prepared.eos_id) == (in_memory.vocab_size, in_memory.eos_id)
    assert (prepared.num_train_documents, prepared.num_val_documents) == (
        in_memory.num_train_documents,
        in_memory.num_val_documents,
    )


# ---- the corpus as a stream of pieces -----------------------------------------------------------------------------


def test_pieces_join_to_the_documents_and_encode_to_the_same_ids(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    (corpus / "crlf.txt").write_bytes(b"first line\r\nsecond line\rthird\r\n" * 50)
    documents = load_documents(str(corpus))
    # Pieces of at most ~100 characters: the long files come in many pieces.
    pieces = list(iter_document_pieces(str(corpus), piece_chars=100))
    joined: list[str] = []
    for starts_document, piece in pieces:
        if starts_document:
            joined.append(piece)
        else:
            joined[-1] += piece
    assert joined == documents and len(pieces) > 3 * len(documents)
    assert "\r" not in "".join(documents)  # universal newlines, as Path.read_text gives them
    # Cut only after a line break between two non-space characters, so a byte-level BPE gives the same ids.
    tok = train_bpe(documents, 400)
    encoded: list[list[int]] = []
    for starts_document, piece in pieces:
        if starts_document:
            encoded.append([])
        encoded[-1].extend(tok.encode(piece))
    assert encoded == tok.encode_batch(documents)


def test_a_text_file_without_safe_cuts_is_cut_at_the_hard_limit(tmp_path):
    (tmp_path / "one.txt").write_text("word " * 2_000)  # no line break at all
    pieces = list(iter_document_pieces(str(tmp_path / "one.txt"), piece_chars=64))
    assert len(pieces) > 1 and all(len(piece) <= 16 * 64 + (1 << 20) for _, piece in pieces)
    assert "".join(piece for _, piece in pieces) == "word " * 2_000
    assert [starts for starts, _ in pieces] == [True] + [False] * (len(pieces) - 1)


def test_utf8_errors_name_the_byte_across_chunks(tmp_path):
    good = "é" * 700_000  # 1.4 MB: the bad byte lies in the second 1 MiB chunk
    (tmp_path / "bad.txt").write_bytes(good.encode() + b"\xff tail")
    with pytest.raises(ValueError, match=r"bad\.txt is not UTF-8 text \(invalid start byte at byte 1400000\)"):
        load_documents(str(tmp_path / "bad.txt"))


# ---- prepare_dataset against the in-memory path --------------------------------------------------------------------


def test_prepared_tokens_equal_the_in_memory_path(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus")
    index = prepare_dataset(str(corpus), tmp_path / "prepared", vocab_size=320, val_fraction=0.2, tokens_per_file=700)
    in_memory = prepare_tokens(path=str(corpus), vocab_size=320, val_fraction=0.2)
    prepared = prepare_tokens(path=str(tmp_path / "prepared"), vocab_size=999, val_fraction=0.5)  # fixed at prepare
    assert_same_tokens(prepared, in_memory)
    assert Path(prepared.tokenizer_path).read_bytes() == Path(in_memory.tokenizer_path).read_bytes()
    assert Path(prepared.tokenizer_path).parent == tmp_path / "prepared"

    # The index's counts match the files, byte for byte.
    on_disk = json.loads((tmp_path / "prepared" / INDEX_FILE).read_text())
    assert on_disk == index == read_index(tmp_path / "prepared")
    assert index["dtype"] == "uint16" and index["split"] == "documents"
    assert index["num_documents"] == {"train": 11, "val": 3}  # 14 non-empty documents, the blank ones dropped
    for split in ("train", "val"):
        files = index["files"][split]
        assert [f["file"] for f in files] == [f"{split}-{i:05d}.bin" for i in range(len(files))]
        assert all(f["tokens"] == 700 for f in files[:-1]) and 0 < files[-1]["tokens"] <= 700
        for f in files:
            assert (tmp_path / "prepared" / f["file"]).stat().st_size == 2 * f["tokens"]
        assert sum(f["tokens"] for f in files) == index["num_tokens"][split] == len(getattr(prepared, split))
    assert len(index["files"]["train"]) > 3  # windows straddle files below
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "prepared"]  # no temporary directory left

    # Streams over the files give the in-memory batches, both shard modes, windows across file boundaries included.
    for shard in ("mixed", "contiguous"):
        kwargs = dict(seq_len=31, batch_size=4, shard_index=1, num_shards=2, seed=5, shard=shard)
        on_disk_stream = ShardedTokenStream(prepared.train, **kwargs)
        in_memory_stream = ShardedTokenStream(in_memory.train, **kwargs)
        for _ in range(3 * in_memory_stream.num_windows // 4):
            for got, expected in zip(on_disk_stream.next_batch(), in_memory_stream.next_batch(), strict=True):
                assert torch.equal(got, expected)
    for got, expected in zip(
        iter_eval_batches(prepared.val, seq_len=15, batch_size=4),
        iter_eval_batches(in_memory.val, seq_len=15, batch_size=4),
        strict=True,
    ):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_single_document_is_split_by_tokens_like_the_in_memory_path(tmp_path):
    (tmp_path / "one.txt").write_text(make_text(0, 200))
    prepare_dataset(
        str(tmp_path / "one.txt"), tmp_path / "prepared", vocab_size=300, val_fraction=0.1, tokens_per_file=150
    )
    prepared = prepare_tokens(path=str(tmp_path / "prepared"))
    in_memory = prepare_tokens(path=str(tmp_path / "one.txt"), vocab_size=300, val_fraction=0.1)
    assert_same_tokens(prepared, in_memory)
    index = read_index(tmp_path / "prepared")
    assert index["split"] == "tokens" and index["num_documents"] == {"train": 1, "val": 0}
    assert len(index["files"]["val"]) > 1  # the tail moved over in whole files and a part of one


def test_preparing_twice_gives_identical_files(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=3, num_jsonl=2)
    for name in ("first", "second"):
        prepare_dataset(str(corpus), tmp_path / name, vocab_size=300, val_fraction=0.2, tokens_per_file=900)
    first = {p.name: p.read_bytes() for p in (tmp_path / "first").iterdir()}
    assert first == {p.name: p.read_bytes() for p in (tmp_path / "second").iterdir()}
    assert oct((tmp_path / "first").stat().st_mode & 0o777) == "0o755"


def test_bpe_sample_is_bounded_and_spread(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=10, num_jsonl=0)
    prepare_dataset(str(corpus), tmp_path / "small", vocab_size=300, val_fraction=0.2, sample_chars=4_000)
    prepare_dataset(str(corpus), tmp_path / "full", vocab_size=300, val_fraction=0.2)
    small, full = (prepare_tokens(path=str(tmp_path / name)) for name in ("small", "full"))
    # A different vocabulary (learnt from about 4,000 characters), the same text.
    assert small.load_tokenizer().backend.to_str() != full.load_tokenizer().backend.to_str()
    assert small.load_tokenizer().decode(small.train[:]) == full.load_tokenizer().decode(full.train[:])


def test_a_vocabulary_above_65536_ids_is_stored_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "big.json"))
    text = " ".join(f"w{i}" for i in range(0, 70_000, 7))  # ids up to 69,993
    (tmp_path / "corpus").mkdir()
    for i in range(4):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text)
    index = prepare_dataset(str(tmp_path / "corpus"), tmp_path / "prepared", tokenizer=str(tmp_path / "big.json"))
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_001  # <|endoftext|> appended as id 70,000
    data = prepare_tokens(path=str(tmp_path / "prepared"))
    assert data.train.dtype == np.uint32 and (tmp_path / "prepared" / "train-00000.bin").stat().st_size == 4 * len(
        data.train
    )
    train = data.train[:]
    assert int(train.max()) == 70_000 and sorted(set(train.tolist()) - {70_000}) == list(range(0, 70_000, 7))
    stream = ShardedTokenStream(data.train, seq_len=99, batch_size=2, shard_index=0, num_shards=2, seed=0)
    inputs = torch.cat([stream.next_batch()[0] for _ in range(stream.num_windows // 2)])  # one epoch
    assert int(inputs.max()) > 65_535  # read back above 16 bits through the stream

    small = prepare_dataset(str(tmp_path / "corpus"), tmp_path / "small", vocab_size=300)
    assert small["dtype"] == "uint16"


def test_the_run_directory_copy_of_the_tokenizer_is_accepted_and_another_is_refused(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=3, num_jsonl=1)
    prepare_dataset(str(corpus), tmp_path / "prepared", vocab_size=300, val_fraction=0.25)
    copy = tmp_path / "run" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes((tmp_path / "prepared" / "tokenizer.json").read_bytes())
    assert len(prepare_tokens(path=str(tmp_path / "prepared"), tokenizer=str(copy)).val) > 0
    train_bpe([make_text(9, 30)], 290).save(tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*other\.json.* is not the tokenizer .* prepared with"):
        prepare_tokens(path=str(tmp_path / "prepared"), tokenizer=str(tmp_path / "other.json"))


def test_a_damaged_prepared_directory_is_refused(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=3, num_jsonl=1)
    prepare_dataset(str(corpus), tmp_path / "prepared", vocab_size=300, val_fraction=0.25)
    with open(tmp_path / "prepared" / "train-00000.bin", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ValueError, match=r"train-00000\.bin should hold \d+ tokens .* --overwrite"):
        prepare_tokens(path=str(tmp_path / "prepared"))
    with open(tmp_path / "prepared" / "train-00000.bin", "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 1)
    index = json.loads((tmp_path / "prepared" / INDEX_FILE).read_text())
    del index["files"]["val"][0]["sampled_sha256"]  # written before the index recorded digests
    (tmp_path / "prepared" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"records no digest or largest id of val-00000\.bin .* --overwrite"):
        prepare_tokens(path=str(tmp_path / "prepared"))
    (tmp_path / "prepared" / INDEX_FILE).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=r"not a version-1 dilocox-tokens index"):
        prepare_tokens(path=str(tmp_path / "prepared"))


# ---- refusals, atomicity --------------------------------------------------------------------------------------------


def test_bad_input_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=2, num_jsonl=1)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"data\.path=.*missing.* does not exist"):
        prepare_dataset(str(tmp_path / "missing"), out)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match=r"contains no text"):
        prepare_dataset(str(tmp_path / "empty"), out)
    with pytest.raises(ValueError, match=r"--val-fraction=0\.7 must be in \(0, 0\.5\]"):
        prepare_dataset(str(corpus), out, val_fraction=0.7)
    with pytest.raises(ValueError, match=r"--vocab-size=100 is too small"):
        prepare_dataset(str(corpus), out, vocab_size=100)
    with pytest.raises(ValueError, match=r"--reader='hf' is not one of: auto, files, datasets"):
        prepare_dataset(str(corpus), out, reader="hf")
    (corpus / "zz.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"zz\.jsonl:2 is not valid JSON"):
        prepare_dataset(str(corpus), out, vocab_size=300)
    (corpus / "zz.jsonl").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty"]  # nothing half-written

    # An interruption while the tokens are written removes the temporary directory.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(str(corpus), out, vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty"]


def test_an_existing_out_directory_is_refused_unless_overwriting_prepared_data(tmp_path):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=3, num_jsonl=1)
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is fine
    prepare_dataset(str(corpus), out, vocab_size=300, val_fraction=0.25)
    before = (out / "train-00000.bin").read_bytes()
    with pytest.raises(ValueError, match=r"--out .*out already holds prepared data; pass --overwrite"):
        prepare_dataset(str(corpus), out, vocab_size=300)
    prepare_dataset(str(corpus), out, vocab_size=400, val_fraction=0.25, overwrite=True)
    assert (out / "train-00000.bin").read_bytes() != before and read_index(out)["vocab_size"] > 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("not prepared data")
    for overwrite in (False, True):  # --overwrite replaces only prepared data, never other files
        with pytest.raises(ValueError, match=r"--out .*notes exists and is not empty"):
            prepare_dataset(str(corpus), tmp_path / "notes", overwrite=overwrite)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "not prepared data"
    with pytest.raises(ValueError, match=r"--out .*keep\.txt is a file"):
        prepare_dataset(str(corpus), tmp_path / "notes" / "keep.txt")


# ---- TokenFiles ----------------------------------------------------------------------------------------------------


def write_token_files(directory: Path, tokens: np.ndarray, sizes: list[int]) -> TokenFiles:
    paths, position = [], 0
    for i, size in enumerate(sizes):
        path = directory / f"t{i}.bin"
        tokens[position : position + size].astype("<u2").tofile(path)
        paths.append(path)
        position += size
    return TokenFiles(paths, sizes, np.uint16)


def test_token_files_read_like_one_array(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 60_000, size=1_000).astype(np.uint16)
    files = write_token_files(tmp_path, tokens, [300, 1, 450, 249])
    assert len(files) == 1_000 and files.dtype == np.uint16
    for lo, hi in [(0, 1_000), (299, 302), (300, 301), (5, 5), (990, 2_000), (-10, None)]:
        assert np.array_equal(files[lo:hi], tokens[lo:hi])
    starts = np.array([0, 290, 299, 300, 700, 751, 990])  # inside a file, across one, across two
    assert np.array_equal(files.windows(starts, 10), tokens[starts[:, None] + np.arange(10)])
    with pytest.raises(IndexError):
        files.windows(np.array([995]), 10)
    with pytest.raises(TypeError):
        files[::2]


def test_a_mixed_stream_over_token_files_holds_no_corpus_sized_memory(tmp_path):
    tokens = (np.arange(4_000_000) % 50_000).astype(np.uint16)
    files = write_token_files(tmp_path, tokens, [1_500_000, 2_500_000])  # 8 MB on disk
    kwargs = dict(seq_len=255, batch_size=16, shard_index=1, num_shards=2, seed=0)
    tracemalloc.start()
    try:
        stream = ShardedTokenStream(files, **kwargs)
        for _ in range(50):
            inputs, _ = stream.next_batch()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stream.num_windows == 4_000_000 // 256 // 2
    # A batch of int64 rows and the permutations' work arrays: tens of kB, not the 8 MB of tokens (nor the 62 kB
    # a stored order of the shard's 7,812 windows would take).
    assert peak < 200_000, peak
    in_memory = ShardedTokenStream(tokens, **kwargs)
    for _ in range(50):
        expected, _ = in_memory.next_batch()
    assert torch.equal(inputs, expected)


# ---- Hugging Face datasets -----------------------------------------------------------------------------------------


def test_missing_datasets_names_the_extra(tmp_path, monkeypatch):
    corpus = write_mixed_corpus(tmp_path / "corpus", num_txt=2, num_jsonl=0)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if it were not installed
    with pytest.raises(ValueError, match=r"pip install 'dilocox\[datasets\]'"):
        prepare_dataset(str(corpus), tmp_path / "out", reader="datasets")
    assert not (tmp_path / "out").exists()


def test_a_saved_hf_dataset_prepares_like_the_same_documents_in_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    texts = [make_text(i, 10 + i) for i in range(12)]
    dataset = datasets.Dataset.from_dict({"body": texts[:6] + [None] + texts[6:], "n": list(range(13))})
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))

    options = dict(vocab_size=300, val_fraction=0.2, text_field="body")
    from_saved = prepare_dataset(str(tmp_path / "saved"), tmp_path / "a", **options)  # auto: read through datasets
    from_files = prepare_dataset(str(tmp_path / "docs.jsonl"), tmp_path / "b", **options)
    streamed = prepare_dataset(str(tmp_path / "docs.jsonl"), tmp_path / "c", reader="datasets", **options)
    assert from_saved["reader"] == streamed["reader"] == "datasets" and from_files["reader"] == "files"
    a, b, c = (prepare_tokens(path=str(tmp_path / name)) for name in "abc")
    assert_same_tokens(a, b)
    assert_same_tokens(c, b)
    held_out = validation_document_indices(12, 0.2)
    assert a.load_tokenizer().decode(a.val[:]).split(EOS_TOKEN) == [texts[i] for i in held_out]

    with pytest.raises(ValueError, match=r"data\.text_field='text'.*no such column.*--text-field"):
        prepare_dataset(str(tmp_path / "saved"), tmp_path / "d", vocab_size=300)


def test_a_text_too_small_for_the_vocabulary_asked_gives_fewer_ids_and_says_so(tmp_path, capsys):
    """16 distinct words: BPE runs out of merges long before 1024 ids. prepare-data and train both say so."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for seed in range(6):
        (corpus / f"doc{seed}.txt").write_text(make_text(seed, 40))
    index = prepare_dataset(str(corpus), tmp_path / "prepared", vocab_size=1024, val_fraction=0.2)
    ids = index["vocab_size"]
    assert 257 < ids < 1024
    err = capsys.readouterr().err
    assert err == (
        f"dilocox: warning: the BPE has {ids:,} ids, fewer than the 1,024 asked (--vocab-size=1024): every word of "
        f"this text is already a single token, so nothing is left to merge; the model's vocabulary is {ids:,} ids. "
        f"Use more text for more ids, or --vocab-size={ids} to ask for what it has\n"
    )
    small = [f"--data.path={corpus}", "--data.val_fraction=0.2", "--train.seq_len=16"]
    cfg = load_config(None, [*small, "--data.vocab_size=1024"])
    data = prepare_data(cfg)
    assert data.vocab_size == ids and capsys.readouterr().err == ""  # said by the launcher once its checks pass
    warned = data_warnings(cfg, data)
    assert warned == [
        f"dilocox: warning: the BPE has {ids:,} ids, fewer than the 1,024 asked (--data.vocab_size=1024): every word "
        f"of this text is already a single token, so nothing is left to merge; the model's vocabulary is {ids:,} "
        f"ids. Use more text for more ids, or --data.vocab_size={ids} to ask for what it has"
    ]
    exact = load_config(None, [*small, f"--data.vocab_size={ids}"])
    assert data_warnings(exact, prepare_data(exact)) == []
    preflight(load_config(None, [*small, "--data.vocab_size=1024", f"--run.out_dir={tmp_path / 'run'}"]))
    assert capsys.readouterr().err == warned[0] + "\n"  # `dilocox train`'s checks, once
    prepare_dataset(str(corpus), tmp_path / "exact", vocab_size=ids, val_fraction=0.2)
    assert capsys.readouterr().err == ""  # asked for what it has: nothing to say
