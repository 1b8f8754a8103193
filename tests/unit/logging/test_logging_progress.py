import io

import pytest

from tandemrl.logging.progress import Progress, format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_heartbeat_line_has_step_reward_kl_time_eta_queue():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(200, stream=stream, clock=clock)
    clock.now += 13.0  # 1.3 s per step so far -> 190 steps left take 247 s
    metrics = {"reward": 0.41, "kl": 0.002, "step_time": 1.31, "pipeline/queue_depth": 3, "entropy": 0.5}
    progress.update(10, metrics)
    assert stream.getvalue() == "step 10/200 reward 0.41 kl 0.002 step_time 1.3s eta 4m07s queue 3\n"


def test_heartbeat_is_rate_limited_but_shows_first_and_last_step():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(100, stream=stream, heartbeat_s=30.0, clock=clock)
    for step in range(1, 101):
        clock.now += 1.0
        progress.update(step, {"reward": 0.5})
    progress.close()
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [1, 31, 61, 91, 100]


def test_close_writes_the_newest_step_not_yet_shown():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(100, start_step=40, stream=stream, clock=clock)
    for step in range(41, 46):
        clock.now += 2.0
        progress.update(step, {"reward": 1.0})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["step 41/100 reward 1 eta 1m58s", "step 45/100 reward 1 eta 1m50s"]


def test_plain_completions_are_one_line_each_with_newlines_escaped():
    stream = io.StringIO()
    progress = Progress(10, stream=stream)
    rows = [{"prompt": "2+2?", "completion": "4\ndone", "reward": 1.0, "rewards": {"format": 0.0}}] * 6
    progress.print_completions(3, rows, max_rows=2)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "step 3 sample 1/2 reward 1 rewards/format 0 | prompt: '2+2?' | completion: '4\\ndone'"
    assert len(lines) == 2


def test_terminal_gets_a_rich_bar_and_table():
    stream, clock = TtyIO(), FakeClock()
    with Progress(20, stream=stream, clock=clock) as progress:
        assert progress.interactive
        clock.now += 5.0
        progress.update(5, {"reward": 0.75})
        progress.print_completions(5, [{"prompt": "what is 2+2", "completion": "four", "reward": 1.0}])
    out = stream.getvalue()
    assert "5/20" in out and "reward 0.75" in out and "eta 15s" in out
    assert "what is 2+2" in out and "four" in out


@pytest.mark.parametrize("seconds, text", [(7, "7s"), (59.6, "1m00s"), (245, "4m05s"), (3725, "1h02m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_force_color_does_not_turn_a_log_file_into_a_progress_bar(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    stream = io.StringIO()
    progress = Progress(10, stream=stream)
    progress.update(10, {"reward": 0.5})
    assert not progress.interactive and stream.getvalue() == "step 10/10 reward 0.5\n"


def test_a_step_stuck_in_one_phase_gets_a_line_naming_it():
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(10, stream=stream, heartbeat_s=30.0, clock=clock)
    progress.update(1, {"reward": 0.5})
    progress.phase("reward")
    clock.now += 20.0
    progress.beat_if_stuck()  # not yet past the heartbeat
    clock.now += 100.0
    progress.beat_if_stuck()
    progress.beat_if_stuck()  # once per heartbeat, not once per call
    assert stream.getvalue().splitlines()[1:] == ["step 2/10 in reward for 2m00s"]


def test_the_watch_thread_writes_while_the_step_is_stuck():
    import time

    stream = io.StringIO()
    progress = Progress(10, stream=stream, heartbeat_s=0.05, watch=True)
    progress.phase("train")
    time.sleep(0.5)
    progress.close()
    assert "step 1/10 in train for 0s" in stream.getvalue()


def test_a_terminals_table_shows_brackets_as_text_and_escapes_a_logged_column():
    """A completion holding "[/INST]" (Llama's chat tags; any "[/x]") raised rich's MarkupError in the table, ending the
    run on a terminal; a log_extra column (issue 36) holding a control character would break its row."""
    stream = TtyIO()
    with Progress(20, stream=stream) as progress:
        progress.print_completions(1, [{"prompt": "[bold]2+2[/bold]?", "completion": "4 [/INST]", "reward": 1.0, "parsed": "a\rb"}])
    out = stream.getvalue()
    assert "[bold]2+2[/bold]?" in out and "4 [/INST]" in out and "a\\rb" in out
