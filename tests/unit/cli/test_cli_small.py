"""Small things of the `tandem` command a user meets first: --version, what a stopped run says next,
a sink package missing before anything loads."""

from __future__ import annotations

import sys

import pytest

from tandemrl.cli.build import how_to_continue
from tandemrl.cli.inputs import check_inputs
from tandemrl.cli.main import main
from tandemrl.cli.train import parse


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"], ["rollout", "--max_model_len", "64", "--version"]])
def test_version_names_tandem_and_its_main_dependencies(capsys, argv):
    """`tandem train --version` too, as `pip --version` after a command: it was 'unknown flag (did you mean --epsilon?)'."""
    import tandemrl

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tandem {tandemrl.__version__} (torch ") and "transformers " in out


def test_how_to_continue_names_the_resume_command_or_the_restart(tmp_path):
    assert "no checkpoint yet" in how_to_continue(tmp_path) and f"--output_dir {tmp_path}" in how_to_continue(tmp_path)
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.pt").write_bytes(b"")
    assert how_to_continue(tmp_path) == f"continue from checkpoint-4 with: tandem train --output_dir {tmp_path} --resume"
    torchrun = "torchrun --nproc_per_node 2 -m tandemrl train"  # a run of 2 ranks goes on as it ran
    assert how_to_continue(tmp_path, ranks=2) == f"continue from checkpoint-4 with: {torchrun} --output_dir {tmp_path} --resume"


def test_a_missing_sink_package_is_an_error_before_anything_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ValueError, match="--report_to wandb needs the wandb package: pip install wandb"):
        check_inputs(parse(["--report_to", "wandb"])[0])


def test_task_help_lists_every_built_in_task():
    from tandemrl.cli.args import field_docs
    from tandemrl.config import RunConfig
    from tandemrl.tasks import TASKS

    assert all(name in field_docs(RunConfig)["task"] for name in TASKS)


def test_log_lines_follow_stdout_and_the_stderr_of_the_moment(monkeypatch):
    import io
    import logging

    from tandemrl.cli.train import LogLines

    handler = LogLines()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    out, err, order = io.StringIO(), io.StringIO(), []
    out.flush = lambda: order.append("stdout flushed")  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)  # as the progress bar's redirect does, after the handler exists
    handler.emit(logging.LogRecord("tandemrl", logging.INFO, __file__, 1, "hello", None, None))
    assert err.getvalue() == "INFO hello\n" and order == ["stdout flushed"]


@pytest.mark.parametrize("rank, said", [("0", "tandem train: interrupted\n"), ("1", "")])
def test_ctrl_c_under_torchrun_is_said_by_rank_zero_alone(monkeypatch, capsys, rank, said):
    """torchrun forwards a terminal's Ctrl-C to every rank: rank 0 says it (with how to continue, when the
    run had started), the others stay quiet, as they do for a RunStopped."""
    import tandemrl.cli.train

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(tandemrl.cli.train, "main", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == said
