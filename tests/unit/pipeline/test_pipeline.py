"""The pipeline with fakes: random generation, reward and training delays, an ordered event log.

The invariant under test (pipeline/buffer.py): a group trained at step k was admitted after version
k - S was live on the generator, so every trained token's policy lag is <= S.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from tandemrl.data.cursor import PromptCursor
from tandemrl.pipeline import loop as loop_module
from tandemrl.pipeline.buffer import RolloutBuffer
from tandemrl.pipeline.loop import LoopParts, LoopSettings, run_loop
from tandemrl.pipeline.parts import EvalSet
from tandemrl.rewards.base import RewardFunc
from tandemrl.train.config import OffloadConfig
from tandemrl.train.offload import TrainerOffload
from tandemrl.types import Completion, Example, SamplingParams

P, G, NUM_TOKENS = 3, 2, 3


class Events(list):
    """The ordered event log: (kind, value, live version)."""


class FakeGenerator:
    """Samples NUM_TOKENS tokens with random delays; each token carries the version live when it was sampled
    (as with `pause` updates: a completion may span versions)."""

    def __init__(self, events: Events, rng: random.Random) -> None:
        self.version = 0
        self.events, self.rng = events, rng

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        versions = []
        for _ in range(NUM_TOKENS):
            await asyncio.sleep(self.rng.uniform(0, 0.004))
            versions.append(self.version)
        return Completion(token_ids=[params.seed % 7] * NUM_TOKENS, logprobs=[-1.0] * NUM_TOKENS, finish_reason="stop", policy_versions=versions)

    async def update_weights(self, weights, *, version: int) -> None:
        await asyncio.sleep(self.rng.uniform(0, 0.002))
        self.version = version
        self.events.append(("live", version, version))

    async def close(self) -> None:
        pass


class FakeSync:
    def __init__(self, generator: FakeGenerator) -> None:
        self.generator = generator

    async def publish(self, weights, *, version: int) -> None:
        await self.generator.update_weights(list(weights), version=version)


class FakeModel:
    def named_parameters(self):
        return iter(())


class FakeTrainer:
    """Sleeps a random time per step (in the worker thread, as the real one computes) and logs what it trained."""

    def __init__(self, events: Events, rng: random.Random) -> None:
        self.policy_version = 0
        self.model = FakeModel()
        self.events, self.rng = events, rng
        self.delay = rng.uniform(0, 0.006)
        self.offload = TrainerOffload(OffloadConfig(), self)  # levers off: every call a no-op

    def published_weights(self):
        return self.model.named_parameters()

    def train_step(self, batch) -> dict[str, float]:
        for group in batch.groups:
            self.events.append(("train", group.example.index, self.policy_version))
        time.sleep(self.delay)
        self.delay = self.rng.uniform(0, 0.006)
        self.policy_version += 1
        return {}

    def state_dict(self) -> dict:
        return {"policy_version": self.policy_version}


class Quiet:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(map(str, ids))


def random_reward(rng: random.Random) -> RewardFunc:
    async def reward(prompts, completions, **columns):
        await asyncio.sleep(rng.uniform(0, 0.003))
        return [float(c[0]) for c in completions]  # differs within a group: none is dropped for zero variance

    return RewardFunc(name="digit", fn=reward)


def run(
    max_staleness: int, *, steps: int, seed: int, tmp_path: Path, start_step: int = 0, cursor: PromptCursor | None = None,
    reward: RewardFunc | None = None, evals: EvalSet | None = None, **overrides,
):  # fmt: skip
    rng = random.Random(seed)
    events = Events()
    generator = FakeGenerator(events, rng)
    trainer = FakeTrainer(events, rng)
    trainer.policy_version = generator.version = start_step
    examples = [Example(prompt=f"p{i}", index=i) for i in range(40)]
    parts = LoopParts(
        examples=examples, prompt_ids=[[i] for i in range(40)], cursor=cursor or PromptCursor(40, seed=seed),
        generator=generator, sync=FakeSync(generator), trainer=trainer, tokenizer=Tokenizer(),
        reward_funcs=[reward or random_reward(rng)], reward_weights=None, params=SamplingParams(max_tokens=NUM_TOKENS),
        logger=Quiet(), progress=Quiet(), run_dir=tmp_path, evals=evals,
    )
    settings = LoopSettings(
        max_steps=steps, num_prompts_per_step=P, num_generations=G, scale_rewards="none", drop_zero_variance_groups=False,
        seed=seed, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0, max_staleness=max_staleness,
    )
    for key, value in overrides.items():
        setattr(settings, key, value)
    admitted = []
    original = parts.cursor.take

    def take(k):
        indices = original(k)
        admitted.extend((i, generator.version) for i in indices)
        events.extend(("admit", i, generator.version) for i in indices)
        return indices

    parts.cursor.take = take
    metrics = []
    parts.logger = type("L", (), {"log": lambda self, step, m: metrics.append(m), "log_completions": lambda *a: None})()
    asyncio.run(run_loop(parts, settings, start_step=start_step))
    return events, metrics, admitted


@pytest.fixture
def saved(monkeypatch):
    checkpoints = []
    monkeypatch.setattr(loop_module, "save_checkpoint", lambda run_dir, step, *, state, **kw: checkpoints.append((step, state)))
    return checkpoints


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_policy_lag_never_exceeds_max_staleness_under_random_delays(tmp_path, saved, max_staleness):
    events, metrics, _ = run(max_staleness, steps=50, seed=max_staleness, tmp_path=tmp_path)
    trained = [e for e in events if e[0] == "train"]
    assert len(trained) == 50 * P
    lags = [m["rollout/policy_lag_max"] for m in metrics]
    assert max(lags) <= max_staleness
    if max_staleness:  # the overlap is real: some step trains on groups sampled by older weights
        assert max(lags) == max_staleness
    else:
        assert all(m["rollout/policy_lag_mean"] == 0 for m in metrics)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_a_group_is_admitted_only_after_version_k_minus_s_is_live(tmp_path, saved, max_staleness):
    events, _, _ = run(max_staleness, steps=50, seed=10 + max_staleness, tmp_path=tmp_path)
    admissions = [version for kind, _, version in events if kind == "admit"]
    for j, version in enumerate(admissions):
        assert version >= j // P - max_staleness, f"group {j} (step {j // P}) admitted at version {version}"


def test_too_many_slots_breaks_the_bound_and_the_assert_catches_it(tmp_path, saved, monkeypatch):
    class Oversized(RolloutBuffer):
        def __init__(self, *, lead: int, first_index: int = 0) -> None:
            super().__init__(lead=lead + 2 * P, first_index=first_index)

    monkeypatch.setattr(loop_module, "RolloutBuffer", Oversized)
    with pytest.raises(AssertionError, match="policy lag"):
        run(0, steps=50, seed=3, tmp_path=tmp_path)


@pytest.mark.parametrize("max_staleness, steps_per_generation", [(0, 2), (0, 3), (1, 3)])
def test_a_round_of_k_steps_is_sampled_by_one_version_and_lags_at_most_s_plus_k_minus_1(tmp_path, saved, max_staleness, steps_per_generation):
    """--steps_per_generation K: the K x P groups of a round are admitted together, once version a - S of
    its first step a is live (exactly a at S = 0: nothing is generated while a step trains)."""
    k = steps_per_generation
    events, metrics, _ = run(max_staleness, steps=20, seed=20 + k, tmp_path=tmp_path, steps_per_generation=k)
    admissions = [version for kind, _, version in events if kind == "admit"]
    assert len([e for e in events if e[0] == "train"]) == 20 * P
    for first in range(0, 20, k):  # each round: one admission version, the bound of its first step
        versions = set(admissions[first * P : min(first + k, 20) * P])
        assert len(versions) == 1 and versions.pop() >= first - max_staleness
        if max_staleness == 0:
            assert admissions[first * P] == first
    lags = [m["rollout/policy_lag_max"] for m in metrics]
    assert max(lags) == max_staleness + k - 1  # reached: the round's last step trains on its oldest groups


def test_resume_in_the_middle_of_a_round_trains_every_prompt_exactly_once(tmp_path, saved):
    """K = 3, checkpoint at step 4 (inside the round of steps 3-5): the resumed run regenerates the rest
    of that round from the saved cursor, and trains the prompts of an uninterrupted run, in order."""
    _, _, whole = run(0, steps=9, seed=8, tmp_path=tmp_path, steps_per_generation=3)
    run(0, steps=4, seed=8, tmp_path=tmp_path, steps_per_generation=3)
    cursor = PromptCursor(40, seed=8)
    cursor.load_state_dict(saved[-1][1]["cursor"])
    events, _, _ = run(0, steps=9, seed=8, tmp_path=tmp_path, start_step=4, cursor=cursor, steps_per_generation=3)
    assert [e[1] for e in events if e[0] == "train"] == [i for i, _ in whole][4 * P :]
    resumed = [version for kind, _, version in events if kind == "admit"]
    assert resumed[: 2 * P] == [4] * (2 * P) and resumed[2 * P :] == [6] * (3 * P)  # rounds: steps 4-5, then 6-8


def test_generation_rounds_start_at_multiples_of_k():
    assert loop_module.generation_rounds(0, 7, 3) == [3, 3, 1]
    assert loop_module.generation_rounds(3, 10, 4) == [1, 4, 2]
    assert loop_module.generation_rounds(0, 5, 1) == [1] * 5


def test_groups_are_trained_in_admission_order_whatever_order_they_finish(tmp_path, saved):
    events, _, admitted = run(2, steps=20, seed=5, tmp_path=tmp_path)
    assert [e[1] for e in events if e[0] == "train"] == [i for i, _ in admitted]


def test_checkpoint_cursor_counts_trained_groups_not_admitted_ones(tmp_path, saved):
    run(2, steps=6, seed=1, tmp_path=tmp_path)
    (step, state), = saved
    assert step == 6 and divmod(6 * P, 40) == (state["cursor"]["epoch"], state["cursor"]["position"])


def test_resume_regenerates_groups_in_flight_exactly_once(tmp_path, saved):
    """A run of 8 steps equals one of 4 steps, then one resumed from its checkpoint for 4 more."""
    _, _, whole = run(2, steps=8, seed=7, tmp_path=tmp_path)
    run(2, steps=4, seed=7, tmp_path=tmp_path)
    cursor = PromptCursor(40, seed=7)
    cursor.load_state_dict(saved[-1][1]["cursor"])
    events, _, _ = run(2, steps=8, seed=7, tmp_path=tmp_path, start_step=4, cursor=cursor)
    resumed = [e[1] for e in events if e[0] == "train"]
    assert resumed == [i for i, _ in whole][4 * P :]



def test_evaluation_at_s0_samples_alone_so_a_run_with_it_trains_as_one_without(tmp_path, saved, monkeypatch):
    """At S = 0 nothing of the next step is sampled while the evaluation samples: the next step's groups
    are admitted once it is done. They were admitted before it, so the engine batched the two together and
    the next step's sampler logprobs came from another batch (float sums in another order): on CPU a run
    with --eval_dataset trained otherwise than one without (its weights differed from step 2), and one
    resumed from a checkpoint otherwise than the uninterrupted run (which had evaluated beside that step)."""
    in_flight = {"eval": 0, "train": 0}
    overlaps = []
    generate = FakeGenerator.generate

    async def tracked(self, prompt_ids, params):
        kind = "eval" if prompt_ids[0] >= 1000 else "train"
        in_flight[kind] += 1
        overlaps.append(in_flight["eval"] > 0 and in_flight["train"] > 0)
        try:
            return await generate(self, prompt_ids, params)
        finally:
            in_flight[kind] -= 1

    monkeypatch.setattr(FakeGenerator, "generate", tracked)
    evals = EvalSet(examples=[Example(prompt=f"e{i}", index=i) for i in range(2)], prompt_ids=[[1000 + i] for i in range(2)], eval_steps=1, num_generations=G)
    _, metrics, _ = run(0, steps=4, seed=3, tmp_path=tmp_path, evals=evals)
    assert all("eval_reward" in m for m in metrics) and len(overlaps) == 4 * (P + 2) * G
    assert not any(overlaps)


def test_evaluation_scores_with_the_runs_reward_deadline_and_trainer_state(tmp_path, saved):
    """Evaluation calls the reward functions as training does: within --reward_timeout_s (a reward that hangs on
    the eval prompts waited without a deadline: a sync one held the run as long as it slept) and with the run's
    trainer_state (it got TrainerState(): max_steps 0, so a reward shaped by global_step / max_steps raised
    ZeroDivisionError at the first evaluation)."""
    seen = []

    def reward(prompts, completions, trainer_state, **columns):
        seen.append((prompts[0][0], trainer_state.global_step / trainer_state.max_steps))
        if prompts[0].startswith("e") and trainer_state.global_step == 1:
            time.sleep(3)  # hangs at the first evaluation
        return [float(c[0]) for c in completions]

    evals = EvalSet(examples=[Example(prompt=f"e{i}", index=i) for i in range(2)], prompt_ids=[[1000 + i] for i in range(2)], eval_steps=1, num_generations=G)
    started = time.perf_counter()
    _, metrics, _ = run(0, steps=2, seed=3, tmp_path=tmp_path, evals=evals, reward=RewardFunc(name="shaped", fn=reward), reward_timeout_s=0.3)
    assert time.perf_counter() - started < 2.5
    assert metrics[0]["eval_failed_groups"] == 2 and "eval_reward" not in metrics[0]  # timed out: not scored, the run goes on
    assert metrics[1]["eval_failed_groups"] == 0 and "eval_reward" in metrics[1]
    assert ("e", 1.0) in seen  # the second evaluation, after step 2 of 2


def flat_for_even_prompts() -> RewardFunc:
    """Rewards all equal (zero variance) for the groups of even prompts: dynamic sampling drops them."""

    async def reward(prompts, completions, **columns):
        return [1.0 if int(p[1:]) % 2 == 0 else float(c[0]) for p, c in zip(prompts, completions)]

    return RewardFunc(name="odd", fn=reward)


def test_dynamic_sampling_at_s0_refills_and_resumes_exactly_once(tmp_path, saved):
    """Each step trains P groups of odd prompts; the cursor saved counts the refill rounds' prompts too."""
    dynamic = dict(drop_zero_variance_groups=True, max_dynamic_sampling_rounds=3, save_steps=3)
    events, metrics, _ = run(0, steps=6, seed=4, tmp_path=tmp_path, reward=flat_for_even_prompts(), **dynamic)
    whole = [e[1] for e in events if e[0] == "train"]
    assert len(whole) == 6 * P and all(i % 2 for i in whole)
    assert any(m["dynamic_sampling/rounds"] > 0 for m in metrics)
    cursor = PromptCursor(40, seed=4)
    cursor.load_state_dict(saved[0][1]["cursor"])  # the step-3 checkpoint
    events, _, _ = run(0, steps=6, seed=4, tmp_path=tmp_path, start_step=3, cursor=cursor, reward=flat_for_even_prompts(), **dynamic)
    assert [e[1] for e in events if e[0] == "train"] == whole[3 * P :]

def test_buffer_takes_in_admission_order_and_admits_a_round_once_its_lead_is_released():
    async def scenario():
        buffer = RolloutBuffer(lead=0)
        assert await buffer.admit(2) == range(0, 2)
        second = asyncio.ensure_future(buffer.admit(4))  # a round of two steps
        await asyncio.sleep(0)
        assert not second.done()
        buffer.put(1, "g1")
        buffer.put(0, "g0")
        assert await buffer.take(2) == ["g0", "g1"]
        assert not second.done()  # taken is not released: the weights are not live yet
        buffer.release(2)
        assert await second == range(2, 6)

    asyncio.run(scenario())


def test_an_error_of_a_producer_surfaces_at_take():
    async def scenario():
        buffer = RolloutBuffer(lead=0)
        await buffer.admit(1)
        buffer.fail(ValueError("reward 'r' returned 3 values for 4 completions"))
        with pytest.raises(ValueError, match="reward 'r'"):
            await buffer.take(1)

    asyncio.run(scenario())


def test_lag0_mismatch_becomes_a_mean_and_warns_past_the_threshold(caplog):
    metrics = {"train/logprob_mismatch_kl_lag0": 0.03, "train/frac_lag0": 0.5}
    loop_module._check_mismatch(metrics, 0.05, step=7)
    assert metrics == {"train/logprob_mismatch_kl_lag0": pytest.approx(0.06)}
    assert "step 7" in caplog.text and "weight sync" in caplog.text
    quiet = {"train/logprob_mismatch_kl_lag0": 0.0, "train/frac_lag0": 0.0}  # no lag-0 token: nothing to compare
    loop_module._check_mismatch(quiet, 0.05, step=8)
    assert quiet == {}


def test_a_group_is_scored_as_soon_as_it_completes_while_others_still_sample(tmp_path, saved):
    """Prompt i samples for 0.05 * i s; a slow reward (0.1 s) of the fastest group overlaps the others' sampling."""
    log: list[tuple[str, int]] = []

    class Staggered(FakeGenerator):
        async def generate(self, prompt_ids, params):
            await asyncio.sleep(0.05 * prompt_ids[0])
            log.append(("generated", prompt_ids[0]))
            return Completion(token_ids=[params.seed % 7], logprobs=[-1.0], finish_reason="stop", policy_versions=[self.version])

    async def slow(prompts, completions, **columns):
        log.append(("scoring", int(prompts[0][1:])))
        await asyncio.sleep(0.1)
        return [float(c[0]) for c in completions]

    generator = Staggered(Events(), random.Random(0))
    trainer = FakeTrainer(Events(), random.Random(0))
    parts = LoopParts(
        examples=[Example(prompt=f"p{i}", index=i) for i in range(3)], prompt_ids=[[i] for i in range(3)],
        cursor=PromptCursor(3), generator=generator, sync=FakeSync(generator), trainer=trainer, tokenizer=Tokenizer(),
        reward_funcs=[RewardFunc(name="slow", fn=slow)], reward_weights=None, params=SamplingParams(max_tokens=1),
        logger=Quiet(), progress=Quiet(), run_dir=tmp_path,
    )  # fmt: skip
    settings = LoopSettings(
        max_steps=1, num_prompts_per_step=3, num_generations=G, scale_rewards="none", drop_zero_variance_groups=False,
        seed=0, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0,
    )  # fmt: skip
    asyncio.run(run_loop(parts, settings))
    assert log.index(("scoring", 0)) < log.index(("generated", 2))
