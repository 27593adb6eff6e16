"""The documents of a ``--data`` file: plain text, JSON Lines, Parquet, or a ``datasets`` folder.

``read_documents(path, text_field)`` yields each document's text. Which
reader a path gets follows from what it is:

- a folder written by ``datasets.Dataset.save_to_disk`` (it holds
  ``state.json`` and ``dataset_info.json``), read by ``datasets.load_from_disk``;
- ``.jsonl`` / ``.ndjson`` (and ``.json`` whose first character opens an
  object): one JSON object a line, the document in ``text_field``;
- ``.parquet``: the column ``text_field``, read by ``pyarrow`` one row group
  at a time;
- anything else: a plain text file, the whole file one document.

Every way a file can be unusable -- a line that is not JSON, a row without the
field, a field that is not text, a column missing, a file pyarrow cannot
read -- is one ``UserError`` naming the file (and line) and the fix, raised by
``check_documents`` before any rank starts.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeweave.errors import UserError

JSON_LINES = (".jsonl", ".ndjson", ".json")
PARQUET = (".parquet", ".pq")


def kind(path: str | os.PathLike[str]) -> str:
    """``"datasets"``, ``"jsonl"``, ``"parquet"`` or ``"text"``: how ``path`` is read.

    Example:
        >>> kind("corpus.jsonl"), kind("notes.txt")
        ('jsonl', 'text')
    """
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return "datasets"
        raise UserError(
            f"--data {str(path)!r} is a folder without state.json and dataset_info.json; give a folder written "
            "by datasets' save_to_disk, or a text, JSON Lines or Parquet file"
        )
    suffix = p.suffix.lower()
    if suffix in PARQUET:
        return "parquet"
    if suffix in JSON_LINES:
        return "jsonl"
    return "text"


def read_documents(path: str | os.PathLike[str], text_field: str = "text") -> Iterator[str]:
    """Each document of ``path`` in file order (a plain text file: one document).

    Raises:
        UserError: the file cannot be read, or a record lacks ``text_field`` or holds something else than text.
    """
    how = kind(path)
    if how == "jsonl":
        yield from _json_lines(Path(path), text_field)
    elif how == "parquet":
        yield from _parquet(Path(path), text_field)
    elif how == "datasets":
        yield from _saved_dataset(Path(path), text_field)
    else:
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --data {str(path)!r} as UTF-8 text ({exc}); give a text file") from exc


def check_documents(path: str | os.PathLike[str], text_field: str = "text") -> int:
    """The number of documents of ``path``, every one read once: a bad record is one line here.

    Raises:
        UserError: as ``read_documents``; no document at all.
    """
    count = sum(1 for _ in read_documents(path, text_field))
    if count == 0:
        raise UserError(f"--data {str(path)!r} holds no document; give a file with at least one")
    return count


def _text(value: object, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise UserError(
            f"{where}: field {text_field!r} holds {type(value).__name__}, not text; give --text-field naming a text field"
        )
    return value


def _json_lines(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                where = f"--data {str(path)!r} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where} is not JSON ({exc.msg}); give one JSON object per line") from None
                if not isinstance(record, dict):
                    raise UserError(f"{where} is a JSON {type(record).__name__}, not an object; give one object a line")
                if text_field not in record:
                    keys = ", ".join(sorted(record)[:6]) or "none"
                    raise UserError(f"{where} has no field {text_field!r} (it has: {keys}); give --text-field FIELD")
                yield _text(record[text_field], where, text_field)
    except UnicodeDecodeError as exc:
        raise UserError(f"--data {str(path)!r} is not UTF-8 ({exc.reason}); give a UTF-8 JSON Lines file") from None
    except OSError as exc:
        raise UserError(f"cannot read --data {str(path)!r} ({exc.strerror}); give a readable file") from None


def _needs(module: str, path: Path, what: str) -> Any:
    """``module`` imported, or one line saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"--data {str(path)!r} ({what}) needs {module.split('.')[0]}; pip install -c constraints.txt -e '.[data]'"
        ) from None


def _check_column(path: Path, text_field: str, names: list[str]) -> None:
    if text_field not in names:
        raise UserError(
            f"--data {str(path)!r} has no column {text_field!r} (it has: {', '.join(names[:6])}); give --text-field"
        )


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    _needs("pyarrow.parquet", path, "Parquet")
    import pyarrow
    import pyarrow.parquet

    try:
        file = pyarrow.parquet.ParquetFile(path)
    except (OSError, pyarrow.ArrowException) as exc:
        raise UserError(f"cannot read --data {str(path)!r} as Parquet ({exc}); give a Parquet file") from None
    _check_column(path, text_field, file.schema_arrow.names)
    try:
        for group in range(file.num_row_groups):
            column = file.read_row_group(group, columns=[text_field]).column(0)
            for row, value in enumerate(column.to_pylist()):
                yield _text(value, f"--data {str(path)!r} row group {group} row {row}", text_field)
    except (OSError, pyarrow.ArrowException) as exc:
        raise UserError(f"cannot read --data {str(path)!r} as Parquet ({exc}); give an intact Parquet file") from None


def _saved_dataset(path: Path, text_field: str) -> Iterator[str]:
    datasets = _needs("datasets", path, "a datasets folder")
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise UserError(f"cannot load --data {str(path)!r} with datasets.load_from_disk ({exc})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise UserError(
            f"--data {str(path)!r} holds several splits ({', '.join(dataset)}); give one split's folder, e.g. "
            f"{path / next(iter(dataset))}"
        )
    _check_column(path, text_field, dataset.column_names)
    for row, value in enumerate(dataset[text_field] if len(dataset) < 4096 else _column(dataset, text_field)):
        yield _text(value, f"--data {str(path)!r} row {row}", text_field)


def _column(dataset: object, text_field: str) -> Iterator[object]:
    for batch in dataset.iter(batch_size=1024):  # type: ignore[attr-defined]
        yield from batch[text_field]
