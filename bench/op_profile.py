"""Where a decode step's time goes, op by op: each op's own time per step (ops.set_op_timing:
the host's clock on the CPU, the device time between events around each op on a GPU), for
each method and batch size, on the bundled pair or the real-dimension slice.

Per (model, method, batch): an engine runs without CUDA graphs (captured ops are not timed)
and with padding to buckets off; B requests are submitted and, once every one has its first
token (the prompts are done), the op times are reset and the decode steps run to the end.
Reports, per op: calls per step, time per step and share of the timed total; and the timed
total against the wall-clock time per step (the rest is host work and launch gaps, which an
eager run has more of than the captured one). On a GPU every op waits for its end event, so
the wall time is not the engine's speed; the per-op times are the kernels'. Writes
<out>/op_profile[_<device>].json.

    python bench/op_profile.py [--device cpu|cuda] [--models pair slice] [--methods ar dflash2]
                               [--batch 1 8] [--new 24] [--kv-cache-dtype f32 bf16 fp8] [--top 15]
                               [--out bench/results]

--kv-cache-dtype: one run per cache type (Engine kv_cache_dtype; on CUDA "bf16" puts MLA on the
tensor cores where kv_lora allows, as the slice's 512), each run's JSON row naming it.

--models slice: the two-layer target with GLM-5.3's attention dimensions and a random DFlash 2
drafter with the GLM-5.3 drafter's attention shape (bench_concurrency.py's slice_pair; needs
torch and transformers, as the tests do): the decode step at real dimensions, not speedups.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import dflash2_rt
from dflash2_rt import ops

HERE = os.path.dirname(os.path.abspath(__file__))


def prompts(n, vocab):
    return [[(i * 131 + j * 17) % (vocab - 2) + 2 for j in range(12 + 5 * i)] for i in range(n)]


def profile(eng, B, new):
    """Per-op times of the decode steps of B requests: (rows, steps, wall seconds)."""
    vocab = eng.vocab_size
    ids = [eng.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in prompts(B, vocab)]
    started, finished = set(), set()
    while len(started) < B:  # every prompt done (its first token out)
        for i in ids:
            if i in started:
                continue
            u = eng.poll(i, timeout=30.0)
            if u.new_token_ids or u.finished:
                started.add(i)
            if u.finished:
                finished.add(i)
    ops.op_times(reset=True)
    s0 = eng.metrics()["steps_total"]
    t0 = time.perf_counter()
    for i in ids:
        while i not in finished:
            if eng.poll(i, timeout=30.0).finished:
                finished.add(i)
    wall = time.perf_counter() - t0
    steps = eng.metrics()["steps_total"] - s0
    return ops.op_times(reset=True), steps, wall


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["pair"], choices=["pair", "slice"])
    ap.add_argument("--methods", nargs="+", default=["ar", "dflash2"], choices=["ar", "mtp", "dflash", "dflash2"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=24, help="tokens per request")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["f32"], choices=["f32", "bf16", "fp8"],
                    help="the target's KV cache types to profile (one run each)")
    ap.add_argument("--top", type=int, default=15, help="ops printed per run (the JSON has all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    suffix = "" if a.device == "cpu" else "_" + a.device.split(":")[0]
    report = {"device": a.device, "new_tokens": a.new, "runs": []}
    tmp = tempfile.TemporaryDirectory(prefix="dflash2_opprof_")
    was = ops.op_timing()
    try:
        for model in a.models:
            target = draft = None
            if model == "slice":
                sys.path.insert(0, HERE)
                from bench_concurrency import slice_pair
                target, draft = slice_pair(tmp.name)
            for kv, method in [(kv, m) for kv in a.kv_cache_dtype for m in a.methods]:
                kw = dict(method=method, device=a.device, max_batch_size=max(a.batch), max_seq_len=512,
                          speculation="fixed", cuda_graphs=False, pad_to_buckets=False, capture_at_load=False,
                          kv_cache_dtype=kv)
                if target is not None:
                    kw.update(target=target, draft=draft if method.startswith("dflash") else None)
                with dflash2_rt.Engine(**kw) as eng:
                    for B in a.batch:
                        ops.set_op_timing(True)
                        try:
                            rows, steps, wall = profile(eng, B, a.new)
                        finally:
                            ops.set_op_timing(False)
                        timed = sum(r["seconds"] for r in rows)
                        per = max(steps, 1)
                        run = {"model": model, "method": method, "kv_cache_dtype": kv, "batch": B, "steps": steps,
                               "wall_ms_per_step": wall / per * 1e3, "timed_ms_per_step": timed / per * 1e3,
                               "ops": [{**r, "calls_per_step": r["calls"] / per, "us_per_step": r["seconds"] / per * 1e6,
                                        "share": r["seconds"] / timed if timed > 0 else 0.0} for r in rows]}
                        report["runs"].append(run)
                        print(f"\n{model} {method} kv {kv} batch {B}: {steps} steps, timed ops "
                              f"{run['timed_ms_per_step']:.3f} ms "
                              f"per step of {run['wall_ms_per_step']:.3f} ms wall", flush=True)
                        print(f"  {'op':26s} {'calls/step':>10s} {'us/step':>10s} {'share':>7s}")
                        for o in run["ops"][:a.top]:
                            print(f"  {o['op']:26s} {o['calls_per_step']:10.1f} {o['us_per_step']:10.1f} "
                                  f"{o['share']:7.1%}")
                        with open(os.path.join(a.out, f"op_profile{suffix}.json"), "w", encoding="utf-8") as f:
                            json.dump(report, f, indent=1)
    finally:
        ops.set_op_timing(was)
    return report


if __name__ == "__main__":
    main()
