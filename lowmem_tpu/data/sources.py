"""Reading records: ``builtin:`` files, local JSONL/JSON/CSV/Parquet, Hub datasets; malformed files named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_tpu.config.assets import BUILTIN, looks_local, resolve_builtin
from lowmem_tpu.errors import UserError

if TYPE_CHECKING:
    import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(UserError):
    """A user error in the data (the CLI prints it and exits 2). Message names the problem and the fix."""


# --------------------------------------------------------------------------- loading


def load_records(path: str, split: str = "train", subset: str | None = None) -> datasets.Dataset:
    """Records of ``builtin:NAME``, a local .jsonl/.json/.csv/.parquet file (or directory), or a Hub dataset
    (``subset``: its configuration).

    JSON files are checked line by line first, so a malformed one fails with its line number.
    """
    if path.startswith(BUILTIN):
        file = resolve_builtin(path)
        if not file.exists():
            raise DataError(f"no built-in dataset {path!r} (looked for {file})")
        return _load_local(file, split)
    if looks_local(path):
        file = Path(path).expanduser()
        if not file.exists():
            raise DataError(f"data file not found: {path} (give an existing file or a Hub dataset id)")
        return _load_local(file, split)
    named = f", subset {subset!r}" if subset else ""
    return _load(
        path,
        f"could not load the Hub dataset {path!r} (split {split!r}{named})",
        "give a local .jsonl/.json/.csv/.parquet file instead (no network, or a wrong name, subset or split?)",
        name=subset,
        split=split,
    )


def _load_local(file: Path, split: str) -> datasets.Dataset:
    if file.is_dir():
        return _load(str(file), f"could not load the dataset directory {file}", "give one data file", split=split)
    builder = BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise DataError(f"{file}: unsupported file type {file.suffix!r}; use one of {', '.join(BUILDERS)}")
    if file.suffix.lower() == ".jsonl":
        _check_json_lines(file)
    elif builder == "json":
        _check_json(file)
    elif builder == "csv":
        _check_utf8(file)
    records = _load(builder, f"could not read {file}", "check the file", data_files=str(file), split="train")
    if len(records) == 0:
        raise DataError(f"{file} holds no records")
    return records


def _load(source: str, failure: str, fix: str, **kwargs: Any) -> datasets.Dataset:
    import datasets

    try:
        return datasets.load_dataset(source, **kwargs)
    except Exception as err:  # datasets raises many types (network, schema, parse); all are user-facing here
        raise DataError(f"{failure}: {type(err).__name__}: {err}; {fix}") from err


def _utf8_lines(file: Path) -> Iterator[tuple[int, str]]:
    """The file's lines, numbered; the first that is not UTF-8 fails (pyarrow reads such bytes and
    fails only when a row is used, with a traceback)."""
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{file}: line {number} is not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                    "save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 FILE > FILE.utf8)"
                ) from None


def _check_utf8(file: Path) -> None:
    for _ in _utf8_lines(file):
        pass


def _check_json_lines(file: Path) -> None:
    """Fail on the first line of a JSON-lines file that is not one JSON object, or on an empty file."""
    records = 0
    for number, line in _utf8_lines(file):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{file}: line {number} is not valid JSON ({err.msg}, column {err.colno}); "
                "each line must hold one JSON object (a JSON array belongs in a .json file)"
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{file}: line {number} is a JSON {type(record).__name__}, not an object")
        records += 1
    if not records:
        raise DataError(f"{file} holds no records")


def _check_json(file: Path) -> None:
    """A .json file is either one array of objects or JSON lines."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.lstrip().startswith("["):
        _check_json_lines(file)
        return
    _check_utf8(file)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{file}: line {err.lineno} is not valid JSON ({err.msg}, column {err.colno})") from None
    for index, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise DataError(f"{file}: item {index} of the array is a JSON {type(record).__name__}, not an object")
    if not records:
        raise DataError(f"{file} holds no records")


def length_percentiles(lengths: list[int]) -> dict[str, int]:
    """Tokens per sample before cutting: the median, 90th and 99th percentiles and the longest."""
    import numpy as np

    p50, p90, p99 = (int(np.percentile(lengths, q, method="higher")) for q in (50, 90, 99))
    return {"p50": p50, "p90": p90, "p99": p99, "max": max(lengths)}
