"""What the KV cache's element type (Engine kv_cache_dtype: f32, bf16, fp8) does to a trained
model: the bundled default pair over held-out prompts (bench_default_pair.py's), each cache type
against the F32 cache measured in the same run.

Per cache type: teacher-forced logits over each prompt + the F32 cache's greedy continuation
(one forward of the whole sequence; NMSE per position against the F32 cache's logits, median and
99th percentile, and the fraction of positions whose argmax changes), greedy generation with ar
(the fraction of requests whose continuation equals the F32 cache's token for token, and the mean
length of the common prefix), dflash2 under the same cache (acceptance length, and whether it
equals ar under that cache: lossless), and the cache's bytes (metrics()["kv_cache_bytes"]).

    python bench/kv_cache_quality.py [--n 16] [--new 64] [--threads 2] [--device cpu|cuda]
                                     [--dtypes f32 bf16 fp8] [--out bench/results]

Writes kv_cache_quality[_cuda].json and .md there.
"""
import argparse
import json
import os
import sys

import numpy as np

import dflash2_rt
from bench_default_pair import heldout_prompts

HERE = os.path.dirname(os.path.abspath(__file__))


def nmse_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return ((a - b) ** 2).sum(1) / np.maximum((b ** 2).sum(1), 1e-300)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16", "fp8"], choices=["f32", "bf16", "fp8"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    dtypes = ["f32"] + [d for d in a.dtypes if d != "f32"]
    kw = dict(num_threads=a.threads, device=a.device, max_batch_size=1)
    if a.device != "cpu":
        kw["capture_at_load"] = False  # six engines: their graphs as the steps need them, not at load
    base = dflash2_rt.Engine(method="ar", kv_cache_dtype="f32", **kw)
    prompts = heldout_prompts(base.tokenizer, a.n)
    want = [list(r.token_ids) for r in (base.generate([p], max_new_tokens=a.new, stop_token_ids=[])[0]
                                        for p in prompts)]
    seqs = [p + w for p, w in zip(prompts, want)]
    ref_logits = [base.logits(s) for s in seqs]
    rows = {}
    for dt in dtypes:
        ar = base if dt == "f32" else dflash2_rt.Engine(method="ar", kv_cache_dtype=dt, **kw)
        d2 = dflash2_rt.Engine(method="dflash2", kv_cache_dtype=dt, **kw)
        nm, flips = [], []
        for s, ref in zip(seqs, ref_logits):
            lg = ar.logits(s)
            nm.append(nmse_rows(lg, ref))
            flips.append(lg.argmax(1) != ref.argmax(1))
        nm, flips = np.concatenate(nm), np.concatenate(flips)
        got = [list(ar.generate([p], max_new_tokens=a.new, stop_token_ids=[])[0].token_ids) for p in prompts]
        same = [g == w for g, w in zip(got, want)]
        prefix = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w))) for g, w in zip(got, want)]
        taus, spec = [], []
        for p in prompts:
            r = d2.generate([p], max_new_tokens=a.new, stop_token_ids=[])[0]
            taus.append(r.stats["acceptance_length"])
            spec.append(list(r.token_ids))
        rows[dt] = {
            "kv_cache_bytes": ar.metrics()["kv_cache_bytes"],
            "logits_nmse_median": float(np.median(nm)), "logits_nmse_p99": float(np.percentile(nm, 99)),
            "argmax_changed": float(flips.mean()),
            "greedy_equal_f32": float(np.mean(same)), "greedy_common_prefix": float(np.mean(prefix)),
            "dflash2_acceptance_length": float(np.mean(taus)), "dflash2_lossless": spec == got,
        }
        r = rows[dt]
        print(f"{dt:5s} bytes {r['kv_cache_bytes'] / rows['f32']['kv_cache_bytes']:.3f}x f32 | logits NMSE median "
              f"{r['logits_nmse_median']:.2e} p99 {r['logits_nmse_p99']:.2e} | argmax changed {r['argmax_changed']:.2%} "
              f"| greedy == f32 {r['greedy_equal_f32']:.0%} (common prefix {r['greedy_common_prefix']:.1f} of {a.new}) | "
              f"dflash2 tau {r['dflash2_acceptance_length']:.2f}, lossless {r['dflash2_lossless']}", flush=True)
    suffix = "" if a.device == "cpu" else "_" + a.device.split(":")[0]
    os.makedirs(a.out, exist_ok=True)
    cmd = "python bench/kv_cache_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(a.out, f"kv_cache_quality{suffix}.json"), "w") as f:
        json.dump({"command": cmd.strip(), "prompts": a.n, "new_tokens": a.new, "device": a.device, "rows": rows}, f,
                  indent=1)
    lines = ["| kv_cache_dtype | bytes vs f32 | logits NMSE median / p99 | argmax changed | greedy == f32 | "
             "common prefix | dflash2 tau | dflash2 == ar |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dt, r in rows.items():
        lines.append(f"| {dt} | {r['kv_cache_bytes'] / rows['f32']['kv_cache_bytes']:.3f} | "
                     f"{r['logits_nmse_median']:.1e} / {r['logits_nmse_p99']:.1e} | {r['argmax_changed']:.2%} | "
                     f"{r['greedy_equal_f32']:.0%} | {r['greedy_common_prefix']:.1f} / {a.new} | "
                     f"{r['dflash2_acceptance_length']:.2f} | {'yes' if r['dflash2_lossless'] else 'NO'} |")
    with open(os.path.join(a.out, f"kv_cache_quality{suffix}.md"), "w") as f:
        f.write(f"# KV cache element type on the bundled pair\n\n`{cmd.strip()}`\n\n{a.n} held-out prompts x 128 "
                f"tokens, {a.new} greedy tokens, batch 1, on {a.device}.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
