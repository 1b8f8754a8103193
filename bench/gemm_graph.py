"""cuBLAS against the Triton decode GEMM's top configs, timed inside a CUDA graph (no launch
overhead) over enough weight copies that every call reads its weight from HBM, not L2. Reads the top
configs of `python bench/decode.py --only matmul` from gemm_results.log (that run's output).

    python bench/decode.py --only matmul --models mistral-7b,0.5b,7b,olmo2-1b,smollm3-3b > gemm_results.log
    python bench/gemm_graph.py
"""
import json, torch, torch.nn.functional as F
from tandemrl.generation.engine.layers.gemm_kernel import decode_linear
from tandemrl.generation.engine.layers.activation import gated
rows_of = {}
for line in open("gemm_results.log"):
    if line.startswith("{") and '"top"' in line:
        r = json.loads(line)
        if r["rows"] == 128 and r["model"] in ("mistral-7b", "0.5b", "olmo2-1b", "smollm3-3b", "7b"):
            rows_of[(r["model"], r["projection"])] = r
WIDTHS = {"0.5b": (896, 896, 128, 4864), "7b": (3584, 3584, 512, 18944), "mistral-7b": (4096, 4096, 1024, 14336), "olmo2-1b": (2048, 2048, 2048, 8192), "smollm3-3b": (2048, 2048, 512, 11008)}
def parse(name):
    import re
    m = re.match(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)", name)
    bm, bn, bk, s, w, p = map(int, m.groups())
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=p)
def graph_time(fn, copies):
    for c in copies: fn(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in copies: fn(c)
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 20 / len(copies) * 1e3  # us per call
for model, (hidden, q, kv, inner) in WIDTHS.items():
    x = torch.randn(128, hidden, device="cuda", dtype=torch.bfloat16)
    total_c, total_t = 0.0, 0.0
    for proj, (n_in, n_out) in {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up+silu": (hidden, 2 * inner), "gate_up": (hidden, 2 * inner), "down": (inner, hidden)}.items():
        r = rows_of.get((model, proj))
        if r is None: continue
        xi = torch.randn(128, n_in, device="cuda", dtype=torch.bfloat16)
        n = max(2, int(400e6 // (n_in * n_out * 2)))
        copies = [torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * n_in**-0.5 for _ in range(n)]
        g = proj == "gate_up+silu"
        cub = graph_time((lambda w: gated(F.linear(xi, w), "silu")) if g else (lambda w: F.linear(xi, w)), copies)
        best = None
        for name, _ in r["top"]:
            cfg = parse(name)
            t = graph_time(lambda w: decode_linear(xi, w, gated="silu" if g else None, **cfg), copies)
            best = min(best or (t, name), (t, name))
        mb = n_in * n_out * 2 / 1e6
        print(json.dumps({"model": model, "proj": proj, "MB": round(mb, 1), "cublas_us": round(cub, 2), "triton_us": round(best[0], 2), "config": best[1], "cublas_TBps": round(mb / cub, 2), "triton_TBps": round(mb / best[0], 2)}), flush=True)
        print(f"ratio graph {model} {proj} rows=128: cuBLAS / best triton = {cub / best[0]:.2f}x", flush=True)
        if proj != "gate_up":
            total_c += cub; total_t += best[0]
        del copies
    print(f"ratio graph {model} layer rows=128 (qkv, o, gate_up+silu, down): cuBLAS / triton = {total_c / total_t:.2f}x ({total_c:.1f} / {total_t:.1f} us)", flush=True)
