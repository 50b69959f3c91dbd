"""Speculative decoding benchmark: ar vs mtp vs dflash (selector off) vs dflash2 on the same
checkpoints, in the same run: output tokens/s, acceptance length (committed tokens per
verify step, per-request mean) and per-position acceptance, speedup over ar, and where a
step's time goes (draft, verify, host = outside both). Greedy outputs are checked equal to
ar's (lossless) and reported.

    python bench/bench_spec.py                               # the bundled default pair if present,
                                                             # else a synthetic self-drafting pair
    python bench/bench_spec.py --target T --draft D [--prompts-file F] [--json OUT]

Prints a table shaped like the published one and writes JSON.
"""
import argparse
import json
import os
import sys
import tempfile
import time

# Only dflash2_rt runs timed work here (torch only builds the synthetic pair), so the
# package's default OpenMP waits apply (see python/dflash2_rt/__init__.py).

import numpy as np  # noqa: E402

import dflash2_rt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def synthetic_pair(root):
    """The tests' self-drafting pair (tests/dflash_fixtures.py): a tiny target whose greedy
    continuation a DFlash 2 drafter predicts except at ~1/5 'break' tokens."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import dflash_fixtures

    pair = dflash_fixtures.make_self_drafting_pair(root)
    return os.path.join(root, "target"), os.path.join(root, "draft"), pair


def default_pair():
    base = os.path.join(os.path.dirname(dflash2_rt.__file__), "models", "default")
    t, d = os.path.join(base, "target"), os.path.join(base, "draft")
    return (t, d) if os.path.isdir(t) and os.path.isdir(d) else (None, None)


def run_method(target, draft, method, prompts, new_tokens, temperature, top_p, seed):
    eng = dflash2_rt.Engine(target=target, draft=draft if method.startswith("dflash") else None, method=method,
                            max_batch_size=1, max_seq_len=max(len(p) for p in prompts) + new_tokens + 16)
    eng.generate([prompts[0]], max_new_tokens=4, stop_token_ids=[])  # warm-up
    outs, stats = [], []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):  # concurrency 1, like the published table's first rows
        r = eng.generate([p], max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                         seed=None if seed is None else seed + i, stop_token_ids=[])[0]
        outs.append(r.token_ids)
        stats.append(r.stats)
    wall = time.perf_counter() - t0
    gen = sum(s["generated_tokens"] for s in stats)
    steps = sum(s["verify_steps"] for s in stats)
    per_pos = np.mean([s["accepted_per_position"] for s in stats], axis=0).tolist() if stats[0]["accepted_per_position"] else []
    return outs, {
        "method": method, "tok_s": gen / wall,
        "acceptance_length": float(np.mean([s["acceptance_length"] for s in stats])),
        "accepted_per_position": per_pos, "verify_steps": steps, "generated_tokens": gen,
        "draft_ms_per_step": 1e3 * sum(s["draft_s"] for s in stats) / max(steps, 1),
        "verify_ms_per_step": 1e3 * sum(s["verify_s"] for s in stats) / max(steps, 1),
        "accept_ms_per_step": 1e3 * sum(s["accept_s"] for s in stats) / max(steps, 1),
        "host_ms_per_step": 1e3 * sum(s["host_s"] for s in stats) / max(steps, 1),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts-file", help="one prompt per line: text (needs tokenizer.json) or space-separated ids")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "spec_cpu.json"))
    args = ap.parse_args()

    tmp = None
    source = "given"
    if args.target:
        target, draft = args.target, args.draft
    else:
        target, draft = default_pair()
        source = "bundled default pair"
        if target is None:
            tmp = tempfile.TemporaryDirectory()
            target, draft, _ = synthetic_pair(tmp.name)
            source = "synthetic self-drafting pair (tests/dflash_fixtures.py)"
    probe = dflash2_rt.Engine(target=target, max_seq_len=64, max_batch_size=1)
    V = probe.vocab_size
    rng = np.random.default_rng(args.seed)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
        prompts = [probe.encode(ln) if probe.tokenizer is not None and not ln.replace(" ", "").isdigit()
                   else [int(t) for t in ln.split()] for ln in lines][: args.num_prompts]
    else:
        prompts = [rng.integers(0, V - 1, int(rng.integers(8, 48))).tolist() for _ in range(args.num_prompts)]
    methods = ["ar"] + (["mtp"] if probe.has_mtp else []) + (["dflash", "dflash2"] if draft else [])
    rows = []
    for temp, top_p in [(0.0, 1.0), (1.0, 0.95)]:
        base_out = None
        for m in methods:
            outs, row = run_method(target, draft, m, prompts, args.new_tokens, temp, top_p, args.seed)
            row.update({"temperature": temp, "top_p": top_p})
            if m == "ar":
                base_out, base = outs, row
            row["speedup"] = row["tok_s"] / base["tok_s"]
            row["greedy_equal_to_ar"] = (outs == base_out) if temp == 0.0 else None
            rows.append(row)
            print(f"  measured {m} T={temp}", file=sys.stderr, flush=True)
    print(f"checkpoints: {source}\n  target {target}\n  draft  {draft}\n"
          f"{len(prompts)} prompts, {args.new_tokens} new tokens each, concurrency 1, "
          f"{dflash2_rt.build_info()['num_threads']} CPU threads")
    hdr = (f"{'T':>4} {'method':>8} | {'tok/s':>8} {'speedup':>8} | {'accept len':>10} | {'draft ms':>8} "
           f"{'verify ms':>9} {'host ms':>8} /step | {'== ar':>6} | per-position acceptance")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        pp = " ".join(f"{x:.2f}" for x in r["accepted_per_position"])
        eq = "" if r["greedy_equal_to_ar"] is None else str(r["greedy_equal_to_ar"])
        print(f"{r['temperature']:>4.1f} {r['method']:>8} | {r['tok_s']:>8.1f} {r['speedup']:>7.2f}x | "
              f"{r['acceptance_length']:>10.2f} | {r['draft_ms_per_step']:>8.2f} {r['verify_ms_per_step']:>9.2f} "
              f"{r['host_ms_per_step']:>8.3f}      | {eq:>6} | {pp}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"bench": "spec_cpu", "source": source, "target": target, "draft": draft,
                   "num_prompts": len(prompts), "new_tokens": args.new_tokens,
                   "build_info": dflash2_rt.build_info(), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
