"""Past one GPU: FSDP2 data-parallel training over torchrun (`train`), a 7B-shaped colocated run
(`colocate`), the trainer and rollout servers on separate GPUs (`servers`), and the engine split over N
GPUs (`engine`).

train: the train phase of one GRPO step (bench/train.py's workload: 512 sequences of 128 + 256 tokens,
random weights of a Qwen2.5 shape, float32 masters, bf16 compute) on 1 GPU and with FSDP2 on N GPUs,
the same global batch. Per run one JSON line: seconds per step (mean of the timed steps), tokens/s, peak
memory, the loss / grad_norm / entropy curve, and the extra peak memory of a colocated weight sync
(gathered --move_model_batches batches at a time, into a sink that drops them as an engine copies them).
Then one line per N: scaling efficiency = tokens/s(N) / (N x tokens/s(1)) (required >= 0.85) and the
largest relative difference of the curves.

servers: issue 19's disaggregated run: `tandem train` under torchrun on GPUs 0..N-1 (FSDP2, rank 0 the
servers' client) and `tandem rollout` servers of tensor parallel size T on the other GPUs, --max_staleness S,
NCCL weight sync, on the same random model and task as `colocate`: the step split, overlap efficiency,
sync seconds and GB/s, and each GPU's utilisation. `--model tiny` runs it on a CPU (a check, not a figure).

colocate: `tandem train` under torchrun on a random Qwen2.5-7B-shaped model saved to a temporary
directory (bf16 on disk, float32 masters), each rank with its own engine (or one split over the ranks:
`-- --tensor_parallel_size 2`), the memory levers as the flags after `--` say; stopped after --steps
logged steps (the run's final checkpoint is not part of the figure). Prints the steady step time split
and rank 0's peak memory (the console's `mem`), or the error that stopped it. `--model tiny` runs the
same command on a CPU (gloo) in about a minute: a check that it runs, not a figure.

engine: the engine split over N GPUs (tensor parallel) against one GPU, on a random model of a real
Qwen2.5 shape: output tokens/s of a GRPO-shaped workload (64 prompts x 8 samples, 128 prompt + 256 new
tokens, temperature 1) and greedy equality (token ids of TP = N against TP = 1, the first token's logprob
gap). This process is rank 0 on GPU 0; ranks 1..N-1 are spawned (generation/engine/workers.py) and cut
their shards from the model's weights on GPU 0 (CUDA IPC). One JSON line per figure, then a ratio line.

    python bench/scale.py train --model 1.5b --nproc 1,2
    python bench/scale.py colocate --model 7b --nproc 2 --steps 3 -- --sleep_level 1 --offload_optimizer --offload_model
    python bench/scale.py colocate --model tiny --nproc 2 --steps 2 --prompts 2 --generations 2 --completion_tokens 8 -- --tensor_parallel_size 2
    python bench/scale.py engine --model 1.5b --tensor_parallel_size 2
    python bench/scale.py servers --model 7b --nproc 2 --server_tp 2 --steps 4             # 4 GPUs: issue 19 run 1
    python bench/scale.py servers --model tiny --nproc 2 --server_tp 2 --steps 3 --prompts 2 --generations 2 --prompt_tokens 16 --completion_tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train import COMPLETION, GENERATIONS, PROMPT, PROMPTS, make_batch  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, tie_word_embeddings=False,
    ),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),  # CPU check
}
CURVE = ("loss", "grad_norm", "entropy")


def qwen_config(shape: str):
    """Qwen2.5's config of that size (the real vocabulary, rope and tying)."""
    from transformers import Qwen2Config

    base = dict(vocab_size=151936, tie_word_embeddings=True)
    return Qwen2Config(
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        **{**base, **SHAPES[shape]},
    )  # fmt: skip


def build_model(shape: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Random weights, the same on every rank (seed 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(qwen_config(shape), dtype=dtype, attn_implementation="sdpa")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Sink:
    """A colocated generator that takes each gathered batch as an engine copies it, and keeps nothing."""

    version = 0

    async def update_weights(self, weights, *, version: int) -> None:
        self.version = version


def sync_peak_gib(trainer, device: torch.device, move_model_batches: int) -> float:
    """Extra peak memory (GiB) of one colocated sync of the sharded trainer's weights."""
    from tandemrl.weights.base import LocalSyncConfig
    from tandemrl.weights.local import LocalSync

    if device.type != "cuda":
        return 0.0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    sync = LocalSync(LocalSyncConfig(move_model_batches=move_model_batches), Sink())
    asyncio.run(sync.publish(trainer.model.named_parameters(), version=1))
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def train_worker(args) -> None:
    """One rank of the train benchmark (under torchrun; alone, the one-GPU run)."""
    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.train.config import TrainerConfig
    from tandemrl.train.distributed import close_data_parallel, init_data_parallel
    from tandemrl.train.trainer import Trainer

    use_cuda = torch.cuda.is_available()
    dp = init_data_parallel(use_cuda)
    device = dp.device(torch.device("cuda" if use_cuda else "cpu"))
    model = build_model(args.model, device)
    config = TrainerConfig(learning_rate=args.learning_rate, device=device.type, max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    trainer = Trainer(config, AlgoConfig(beta=0.0), model, max_steps=100, dp=dp)
    batch = make_batch()
    batch.groups = batch.groups[: args.num_prompts]
    curve, seconds = [], []
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup + args.steps):
        synchronize(device)
        dp.barrier()
        started = time.perf_counter()
        metrics = trainer.train_step(batch)
        synchronize(device)
        dp.barrier()
        seconds.append(time.perf_counter() - started)
        curve.append({key: metrics[key] for key in CURVE})
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if use_cuda else 0.0
    sync = {f"sync_peak_gib_batches_{n}": round(sync_peak_gib(trainer, device, n), 2) for n in (1, args.move_model_batches)}
    timed = seconds[args.warmup :]
    num_tokens = len(batch.groups) * GENERATIONS * (PROMPT + COMPLETION)
    if dp.is_main:
        row = {
            "model": args.model, "num_gpus": dp.world_size, "seconds": round(sum(timed) / len(timed), 3),
            "first_step_s": round(seconds[0], 2), "tokens_per_s": round(num_tokens * len(timed) / sum(timed)),
            "peak_gib": round(peak, 2), **sync, "curve": curve,
        }  # fmt: skip
        print("RESULT " + json.dumps(row), flush=True)
    close_data_parallel(dp)


def launch(nproc: int, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """This file's worker on `nproc` ranks (torchrun), or alone for one."""
    script = [os.path.abspath(__file__), *argv]
    cmd = [sys.executable, *script] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def max_relative_difference(a: list[dict], b: list[dict]) -> float:
    """max over steps and CURVE keys of |a - b| / max(|a|, 1e-6). Example: [{"loss": 1.0}] vs [{"loss": 1.01}] -> 0.0099..."""
    return max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-6) for x, y in zip(a, b) for k in CURVE)


def train(args) -> None:
    worker = ["_train_worker", "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--learning_rate", str(args.learning_rate), "--move_model_batches", str(args.move_model_batches),
              "--max_tokens_per_microbatch", str(args.max_tokens_per_microbatch), "--num_prompts", str(args.num_prompts)]  # fmt: skip
    results = {}
    for nproc in [int(n) for n in args.nproc.split(",")]:
        done = launch(nproc, worker, args.timeout_s)
        found = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            print(json.dumps({"model": args.model, "num_gpus": nproc, "error": (done.stderr or done.stdout)[-3000:]}), flush=True)
            continue
        results[nproc] = json.loads(found[0])
        print(json.dumps(results[nproc]), flush=True)
    if 1 not in results:
        return
    one = results[1]
    for nproc, row in results.items():
        if nproc == 1:
            continue
        efficiency = row["tokens_per_s"] / (nproc * one["tokens_per_s"])
        drift = max_relative_difference(one["curve"], row["curve"])
        verdict = "meets" if efficiency >= 0.85 else "BELOW"
        print(
            f"ratio {args.model} train phase: {nproc} GPUs {row['seconds']:.3f} s vs 1 GPU {one['seconds']:.3f} s = "
            f"{one['seconds'] / row['seconds']:.2f}x, scaling efficiency {efficiency:.2f} ({verdict} 0.85); "
            f"curves (loss, grad_norm, entropy) differ by at most {drift:.2e} (relative)",
            flush=True,
        )


def write_run_inputs(tmp: str, args) -> float:
    """A random model of `args.model`'s shape (bf16 on disk), prompts and a noise reward, under `tmp`;
    returns the seconds saving the model took."""
    from tandemrl.tasks.tiny import build_tokenizer

    started = time.perf_counter()
    model = build_model(args.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16)
    model.save_pretrained(f"{tmp}/model")
    build_tokenizer().save_pretrained(f"{tmp}/model")
    del model
    torch.cuda.empty_cache()
    with open(f"{tmp}/data.jsonl", "w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": f"{i:04d} " + "abcdefghij" * (args.prompt_tokens // 10)}) + "\n")
    with open(f"{tmp}/noise.py", "w") as f:
        f.write("import random\n\ndef noise(prompts, completions, **kw):\n    return [random.random() for _ in completions]\n")
    return time.perf_counter() - started


def train_command(tmp: str, args, nproc: int) -> list[str]:
    """`tandem train` under torchrun on `nproc` ranks over write_run_inputs' files, stopped by run_until."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "tandemrl", "train",
        "--model", f"{tmp}/model", "--dataset", f"{tmp}/data.jsonl", "--reward_funcs", f"{tmp}/noise.py:noise",
        "--num_prompts_per_step", str(args.prompts), "--num_generations", str(args.generations),
        "--max_completion_length", str(args.completion_tokens), "--max_prompt_length", str(args.prompt_tokens + 64),
        "--beta", "0", "--max_steps", "1000", "--logging_steps", "1", "--output_dir", f"{tmp}/run",
        "--move_model_batches", str(args.move_model_batches),
    ]  # fmt: skip


def run_summary(rows: list[dict], output: str, args) -> dict:
    """Steps logged, the steady (after step 1) mean step time and its split, rank 0's peak GiB, or the error."""
    memory = [float(m) for m in re.findall(r"mem ([0-9.]+)G", output)]
    out: dict = {"steps": len(rows)}
    if len(rows) < args.steps:
        out["error"] = output[-3000:]
    steady = rows[1:] or rows
    for key in ("step_time", "rollout/generate_s", "time/generate", "time/train", "time/sync", "pipeline/wait_time"):
        if steady and key in steady[0]:
            out[key] = round(sum(r[key] for r in steady) / len(steady), 3)
    if memory:
        out["peak_gib_rank0"] = max(memory)
    out["grad_norm"] = [r.get("grad_norm") for r in rows]  # NaN here: the steps did not train, whatever the times say
    return out


def colocate(args) -> None:
    """`tandem train` under torchrun on a random model of `args.model`'s shape, stopped after args.steps steps."""
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        saved_s = write_run_inputs(tmp, args)
        cmd = [*train_command(tmp, args, args.nproc), *args.train_flags]
        rows, output, _ = run_until(cmd, f"{tmp}/run/metrics.jsonl", args.steps, args.timeout_s)
    out = {"model": args.model, "num_gpus": args.nproc, "flags": args.train_flags, "model_saved_s": round(saved_s, 1)}
    print(json.dumps({**out, **run_summary(rows, output, args)}), flush=True)


def servers(args) -> None:
    """Issue 19's run 1: `tandem train` under torchrun on GPUs 0..N-1 (FSDP2) and `tandem rollout` servers of
    TP = T on the other GPUs (--server_gpus, T at a time), --max_staleness S, weights over NCCL; stopped after
    args.steps steps. One JSON line: the steady step split, the overlap efficiency max(gen, train) / step, the
    sync's seconds and GB/s (on GPU the bf16 compute weights are pushed, on CPU the float32 masters; the FSDP
    gathers count in its time) and each GPU's mean
    utilisation (nvidia-smi, sampled each second). On a CPU (gloo) the same command is a check that it runs.
    --timeout_s bounds the whole: saving the model, starting the servers and the run."""
    deadline = time.monotonic() + args.timeout_s
    cuda = torch.cuda.is_available()
    if cuda:
        server_gpus = args.server_gpus or ",".join(str(g) for g in range(args.nproc, torch.cuda.device_count()))
        gpus = [int(g) for g in server_gpus.split(",")]
        gpu_sets = [",".join(map(str, gpus[i : i + args.server_tp])) for i in range(0, len(gpus), args.server_tp)]
    else:
        gpu_sets = [""] * args.num_servers
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        saved_s = write_run_inputs(tmp, args)
        procs = [start_server(tmp, args, gpu_set, i) for i, gpu_set in enumerate(gpu_sets)]
        try:
            urls = [wait_for_url(tmp, i, proc, deadline - time.monotonic()) for i, proc in enumerate(procs)]
            if None in urls:
                print(json.dumps({"model": args.model, "error": urls}), flush=True)
                return
            cmd = [
                *train_command(tmp, args, args.nproc), "--rollout_mode", "server", "--rollout_server_urls", *urls,
                "--max_staleness", str(args.max_staleness), "--weight_sync_port", "0", *(["--weight_sync_backend", "nccl"] if cuda else []),
                *args.train_flags,
            ]  # fmt: skip
            env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(args.nproc))} if cuda else {}
            with GpuUtilisation() as utilisation:
                rows, output, _ = run_until(cmd, f"{tmp}/run/metrics.jsonl", args.steps, deadline - time.monotonic(), env=env)
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
    out = {"model": args.model, "trainer_gpus": args.nproc, "servers": gpu_sets, "server_tp": args.server_tp, "max_staleness": args.max_staleness,
           "flags": args.train_flags, "model_saved_s": round(saved_s, 1), **run_summary(rows, output, args)}  # fmt: skip
    if "rollout/generate_s" in out and out.get("step_time"):
        out["overlap_efficiency"] = round(max(out["rollout/generate_s"], out["time/train"]) / out["step_time"], 3)
    if out.get("time/sync"):
        gigabytes = (2 if cuda else 4) * sum(qwen_config_numel(args.model)) / 1e9  # shards gathered in bf16 on GPU
        out["sync_gb"], out["sync_gb_per_s"] = round(gigabytes, 2), round(gigabytes / out["time/sync"], 1)
    out["gpu_utilisation_mean"] = utilisation.means(last_s=sum(r["step_time"] for r in rows[1:]))  # the steady steps
    print(json.dumps(out), flush=True)


def start_server(tmp: str, args, gpus: str, index: int) -> subprocess.Popen:
    """`tandem rollout` on `gpus` (CUDA_VISIBLE_DEVICES; "" on a CPU), its output in tmp/server<index>.log."""
    cmd = [
        sys.executable, "-m", "tandemrl", "rollout", "--model", f"{tmp}/model", "--port", "0", "--tensor_parallel_size", str(args.server_tp),
        "--max_model_len", str(args.prompt_tokens + 64 + args.completion_tokens), "--gpu_memory_utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})}
    log = open(f"{tmp}/server{index}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def wait_for_url(tmp: str, index: int, proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The URL server `index` prints once it serves, or None (its log's tail printed) if it exits or passes `timeout_s` first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        text = open(f"{tmp}/server{index}.log").read()
        found = re.search(r"serving .* on (http://\S+)", text)
        if found:
            return found.group(1)
        time.sleep(1)
    print(f"server {index} did not start:\n{open(f'{tmp}/server{index}.log').read()[-3000:]}", flush=True)
    return None


def qwen_config_numel(shape: str) -> list[int]:
    """Parameter counts of a model of that shape (its meta-device build: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen_config(shape))
    return [p.numel() for p in model.parameters()]


class GpuUtilisation:
    """Samples every GPU's utilisation (nvidia-smi) each second while open; nothing without nvidia-smi."""

    def __enter__(self) -> GpuUtilisation:
        self.samples: list[tuple[float, list[int]]] = []
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        if shutil.which("nvidia-smi"):
            self.thread.start()
        return self

    def _sample(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self.stop.wait(1.0):
            out = subprocess.run(query, capture_output=True, text=True).stdout
            self.samples.append((time.monotonic() - self.started, [int(x) for x in out.split()]))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.ended = time.monotonic() - self.started

    def means(self, last_s: float) -> list[float]:
        """Each GPU's mean utilisation (%) over the last `last_s` seconds sampled (the start-up left out)."""
        kept = [values for at, values in self.samples if at >= self.ended - last_s - 2.0]  # 2 s: run_until's polling
        return [round(sum(column) / len(column), 1) for column in zip(*kept)] if kept else []


def run_until(cmd: list[str], metrics_path: str, steps: int, timeout_s: float, env: dict | None = None) -> tuple[list[dict], str, str]:
    """Runs `cmd` until metrics_path holds `steps` rows (then stops it), it exits, or timeout_s passes."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(2)
        if os.path.exists(metrics_path):
            rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
        if len(rows) >= steps:
            break
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    output = process.communicate(timeout=60)[0]
    if os.path.exists(metrics_path):
        rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    return rows[:steps], output, output


def _rank_died(rank: int, exit_code: int | None) -> None:
    print(json.dumps({"error": f"tensor-parallel rank {rank} exited (code {exit_code})"}), flush=True)
    os._exit(1)


def run_engine(model, size: int, args, requests: list, greedy_prompts: list) -> tuple[float, float, list]:
    """(tokens/s, seconds, greedy completions) of one engine split over `size` GPUs (rank 0 here, on GPU 0)."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.generation.engine.workers import launch as launch_ranks
    from tandemrl.types import SamplingParams

    config = EngineConfig(
        device="cuda:0" if torch.cuda.is_available() else "cpu", gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=512,
        max_model_len=args.prompt_tokens + args.new_tokens, enforce_eager=args.enforce_eager, tensor_parallel_size=size,
    )  # fmt: skip
    tp = launch_ranks(config, model=model, on_death=_rank_died)[0] if size > 1 else None
    engine = Engine(config, model=model, tp=tp)

    async def go(prompts, params):
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    sampled = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i) for i, (_, n) in enumerate(requests)]
    prompts = [p for p, _ in requests]
    asyncio.run(go(prompts[:64], sampled[:64]))  # warm: Triton kernels compile
    started = time.perf_counter()
    completions = asyncio.run(go(prompts, sampled))
    elapsed = time.perf_counter() - started
    greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    greedy_out = asyncio.run(go(greedy_prompts, [greedy] * len(greedy_prompts)))
    asyncio.run(engine.close())
    return sum(len(c.token_ids) for c in completions) / elapsed, elapsed, greedy_out


def engine(args) -> None:
    """Output tokens/s of the engine on 1 GPU and split over N, and greedy equality between them."""
    rng = random.Random(0)
    vocab = qwen_config(args.model).vocab_size
    requests = [([rng.randrange(vocab) for _ in range(args.prompt_tokens)], args.new_tokens) for _ in range(args.num_prompts) for _ in range(8)]
    greedy_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.num_greedy)]
    cuda = torch.cuda.is_available()
    model = build_model(args.model, torch.device("cuda:0" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32).eval()
    results = {}
    for size in (1, args.tensor_parallel_size):
        tokens_per_s, seconds, greedy = run_engine(model, size, args, requests, greedy_prompts)
        results[size] = (tokens_per_s, greedy)
        print(json.dumps({"model": args.model, "tensor_parallel_size": size, "requests": len(requests), "new_tokens": args.new_tokens,
                          "seconds": round(seconds, 3), "tokens_per_s": round(tokens_per_s), "enforce_eager": args.enforce_eager}), flush=True)  # fmt: skip
    one, many = results[1][1], results[args.tensor_parallel_size][1]
    same = [a.token_ids == b.token_ids for a, b in zip(one, many)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids)) for a, b in zip(one, many)]
    gap = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(one, many))
    print(json.dumps({"model": args.model, "greedy_sequences": len(same), "identical": sum(same), "tokens_each": args.greedy_tokens,
                      "mean_common_prefix": round(sum(prefix) / len(prefix), 1), "first_logprob_max_gap": round(gap, 5)}), flush=True)  # fmt: skip
    ratio = results[args.tensor_parallel_size][0] / results[1][0]
    print(f"ratio {args.model} engine tokens/s TP={args.tensor_parallel_size} / TP=1 = {ratio:.2f}; greedy identical {sum(same)}/{len(same)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="the train phase on 1 GPU and with FSDP2 on N GPUs, same global batch")
    w = sub.add_parser("_train_worker", help=argparse.SUPPRESS)
    for p in (t, w):
        p.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--learning_rate", type=float, default=1e-5)
        p.add_argument("--move_model_batches", type=int, default=8)
        p.add_argument("--max_tokens_per_microbatch", type=int, default=0)
        p.add_argument("--num_prompts", type=int, default=PROMPTS, help="groups of the global batch (64; fewer for a CPU check)")
    t.add_argument("--nproc", default="1,2")
    t.add_argument("--timeout_s", type=float, default=220)
    c = sub.add_parser("colocate", help="tandem train under torchrun, colocated engines, a random model")
    c.add_argument("--model", default="7b", choices=sorted(SHAPES))
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--steps", type=int, default=4)
    c.add_argument("--prompts", type=int, default=16)
    c.add_argument("--generations", type=int, default=8)
    c.add_argument("--prompt_tokens", type=int, default=128)
    c.add_argument("--completion_tokens", type=int, default=256)
    c.add_argument("--move_model_batches", type=int, default=8)
    c.add_argument("--timeout_s", type=float, default=200)
    c.add_argument("--tmp_dir", default=None)
    c.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: more `tandem train` flags")
    v = sub.add_parser("servers", help="tandem train under torchrun (FSDP2) + tandem rollout servers on the other GPUs (issue 19 run 1)")
    v.add_argument("--model", default="7b", choices=sorted(SHAPES))
    v.add_argument("--nproc", type=int, default=2, help="trainer GPUs (0..N-1), one torchrun rank each")
    v.add_argument("--server_gpus", default="", help="GPUs of the servers, e.g. 2,3 (default: every GPU after the trainer's)")
    v.add_argument("--server_tp", type=int, default=2, help="each server splits its model over this many of --server_gpus")
    v.add_argument("--num_servers", type=int, default=1, help="on a CPU: how many servers (on GPUs: as --server_gpus hold)")
    v.add_argument("--gpu_memory_utilization", type=float, default=0.85, help="each server's (lower when a server shares a trainer GPU)")
    v.add_argument("--max_staleness", type=int, default=1)
    v.add_argument("--steps", type=int, default=4)
    v.add_argument("--prompts", type=int, default=64)
    v.add_argument("--generations", type=int, default=8)
    v.add_argument("--prompt_tokens", type=int, default=256)
    v.add_argument("--completion_tokens", type=int, default=1024)
    v.add_argument("--move_model_batches", type=int, default=8)
    v.add_argument("--timeout_s", type=float, default=600)
    v.add_argument("--tmp_dir", default=None)
    v.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: more `tandem train` flags")
    e = sub.add_parser("engine", help="the engine split over N GPUs (tensor parallel) against one GPU")
    e.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    e.add_argument("--tensor_parallel_size", type=int, default=2)
    e.add_argument("--num_prompts", type=int, default=64, help="prompts, 8 samples each (temperature 1)")
    e.add_argument("--prompt_tokens", type=int, default=128)
    e.add_argument("--new_tokens", type=int, default=256)
    e.add_argument("--num_greedy", type=int, default=32, help="greedy sequences compared token for token")
    e.add_argument("--greedy_tokens", type=int, default=64)
    e.add_argument("--gpu_memory_utilization", type=float, default=0.6)
    e.add_argument("--enforce_eager", action="store_true", help="no CUDA graphs (the ranks' collectives run eagerly)")
    args = parser.parse_args()
    if args.what in ("colocate", "servers"):
        args.train_flags = [f for f in args.train_flags if f != "--"]
    {"train": train, "_train_worker": train_worker, "colocate": colocate, "servers": servers, "engine": engine}[args.what](args)


if __name__ == "__main__":
    main()
