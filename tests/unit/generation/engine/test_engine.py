"""The engine against transformers (greedy tokens, logprobs) and its own invariants: concurrency,
prefix sharing, preemption, abort, weight updates, sleep."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import EngineConfig, HFConfig, describe_generator

from tandemrl.generation.engine import Engine
from tandemrl.generation.factory import build_generator
from tandemrl.generation.engine.sequence import out_of_range
from tandemrl.generation.engine.models.family import SUPPORTED_MODEL_TYPES
from tandemrl.generation.hf import HFGenerator
from tandemrl.types import SamplingParams
from tandemrl.weights.group import StagedTensors
from tests.unit.generation.engine.conftest import FAMILIES, WINDOW


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXTS = ("hello there", "the answer is 42", "abc", "x", "the answer is 42. user assistant system, hello there")  # the last: past every window


def run(coro):
    return asyncio.run(coro)


def make_engine(model_dir: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", **{"kv_cache_tokens": 2048, **overrides}))


async def gather(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, family_dirs):
    model_dir = family_dirs[request.param]
    engine = make_engine(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield engine, reference
    run(engine.close())


def test_greedy_equals_transformers_generate_token_for_token(family):
    engine, reference = family
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    completions = run(gather(engine, prompts, GREEDY))
    for prompt, completion in zip(prompts, completions):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert completion.token_ids == expected[0, len(prompt) :].tolist()
        assert completion.finish_reason == "length"


def test_greedy_under_a_repetition_penalty_equals_transformers_generate(family):
    """The penalty covers prompt and completion tokens (transformers' and vLLM's); the logprobs are of the
    penalised distribution, as transformers' scores; the hf generator gives the same tokens."""
    from transformers import RepetitionPenaltyLogitsProcessor

    engine, reference = family
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    completions = run(gather(engine, prompts, params))
    plain = run(gather(engine, prompts, GREEDY))
    assert any(c.token_ids != p.token_ids for c, p in zip(completions, plain))  # the penalty changed something
    hf = HFGenerator(HFConfig(device="cpu"), model=reference, tokenizer=engine.tokenizer)
    for prompt, completion in zip(prompts, completions):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, repetition_penalty=1.5)
        assert completion.token_ids == expected[0, len(prompt) :].tolist()
        assert run(hf.generate(prompt, params)).token_ids == completion.token_ids
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        penalised = torch.stack([RepetitionPenaltyLogitsProcessor(1.5)(ids[:, : len(prompt) + i], logits[i : i + 1])[0] for i in range(len(logits))])
        expected_logprobs = penalised.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), expected_logprobs, atol=1e-4)


def test_logprobs_equal_a_transformers_forward(family):
    engine, reference = family
    prompt = engine.tokenizer.encode("the answer is")
    for params in (GREEDY, SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)):
        completion = run(engine.generate(prompt, params))
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
        temperature = params.temperature or 1.0
        expected = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_the_windows_of_the_families_change_what_a_long_prompt_gives(name, family_dirs):
    """The parity tests above would not see a window ignored unless it changed transformers' answer: it does."""
    windowed = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32).eval()
    unwindowed = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32, sliding_window=4096).eval()
    ids = torch.tensor([windowed.config.vocab_size // 2 + i % 50 for i in range(4 * WINDOW)])[None]
    with torch.no_grad():
        assert not torch.allclose(windowed(ids).logits[0, -1], unwindowed(ids).logits[0, -1], atol=1e-3)


def test_concurrent_requests_submitted_while_others_run_equal_alone(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(prompts))]
    alone = [run(engine.generate(p, s)) for p, s in zip(prompts, params)]

    async def staggered():
        tasks = []
        for prompt, p in zip(prompts, params):
            tasks.append(asyncio.create_task(engine.generate(prompt, p)))
            await asyncio.sleep(0.005)  # later requests join while earlier ones decode
        return await asyncio.gather(*tasks)

    together = run(staggered())
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert torch.allclose(torch.tensor(sum((c.logprobs for c in together), [])), torch.tensor(sum((c.logprobs for c in alone), [])), atol=1e-5)
    run(engine.close())


def test_group_of_equal_prompts_prefills_the_prompt_once(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    prompt = engine.tokenizer.encode("a group of eight equal prompts, 37 tokens or so, shared")
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    completions = run(gather(engine, [prompt] * 8, params))
    stats = engine.stats()
    assert stats["engine/num_prefill_tokens"] == len(prompt)
    assert stats["engine/num_prefix_hit_tokens"] == 7 * len(prompt)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # each sample still draws its own tokens
    assert stats["engine/kv_blocks_used"] == 0
    assert stats["engine/num_prefill_steps"] == 1 and stats["engine/num_steps"] == 6  # one prefill, then 5 decodes
    assert 0 < stats["engine/prefill_s"] <= stats["engine/prepare_s"] + stats["engine/device_wait_s"]
    assert stats["engine/prefill_gpu_s"] == 0.0  # CUDA events only
    run(engine.close())


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "smollm3-yarn", "phi3-longrope"])
def test_shared_prefix_gives_the_same_tokens_as_no_sharing(family_dirs, name):
    prompt = list(range(40, 72))  # exactly two blocks: the follower shares every block
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    shared = make_engine(family_dirs[name])
    together = run(gather(shared, [prompt] * 4, params))
    alone = [run(make_engine(family_dirs[name]).generate(prompt, p)) for p in params]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_preemption_when_blocks_run_out_gives_identical_results(family_dirs):
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    roomy = make_engine(family_dirs["qwen2"])
    tight = make_engine(family_dirs["qwen2"], kv_cache_tokens=12 * 16)  # 12 blocks; 6 x 4 are needed
    expected = run(gather(roomy, prompts, params))
    got = run(gather(tight, prompts, params))
    assert tight.stats()["engine/num_preemptions"] > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert torch.allclose(torch.tensor(sum((c.logprobs for c in got), [])), torch.tensor(sum((c.logprobs for c in expected), [])), atol=1e-4)


def test_cancelling_the_awaiting_task_aborts_and_frees_blocks(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    params = SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True)

    async def cancel_one():
        long = asyncio.create_task(engine.generate(list(range(5, 40)), params))
        short = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
        while engine.stats()["engine/num_decode_tokens"] < 20:
            await asyncio.sleep(0.001)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        return await short

    assert len(run(cancel_one()).token_ids) == 4
    for _ in range(200):
        if engine.num_unfinished() == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.num_unfinished() == 0 and engine.stats()["engine/kv_blocks_used"] == 0
    run(engine.close())


def test_stop_token_ids_and_stop_strings(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    prompt = engine.tokenizer.encode("the answer is")
    free = run(engine.generate(prompt, GREEDY))
    stop_id = free.token_ids[4]
    by_id = run(engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))))
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    text = engine.tokenizer.decode(free.token_ids)
    stop = text[len(engine.tokenizer.decode(free.token_ids[:6])) - 1 :][:2]
    by_text = run(engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=(stop,))))
    assert by_text.finish_reason == "stop"
    assert stop in engine.tokenizer.decode(by_text.token_ids)
    assert stop not in engine.tokenizer.decode(by_text.token_ids[:-1])
    run(engine.close())


def test_eos_stops_unless_ignored(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    free = run(engine.generate([5, 6, 7], GREEDY))
    engine.eos_ids = frozenset({free.token_ids[2]})  # pretend the third greedy token is EOS
    done = run(engine.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0)))
    assert done.finish_reason == "stop" and done.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[2]) + 1]
    ignored = run(engine.generate([5, 6, 7], GREEDY))
    assert ignored.finish_reason == "length" and ignored.token_ids == free.token_ids
    run(engine.close())


def test_update_weights_by_hf_names_matches_new_weights_and_bumps_version(family_dirs):
    model_dir = family_dirs["llama3-untied"]
    engine = make_engine(model_dir)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    prompt = engine.tokenizer.encode("hello there")
    before = run(engine.generate(prompt, GREEDY))
    run(engine.update_weights(new.named_parameters(), version=3))
    after = run(engine.generate(prompt, GREEDY))
    expected = new.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    assert engine.version == 3 and after.policy_versions == [3] * 10 and before.policy_versions == [0] * 10
    assert after.token_ids == expected.tolist() != before.token_ids
    assert engine.stats()["engine/num_prefix_hit_tokens"] == 0  # the prefix cache was reset
    with pytest.raises(ValueError, match="no parameter"):
        run(engine.update_weights([("model.nope.weight", torch.zeros(1))], version=4))
    run(engine.close())


@pytest.mark.parametrize("one_buffer", [True, False])
def test_a_list_staged_like_the_last_reuses_its_load_plan_and_loads_the_new_values(family_dirs, one_buffer):
    """A server stages every update in the same buffer: the second load copies by the first's plan, by
    runs of back-to-back tensors (one_buffer: a server's StagedTensors, handed over again) or tensor by tensor."""
    model_dir = family_dirs["qwen2"]
    engine = make_engine(model_dir)
    first, second = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval() for _ in range(2))
    with torch.no_grad():
        for a, b in zip(first.parameters(), second.parameters()):
            a.add_(torch.randn_like(a) * 0.05)
            b.add_(torch.randn_like(b) * 0.05)
    named = list(first.named_parameters())
    if one_buffer:
        flat, starts = torch.cat([p.detach().reshape(-1) for _, p in named]), [0]
        for _, p in named:
            starts.append(starts[-1] + p.numel())
        staged = StagedTensors((name, flat[start : start + p.numel()].view(p.shape)) for (name, p), start in zip(named, starts))
    else:
        staged = [(name, p.detach().clone()) for name, p in named]
    run(engine.update_weights(staged, version=1))
    plan = engine.model._load_plan
    assert sum(len(sizes) for _, sizes, _ in plan.runs) == (len(staged) if one_buffer else 0)
    with torch.no_grad():
        for (_, t), p in zip(staged, second.parameters()):
            t.copy_(p)  # the next update lands in the same buffers
    run(engine.update_weights(staged if one_buffer else list(staged), version=2))  # a server's: the very same list again
    assert engine.model._load_plan is plan and (plan.source is not None) == one_buffer
    prompt = engine.tokenizer.encode("hello there")
    expected = second.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    assert run(engine.generate(prompt, GREEDY)).token_ids == expected.tolist()
    run(engine.close())


def test_kv_cache_never_books_more_blocks_than_max_num_seqs_full_sequences(family_dirs):
    engine = make_engine(family_dirs["qwen2"], kv_cache_tokens=10_000_000, max_num_seqs=4, max_model_len=64)
    try:
        assert len(engine.blocks.blocks) == 4 * (64 // engine.config.block_size) + 1  # + the scratch block
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        params = SamplingParams(max_tokens=64 - max(len(p) for p in prompts), temperature=0.0, ignore_eos=True)
        assert all(c.finish_reason == "length" for c in run(gather(engine, prompts * 2, params)))
    finally:
        run(engine.close())


def test_update_during_generation_lands_between_steps(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    weights = list(AutoModelForCausalLM.from_pretrained(family_dirs["qwen2"]).named_parameters())

    async def pause_mode():
        task = asyncio.create_task(engine.generate([3, 4, 5], SamplingParams(max_tokens=300, ignore_eos=True)))
        while engine.stats()["engine/num_decode_tokens"] < 5:
            await asyncio.sleep(0.001)
        await engine.update_weights(weights, version=1)
        return await task

    versions = run(pause_mode()).policy_versions
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    run(engine.close())


def test_sleep_frees_the_cache_and_wake_resumes(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    before = run(engine.generate([7, 8, 9], GREEDY))
    run(engine.sleep(1))
    assert engine.runner.kv_cache is None
    run(engine.wake())
    assert run(engine.generate([7, 8, 9], GREEDY)).token_ids == before.token_ids
    run(engine.close())


def test_invalid_requests_are_rejected_at_the_boundary(family_dirs):
    engine = make_engine(family_dirs["qwen2"], max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine.generate([1] * 60, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="token ids"):
        run(engine.generate([10**6], SamplingParams(max_tokens=1)))
    run(engine.close())


@pytest.mark.parametrize("ids", [[0, 5], [6], [5, -1], [2**32], [-(2**40)], [True, 5], [np.int64(6)], [1.5]])
def test_token_id_range_check_answers_as_min_and_max_did(ids):
    assert out_of_range(ids, 6) == (min(ids) < 0 or max(ids) >= 6)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_in_memory_model_is_copied_and_follows_updates_by_the_trainers_names(name, family_dirs):
    """Colocated: the trainer's transformers model is copied in, and its state_dict (the names weight sync
    publishes, Phi-3's fused tensors and Gemma's norms included) updates the engine to the new weights."""
    model_dir = family_dirs[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = build_generator(EngineConfig(device="cpu", kv_cache_tokens=1024), model=model, tokenizer=make_tok(model_dir))
    assert isinstance(engine, Engine) and describe_generator(engine) == "engine"
    prompt = list(range(5, 5 + 3 * WINDOW))
    for version in (0, 1):
        if version:
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(7)
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            run(engine.update_weights(list(model.state_dict().items()), version=1))
        got = run(engine.generate(prompt, GREEDY)).token_ids
        assert got == model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)[0, len(prompt) :].tolist()
    run(engine.close())


def make_tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_other_architectures_fall_back_to_hf_with_a_notice(tmp_path, caplog):
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), model_type="gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=64)
    with caplog.at_level(logging.WARNING, logger="tandemrl.generation.base"):
        generator = build_generator(EngineConfig(model=model_dir, device="cpu"))
    assert isinstance(generator, HFGenerator)
    assert "falling back to the hf generator" in caplog.text and "gpt2" in caplog.text
    assert describe_generator(generator) == "fallback: transformers generate (model type 'gpt2' is not one of the engine's " + ", ".join(SUPPORTED_MODEL_TYPES) + ")"
    with pytest.raises(ValueError, match="hf generator"):
        Engine(EngineConfig(model=model_dir, device="cpu"))
    assert describe_generator(build_generator(HFConfig(model=model_dir, device="cpu"))) == "transformers generate"


def test_first_tokens_of_many_seeded_requests_follow_the_softmax(family_dirs):
    engine = make_engine(family_dirs["qwen2"], max_num_seqs=1024)
    model = AutoModelForCausalLM.from_pretrained(family_dirs["qwen2"], dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("the answer")
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.5).softmax(-1)
    n = 3000
    params = [SamplingParams(max_tokens=1, temperature=0.5, seed=s) for s in range(n)]
    tokens = torch.tensor([c.token_ids[0] for c in run(gather(engine, [prompt] * n, params))])
    top = probs.argsort(descending=True)[:5]  # the 5 likeliest tokens, the rest pooled
    expected = torch.cat([probs[top], 1 - probs[top].sum(dim=0, keepdim=True)]) * n
    observed = torch.tensor([(tokens == t).sum() for t in top] + [(~torch.isin(tokens, top)).sum()]).float()
    keep = expected > 5
    assert float(((observed - expected)[keep] ** 2 / expected[keep]).sum()) < 20.5  # 5 dof, p = 0.001
    run(engine.close())


@pytest.mark.parametrize("name", ["qwen2", "gemma3_text", "olmo2"])  # (a model windowed on every layer frees blocks: test above)
def test_a_next_turn_reuses_the_decoded_blocks_of_the_last_and_matches_no_reuse(family_dirs, name):
    """Multi-turn: turn 2's prompt is turn 1's prompt + completion + more; every position turn 1 wrote
    (its decoded full blocks, and the written head of its last block) is reused, and turn 2's tokens
    equal those of an engine with nothing cached."""
    engine, fresh = make_engine(family_dirs[name], block_size=4), make_engine(family_dirs[name], block_size=4)
    try:
        prompt = engine.tokenizer.encode("the answer is")
        first = run(engine.generate(prompt, SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)))
        second_prompt = prompt + first.token_ids + engine.tokenizer.encode(" more")
        hits = engine.stats()["engine/num_prefix_hit_tokens"]
        second = run(engine.generate(second_prompt, GREEDY))
        reused = engine.stats()["engine/num_prefix_hit_tokens"] - hits
        assert reused == len(prompt) + len(first.token_ids) - 1  # all but the last sampled token
        assert second.token_ids == run(fresh.generate(second_prompt, GREEDY)).token_ids
    finally:
        run(engine.close())
        run(fresh.close())


def _bypassing_validation(params: SamplingParams, **fields) -> SamplingParams:
    """`params` with fields SamplingParams would refuse: what a bug past validation would send."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_a_request_that_breaks_a_step_fails_alone_and_its_neighbours_finish_unchanged(family_dirs):
    engine = make_engine(family_dirs["qwen2"])
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    alone = [run(engine.generate(p, s)) for p, s in zip(prompts, params)]
    bad = _bypassing_validation(SamplingParams(max_tokens=8, ignore_eos=True), top_k=10**20)  # overflows int64

    async def together():
        return await asyncio.gather(engine.generate(prompts[0], bad), *(engine.generate(p, s) for p, s in zip(prompts, params)), return_exceptions=True)

    failed, *completions = run(together())
    assert isinstance(failed, Exception) and "Overflow" in str(failed)
    assert [c.token_ids for c in completions] == [c.token_ids for c in alone]
    assert run(engine.generate(prompts[1], params[1])).token_ids == alone[1].token_ids  # the engine serves on
    assert engine.stats()["engine/kv_blocks_used"] == 0
    run(engine.close())


def test_a_request_that_breaks_decode_steps_fails_alone(family_dirs, monkeypatch):
    engine = make_engine(family_dirs["qwen2"])
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    alone = [run(engine.generate(p, s)) for p, s in zip(prompts, params)]
    poison = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    launch = engine.runner.launch

    def failing_launch(batch):  # the poisoned request breaks every step from its 4th token on
        if any(seq.params is poison and seq.num_output_tokens >= 3 for seq in batch.seqs):
            raise RuntimeError("device assert")
        return launch(batch)

    monkeypatch.setattr(engine.runner, "launch", failing_launch)

    async def together():
        return await asyncio.gather(engine.generate(prompts[0], poison), *(engine.generate(p, s) for p, s in zip(prompts, params)), return_exceptions=True)

    failed, *completions = run(together())
    assert isinstance(failed, RuntimeError) and "device assert" in str(failed)
    assert [c.token_ids for c in completions] == [c.token_ids for c in alone]
    run(engine.close())


def test_a_model_windowed_on_every_layer_frees_old_blocks_and_still_equals_transformers(family_dirs):
    """Mistral (window 6 on every layer), blocks of 4: decoding long completions holds a few blocks per
    sequence, not its whole context, and the tokens stay transformers'; a next turn over the freed turn too."""
    model_dir = family_dirs["mistral"]
    engine = make_engine(model_dir, block_size=4)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert engine.blocks.window == WINDOW
    prompts = [list(range(5 + i, 25 + i)) for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    total, lowest = engine.blocks.num_free_blocks, [engine.blocks.num_free_blocks]

    async def watched():
        return await asyncio.gather(*(engine.generate(p, params, on_token=lambda _: lowest.append(engine.blocks.num_free_blocks)) for p in prompts))

    completions = run(watched())
    late = lowest[len(lowest) // 2 :]  # past the prompts' blocks, which a prefill holds whole
    assert total - min(late) <= 3 * (WINDOW // 4 + 3) < 3 * (20 + 40) // 4  # a window's blocks each, not a context's
    assert engine.blocks.num_free_blocks == total
    turns = [p + c.token_ids + [7, 8, 9] for p, c in zip(prompts, completions)]
    for prompt, completion in zip(prompts + turns, completions + list(run(gather(engine, turns, params)))):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert completion.token_ids == expected[0, len(prompt) :].tolist()
    run(engine.close())


def test_a_window_with_shared_prompts_preemption_and_an_abort_equals_each_request_alone(family_dirs):
    """Mistral (window 6 on every layer), blocks of 4, a cache of 14 blocks: prompts past the window shared
    by greedy and sampled requests (followers, prefix hits), one cancelled while its blocks are shared, then
    every prompt sent again over blocks the window freed: each completion equals an engine serving it alone."""
    model_dir = family_dirs["mistral"]
    base = list(range(30, 50))  # 5 blocks, past the window
    prompts = [base] * 4 + [base + [7, 8], base[:13], list(range(60, 75))]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i < 2 else 1.0, seed=i % 3, ignore_eos=True) for i in range(len(prompts))]
    alone = make_engine(model_dir, block_size=4)
    expected = []
    for prompt, p in zip(prompts, params):
        alone.blocks.reset_prefix_cache()  # nothing cached: each request on its own
        expected.append(run(alone.generate(prompt, p)))
    run(alone.close())
    engine = make_engine(model_dir, block_size=4, kv_cache_tokens=14 * 4)

    async def one_cancelled():
        tasks = [asyncio.create_task(engine.generate(prompt, p)) for prompt, p in zip(prompts, params)]
        victim = asyncio.create_task(engine.generate(base, SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True)))
        while engine.stats()["engine/num_decode_tokens"] < 30:
            await asyncio.sleep(0.001)
        victim.cancel()
        return await asyncio.gather(*tasks)

    try:
        for completions in (run(one_cancelled()), run(gather(engine, prompts, params))):
            assert [c.token_ids for c in completions] == [c.token_ids for c in expected]
            assert torch.allclose(torch.tensor(sum((c.logprobs for c in completions), [])), torch.tensor(sum((c.logprobs for c in expected), [])), atol=1e-4)
        stats = engine.stats()
        assert stats["engine/num_preemptions"] > 0 and stats["engine/num_prefix_hit_tokens"] > 0 and stats["engine/kv_blocks_used"] == 0
    finally:
        run(engine.close())
