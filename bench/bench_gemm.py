"""CPU GEMM microbenchmark: dflash2_rt's linear (weights in their stored format) against
torch.matmul in the same run, for decode shapes (M = 1..8) and prefill (M = 512).

    python bench/bench_gemm.py [--quick] [--json bench/results/gemm_cpu.json]

Prints a table and writes JSON. Timings are medians of several runs after a warm-up;
compare the ratios within one run (absolute numbers on shared machines are noisy).
"""
import argparse
import json
import os

# torch and dflash2_rt each bring an OpenMP runtime; with long spinning waits the two
# thread pools steal the 2 cores from each other and every call costs a scheduler slice
# (~12 ms). Passive waits are fair to both. Must be set before either is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import platform
import sys
import time

import numpy as np
import torch

import dflash2_rt
from dflash2_rt import ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import refs  # noqa: E402


def timeit(fn, min_time=0.3, max_reps=200):
    fn()  # warm-up
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes (for a smoke run)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gemm_cpu.json"))
    args = ap.parse_args()

    threads = dflash2_rt.build_info()["num_threads"]
    torch.set_num_threads(threads)
    shapes = [(K, N) for (K, N) in [(4096, 4096), (2048, 6144)]]
    Ms = [1, 2, 4, 8, 512]
    if args.quick:
        shapes, Ms = [(1024, 1024)], [1, 8, 64]
    fmts = ["bf16", "fp8", "nvfp4"]
    rng = np.random.default_rng(0)
    rows = []
    for (K, N) in shapes:
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        weights = {}
        t = refs.bf16_round(w)
        weights["bf16"] = (ops.Weight.dense(t), 2 * N * K)
        q, s = refs.quantize_fp8_block128(w)
        weights["fp8"] = (ops.Weight.fp8_block128(torch.from_numpy(q).view(torch.float8_e4m3fn), s), N * K)
        p, s4, g = refs.quantize_nvfp4(w)
        weights["nvfp4"] = (ops.Weight.nvfp4(p, torch.from_numpy(s4).view(torch.float8_e4m3fn), float(g)), N * K // 2 + N * K // 16)
        w32 = torch.from_numpy(w)
        wbf = t
        for M in Ms:
            x = rng.standard_normal((M, K)).astype(np.float32)
            xt = torch.from_numpy(x)
            xbf = xt.to(torch.bfloat16)
            y = np.empty((M, N), np.float32)
            row = {"M": M, "K": K, "N": N}
            with torch.inference_mode():
                row["torch_f32_s"] = timeit(lambda: torch.matmul(xt, w32.T))
                row["torch_bf16_s"] = timeit(lambda: torch.matmul(xbf, wbf.T))
            for f in fmts:
                wt, wbytes = weights[f]
                row[f"{f}_s"] = timeit(lambda: ops.linear(x, wt, out=y))
                row[f"{f}_weight_GBps"] = wbytes / row[f"{f}_s"] / 1e9
            row["gflops_bf16"] = 2 * M * N * K / row["bf16_s"] / 1e9
            row["gflops_torch_f32"] = 2 * M * N * K / row["torch_f32_s"] / 1e9
            row["speedup_bf16_vs_torch_f32"] = row["torch_f32_s"] / row["bf16_s"]
            row["speedup_bf16_vs_torch_bf16"] = row["torch_bf16_s"] / row["bf16_s"]
            rows.append(row)
            print(f"  measured M={M} K={K} N={N}", file=sys.stderr, flush=True)

    hdr = (f"{'M':>4} {'K':>5} {'N':>5} | {'torch f32':>10} {'torch bf16':>10} | {'ours bf16':>10} {'ours fp8':>10} "
           f"{'ours nvfp4':>10} | {'bf16 GF/s':>9} {'torch GF/s':>10} | {'vs f32':>6} {'vs bf16':>7} | {'bf16 GB/s':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['M']:>4} {r['K']:>5} {r['N']:>5} | {r['torch_f32_s']*1e3:>8.3f}ms {r['torch_bf16_s']*1e3:>8.3f}ms | "
              f"{r['bf16_s']*1e3:>8.3f}ms {r['fp8_s']*1e3:>8.3f}ms {r['nvfp4_s']*1e3:>8.3f}ms | "
              f"{r['gflops_bf16']:>9.1f} {r['gflops_torch_f32']:>10.1f} | {r['speedup_bf16_vs_torch_f32']:>5.2f}x "
              f"{r['speedup_bf16_vs_torch_bf16']:>6.2f}x | {r['bf16_weight_GBps']:>9.1f}")
    out = {
        "bench": "gemm_cpu",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads},
        "build_info": dflash2_rt.build_info(),
        "torch": torch.__version__,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
