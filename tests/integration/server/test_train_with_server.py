"""`tandem train --rollout_mode server`: a real trainer process and a real `tandem rollout` process,
rollouts over HTTP, weights over a gloo group; the server ends at the trainer's version."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rollout_helpers import start_server


def train_through(model_dir: str, server, tmp_path, *extra: str, more_servers: tuple = ()) -> list[dict]:
    args = [
        sys.executable, "-m", "tandemrl", "train", "--model", model_dir, "--rollout_mode", "server",
        "--rollout_server_urls", server.url, *(s.url for s in more_servers), "--weight_sync_port", "0", "--weight_sync_timeout_s", "60",
        "--output_dir", str(tmp_path), "--max_steps", "3", "--num_prompts_per_step", "4", "--num_generations", "4",
        "--max_completion_length", "6", "--max_prompt_length", "64", *extra,
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:] + server.log_text()[-2000:]
    assert " is busy: " not in result.stderr, result.stderr[-3000:]  # no server refused a batch (503)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_training_through_a_rollout_server_keeps_versions_in_step(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, backend="engine")
    try:
        rows = train_through(tiny_model_dir, server, tmp_path)
        assert [r["policy_version"] for r in rows] == [1, 2, 3]
        assert [r["rollout/policy_lag_max"] for r in rows] == [0, 0, 0]  # each step sampled by the live version
        assert server.get("/ready").json()["policy_version"] == 3
    finally:
        server.stop()


def test_servers_whose_queues_are_smaller_than_a_step_get_what_fits_and_every_group_trains(tiny_model_dir, tmp_path):
    """16 sequences a step against --max_pending_requests 3 and 5: the step left as one /generate_batch per
    server, each answered 503 (nothing started) on every retry, so every group failed and the run stopped at
    step 1 on main. The client reads each server's queue off /ready and sends each what fits, the rest as
    sequences end: no 503, no group lost, both servers used."""
    small, larger = start_server(tiny_model_dir, "--max_pending_requests", "3", backend="engine"), start_server(tiny_model_dir, "--max_pending_requests", "5", backend="engine")
    try:
        rows = train_through(tiny_model_dir, small, tmp_path, more_servers=(larger,))
        assert [r["policy_version"] for r in rows] == [1, 2, 3] and [r["rollout/failed_groups"] for r in rows] == [0, 0, 0]
        served = [sum(v for k, v in s.metrics().items() if k.startswith("tandem_requests_total{")) for s in (small, larger)]
        assert sum(served) == 3 * 16 and min(served) > 0, served
    finally:
        small.stop()
        larger.stop()


def test_async_training_with_pause_updates_bounds_the_oldest_token_lag(tiny_model_dir, tmp_path):
    """--max_staleness 1 with `pause` updates: weights change under completions in flight, so a completion
    may span versions; every token's lag, the oldest's included, stays <= 1."""
    server = start_server(tiny_model_dir, backend="engine")
    try:
        rows = train_through(tiny_model_dir, server, tmp_path, "--max_staleness", "1", "--update_mode", "pause", "--max_completion_length", "24")
        assert [r["policy_version"] for r in rows] == [1, 2, 3]
        assert rows[0]["rollout/policy_lag_max"] == 0 and all(r["rollout/policy_lag_max"] <= 1 for r in rows)
        assert server.get("/ready").json()["policy_version"] == 3
    finally:
        server.stop()


def test_a_rollout_server_that_dies_mid_training_ends_the_run_with_one_line(tiny_model_dir, tmp_path):
    import time

    server = start_server(tiny_model_dir, backend="engine")
    args = [
        sys.executable, "-m", "tandemrl", "train", "--model", tiny_model_dir, "--rollout_mode", "server",
        "--rollout_server_urls", server.url, "--weight_sync_port", "0", "--weight_sync_timeout_s", "20",
        "--output_dir", str(tmp_path), "--max_steps", "500", "--num_prompts_per_step", "2", "--num_generations", "2",
        "--max_completion_length", "4", "--max_prompt_length", "64",
    ]
    trainer = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
            time.sleep(0.2)
        server.kill()
        _, stderr = trainer.communicate(timeout=120)
        assert trainer.returncode == 1, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("tandem train: error")]
        assert len(errors) == 1 and server.url.split("//")[1] in errors[0], stderr[-3000:]
    finally:
        trainer.kill()
        server.stop()


def test_a_frozen_rollout_server_ends_the_run_with_one_line_within_the_silence_deadline(tiny_model_dir, tmp_path):
    """SIGSTOP: the server's sockets stay open (connections are accepted, nothing is answered), so no
    connection error comes. --rollout_server_silence_s after the trainer begins to wait on it the run ends
    with one line naming the server, whatever it waits on (a generation or a weight update)."""
    import signal
    import time

    server = start_server(tiny_model_dir, backend="engine")
    args = [
        sys.executable, "-m", "tandemrl", "train", "--model", tiny_model_dir, "--rollout_mode", "server",
        "--rollout_server_urls", server.url, "--weight_sync_port", "0", "--weight_sync_timeout_s", "60",
        "--rollout_server_silence_s", "4", "--output_dir", str(tmp_path), "--max_steps", "500",
        "--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4", "--max_prompt_length", "64",
    ]  # fmt: skip
    trainer = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
            time.sleep(0.2)
        server.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        lines = []
        for line in trainer.stderr:  # read as written: the error line's time is the deadline's measure
            lines.append(line)
            if line.startswith("tandem train: error"):
                noticed = time.monotonic() - stopped
                break
        else:
            raise AssertionError("".join(lines)[-3000:])
        stderr = "".join(lines) + trainer.communicate(timeout=60)[1]  # the exit: the weight-sync group released
        assert trainer.returncode == 1, stderr[-3000:]
        # the deadline runs from when the trainer begins to wait on the server: the stop may land before a
        # training step (seconds on a loaded CPU) after which the push waits; the client's own timeout is 600 s
        assert noticed < 4 + 30, noticed
        assert "Traceback" not in stderr, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("tandem train: error")]
        assert len(errors) == 1 and server.url.split("//")[1] in errors[0] and "answered nothing for 4 s" in errors[0], stderr[-3000:]
    finally:
        trainer.kill()
        server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_lora_pushes_only_the_adapters_to_a_server_that_applies_them(tiny_model_dir, tmp_path):
    """`tandem rollout --max_lora_rank 8` applies adapters beside its base: after the first update (which carries
    the base too) each push is the adapters alone, and the server samples the trainer's policy (lag-0 logprobs
    equal within float32 rounding). A server without the flag gets the merged weights every time."""
    adapters, plain = start_server(tiny_model_dir, "--max_lora_rank", "8", backend="engine"), start_server(tiny_model_dir, backend="engine")
    try:
        assert adapters.get("/ready").json()["max_lora_rank"] == 8 and plain.get("/ready").json()["max_lora_rank"] == 0
        lora = ("--lora_r", "8", "--learning_rate", "1e-2")
        rows = train_through(tiny_model_dir, adapters, tmp_path / "adapters", *lora)
        merged = train_through(tiny_model_dir, plain, tmp_path / "merged", *lora)
        assert [r["policy_version"] for r in rows] == [1, 2, 3] and adapters.get("/ready").json()["policy_version"] == 3
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)  # the server's policy is the trainer's
        assert all(0 < r["sync/pushed_mib"] < merged[0]["sync/pushed_mib"] / 4 for r in rows), [(r["sync/pushed_mib"], m["sync/pushed_mib"]) for r, m in zip(rows, merged)]
        refused = adapters.post("/sleep", json={"level": 2})
        assert refused.status_code == 400 and "--max_lora_rank" in refused.json()["error"]["message"]
    finally:
        adapters.stop()
        plain.stop()
