"""Engine tensor parallelism on CPU (gloo, 2 processes): greedy tokens equal TP = 1 exactly, logprobs
within float tolerance, for every family (split and replicated KV heads, a vocab that does not divide),
(Phi-3's fused checkpoint tensors cut per rank, OLMo 2's whole-projection norms reduced over ranks, Gemma 2's
windows and caps), and after a weight update by Hugging Face name, broadcast by the leader (a server's groups) or handed to
every rank (colocate: the group split from torchrun's default process group). This process is rank 0 (and runs TP = 1), one spawned process rank 1, for every case."""

from __future__ import annotations

import asyncio
import faulthandler
import multiprocessing
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.parallel import connect, split_world
from tandemrl.types import SamplingParams
from tandemrl.weights.base import LocalSyncConfig
from tandemrl.weights.local import LocalSync

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=5, repetition_penalty=1.3, ignore_eos=True)
COLOCATED = "qwen3"  # the case whose group is split from a torchrun-like world, updated through LocalSync
PROMPTS = ([5, 17, 40, 2], [100, 3], [7] * 9, [250, 251, 252])


def _config(model_dir: str, size: int) -> EngineConfig:
    return EngineConfig(model=model_dir, device="cpu", kv_cache_tokens=1024, tensor_parallel_size=size)


def _updated(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """New weights by Hugging Face name, the same in every process: some heads, an MLP and the vocab changed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    changed = ("q_proj.weight", "v_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight", "experts.gate_up_proj")
    return [(name, -t if name.endswith(changed) else t) for name, t in model.state_dict().items()]


async def _outputs(engine: Engine) -> dict[str, list]:
    params = [GREEDY] * len(PROMPTS) + [SAMPLED]
    done = await asyncio.gather(*(engine.generate(p, s) for p, s in zip([*PROMPTS, PROMPTS[0]], params)))
    return {"token_ids": [c.token_ids for c in done], "logprobs": [c.logprobs for c in done], "versions": [c.policy_versions[-1] for c in done]}


async def _publish(engine: Engine, model_dir: str, colocate: bool) -> None:
    """The new weights by name: in one call (a server's staging), or as the colocated trainer publishes
    them (LocalSync: one update, its batches gathered in the same order on every rank)."""
    if colocate:
        await LocalSync(LocalSyncConfig(move_model_batches=3), engine).publish(_updated(model_dir), version=1)
    else:
        await engine.update_weights(_updated(model_dir), version=1)


async def _lead(engine: Engine, model_dir: str, colocate: bool = False) -> dict[str, dict]:
    before = await _outputs(engine)
    if not colocate:  # a bad name fails the update on every rank; the engine serves on
        with pytest.raises(ValueError, match="no parameter 'model.nope.weight'"):
            await engine.update_weights([("model.norm.weight", torch.ones(64)), ("model.nope.weight", torch.zeros(1))], version=9)
        before["after_failed_update"] = (await _outputs(engine))["token_ids"]
        # a wrong shape after a good tensor: refused before any rank writes either (the norm was written, then a 504)
        norm = torch.rand(engine.model.get_parameter("model.norm.weight").shape, generator=torch.Generator().manual_seed(0)) + 0.5
        with pytest.raises(ValueError, match=r"tensor model.layers.0.self_attn.o_proj.weight has shape \[3, 3\]; this model's is \["):
            await engine.update_weights([("model.norm.weight", norm), ("model.layers.0.self_attn.o_proj.weight", torch.zeros(3, 3))], version=9)
        refused = await _outputs(engine)
        assert refused["token_ids"] == before["token_ids"] and refused["versions"] == before["versions"]
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4) for a, b in zip(refused["logprobs"], before["logprobs"]))
    await _publish(engine, model_dir, colocate)
    after = await _outputs(engine)
    await engine.sleep(1)  # every rank frees its KV cache and re-creates it
    await engine.wake()
    return {"before": before, "after": after, "after_wake": await _outputs(engine)}


async def _follow_as_trainer(engine: Engine, model_dir: str) -> None:
    """A colocated follower's trainer: its sleep and wake return once the leader's have been applied here
    (the trainer's next GPU work never overlaps this rank's engine freeing memory or capturing graphs)."""
    await _publish(engine, model_dir, colocate=True)
    await engine.sleep(1)
    assert engine.runner.kv_cache is None
    await engine.wake()
    assert engine.runner.kv_cache is not None


def _rank(rank: int, port: int, cases: list[tuple[str, str, bool]]) -> dict[str, dict]:
    """Rank 0 (this process) leads and returns its outputs; rank 1 (spawned) follows."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    results = {}
    for name, model_dir, colocate in cases:
        if colocate:  # as under torchrun: the engine's group split from the default process group
            dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank, world_size=2)
            tp = split_world(2, timeout_s=60)
        else:  # as tandem rollout: groups of their own, the leader broadcasts updates
            tp = connect(dist.PrefixStore(name, store), rank=rank, size=2, device=torch.device("cpu"), timeout_s=60)
            long = ("tick", [("add_many", list(range(5000)))])  # past one broadcast's MESSAGE_BYTES: sent in two
            if rank == 0:
                tp.send(long)
            else:
                assert tp.receive() == long
        engine = Engine(_config(model_dir, 2), tp=tp)
        if rank == 0:
            results[name] = asyncio.run(_lead(engine, model_dir, colocate))
            asyncio.run(engine.close())
        else:
            if colocate:  # this rank's own trainer hands the same tensors over, then sleeps and wakes as the leader does
                asyncio.run(_follow_as_trainer(engine, model_dir))
            assert engine.follow()
            engine.release_group()  # as tandem rollout's followers do (workers._follow): never left to the exit
        if colocate:
            dist.destroy_process_group()
    return results


def _follow(port: int, cases: list[tuple[str, str, bool]], log_path: str) -> None:
    """Rank 1's process: its stderr (and a Python stack on a crash) to `log_path`, for the test's message."""
    log = open(log_path, "w")
    os.dup2(log.fileno(), 2)
    faulthandler.enable(log)
    _rank(1, port, cases)


def _tp2(cases: list[tuple[str, str, bool]], log_path: str) -> dict[str, dict]:
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    follower = multiprocessing.get_context("spawn").Process(target=_follow, args=(store.port, cases, log_path))
    follower.start()
    try:
        results = _rank(0, store.port, cases)
    finally:
        follower.join(60)
        hung = follower.is_alive()
        if hung:  # never left behind the test
            follower.kill()
            follower.join(10)
    if follower.exitcode != 0:  # e.g. a SIGABRT (-6): what rank 1 printed says where
        ended = "was still running 60 s after rank 0 ended" if hung else f"exited with {follower.exitcode}"
        with open(log_path) as log:
            pytest.fail(f"rank 1 {ended}; its stderr ends:\n{log.read()[-4000:]}")
    return results


@pytest.fixture(scope="module")
def model_dirs(family_dirs, tmp_path_factory) -> dict[str, str]:
    from tandemrl.tasks.tiny import save_tiny

    # an untied llama with one KV head for two ranks (replicated) and 321 vocab rows (the last rank's padded)
    odd = save_tiny(str(tmp_path_factory.mktemp("kv1")), model_type="llama", seed=2, num_key_value_heads=1, vocab_size=321, tie_word_embeddings=False)
    # OLMo 2 with one KV head: its whole-projection k norm over a head replicated on both ranks
    olmo = save_tiny(str(tmp_path_factory.mktemp("olmo")), model_type="olmo2", seed=2, num_key_value_heads=1)
    named = {name: family_dirs[name] for name in ("qwen2", "qwen3", "phi3-longrope", "gemma2")}
    # experts split over their width (per-expert files at load, stacked tensors in the update), one dense layer
    moe = save_tiny(
        str(tmp_path_factory.mktemp("moe")), model_type="qwen3_moe", seed=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_hidden_layers=3, mlp_only_layers=[1],
    )  # fmt: skip
    return {**named, "llama-kv1-odd-vocab": odd, "olmo2-kv1": olmo, "qwen3_moe": moe}


@pytest.fixture(scope="module")
def tp2_results(model_dirs, tmp_path_factory) -> dict[str, dict]:
    log_path = str(tmp_path_factory.mktemp("tp2") / "rank1.log")
    return _tp2([(name, path, name == COLOCATED) for name, path in model_dirs.items()], log_path)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama-kv1-odd-vocab", "phi3-longrope", "gemma2", "olmo2-kv1", "qwen3_moe"])
def test_tp2_equals_tp1_before_and_after_a_weight_update_by_hf_name(name, model_dirs, tp2_results):
    engine = Engine(_config(model_dirs[name], 1))
    try:
        expected = asyncio.run(_lead(engine, model_dirs[name], colocate=name == COLOCATED))
    finally:
        asyncio.run(engine.close())
    got = tp2_results[name]
    for phase in ("before", "after", "after_wake"):
        assert got[phase]["token_ids"] == expected[phase]["token_ids"], phase
        for a, b in zip(got[phase]["logprobs"], expected[phase]["logprobs"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), phase
        assert got[phase]["versions"] == expected[phase]["versions"]
    assert got["before"]["token_ids"] != got["after"]["token_ids"]  # the update changed the output
    assert got["before"].get("after_failed_update") == expected["before"].get("after_failed_update")


def test_a_split_engine_without_its_group_or_with_heads_that_do_not_divide_is_one_clear_error(model_dirs):
    with pytest.raises(ValueError, match="needs a group of that many ranks"):
        Engine(_config(model_dirs["qwen2"], 2))
    from transformers import AutoConfig

    from tandemrl.generation.engine.models.llama import check_shardable

    with pytest.raises(ValueError, match="--tensor_parallel_size 3 does not divide the model"):
        check_shardable(AutoConfig.from_pretrained(model_dirs["qwen2"]), 3)
