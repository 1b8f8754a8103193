"""Multi-turn rollout throughput of our engine (tokens/s, tool calls/s) on a random-weight Qwen2.5-0.5B shape (or 1.5B).

Three ways to sample the same tokens, in one process, each in steady state (one untimed run of the same
size, then --repeats timed runs: the median's row, every run's seconds in `runs_s`), with the heap
frozen after setup as `tandem train` and `tandem rollout` run (cli.frozen_heap: a full collection
would rescan the model's objects, ~0.1-0.2 s, inside a timed run):
- single_turn: 64 prompts x 8 samples, 128 prompt tokens, one turn of 3 x T sampled tokens (the reference);
- multiturn: the same rollouts as 3 turns of T tokens through rollout/run.py, a 50 ms tool call between
  turns (an async Python tool through the ToolBox), each turn's prompt the whole conversation so far, so
  the engine's prefix cache reuses earlier turns and rollouts run through their turns independently
  (with --warm_up_turns each rollout prefills its next turn's head while the tool runs);
- turn_at_a_time: the same 3 turns played in lockstep (every rollout's turn k, then all tool calls, then
  turn k + 1) with the prefix cache emptied before each turn: every turn re-prefills its whole history.
Random weights never write the end-of-turn token, so each turn samples exactly T tokens (ignore_eos) and
is then treated as stopped. Required: multiturn keeps >= 70% of single_turn's tokens/s.
Prints one JSON line per mode and two ratio lines.

    python bench/multiturn.py                      # H200: 0.5B shape, 64 x 8, T = 128 (about 1-2 minutes)
    python bench/multiturn.py --timeline           # then where the engine idles, step by step
    python bench/multiturn.py --shape 1.5b         # the Qwen2.5-1.5B shape, same workload
    python bench/multiturn.py --toy --device cpu   # CPU check: a 2-layer model, 4 x 2, T = 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import gc
import random
import sys
import time

import torch

from tandemrl.cli import frozen_heap
from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.sequence import Status
from tandemrl.rollout.chat import ChatFormat, ToolCall
from tandemrl.rollout.group import play_group
from tandemrl.rollout.run import MultiTurn
from tandemrl.rollout.tools import ToolBox, python_tool
from tandemrl.tasks.tiny import build_tokenizer
from tandemrl.types import Completion, Example, SamplingParams

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
NUM_TURNS = 3


async def lookup(key: str) -> str:
    """A tool that takes 50 ms, like a remote lookup.

    Args:
        key: What to look up.
    """
    await asyncio.sleep(0.05)
    return f"value of {key}: 4821"


class BenchEnv:
    """Calls the 50 ms tool after every turn but the last (random text holds no parsable call). Each
    example gets its own answer, as rollouts of one example calling the same lookup would: the G
    rollouts of a group share it, so rollout/chat.py renders each answer's token delta once a group."""

    def __init__(self, toolbox: ToolBox):
        self.toolbox, self.tools = toolbox, toolbox.schemas

    async def step(self, example: Example, messages: list) -> list:
        if sum(m["role"] == "assistant" for m in messages) >= NUM_TURNS:
            return []
        return [{"role": "tool", "content": await self.toolbox.call(ToolCall(name="lookup", arguments={"key": str(example.index)}))}]


class FixedTurns:
    """The engine, with every turn exactly max_tokens long and reported as stopped (see module docstring)."""

    caches_prefixes = Engine.caches_prefixes

    def __init__(self, engine: Engine):
        self.engine, self.version = engine, engine.version
        self._fixed: dict[SamplingParams, SamplingParams] = {}  # a rollout's turns share their params: replaced once (8 us each)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        fixed = self._fixed.get(params)
        if fixed is None:
            fixed = self._fixed[params] = dataclasses.replace(params, ignore_eos=True, stop_token_ids=())
        completion = await self.engine.generate(prompt_ids, fixed)
        # in place: the completion is this request's own, and a dataclasses.replace (validated again) cost
        # ~8 us a turn on the event loop, between the turn and its tool call, that a model's real stop does not
        object.__setattr__(completion, "finish_reason", "stop")
        return completion

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


async def run_multiturn(engine: Engine, prompts: list[list[int]], group_size: int, turn_tokens: int, mt: MultiTurn, tokenizer) -> dict:
    generator = FixedTurns(engine)
    params = SamplingParams(max_tokens=turn_tokens, temperature=1.0)
    groups = await asyncio.gather(*(
        play_group(Example(prompt="", index=i), p, generator=generator, params=params, group_size=group_size, tokenizer=tokenizer,
                   seed=i * group_size, multi_turn=mt)
        for i, p in enumerate(prompts)
    ))  # fmt: skip
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == len(prompts) * group_size and all(len(r.turns) == NUM_TURNS for r in rollouts)
    return {"sampled_tokens": sum(r.trace.num_sampled for r in rollouts), "tool_calls": sum(m["role"] == "tool" for r in rollouts for m in r.messages)}


async def run_single_turn(engine: Engine, prompts: list[list[int]], group_size: int, turn_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=NUM_TURNS * turn_tokens, temperature=1.0, ignore_eos=True, seed=s) for s in range(len(prompts) * group_size)]
    completions = await asyncio.gather(*(engine.generate(prompts[i // group_size], p) for i, p in enumerate(params)))
    return {"sampled_tokens": sum(len(c.token_ids) for c in completions), "tool_calls": 0}


async def run_turn_at_a_time(engine: Engine, prompts: list[list[int]], group_size: int, turn_tokens: int, mt: MultiTurn) -> dict:
    histories = [list(p) for p in prompts for _ in range(group_size)]
    sampled = calls = 0
    for turn in range(NUM_TURNS):
        await engine.update_weights([], version=engine.version)  # empties the prefix cache, changes no weight
        params = [SamplingParams(max_tokens=turn_tokens, temperature=1.0, ignore_eos=True, seed=s) for s in range(len(histories))]
        completions = await asyncio.gather(*(engine.generate(h, p) for h, p in zip(histories, params)))
        sampled += sum(len(c.token_ids) for c in completions)
        if turn == NUM_TURNS - 1:
            break
        examples = [Example(prompt="", index=i // group_size) for i in range(len(histories))]
        answers = await asyncio.gather(*(mt.env.step(e, [{"role": "assistant", "content": ""}]) for e in examples))
        calls += len(answers)
        for history, completion, answer in zip(histories, completions, answers):
            history += completion.token_ids + mt.chat.delta_ids(answer, last_sampled_id=completion.token_ids[-1])
    return {"sampled_tokens": sampled, "tool_calls": calls}


def timed(label: str, engine: Engine, make, config: dict, repeats: int) -> dict:
    """The run `make()` timed `repeats` times after one untimed run of the same size, each from an empty
    prefix cache; the row of the median run (every run's seconds listed). Steady state, as a training
    run's rollouts meet the engine: every step plays rollouts of these shapes, so kernels are compiled
    and tuned (Triton, cuBLAS) for the real prefill shapes and the allocator has settled before the
    first timed run (a warm-up of a smaller run left the first full run's prefills cold: 0.93 s of
    prefill device time against 0.22 s in a later process, bench/RESULTS.md)."""
    asyncio.run(engine.update_weights([], version=engine.version))
    asyncio.run(make())  # warm, at the timed shapes
    runs = []
    for _ in range(repeats):
        asyncio.run(engine.update_weights([], version=engine.version))  # nothing cached from the last run
        before = engine.stats()
        started = time.perf_counter()
        counts = asyncio.run(make())
        seconds = time.perf_counter() - started
        runs.append((seconds, counts, before, engine.stats()))
    seconds, counts, before, after = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    counters = ("engine/num_prefill_tokens", "engine/num_prefix_hit_tokens", "engine/num_steps", "engine/num_prefill_steps")
    prefill = {k.split("/")[1]: int(after[k] - before[k]) for k in counters}
    # the engine thread's seconds by phase (prefill_s is part of prepare_s + device_wait_s); wall time
    # past their sum is time the engine had nothing to run: the turn boundaries' cost
    phases = ("prepare_s", "device_wait_s", "schedule_s", "postprocess_s", "prefill_s", "prefill_gpu_s", "gpu_s")
    prefill |= {k: round(after.get(f"engine/{k}", 0.0) - before.get(f"engine/{k}", 0.0), 3) for k in phases}  # .get: older trees (bench/ab.py)
    row = {"mode": label, **config, **counts, **prefill, "seconds": round(seconds, 3), "runs_s": [round(run[0], 3) for run in runs],
           "tokens_per_s": round(counts["sampled_tokens"] / seconds, 1), "tool_calls_per_s": round(counts["tool_calls"] / seconds, 1)}
    print(json.dumps(row), flush=True)
    return row


def profile(make, device: str) -> None:
    """One untimed multiturn run under torch.profiler; prints the kernels that took the most device time,
    then the ops that took the most host time (a prefill's launch: its inputs and the eager forward)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:  # the engine's ops run in its own thread
        config = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        config = {}
    with profiler(activities=activities, **config) as prof:
        asyncio.run(make())
    for sort in ("self_device_time_total", "self_cpu_time_total") if device == "cuda" else ("self_cpu_time_total",):
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)


class Timeline:
    """The engine thread's steps of one run on the wall clock (each from its launch to the end of its
    wait) and the requests' arrivals (one hand-over an event-loop tick); what it prints says where the
    engine had nothing in flight: the turn boundaries' cost. A look-ahead decode whose every row had
    finished before it was read (launched ahead of a turn's last step) is stale: it does not count as
    busy, so a boundary's gap runs from the turn's last real step to the next one."""

    def __init__(self, engine: Engine):
        self.engine, self.start = engine, time.perf_counter()
        self.steps: list[list] = []  # [launch start, launch end, wait end, is_prefill, seqs, new tokens, stale]
        self.arrivals: list[tuple[float, int]] = []
        self._open: dict[int, list] = {}
        runner, ticks = engine.runner, engine._this_tick
        add_many = ticks._hand_over
        launch, wait = runner.launch, runner.wait

        def timed_launch(batch):
            started = time.perf_counter()
            launched = launch(batch)
            self._open[id(launched)] = [started, time.perf_counter(), 0.0, batch.is_prefill, len(batch.seqs), sum(batch.num_new_tokens), False]
            return launched

        def timed_wait(launched):
            result = wait(launched)
            step = self._open.pop(id(launched))
            step[2] = time.perf_counter()
            self.steps.append(step)
            return result

        def timed_add(seqs):
            self.arrivals.append((time.perf_counter(), len(seqs)))
            add_many(seqs)

        scheduler, schedule = engine.scheduler, engine.scheduler.schedule
        self.schedules: list[tuple[float, float]] = []  # (start, end) of each schedule() (a step's admission)
        self.collections: list[tuple[float, float, int]] = []  # (start, end, generation) of each garbage collection
        collecting: list[float] = []

        def timed_schedule():
            started = time.perf_counter()
            batch = schedule()
            self.schedules.append((started, time.perf_counter()))
            return batch

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                collecting[:] = [time.perf_counter()]
            elif collecting:
                self.collections.append((collecting[0], time.perf_counter(), info["generation"]))

        finish = engine._finish

        def timed_finish(batch, launched, version):
            stale = not batch.is_prefill and all(seq.status is Status.FINISHED for seq in batch.seqs)
            finish(batch, launched, version)
            if stale:  # runner.wait (timed_wait) appended this step last
                self.steps[-1][6] = True

        engine._finish = timed_finish
        outbox, flush = engine._outbox, engine._outbox.flush
        self.deliveries: list[tuple[float, int]] = []  # (time, number) of completions handed to the event loop

        def timed_flush():
            num_results = sum(len(results) for results in outbox._pending.values())
            flush()
            if num_results:
                self.deliveries.append((time.perf_counter(), num_results))

        runner.launch, runner.wait, ticks._hand_over, scheduler.schedule, outbox.flush = timed_launch, timed_wait, timed_add, timed_schedule, timed_flush
        gc.callbacks.append(on_gc)
        self._restore = lambda: (vars(runner).pop("launch"), vars(runner).pop("wait"), setattr(ticks, "_hand_over", add_many), delattr(engine, "_finish"),
                                 delattr(scheduler, "schedule"), delattr(outbox, "flush"), gc.callbacks.remove(on_gc))  # fmt: skip

    def report(self, label: str) -> None:
        self._restore()
        num_stale = sum(step[6] for step in self.steps)
        steps = sorted(step for step in self.steps if not step[6])
        t = lambda x: f"{x - self.start:.3f}"  # noqa: E731
        busy_until, idle = steps[0][0], []
        for i, (launched, _, done, *_) in enumerate(steps):
            if launched > busy_until:
                idle.append((busy_until, launched, i))
            busy_until = max(busy_until, done)
        print(f"timeline of {label}: {len(steps)} steps (and {num_stale} stale look-ahead decodes, not counted), "
              f"{sum(e - s for s, e, _ in idle):.3f} s with no step in flight ({sum(e - s > 0.005 for s, e, _ in idle)} gaps > 5 ms), "
              f"run {busy_until - self.start:.3f} s", flush=True)
        for started, ended, i in idle:
            if ended - started > 0.005:
                arrived = [(a, n) for a, n in self.arrivals if started <= a < ended]
                first = f", the first {1e3 * (arrived[0][0] - started):.1f} ms in" if arrived else ""
                before, after = steps[i - 1], steps[i]
                scheduling = sum(min(e, ended) - max(s, started) for s, e in self.schedules if s < ended and e > started)
                collected = [(s, e, g) for s, e, g in self.collections if s < ended and e > started]
                pauses = "".join(f", a generation-{g} collection of {1e3 * (e - s):.1f} ms" for s, e, g in collected)
                calls = [f"{1e3 * (s - started):.1f}+{1e3 * (e - s):.1f}" for s, e in self.schedules if s < ended and e > started]
                print(f"  idle {1e3 * (ended - started):.1f} ms from {t(started)} s: after a {'prefill' if before[3] else 'decode'} of "
                      f"{before[4]}, before a {'prefill' if after[3] else 'decode'} of {after[4]}; {sum(n for _, n in arrived)} requests "
                      f"arrived meanwhile{first}, the last {1e3 * (arrived[-1][0] - started) if arrived else 0:.1f} ms in; "
                      f"{1e3 * scheduling:.1f} ms in schedule() (calls at ms in + ms long: {', '.join(calls)}){pauses}", flush=True)
        for what, events in (("completions handed to the event loop", self.deliveries), ("arrivals of requests", self.arrivals)):
            bursts: list[list] = []  # events closer than 20 ms: one turn boundary's
            for at, n in events:
                if bursts and at - bursts[-1][1] < 0.02:
                    bursts[-1][1:] = [at, bursts[-1][2] + n, bursts[-1][3] + 1]
                else:
                    bursts.append([at, at, n, 1])
            for first, last, n, times in bursts:
                print(f"  {what}: {n} from {t(first)} to {t(last)} s in {times} hand-overs", flush=True)
        decodes = [(end - start, start, n) for start, end, _, is_prefill, n, *_ in steps if not is_prefill]
        slow = sorted(decodes, reverse=True)[:5]
        print(f"  decode launches: {len(decodes)}, {sum(d for d, _, _ in decodes):.3f} s in all, {sum(d > 0.001 for d, _, _ in decodes)} over 1 ms; "
              f"slowest: {', '.join(f'{1e3 * d:.1f} ms at {t(at)} s ({n} seqs)' for d, at, n in slow)}", flush=True)
        slow_gc = [(s, e, g) for s, e, g in self.collections if e - s > 0.001]
        print(f"  garbage collections: {len(self.collections)}, {sum(e - s for s, e, _ in self.collections):.3f} s in all; over 1 ms: "
              f"{', '.join(f'generation {g} {1e3 * (e - s):.1f} ms at {t(s)} s' for s, e, g in slow_gc) or 'none'}", flush=True)
        for launched, launch_end, done, is_prefill, num_seqs, num_tokens, _ in steps:
            if is_prefill:
                print(f"  prefill at {t(launched)} s: {num_seqs} seqs, {num_tokens} tokens, launch {1e3 * (launch_end - launched):.1f} ms, "
                      f"done {1e3 * (done - launched):.1f} ms after its launch began", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="a 2-layer model, 4 prompts x 2, 8 tokens a turn (CPU check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=[name for name in SHAPES if name != "toy"], default="0.5b", help="the model's shape (Qwen2.5 configs, random weights)")
    parser.add_argument("--num_prompts", type=int, default=None)
    parser.add_argument("--group_size", type=int, default=None)
    parser.add_argument("--turn_tokens", type=int, default=None)
    parser.add_argument("--prefill_wait_steps", type=int, default=0, help="the engine's prefill holdoff (EngineSettings)")
    parser.add_argument("--overlap_prefills", action=argparse.BooleanOptionalAction, default=EngineConfig.overlap_prefills,
                        help="the engine's prefill overlap (EngineSettings)")
    parser.add_argument("--warm_up_turns", action=argparse.BooleanOptionalAction, default=False,
                        help="prefill each next turn's head while the tool runs (ToolsConfig)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (after one untimed run); the median is reported")
    parser.add_argument("--max_num_batched_tokens", type=int, default=EngineConfig.max_num_batched_tokens, help="the engine's prefill token budget (EngineSettings)")
    parser.add_argument("--block_size", type=int, default=EngineConfig.block_size, help="tokens a KV block (EngineSettings): fewer blocks, less host work a sequence")
    parser.add_argument("--paged_prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill attention through the paged Triton kernel (the engine's default), or torch's flash attention over copied-out context")
    parser.add_argument("--graph_prefills", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill forwards replayed from CUDA graphs of their padded row counts (the engine's default), or launched eagerly")
    parser.add_argument("--frozen_heap", action=argparse.BooleanOptionalAction, default=True, help="freeze the heap after setup, as tandem train does")
    parser.add_argument("--switch_interval_ms", type=float, default=0.0,
                        help="the interpreter's thread switch interval (sys.setswitchinterval; 0 = Python's 5 ms): how long the engine thread may wait for the GIL while the event loop runs")
    parser.add_argument("--no-turn_at_a_time", dest="turn_at_a_time", action="store_false",
                        help="time only single_turn and multiturn (a sweep's processes: the turn-at-a-time ratio is not printed)")
    parser.add_argument("--profile", action="store_true", help="then one more multiturn run under torch.profiler: its top device kernels")
    parser.add_argument("--timeline", action="store_true", help="then one more multiturn run, its engine steps and idle gaps on the wall clock")
    args = parser.parse_args()
    shape, num_prompts, group_size, turn_tokens = ("toy", 4, 2, 8) if args.toy else (args.shape, 64, 8, 128)
    num_prompts, group_size, turn_tokens = args.num_prompts or num_prompts, args.group_size or group_size, args.turn_tokens or turn_tokens
    model = build_model(shape, args.device)
    tokenizer = build_tokenizer()  # ChatML template; its ids are valid ids of the bigger vocab
    rng = random.Random(0)
    prompts = [[rng.randrange(400, SHAPES[shape]["vocab_size"]) for _ in range(128)] for _ in range(num_prompts)]
    toolbox = ToolBox([python_tool(lookup)], timeout_s=5)
    mt = MultiTurn(env=BenchEnv(toolbox), chat=ChatFormat(tokenizer, toolbox.schemas), max_turns=NUM_TURNS, max_total_tokens=2048, warm_up=args.warm_up_turns)
    engine = Engine(EngineConfig(device=args.device, gpu_memory_utilization=0.6, max_num_seqs=512, max_model_len=2048, prefill_wait_steps=args.prefill_wait_steps,
                                 overlap_prefills=args.overlap_prefills, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size),
                    model=model, tokenizer=tokenizer)
    # prefill graphs replay the paged kernel's forward: with flash (--no-paged_prefill) prefills run eagerly
    engine.runner.paged_prefill = args.paged_prefill
    engine.runner.graph_prefills = args.graph_prefills and args.paged_prefill and engine.runner.graph_prefills
    config = {"shape": shape, "num_prompts": num_prompts, "group_size": group_size, "turn_tokens": turn_tokens, "num_turns": NUM_TURNS, "tool_ms": 50,
              "prefill_wait_steps": args.prefill_wait_steps, "overlap_prefills": args.overlap_prefills, "warm_up_turns": args.warm_up_turns,
              "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size, "paged_prefill": args.paged_prefill, "graph_prefills": engine.runner.graph_prefills, "frozen_heap": args.frozen_heap, "switch_interval_ms": args.switch_interval_ms}  # fmt: skip
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    with frozen_heap() if args.frozen_heap else contextlib.nullcontext():
        single, multi, naive = run_modes(args, engine, prompts, group_size, turn_tokens, mt, tokenizer, config)
    asyncio.run(engine.close())
    kept = multi["tokens_per_s"] / single["tokens_per_s"]
    print(f"multiturn / single_turn tokens/s: {kept:.2f} (required >= 0.70: {'met' if kept >= 0.7 else 'NOT met'}; multiturn runs {multi['runs_s']} s, "
          f"single_turn {single['runs_s']} s)")
    if naive is not None:
        print(f"multiturn / turn_at_a_time tokens/s: {multi['tokens_per_s'] / naive['tokens_per_s']:.2f}")


def run_modes(args, engine: Engine, prompts: list[list[int]], group_size: int, turn_tokens: int, mt: MultiTurn, tokenizer, config: dict) -> tuple[dict, dict, dict | None]:
    """The three timed modes (their rows; turn_at_a_time's None with --no-turn_at_a_time), then the --timeline and --profile runs."""
    single = timed("single_turn", engine, lambda: run_single_turn(engine, prompts, group_size, turn_tokens), config, args.repeats)
    multi = timed("multiturn", engine, lambda: run_multiturn(engine, prompts, group_size, turn_tokens, mt, tokenizer), config, args.repeats)
    naive = None if not args.turn_at_a_time else timed("turn_at_a_time", engine, lambda: run_turn_at_a_time(engine, prompts, group_size, turn_tokens, mt), config, args.repeats)
    if args.timeline:
        for label, make in (("single_turn", lambda: run_single_turn(engine, prompts, group_size, turn_tokens)),
                            ("multiturn", lambda: run_multiturn(engine, prompts, group_size, turn_tokens, mt, tokenizer))):  # fmt: skip
            asyncio.run(engine.update_weights([], version=engine.version))  # nothing cached from the last run
            timeline = Timeline(engine)
            asyncio.run(make())
            timeline.report(label)
    if args.profile:
        profile(lambda: run_multiturn(engine, prompts, group_size, turn_tokens, mt, tokenizer), args.device)
    return single, multi, naive


if __name__ == "__main__":
    main()
