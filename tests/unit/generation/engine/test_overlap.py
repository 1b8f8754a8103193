"""Overlapped steps: the engine launches the next decode before reading this one's tokens (on by
default on CUDA; switched on here on CPU). Tokens, logprobs and finish reasons equal a run without it;
rows of finished or aborted sequences are dropped; weight updates and sleep finish the step in flight."""

from __future__ import annotations

import asyncio
import time

import torch
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.types import SamplingParams


def run(coro):
    return asyncio.run(coro)


def make_engine(model_dir: str, *, overlap: bool, **overrides) -> Engine:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", **{"kv_cache_tokens": 2048, **overrides}))
    engine.overlap = overlap
    return engine


def generate_all(engine: Engine, prompts, params, streamed=None):
    async def go():
        def on_token(i):
            return None if streamed is None else (lambda token_id: streamed[i].append(token_id))

        return await asyncio.gather(*(engine.generate(p, s, on_token=on_token(i)) for i, (p, s) in enumerate(zip(prompts, params))))

    return run(go())


def test_overlap_gives_the_tokens_of_a_run_without_it(family_dirs):
    model_dir = family_dirs["qwen2"]
    prompts = [list(range(5 + i, 12 + 3 * i)) for i in range(8)]
    # different lengths and temperatures; stop ids, stop strings and EOS end some early, at different steps
    plain = make_engine(model_dir, overlap=False)
    free = generate_all(plain, prompts, [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True) for i in range(8)])
    params = []
    for i, completion in enumerate(free):
        kind = i % 4
        stop_ids = (completion.token_ids[3 + i],) if kind == 1 else ()
        stop = (plain.tokenizer.decode(completion.token_ids[5:7])[-1:],) if kind == 2 else ()
        params.append(SamplingParams(max_tokens=6 + 2 * i, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=kind != 3, stop_token_ids=stop_ids, stop=stop))
    plain.eos_ids = frozenset({free[3].token_ids[4]})
    expected = generate_all(plain, prompts, params)
    overlapped = make_engine(model_dir, overlap=True)
    overlapped.eos_ids = plain.eos_ids
    streamed = [[] for _ in prompts]
    got = generate_all(overlapped, prompts, params, streamed)
    stats = overlapped.stats()
    assert stats["engine/num_ahead_steps"] > 0
    assert {c.finish_reason for c in expected} == {"stop", "length"}
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert torch.allclose(torch.tensor(sum((c.logprobs for c in got), [])), torch.tensor(sum((c.logprobs for c in expected), [])), atol=1e-5)
    assert streamed == [c.token_ids for c in got]  # a stream never sees a dropped row
    assert stats["engine/kv_blocks_used"] == 0 and overlapped.num_unfinished() == 0
    run(plain.close())
    run(overlapped.close())


def test_overlap_with_preemption_gives_the_same_results(family_dirs):
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    roomy = make_engine(family_dirs["qwen2"], overlap=False)
    tight = make_engine(family_dirs["qwen2"], overlap=True, kv_cache_tokens=12 * 16)  # 12 blocks; 6 x 4 are needed
    expected = generate_all(roomy, prompts, params)
    got = generate_all(tight, prompts, params)
    assert tight.stats()["engine/num_preemptions"] > 0 and tight.stats()["engine/num_ahead_steps"] > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert tight.stats()["engine/kv_blocks_used"] == 0
    run(roomy.close())
    run(tight.close())


def test_abort_while_a_step_is_in_flight_frees_everything(family_dirs):
    engine = make_engine(family_dirs["qwen2"], overlap=True)

    async def cancel_one():
        long = asyncio.create_task(engine.generate(list(range(5, 40)), SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True)))
        short = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
        while engine.stats()["engine/num_decode_tokens"] < 20:
            await asyncio.sleep(0.001)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        return await short

    assert len(run(cancel_one()).token_ids) == 30
    for _ in range(200):
        if engine.num_unfinished() == 0 and engine._ahead is None:
            break
        run(asyncio.sleep(0.01))
    assert engine.stats()["engine/num_ahead_steps"] > 0
    assert engine.num_unfinished() == 0 and engine.stats()["engine/kv_blocks_used"] == 0
    run(engine.close())


def test_update_and_sleep_finish_the_step_in_flight_first(family_dirs):
    engine = make_engine(family_dirs["qwen2"], overlap=True)
    weights = list(AutoModelForCausalLM.from_pretrained(family_dirs["qwen2"]).named_parameters())
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = run(engine.generate([7, 8, 9], greedy))

    async def update_mid_run():
        start = engine.stats()["engine/num_decode_tokens"]
        task = asyncio.create_task(engine.generate([3, 4, 5], SamplingParams(max_tokens=300, ignore_eos=True)))
        while engine.stats()["engine/num_decode_tokens"] < start + 5:
            await asyncio.sleep(0.001)
        await engine.update_weights(weights, version=1)
        assert engine._ahead is None  # finished under the step lock, before the weights changed
        await engine.sleep(1)
        await engine.wake()
        return await task

    completion = run(update_mid_run())
    versions = completion.policy_versions
    assert len(completion.token_ids) == 300 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert run(engine.generate([7, 8, 9], greedy)).token_ids == before.token_ids
    run(engine.close())


def test_a_weight_update_finishes_the_step_in_flight_under_the_version_it_was_launched_with(family_dirs):
    from tandemrl.generation.engine.sequence import Sequence, Status

    engine = make_engine(family_dirs["qwen2"], overlap=True)
    run(engine.close())  # the engine thread stops: this test steps the engine itself, deterministically
    engine.runner.allocate_kv_cache(engine.blocks.num_blocks)  # close freed the cache
    done = []
    seqs = [Sequence([3 + i, 4, 5], SamplingParams(max_tokens=2 + 4 * i, ignore_eos=True), seed=i, stop_ids=frozenset(), on_finish=done.append) for i in range(2)]
    for seq in seqs:
        engine.scheduler.add(seq)
    engine.step()  # prefill: never looks ahead
    assert engine._ahead is None
    engine.step()  # decode 1 of both, and decode 2 launched before decode 1's tokens were read
    assert engine._ahead is not None and seqs[0].status is Status.FINISHED  # max_tokens 2: done at decode 1
    weights = list(AutoModelForCausalLM.from_pretrained(family_dirs["qwen2"]).named_parameters())
    engine._update_weights(weights, version=7)
    assert engine._ahead is None  # finished under the step lock before the weights changed
    assert seqs[0].num_output_tokens == 2  # its look-ahead row was dropped
    assert seqs[1].policy_versions == [0, 0, 0]  # decode 2 ran on the old weights and says so
    while engine.scheduler.num_unfinished():
        engine.step()
    assert seqs[1].policy_versions == [0, 0, 0] + [7] * 3 and len(done) == 2
    assert engine.stats()["engine/kv_blocks_used"] == 0


def test_postprocess_drops_the_rows_of_finished_sequences(family_dirs):
    from tandemrl.generation.engine.kv_cache import BlockManager
    from tandemrl.generation.engine.scheduler import Scheduler
    from tandemrl.generation.engine.sequence import Sequence

    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), seed=i, stop_ids=frozenset()) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.postprocess(scheduler.schedule(), [5, 6], [-0.1, -0.2], 0)
    batch = scheduler.schedule()
    ahead = scheduler.schedule_ahead(batch)
    assert ahead is not None and ahead.seqs == batch.seqs
    assert all(len(s.block_table) * 4 >= s.num_tokens + 1 for s in seqs)  # room for the look-ahead token
    scheduler.postprocess(batch, [7, 8], [-0.3, -0.4], 0)
    assert scheduler.abort(seqs[0])
    finished = scheduler.postprocess(ahead, [9, 10], [-0.5, -0.6], 0)
    assert finished == [] and seqs[0].token_ids == [1, 2, 3, 5, 7] and seqs[1].token_ids == [1, 2, 3, 6, 8, 10]
    assert seqs[0].finish_reason == "abort"


def test_scheduling_time_leaves_out_the_launches(family_dirs):
    """`engine/schedule_s` is the scheduler's time alone: a launch, however slow, is not in it."""
    engine = make_engine(family_dirs["qwen2"], overlap=True)
    launch = engine.runner.launch

    def slow_launch(batch):
        time.sleep(0.2)
        return launch(batch)

    engine.runner.launch = slow_launch
    generate_all(engine, [list(range(5, 12)), list(range(7, 20))], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 2)
    stats = engine.stats()
    assert stats["engine/num_ahead_steps"] > 0
    assert stats["engine/num_steps"] > stats["engine/num_ahead_steps"]  # launches after schedule(), not only ahead
    assert stats["engine/schedule_s"] < 0.2


def test_a_prefill_after_a_prefill_runs_ahead_and_gives_the_tokens_of_a_run_without_it(family_dirs):
    """Prompts past one step's token budget are prefilled in several steps: each next one is launched
    before the last one's tokens are read (other sequences), and the tokens equal a run without overlap."""
    prompts = [list(range(5 + i, 40 + i)) for i in range(7)]  # 35 tokens each; a budget of 64 admits one a step
    params = [SamplingParams(max_tokens=5 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(7)]
    small = {"max_model_len": 64, "max_num_batched_tokens": 64, "overlap_prefills": True}
    expected = generate_all(make_engine(family_dirs["qwen2"], overlap=False, **small), prompts, params)
    engine = make_engine(family_dirs["qwen2"], overlap=True, **small)
    ahead_kinds, schedule_ahead = [], engine.scheduler.schedule_ahead

    def logged(batch):
        ahead = schedule_ahead(batch)
        ahead_kinds.append(None if ahead is None else ("prefill" if ahead.is_prefill else "decode"))
        return ahead

    engine.scheduler.schedule_ahead = logged
    got = generate_all(engine, prompts, params)
    assert engine.stats()["engine/num_prefill_steps"] == 7 and ahead_kinds.count("prefill") == 6
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    # decode batches differ in size between the two runs: float32 rows may differ in the last bits
    assert torch.allclose(torch.tensor([x for c in got for x in c.logprobs]), torch.tensor([x for c in expected for x in c.logprobs]), atol=1e-5)
    run(engine.close())


def test_a_request_that_breaks_a_prefill_launched_ahead_fails_alone(family_dirs):
    prompts = [list(range(5 + i, 40 + i)) for i in range(5)]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
    small = {"max_model_len": 64, "max_num_batched_tokens": 64, "overlap_prefills": True}  # one prompt a prefill step
    expected = generate_all(make_engine(family_dirs["qwen2"], overlap=False, **small), prompts, params)
    engine = make_engine(family_dirs["qwen2"], overlap=True, **small)
    poison = SamplingParams(max_tokens=6, temperature=1.0, seed=99, ignore_eos=True)
    launch = engine.runner.launch

    def failing_launch(batch):  # the poisoned request breaks every prefill it is in
        if batch.is_prefill and any(seq.params is poison for seq in batch.seqs):
            raise RuntimeError("device assert")
        return launch(batch)

    engine.runner.launch = failing_launch

    async def together():  # the poisoned one is admitted third: its prefill is launched ahead of the second's
        requests = [engine.generate(p, s) for p, s in zip(prompts[:2], params[:2])]
        requests += [engine.generate(prompts[0], poison)] + [engine.generate(p, s) for p, s in zip(prompts[2:], params[2:])]
        return await asyncio.gather(*requests, return_exceptions=True)

    results = run(together())
    failed, completions = results[2], results[:2] + results[3:]
    assert isinstance(failed, RuntimeError) and "device assert" in str(failed)
    assert [c.token_ids for c in completions] == [c.token_ids for c in expected]
    assert engine.stats()["engine/kv_blocks_used"] == 0
    run(engine.close())
