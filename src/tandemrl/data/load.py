"""Loading a dataset into Examples: a local .jsonl/.json/.parquet/.csv file, a directory (saved by `save_to_disk`, or of
data files `datasets.load_dataset` reads as splits: train.jsonl, test.csv, ...), or a hub id.

Invariant: every Example of one dataset has a valid prompt (a string or {role, content} messages) and
the same column names, missing values filled with None, so reward columns align across a batch.
`datasets` is imported only for hub ids and directories.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tandemrl.data.prompts import lone_surrogate
from tandemrl.types import REWARD_KEYWORDS, Example

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
FILE_SPLIT = "train"
"""A single data file's one split, as datasets.load_dataset reads a file: another split of it is refused."""


def load_examples(spec: str, *, split: str = "train", limit: int | None = None, config: str | None = None) -> list[Example]:
    """Rows of `spec` as Examples: `prompt` is the prompt, every other column goes to `columns`.

    A hub id may name its config after a colon ("openai/gsm8k:main") or through `config`.
    Example: a .jsonl line {"prompt": "1+1=", "answer": "2"} -> Example(prompt="1+1=", columns={"answer": "2"})
    """
    return rows_to_examples(load_rows(spec, split=split, limit=limit, config=config), source=spec)


def load_rows(spec: str, *, split: str = "train", limit: int | None = None, config: str | None = None) -> list[dict[str, Any]]:
    """The first `limit` rows of `spec` as plain dicts, whatever their columns (tasks convert them)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        rows = _read_saved(path, split, limit)
    elif is_one_file(spec):
        if split != FILE_SPLIT:
            raise ValueError(
                f"dataset {spec} is one file, whose one split is {FILE_SPLIT!r} (as datasets.load_dataset reads a file), "
                f"not {split!r}; ask for split {FILE_SPLIT} (--dataset_split, --eval_dataset_split), or give a directory of split files (train.jsonl, test.jsonl, ...)"
            )
        rows = _read_file(path, spec)[:limit]
    else:
        rows = _read_hub(spec, split, limit, config)
    if not rows:
        raise ValueError(f"dataset {spec} has no rows (split {split!r}); pass a dataset with at least one row")
    check_text(rows, spec)
    return rows


def check_text(rows: list[dict[str, Any]], source: str) -> None:
    """Every string of every row (prompt, messages, columns, at any depth) is Unicode text; else a ValueError
    naming the row and field. A lone surrogate (JSON's "\\ud800") made the tokenizer raise a TypeError
    (issue 36), and UTF-8 cannot write it; it is refused, not replaced, so no reward sees altered data.

    Example: row 3 {"prompt": [{"role": "user", "content": "hi \\ud800"}]} -> "row 3 of dataset d.jsonl:
    prompt[0].content holds a lone surrogate ..."
    """
    for index, row in enumerate(rows):
        for field, text in _strings(row, ""):
            at = lone_surrogate(text)
            if at is not None:
                raise ValueError(
                    f"row {index} of dataset {source}: {field} holds a lone surrogate {text[at]!r} at character {at}, "
                    "which is not Unicode text (half of a UTF-16 pair); fix the row or drop it"
                )


def _strings(value: Any, path: str) -> Any:
    """(path, text) of every string in `value`, keys included. Example: {"a": ["x"]} -> ("the name of a", "a"), ("a[0]", "x")"""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                yield f"the name of {name}", key
            yield from _strings(item, name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")


def rows_to_examples(rows: list[dict[str, Any]], *, source: str) -> list[Example]:
    """Checks every prompt and fills missing columns with None.

    Example: [{"prompt": "a", "x": 1}, {"prompt": "b"}] -> columns {"x": 1} and {"x": None}
    """
    names = list(dict.fromkeys(name for row in rows for name in row))
    if "prompt" not in names:
        listed = ", ".join(names)
        if "messages" in names:  # SFT's format: renamed to prompt, the model would be asked to go on after the answer
            raise ValueError(
                f"dataset {source} has no 'prompt' column (columns: {listed}); 'messages' holds whole conversations (SFT's "
                "format), the answer included: give a 'prompt' column of the messages before the answer (the answer may "
                "stay in another column, for the reward functions)"
            )
        raise ValueError(f"dataset {source} has no 'prompt' column (columns: {listed}); rename the prompt column to 'prompt'")
    others = [name for name in names if name != "prompt"]
    for name in others:
        if name in REWARD_KEYWORDS:  # the column would be replaced by tandem's keyword, silently
            keywords = ", ".join(REWARD_KEYWORDS)
            raise ValueError(f"dataset {source} has a column '{name}', a keyword reward functions receive ({keywords}); rename it")
    return [
        Example(prompt=check_prompt(row.get("prompt"), i, source), columns={k: row.get(k) for k in others}, index=i)
        for i, row in enumerate(rows)
    ]


def check_prompt(prompt: Any, index: int, source: str) -> Any:
    """The prompt itself if it is a non-blank string or a list of {role, content} dicts with some text;
    else ValueError. An empty prompt would fail every group of it, and a run of them trains on nothing."""
    messages = isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt)
    if isinstance(prompt, str) or messages:
        if prompt.strip() if isinstance(prompt, str) else any(_has_text(m) for m in prompt):
            return prompt
        raise ValueError(f"prompt of row {index} of dataset {source} is empty; give every row a prompt with text, or drop the row")
    shown = repr(prompt)[:60]
    raise ValueError(
        f"prompt of row {index} of dataset {source} is {shown}; give a string or a list of {{role, content}} messages"
    )


def _has_text(message: dict) -> bool:
    content = message["content"]
    return bool(content.strip()) if isinstance(content, str) else bool(content)


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message


def is_one_file(spec: str) -> bool:
    """Whether `spec` names a single local data file (not a directory, not a hub id)."""
    path = os.path.expanduser(spec)
    return not os.path.isdir(path) and (path.endswith(FILE_SUFFIXES) or os.path.isfile(path) or _looks_local(spec))


def _looks_local(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1


def _read_file(path: str, spec: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {spec!r} does not exist; pass an existing file, directory or hub id")
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".json"):
        return _read_json(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    if path.endswith(".csv"):
        import pyarrow.csv  # typed as `datasets` types a csv: numbers as numbers, an empty number cell None

        return pyarrow.csv.read_csv(path).to_pylist()
    raise ValueError(f"dataset file {spec!r} has an unsupported type; use .jsonl, .json, .parquet or .csv")


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number} of {path} is not valid JSON ({error}); write one object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"line {number} of {path} is not a JSON object; write one object per line")
            rows.append(row)
    return rows


def _read_json(path: str) -> list[dict[str, Any]]:
    """A list of row objects, or an object of equally long column lists."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return data
    if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        if len({len(v) for v in data.values()}) <= 1:
            return [dict(zip(data, values)) for values in zip(*data.values())]
    raise ValueError(f"{path} must hold a list of row objects or an object of equally long column lists")


def _read_saved(path: str, split: str, limit: int | None) -> list[dict[str, Any]]:
    """A directory saved by save_to_disk, else one of data files, read as `load_dataset(path)` reads it (TRL's script)."""
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except FileNotFoundError:
        try:
            dataset = datasets.load_dataset(path)
        except FileNotFoundError:  # datasets' EmptyDatasetError, DataFilesNotFoundError
            raise FileNotFoundError(
                f"{path} holds no dataset saved with save_to_disk and no data files (.jsonl, .json, .parquet, .csv); pass such a directory or a file"
            ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"dataset {path} has no split {split!r} (splits: {', '.join(dataset)}); pick one of them")
        dataset = dataset[split]
    return _take(dataset, limit)


def _read_hub(spec: str, split: str, limit: int | None, config: str | None) -> list[dict[str, Any]]:
    import datasets

    name, _, named_config = spec.partition(":")
    try:
        dataset = datasets.load_dataset(name, config or named_config or None, split=split)
    except (FileNotFoundError, ConnectionError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise FileNotFoundError(
            f"cannot load dataset {spec!r} from the hub ({reason}); check the id or pass a local file or directory"
        ) from None
    return _take(dataset, limit)


def _take(dataset: Any, limit: int | None) -> list[dict[str, Any]]:
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))
    return dataset.to_list()
