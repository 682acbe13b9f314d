"""Corpora read through Hugging Face ``datasets`` (the ``datasets`` extra), for ``dilocox prepare-data``.

A directory written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: its ``train`` split) is opened
with ``load_from_disk`` and read batch by batch from its memory-mapped Arrow files; local ``.jsonl``, ``.parquet``,
``.txt`` and ``.md`` files are streamed through ``load_dataset`` (a text file is one document, as in
`dilocox.data.corpus`). The data is read in place: nothing is downloaded or copied into the ``datasets`` cache.

    for text in iter_dataset_documents("data/my_saved_dataset", text_field="text"):
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from dilocox.data.corpus import _resolve_user_files

_BUILDERS = {".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".md": "text"}


def is_saved_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    if not str(path):
        return False
    directory = Path(path).expanduser()
    return (directory / "dataset_dict.json").is_file() or (
        (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file()
    )


def iter_dataset_documents(path: str, *, text_field: str = "text") -> Iterator[str]:
    """Every value of ``text_field`` (None skipped), in the dataset's order; files in sorted path order."""
    datasets = _import_datasets()
    if is_saved_dataset(path):
        yield from _iter_saved(datasets, path, text_field)
        return
    for file in _resolve_user_files(path):
        builder = _BUILDERS[file.suffix.lower()]
        options = {"sample_by": "document"} if builder == "text" else {}
        column = "text" if builder == "text" else text_field  # the text builder names its one column "text"
        stream = datasets.load_dataset(builder, data_files=[str(file)], split="train", streaming=True, **options)
        for row, record in enumerate(stream):
            if column not in record:
                raise ValueError(
                    f"data.text_field={text_field!r}: {file} has no such field (fields: {sorted(record)[:8]}); "
                    f"set --text-field to the field that holds the text"
                )
            yield from _checked([record[column]], file, f"row {row}", text_field)


def _iter_saved(datasets: ModuleType, path: str, text_field: str) -> Iterator[str]:
    dataset = datasets.load_from_disk(str(Path(path).expanduser()))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(
                f"{path} is a DatasetDict without a 'train' split (splits: {sorted(dataset)}); save the split to "
                f"prepare with `dataset[split].save_to_disk(...)`"
            )
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        raise ValueError(
            f"data.text_field={text_field!r}: the dataset at {path} has no such column (columns: "
            f"{dataset.column_names[:8]}); set --text-field to the column that holds the text"
        )
    for start, batch in enumerate(dataset.iter(batch_size=1024)):
        yield from _checked(batch[text_field], path, f"batch {start}", text_field)


def _checked(values: list, source: object, where: str, text_field: str) -> Iterator[str]:
    for value in values:
        if value is None:
            continue  # a missing row, not text
        if not isinstance(value, str):
            raise ValueError(
                f"data.text_field={text_field!r}: {source} ({where}) holds {type(value).__name__} values, not "
                f"strings; set --text-field to the column that holds the text"
            )
        yield value


def _import_datasets() -> ModuleType:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "reading a corpus through Hugging Face datasets needs the `datasets` package; run "
            "`pip install 'dilocox[datasets]'`, or use --reader=files for .txt/.md/.jsonl/.parquet files"
        ) from None
    return datasets
