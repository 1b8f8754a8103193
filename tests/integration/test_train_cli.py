"""`tandem train` end to end, as a user runs it: real subprocesses, a tiny local model, local data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TINY = ["--num_prompts_per_step", "4", "--num_generations", "4", "--max_completion_length", "6"]


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=timeout, env=env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_help_is_instant():
    for args in (["--help"], ["train", "--help"]):
        started = time.perf_counter()
        result = tandem(*args)
        assert result.returncode == 0, result.stderr
        assert time.perf_counter() - started < 2.0
    assert "--num_generations" in tandem("train", "--help").stdout


def test_resume_equals_uninterrupted_run_bitwise(tmp_path):
    from safetensors.torch import load_file

    common = ["--max_steps", "4", "--save_steps", "2", "--save_total_limit", "0", *TINY]
    full, split = tmp_path / "full", tmp_path / "split"
    assert tandem("train", "--output_dir", str(full), *common).returncode == 0
    first = tandem("train", "--output_dir", str(split), *common, "--max_steps", "2")
    assert first.returncode == 0, first.stderr
    resumed = tandem("train", "--output_dir", str(split), "--resume", "--max_steps", "4")
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_file(full / "checkpoint-4" / "model.safetensors"), load_file(split / "checkpoint-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert [m["reward"] for m in metrics(full)] == [m["reward"] for m in metrics(split)]
    assert [m["step"] for m in metrics(split)] == [1, 2, 3, 4]
    assert all(m["rollout/policy_lag_max"] == 0 for m in metrics(split))  # on-policy, resume included


@pytest.mark.slow
def test_evaluation_leaves_training_and_resume_bitwise(tmp_path, tiny_model_dir):
    """--eval_dataset every step: the weights equal a run's without evaluation, and a run resumed from
    checkpoint-2 equals the uninterrupted one. The next step's groups were sampled beside the evaluation's
    prompts, and batched with them their sampler logprobs came out otherwise (the loss weighs them): both
    differed from step 2 (pipeline/loop.py evaluates before admitting the next step's groups now)."""
    import shutil

    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"prompt {i}"} for i in range(6)])
    evals = ["--eval_dataset", write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"eval {i}"} for i in range(3)]), "--eval_steps", "1"]
    rewards = reward_file(tmp_path, "def reward(prompts, completions, **kw):\n    return [float(len(c) % 3) for c in completions]\n")
    common = ["--model", tiny_model_dir, "--dataset", data, "--reward_funcs", rewards, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "0", *TINY]
    full, resumed, plain = tmp_path / "full", tmp_path / "resumed", tmp_path / "plain"
    for run_dir, flags in ((full, evals), (plain, [])):
        result = tandem("train", "--output_dir", str(run_dir), *common, *flags)
        assert result.returncode == 0, result.stderr[-2000:]
    shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("checkpoint-4"))
    result = tandem("train", "--output_dir", str(resumed), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert all("eval_reward" in m for m in metrics(resumed))
    weights = {run_dir: load_file(run_dir / "checkpoint-4" / "model.safetensors") for run_dir in (full, resumed, plain)}
    for run_dir in (resumed, plain):
        assert all(weights[full][k].equal(weights[run_dir][k]) for k in weights[full]), run_dir.name
    trained = ("loss", "grad_norm", "sampling/sampling_logp_difference/mean")
    assert [[m[k] for k in trained] for m in metrics(full)] == [[m[k] for k in trained] for m in metrics(resumed)]

def test_generation_kwargs_temperature_is_the_trainers_too(tmp_path):
    """--generation_kwargs' temperature reaches the trainer as well as the sampler: at lag 0 the two score
    the sampled tokens alike (it reached the sampler only once: KL 0.033 on an H200, 0.002 here)."""
    result = tandem("train", "--output_dir", str(tmp_path), "--max_steps", "1", *TINY, "--generation_kwargs", '{"temperature": 0.7}')
    assert result.returncode == 0, result.stderr[-2000:]
    assert metrics(tmp_path)[0]["train/logprob_mismatch_kl_lag0"] < 1e-5


def test_checkpoint_loads_with_transformers_as_is(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert tandem("train", "--output_dir", str(tmp_path), "--max_steps", "1", *TINY).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "checkpoint-1")
    assert model.config.vocab_size == len(tokenizer)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_local_model_and_dataset_with_chat_prompts_and_columns(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "solution": str(i)} for i in range(8)]
    rows += [{"prompt": f"plain {i}", "solution": str(i)} for i in range(8)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    result = tandem(
        "train", "--model", tiny_model_dir, "--dataset", data, "--reward_funcs", "math_accuracy", "length",
        "--reward_weights", "1.0", "0.5", "--output_dir", str(tmp_path / "run"), "--max_steps", "2", *TINY,
    )
    assert result.returncode == 0, result.stderr
    last = metrics(tmp_path / "run")[-1]
    assert {"rewards/length/mean", "rewards/math_accuracy/mean", "completions/mean_length"} <= last.keys()


def test_a_trl_users_run_keyword_rewards_yaml_and_evaluation(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "solution": str(i)} for i in range(8)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "trl_rewards.py").write_text(
        "def reward(completions, trainer_state, **kwargs):\n"
        "    return [float(len(c[0]['content']) + trainer_state.global_step) for c in completions]\n"
    )
    (tmp_path / "grpo.yaml").write_text(
        "loss_type: dapo\nbeta: 0.04\nwarmup_ratio: 0.5\nchat_template_kwargs: {enable_thinking: false}\nsteps_per_generation: 2\n"
        f"eval_dataset: {data}\neval_steps: 1\nnum_generations_eval: 2\n"
    )
    result = tandem(
        "train", "--config", str(tmp_path / "grpo.yaml"), "--model", tiny_model_dir, "--dataset", data,
        "--reward_funcs", f"{tmp_path / 'trl_rewards.py'}:reward", "--output_dir", str(tmp_path / "run"), "--max_steps", "2", *TINY,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = metrics(tmp_path / "run")
    assert all({"eval_reward", "eval_rewards/reward/mean", "reward"} <= row.keys() for row in rows)


def reward_file(tmp_path: Path, body: str) -> str:
    (tmp_path / "myrewards.py").write_text(body)
    return f"{tmp_path / 'myrewards.py'}:reward"


TRL_LOGGING_REWARD = """
def reward(completions, log_metric, log_extra, **kwargs):  # TRL 1.16's keywords, taken by name
    lengths = [len(c) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    log_extra("chars", lengths)
    return [n / 10 for n in lengths]
"""


def test_a_trl_reward_logs_its_metric_and_completion_columns(tmp_path):
    """A reward taking TRL's log_metric and log_extra failed (issue 36): the metric is in metrics.jsonl under
    its own name (the mean over the step's groups), the column in completions.jsonl beside the completion.
    A function named `reward` (TRL's) overwrote the weighted total there: its column is rewards/reward."""
    rewards = reward_file(tmp_path, TRL_LOGGING_REWARD)
    tiny = ["--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4", "--reward_weights", "0.5"]
    result = tandem("train", "--reward_funcs", rewards, "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--log_completions_steps", "1", *tiny)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["chars"] == len(row["completion"]) == round(row["rewards/reward"] * 10) for row in rows)
    assert all(row["reward"] == pytest.approx(row["rewards/reward"] * 0.5) for row in rows)
    (step,) = metrics(tmp_path / "run")  # 2 groups of 2: each group's mean, then their mean = the mean of all 4
    assert step["mean_chars"] == pytest.approx(sum(row["chars"] for row in rows) / 4) == pytest.approx(step["reward"] * 20)
    assert "chars " in result.stdout  # the console's samples show the column too


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_column", "no 'prompt' column"),
        ("unknown_reward", "unknown reward function 'nope'"),
        ("missing_model", "does not exist"),
        ("long_prompt", "prompt of row 0 of --dataset"),
        ("long_eval_prompt", "prompt of row 1 of --eval_dataset"),  # which file: the row numbers of both start at 0
        ("file_split", "is one file, whose one split is 'train'"),  # on main --dataset_split test trained on the whole file
        ("raising_reward", "ZeroDivisionError"),
        ("wrong_length", "reward"),
    ],
)
def test_bad_input_is_one_line_error_with_exit_2(tmp_path, tiny_model_dir, case, expected):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello", "answer": "1"}] * 4)
    args = ["train", "--model", tiny_model_dir, "--dataset", data, "--reward_funcs", "length", "--output_dir", str(tmp_path / "r"), "--max_steps", "1", *TINY]
    if case == "missing_column":
        args[args.index(data)] = write_jsonl(tmp_path / "bad.jsonl", [{"question": "hello"}])
    elif case == "unknown_reward":
        args[args.index("length")] = "nope"
    elif case == "missing_model":
        args[args.index(tiny_model_dir)] = str(tmp_path / "no-such-model")
    elif case == "long_prompt":
        args += ["--max_prompt_length", "1"]
    elif case == "long_eval_prompt":
        args += ["--eval_dataset", write_jsonl(tmp_path / "e.jsonl", [{"prompt": "hi", "answer": "1"}, {"prompt": "hello " * 40, "answer": "2"}])]
        args += ["--max_prompt_length", "16"]
    elif case == "file_split":
        args += ["--dataset_split", "test"]
    elif case == "raising_reward":
        args[args.index("length")] = reward_file(tmp_path, "def reward(prompts, completions, **kw):\n    return [1 / 0]\n")
    elif case == "wrong_length":
        args[args.index("length")] = reward_file(tmp_path, "def reward(prompts, completions, **kw):\n    return [1.0]\n")
    result = tandem(*args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower() and "Traceback" not in result.stderr]
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_unknown_flag_is_a_usage_error():
    result = tandem("train", "--num_generationz", "4")
    assert result.returncode == 2 and "unknown flag --num_generationz (did you mean --num_generations?)" in result.stderr


@pytest.mark.slow
def test_embedded_default_learns_within_five_minutes(tmp_path):
    started = time.perf_counter()
    result = tandem("train", "--output_dir", str(tmp_path), timeout=600)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-2000:]
    rewards = [m["reward"] for m in metrics(tmp_path)]
    print(f"default run: {elapsed:.0f}s, first reward {rewards[0]:.3f}, last-10 mean {sum(rewards[-10:]) / 10:.3f}")
    assert elapsed < 300
    assert rewards[0] <= 0.3
    readme = (Path(__file__).parents[2] / "README.md").read_text()  # its table of this run is the code's figures
    table = readme[readme.index("| step | 1 | 10 |") :].splitlines()
    steps, shown = [int(c) for c in table[0].strip("|").split("|")[1:]], [float(c) for c in table[2].strip("|").split("|")[1:]]
    assert shown == [round(rewards[s - 1], 3) for s in steps], "README's embedded-default table differs from this run"
    assert f"Mean of the last 10 steps: {sum(rewards[-10:]) / 10:.3f}" in readme
    assert sum(rewards[-10:]) / 10 >= 0.9


def test_gsm8k_task_on_local_data(tmp_path, tiny_model_dir):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} plus one.\n#### {i + 1}"} for i in range(6)]
    data = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    result = tandem(
        "train", "--task", "gsm8k", "--dataset", data, "--model", tiny_model_dir,
        "--output_dir", str(tmp_path / "run"), "--max_steps", "1", *TINY,
    )
    assert result.returncode == 0, result.stderr
    assert {"rewards/math_accuracy/mean", "rewards/format/mean"} <= metrics(tmp_path / "run")[-1].keys()


# Measured on this project's CI machine (torch 2.13 CPU) with the code of the commit that adds it; moving
# these numbers needs a reason in the commit that moves them (a changed sampler, loss or init).
GOLDEN_REWARDS = [0.1015625, 0.15610119047619048, 0.23430059523809524, 0.11979166666666666, 0.1380952380952381, 0.20049603174603176]
GOLDEN_ENTROPY = [5.753051280975342, 5.752743244171143, 5.752295970916748, 5.751894950866699, 5.751088619232178, 5.750354290008545]


def test_golden_curve_of_a_tiny_run(tmp_path):
    result = tandem("train", "--output_dir", str(tmp_path), "--max_steps", "6", *TINY)
    assert result.returncode == 0, result.stderr
    rows = metrics(tmp_path)
    assert [m["reward"] for m in rows] == pytest.approx(GOLDEN_REWARDS, abs=1e-9)
    assert [m["entropy"] for m in rows] == pytest.approx(GOLDEN_ENTROPY, abs=1e-4)


def test_memory_levers_leave_the_golden_curve_as_it_is(tmp_path):
    """The engine frees its KV cache and weights while the policy trains (refilled from it on wake), the
    optimizer state and weights wait on the CPU while the engine generates, a checkpoint is written
    between: the run is the golden one, step for step."""
    levers = ["--sleep_level", "2", "--offload_optimizer", "--offload_model", "--gc_collect_after_offload", "--save_steps", "2"]
    result = tandem("train", "--output_dir", str(tmp_path), "--max_steps", "4", *TINY, *levers)
    assert result.returncode == 0, result.stderr
    rows = metrics(tmp_path)
    assert [m["reward"] for m in rows] == pytest.approx(GOLDEN_REWARDS[:4], abs=1e-9)
    assert [m["entropy"] for m in rows] == pytest.approx(GOLDEN_ENTROPY[:4], abs=1e-4)
    assert [m["policy_version"] for m in rows] == [1, 2, 3, 4] and (tmp_path / "checkpoint-2").is_dir()


def first_step_at(run_dir: Path, bar: float, window: int = 10) -> int:
    """The first step whose mean reward over the last `window` steps reaches `bar` (a large number if none)."""
    rewards = [m["reward"] for m in metrics(run_dir)]
    return next((i + 1 for i in range(window - 1, len(rewards)) if sum(rewards[i + 1 - window : i + 1]) / window >= bar), 10**9)


@pytest.mark.slow
def test_embedded_default_with_staleness_2_reaches_the_bar_within_1_3x_the_steps(tmp_path):
    synchronous = tandem("train", "--output_dir", str(tmp_path / "s0"), timeout=600)
    assert synchronous.returncode == 0, synchronous.stderr[-2000:]
    steps_s0 = first_step_at(tmp_path / "s0", 0.9)
    stale = tandem("train", "--output_dir", str(tmp_path / "s2"), "--max_staleness", "2", "--max_steps", str(int(1.3 * steps_s0)), timeout=600)
    assert stale.returncode == 0, stale.stderr[-2000:]
    steps_s2 = first_step_at(tmp_path / "s2", 0.9)
    print(f"reward bar 0.9 (10-step mean): S=0 at step {steps_s0}, S=2 at step {steps_s2}")
    assert steps_s0 < 10**9 and steps_s2 <= 1.3 * steps_s0
    assert max(m["rollout/policy_lag_max"] for m in metrics(tmp_path / "s2")) == 2


def trained_prompts(run_dir: Path) -> dict[int, list[str]]:
    """step -> the prompts of its first 2 groups, from completions.jsonl (2 rollouts of each: 4 rows a step);
    a step logged again after a resume keeps its last 4 rows (a line torn by a kill is skipped)."""
    by_step: dict[int, list[str]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step.setdefault(row["step"], []).append(row["prompt"])
    return {step: prompts[-4:][::2] for step, prompts in by_step.items()}


def test_async_run_killed_mid_step_then_resumed_trains_every_prompt_exactly_once(tmp_path, tiny_model_dir):
    """--max_staleness 1, SIGKILL while step 4 trains and step 5 generates: the groups in flight are
    regenerated after --resume, and every step trains the prompts of an uninterrupted run."""
    killed_and_resumed(tmp_path, tiny_model_dir, "--max_staleness", "1")


def test_run_of_generation_rounds_killed_mid_round_then_resumed_trains_every_prompt_exactly_once(tmp_path, tiny_model_dir):
    """--steps_per_generation 3 (rounds of steps 1-3, 4-6, 7-8), checkpoints every 2 steps, so inside a
    round: the resumed run regenerates the rest of the round, and trains the prompts of an uninterrupted run."""
    killed_and_resumed(tmp_path, tiny_model_dir, "--steps_per_generation", "3")


def killed_and_resumed(tmp_path: Path, tiny_model_dir: str, *flags: str) -> None:
    """An 8-step run killed (SIGKILL) after its third step and resumed trains every step's prompts as an
    uninterrupted run does, each prompt once an epoch."""
    num_prompts, p, steps = 8, 2, 8  # p = 2: the completions log shows both groups of every step
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"prompt {i}"} for i in range(num_prompts)])
    slow = reward_file(tmp_path, "import time\ndef reward(prompts, completions, **kw):\n    time.sleep(0.1)\n    return [float(len(c) % 3) for c in completions]\n")
    common = [
        "--model", tiny_model_dir, "--dataset", data, "--reward_funcs", slow, *flags, "--max_steps", str(steps),
        "--save_steps", "2", "--save_total_limit", "0", "--log_completions_steps", "1",
        "--num_prompts_per_step", str(p), "--num_generations", "4", "--max_completion_length", "6",
    ]  # fmt: skip
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert tandem("train", "--output_dir", str(full), *common).returncode == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "tandemrl", "train", "--output_dir", str(killed), *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    deadline = time.monotonic() + 240
    while not (killed / "metrics.jsonl").exists() or (killed / "metrics.jsonl").read_text().count("\n") < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / f"checkpoint-{steps}").exists()
    resumed = tandem("train", "--output_dir", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = trained_prompts(killed)
    assert sorted(got) == list(range(1, steps + 1)) and got == trained_prompts(full)
    for epoch in range(steps * p // num_prompts):  # each epoch trains each prompt once
        prompts = [prompt for step in range(epoch * 4 + 1, epoch * 4 + 5) for prompt in got[step]]
        assert sorted(prompts) == sorted(f"prompt {i}" for i in range(num_prompts))


def test_shuffle_dataset_false_trains_the_prompts_in_dataset_order_and_resumes_exactly(tmp_path, tiny_model_dir):
    """TRL's shuffle_dataset false: step k trains prompts 2k-2 and 2k-1 (8 prompts, 2 a step, epoch after epoch),
    and a run resumed from checkpoint-2 trains what the uninterrupted one does."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"prompt {i}"} for i in range(8)])
    common = [
        "--model", tiny_model_dir, "--dataset", data, "--reward_funcs", "length", "--shuffle_dataset", "false", "--save_steps", "2",
        "--save_total_limit", "0", "--log_completions_steps", "1", "--num_prompts_per_step", "2", "--num_generations", "4",
        "--max_completion_length", "6",
    ]  # fmt: skip
    full, split = tmp_path / "full", tmp_path / "split"
    assert tandem("train", "--output_dir", str(full), *common, "--max_steps", "6").returncode == 0
    assert tandem("train", "--output_dir", str(split), *common, "--max_steps", "2").returncode == 0
    resumed = tandem("train", "--output_dir", str(split), "--resume", "--max_steps", "6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = trained_prompts(split)
    assert got == trained_prompts(full)
    assert got == {k: [f"prompt {(2 * k - 2) % 8}", f"prompt {(2 * k - 1) % 8}"] for k in range(1, 7)}


def test_lora_learns_the_default_task_and_resumes_from_its_adapter(tmp_path):
    """`tandem train --lora_r 16` on the embedded default, as a user runs it: its LoRA recipe (adapters on
    every linear layer but the head at 1e-3, the final norm trained whole at 1.0) learns the task in 30
    steps, the engine sampling the merged policy. With adapters alone (the recipe before) the frozen tied
    embeddings (init std 0.02) bound every logit to about +-1.3 and the reward stayed flat (0.10-0.21 over
    150 steps): the bar below failed. Resuming from the adapter's checkpoint gives the same adapter, bit
    for bit (its two learning rates: two optimizer groups restored)."""
    import shutil

    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tandemrl.tasks.tiny import build_model, build_tokenizer

    common = ["--lora_r", "16", "--max_steps", "30", "--save_steps", "28", "--save_total_limit", "0", "--lora_save_merged",
              "--log_completions_steps", "0"]  # fmt: skip
    full = tandem("train", "--output_dir", str(tmp_path / "full"), *common)
    assert full.returncode == 0, full.stderr[-2000:]
    assert "trained whole: model.norm, learning rate 1" in full.stdout  # the banner says what the recipe trains
    rows = metrics(tmp_path / "full")
    rewards = [m["reward"] for m in rows]
    assert rewards[0] < 0.35 and sum(rewards[-5:]) / 5 > 0.7, rewards  # seeds 0-5 on the dev CPU: 0.92 to 1.0
    assert max(abs(m["train/logprob_mismatch_kl_lag0"]) for m in rows) < 1e-5  # the engine samples what trains
    shutil.copytree(tmp_path / "full", tmp_path / "resumed", ignore=shutil.ignore_patterns("checkpoint-30"))
    resumed = tandem("train", "--output_dir", str(tmp_path / "resumed"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (load_file_of(tmp_path / run / "checkpoint-30" / "adapter_model.safetensors") for run in ("full", "resumed"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert a["base_model.model.model.norm.weight"].mean() > 2  # grown from 1: the logits' scale
    policy = PeftModel.from_pretrained(build_model(build_tokenizer()), tmp_path / "full" / "checkpoint-30")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint-30" / "merged")
    x = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(merged(x).logits, policy(x).logits, rtol=1e-4, atol=1e-4)


def load_file_of(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)
