"""Loading Examples from local files and saved datasets, and the errors for bad input."""

from __future__ import annotations

import json
import re

import pytest

from tandemrl.data.load import load_examples, load_rows

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_jsonl_rows_become_examples_in_order(tmp_path) -> None:
    examples = load_examples(_jsonl(tmp_path / "d.jsonl", ROWS))
    assert [e.prompt for e in examples] == ["1+1=", "2+2=", "3+3="]
    assert [e.columns for e in examples] == [{"answer": "2"}, {"answer": "4"}, {"answer": "6"}]
    assert [e.index for e in examples] == [0, 1, 2]


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_single_file_is_its_one_train_split_as_datasets_reads_it(tmp_path, suffix) -> None:
    """Another split of one file is one line naming the file and its split (on main the split was ignored: split
    test trained on the whole file, silently); a directory of split files keeps its splits."""
    path = tmp_path / f"d.{suffix}"
    if suffix == "jsonl":
        _jsonl(path, ROWS)
    else:
        path.write_text("prompt,answer\n1+1=,2\n2+2=,4\n3+3=,6\n")
    assert len(load_examples(str(path), split="train")) == 3
    message = f"dataset {path} is one file, whose one split is 'train' (as datasets.load_dataset reads a file), not 'test'; ask for split train"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_examples(str(path), split="test")


def test_limit_keeps_the_first_rows(tmp_path) -> None:
    assert [e.prompt for e in load_examples(_jsonl(tmp_path / "d.jsonl", ROWS), limit=2)] == ["1+1=", "2+2="]


def test_chat_message_prompts_and_missing_columns_filled_with_none(tmp_path) -> None:
    rows = [{"prompt": CHAT, "answer": "2"}, {"prompt": "plain", "id": 7}]
    examples = load_examples(_jsonl(tmp_path / "d.jsonl", rows))
    assert examples[0].prompt == CHAT
    assert examples[0].columns == {"answer": "2", "id": None}
    assert examples[1].columns == {"answer": None, "id": 7}


def test_json_list_and_column_object(tmp_path) -> None:
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["a", "b"], "answer": ["1", "2"]}))
    assert [e.prompt for e in load_examples(str(tmp_path / "rows.json"))] == ["1+1=", "2+2=", "3+3="]
    assert [e.columns for e in load_examples(str(tmp_path / "cols.json"))] == [{"answer": "1"}, {"answer": "2"}]


def test_parquet_with_chat_prompts(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": CHAT, "answer": "2"}, {"prompt": CHAT, "answer": "3"}]), path)
    examples = load_examples(path)
    assert examples[0].prompt == CHAT and examples[1].columns == {"answer": "3"}


def test_save_to_disk_dataset_and_dataset_dict(tmp_path) -> None:
    import datasets

    data = datasets.Dataset.from_list(ROWS)
    data.save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert [e.prompt for e in load_examples(str(tmp_path / "flat"), limit=2)] == ["1+1=", "2+2="]
    assert len(load_examples(str(tmp_path / "dict"), split="test")) == 1
    with pytest.raises(ValueError, match=r"has no split 'validation' \(splits: train, test\)"):
        load_examples(str(tmp_path / "dict"), split="validation")


def test_missing_file_names_the_path(tmp_path) -> None:
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=re.escape(repr(path))):
        load_examples(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples("./no/such/dir")


def test_missing_prompt_column_says_rename(tmp_path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    message = f"dataset {path} has no 'prompt' column (columns: question, answer); rename the prompt column to 'prompt'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_examples(path)


@pytest.mark.parametrize("prompt", [3, [], [{"content": "no role"}], ["just a string in a list"], None])
def test_bad_prompt_names_the_row(tmp_path, prompt) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=r"^prompt of row 1 of dataset .*; give a string or a list of \{role, content\} messages$"):
        load_examples(path)


def test_bad_json_line_empty_dataset_and_bad_limit(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 of .* is not valid JSON"):
        load_examples(str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_examples(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_rows(str(bad), limit=0)


def test_hub_ids_are_passed_to_datasets_with_their_config(monkeypatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(load_examples("openai/gsm8k:main", split="test", limit=2)) == 2
    load_examples("someone/data", config="other")
    assert calls == [("openai/gsm8k", "main", "test"), ("someone/data", "other", "train")]


@pytest.mark.parametrize("prompt", ["", "  \n", [{"role": "user", "content": ""}], [{"role": "user", "content": " "}, {"role": "system", "content": None}]])
def test_an_empty_prompt_is_refused_at_load_naming_the_row(tmp_path, prompt) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=r"^prompt of row 1 of dataset .* is empty; give every row a prompt with text, or drop the row$"):
        load_examples(path)


def test_a_lone_surrogate_anywhere_in_a_row_is_one_line_naming_row_and_field(tmp_path) -> None:
    """JSON's "\\ud800" decodes to half a UTF-16 pair, which no tokenizer takes: the run died in the tokenizer
    with a TypeError traceback (issue 36). Every string of a row is checked, chat messages and columns too."""
    good = '{"prompt": "fine", "answer": "1"}\n'
    cases = {
        '{"prompt": "hi \\ud800", "answer": "2"}\n': "row 1 of dataset {}: prompt holds a lone surrogate '\\ud800' at character 3",
        '{"prompt": [{"role": "user", "content": "\\udc80x"}]}\n': "row 1 of dataset {}: prompt[0].content holds a lone surrogate '\\udc80' at character 0",
        '{"prompt": "hi", "answer": "4\\ud83d"}\n': "row 1 of dataset {}: answer holds a lone surrogate '\\ud83d' at character 1",
    }
    for line, message in cases.items():
        path = tmp_path / "d.jsonl"
        path.write_text(good + line)
        with pytest.raises(ValueError, match=re.escape(message.format(path))):
            load_examples(str(path))
    path.write_text(good + '{"prompt": "a pair is fine: \\ud83d\\ude00"}\n')
    assert load_examples(str(path))[1].prompt == "a pair is fine: \U0001f600"


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"])
def test_a_column_named_like_a_reward_keyword_is_refused_naming_it(tmp_path, column) -> None:
    """Every other column reaches the reward functions by its name, but these names are the keywords tandem
    passes them itself: the column was silently replaced (a reward reading `completions` or `trainer_state`
    from the data got tandem's), so it is refused at load with one line saying to rename it."""
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", column: "2"}])
    with pytest.raises(ValueError, match=rf"^dataset .* has a column '{column}', a keyword reward functions receive .*; rename it$"):
        load_examples(path)


def test_a_csv_file_loads_with_its_values_typed(tmp_path) -> None:
    """TRL users load csv through `datasets` (typed by its csv reader); a .csv file was refused here."""
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer,weight\n"1+1=",2,0.5\n"say ""hi"", twice",4,\n')
    examples = load_examples(str(path))
    assert [e.prompt for e in examples] == ["1+1=", 'say "hi", twice']
    assert [e.columns for e in examples] == [{"answer": 2, "weight": 0.5}, {"answer": 4, "weight": None}]


def test_a_directory_of_data_files_loads_its_splits_as_datasets_does(tmp_path) -> None:
    """`load_dataset(dir)` (TRL's script, for a dataset_name that is a local directory) reads train.jsonl /
    test.jsonl as splits; such a directory was refused as not saved with save_to_disk."""
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    _jsonl(tmp_path / "data" / "test.jsonl", ROWS[:1])
    assert [e.prompt for e in load_examples(str(tmp_path / "data"))] == ["1+1=", "2+2=", "3+3="]
    assert [e.columns for e in load_examples(str(tmp_path / "data"), split="test")] == [{"answer": "2"}]
    with pytest.raises(ValueError, match=r"has no split 'validation' \(splits: train, test\); pick one of them"):
        load_examples(str(tmp_path / "data"), split="validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no dataset saved with save_to_disk and no data files"):
        load_examples(str(tmp_path / "empty"))


def test_a_messages_column_is_refused_as_whole_conversations_not_prompts(tmp_path) -> None:
    """SFT's `messages` (the answer included) is no GRPO prompt: renamed to prompt, the model would be asked
    to go on after the answer. TRL's GRPOTrainer fails on it with a KeyError."""
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT + [{"role": "assistant", "content": "2"}]}])
    with pytest.raises(ValueError, match=r"has no 'prompt' column \(columns: messages\); 'messages' holds whole conversations"):
        load_examples(path)
