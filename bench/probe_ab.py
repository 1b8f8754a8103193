"""The top-p probe (sampler_kernel._probe, at this commit) against the kernel before it (old_sampler_kernel.py: `git show 422cc81:src/tandemrl/generation/engine/layers/sampler_kernel.py > old_sampler_kernel.py`), one process, H200."""
import json, torch, importlib.util
from triton.testing import do_bench
from tandemrl.generation.engine.layers.sampler import SamplingTensors, row_keys, sample
from tandemrl.generation.engine.layers import sampler_kernel as new
spec = importlib.util.spec_from_file_location("old_sampler_kernel", "old_sampler_kernel.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
vocab = 151936
for rows in (128, 256, 512):
    for scale in (0.5, 3.0):
        logits = (torch.randn(rows, vocab, device="cuda") * scale).to(torch.bfloat16)
        ones = torch.ones(rows, device="cuda"); keys = row_keys(torch.arange(rows, device="cuda"), torch.full((rows,), 5, device="cuda"))
        for p in (0.9, 0.95, 0.5):
            top_k, top_p, min_p = torch.full((rows,), vocab, device="cuda"), torch.full((rows,), p, device="cuda"), torch.zeros(rows, device="cuda")
            ref = sample(logits, SamplingTensors(temperatures=ones, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys, needs_filter=True))
            got = new.sample_filtered(logits, ones, top_k, top_p, min_p, keys)
            t_new = do_bench(lambda: new.sample_filtered(logits, ones, top_k, top_p, min_p, keys), warmup=10, rep=100, return_mode="median")
            t_old = do_bench(lambda: old.sample_filtered(logits, ones, top_k, top_p, min_p, keys), warmup=10, rep=100, return_mode="median")
            t_un = do_bench(lambda: new.sample_unfiltered(logits, ones, keys), warmup=10, rep=100, return_mode="median")
            print(json.dumps({"rows": rows, "scale": scale, "top_p": p, "new_ms": round(t_new, 4), "old_ms": round(t_old, 4), "unfiltered_ms": round(t_un, 4),
                "same_ids": round((got[0] == ref[0]).float().mean().item(), 4), "same_floors": round(torch.isclose(got[2], ref[2], atol=1e-4).float().mean().item(), 4)}), flush=True)
            print(f"ratio probe rows={rows} scale={scale} top_p={p}: old / new = {t_old / t_new:.2f}x; new / unfiltered = {t_new / t_un:.2f}x", flush=True)
