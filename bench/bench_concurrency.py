"""Throughput at several concurrency levels on one engine per mode, every mode in the same
run: by default ar vs dflash2 with the full block every step ("fixed") vs dflash2 with
adaptive speculation, on the bundled pair, on the CPU.

Each concurrency level runs C client threads in a closed loop (each submits a request,
waits for it, submits the next) against one Engine per mode (max_batch_size = the largest
level), greedy, mixed prompt lengths; a warm-up round (not measured) lets the adaptive
policy learn and the CUDA graphs of that batch size be captured. The modes alternate within
each level (--repeat rounds each, the best kept) so that machine noise hits all of them
alike. Per mode and level: tokens/s (all requests), speedup over ar, committed tokens per
sequence per step, draft length, and the decode time split into draft / verify / accept /
prefill_wait (waiting while newly admitted requests' prompts run: the scheduler prefills
between steps) / host (the requests' draft_s, verify_s, accept_s, prefill_wait_s,
host_s). With --clients loop one thread keeps each level's C requests in flight instead
(the same load without C Python threads taking cores and the GIL from the engine's
scheduler thread: the host share is then the engine's own). Prints a table and writes <out>/concurrency[_<device>].{json,md,png}; the JSON is
rewritten after every level, so a
run stopped by --budget or a timeout keeps what it measured.

    python bench/bench_concurrency.py [--levels 1 4 8 16 32] [--requests 3] [--new 64]
        [--modes ar "dflash2 fixed" "dflash2 adaptive" mtp dflash] [--models pair slice]
        [--device cpu|cuda|cuda:N] [--clients threads|loop] [--budget SECONDS] [--kv-cache-dtype f32|bf16|fp8]
        [--decode-gemm exact|auto|bf16|fp8|nvfp4] [--exact-tc] [--temperature T --top-p P]

--models slice: a two-layer target with GLM-5.3's attention dimensions (tests/glm_fixtures.py
REAL_DIMS, random weights, with an MTP layer) and a random DFlash 2 drafter with the GLM-5.3
drafter's attention shape (64 heads over 8 KV heads, head_dim 128, block 8, window 2048):
its acceptance is that of random weights, so it measures what the steps cost at real
dimensions, not speedups (needs torch and transformers, as the tests do).
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (method, speculation)
MODES = {"ar": ("ar", "fixed"), "mtp": ("mtp", "fixed"), "dflash": ("dflash", "fixed"),
         "dflash2 fixed": ("dflash2", "fixed"), "dflash2 adaptive": ("dflash2", "adaptive")}
DEFAULT_MODES = ["ar", "dflash2 fixed", "dflash2 adaptive"]


def prompts(n, seed, vocab):
    return [[(seed * 977 + i * 31 + j * 17) % (vocab - 2) + 2 for j in range(16 + (i * 13) % 80)] for i in range(n)]


SPLIT_KEYS = ("draft_s", "verify_s", "accept_s", "prefill_wait_s", "host_s", "decode_s")


def run_level_loop(eng, C, per_client, new, seed, vocab, sampling=None):
    """run_level with one client thread keeping C requests in flight (a finished one is
    replaced by the next at once): the same load without C Python threads competing with the
    engine's scheduler thread for the cores and the GIL."""
    ps = prompts(C * per_client, seed, vocab)
    total = dict.fromkeys(SPLIT_KEYS, 0.0)
    tokens = 0
    t0 = time.perf_counter()
    queue = list(ps)
    pending = set()
    while queue or pending:
        while queue and len(pending) < C:
            pending.add(eng.submit(queue.pop(0), max_new_tokens=new, stop_token_ids=[], **(sampling or {})))
        # the engine's poll over several requests (what Engine.generate waits with)
        for rid, toks, finished, res in eng._e.poll(list(pending), 0.1):
            if finished:
                pending.discard(rid)
                tokens += len(res.token_ids)
                for key in SPLIT_KEYS:
                    total[key] += float(dict(res.stats).get(key, 0.0))
    return tokens, time.perf_counter() - t0, total


def run_level(eng, C, per_client, new, seed, vocab, clients="threads", sampling=None):
    """C closed-loop clients, per_client requests each: (committed tokens, seconds, summed
    request stats draft_s / verify_s / accept_s / prefill_wait_s / host_s / decode_s).
    clients "loop": one thread drives them all (run_level_loop)."""
    if clients == "loop":
        return run_level_loop(eng, C, per_client, new, seed, vocab, sampling)
    ps = prompts(C * per_client, seed, vocab)
    tokens = [0] * C
    split = [dict.fromkeys(SPLIT_KEYS, 0.0) for _ in range(C)]
    errors = []

    def client(c):
        try:
            for k in range(per_client):
                r = eng.generate([ps[c * per_client + k]], max_new_tokens=new, stop_token_ids=[],
                                 **(sampling or {}))[0]
                tokens[c] += len(r.token_ids)
                for key in split[c]:
                    split[c][key] += float(r.stats.get(key, 0.0))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(C)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    total = {key: sum(s[key] for s in split) for key in split[0]}
    return sum(tokens), dt, total


def slice_pair(root):
    """The real-dimension slice target (with an MTP layer) and a random DFlash 2 drafter for it."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import dflash_fixtures as F
    import glm_fixtures as gf
    target = gf.build_model(os.path.join(root, "slice_target"), "tiny", mtp=True, config=gf.REAL_DIMS)
    draft = F.make_dflash2_drafter(target, os.path.join(root, "slice_draft"), num_layers=2, heads=64, kv_heads=8,
                                   head_dim=128, intermediate=2048, sliding_window=2048, seed=3)
    return target, draft


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--requests", type=int, default=3, help="requests per client per measured round")
    ap.add_argument("--new", type=int, default=64, help="tokens per request")
    ap.add_argument("--repeat", type=int, default=3, help="measured rounds per mode and level (best kept)")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    ap.add_argument("--models", nargs="+", default=["pair"], choices=["pair", "slice"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (where the target runs)")
    ap.add_argument("--clients", default="threads", choices=["threads", "loop"],
                    help="threads: a Python thread per client (as the server serves); loop: one thread keeps the "
                         "level's requests in flight, so the host share is the engine's own")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: no new model or level starts that would likely end past it (0: no limit); "
                         "what ran is kept")
    ap.add_argument("--kv-cache-dtype", default="f32", choices=["f32", "bf16", "fp8"],
                    help="every engine's Engine(kv_cache_dtype=...) (bf16 on CUDA: MLA on the tensor cores where "
                         "kv_lora allows, as the slice's 512)")
    ap.add_argument("--decode-gemm", default="exact", choices=["exact", "auto", "bf16", "fp8", "nvfp4"],
                    help="every engine's Engine(decode_gemm=...): the numerics of the decode / verify chunks' "
                         "GEMMs (auto on a GPU: the tensor cores; exact: the fp32 SIMT GEMV, FMA-bound at verify "
                         "sizes)")
    ap.add_argument("--exact-tc", action="store_true",
                    help="ops.set_exact_tc(True) before the engines load: decode_gemm='exact' on the tensor cores")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0 = greedy); sampled requests are unseeded, so "
                         "adaptive speculation picks their draft length too")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    exact_tc_was = dflash2_rt.ops.exact_tc()
    if a.exact_tc:
        dflash2_rt.ops.set_exact_tc(True)
    modes = ["ar"] + [m for m in a.modes if m != "ar"]  # ar first: the speedups' baseline
    suffix = ("" if a.device == "cpu" else "_" + a.device.split(":")[0]) + (f"_t{a.temperature:g}" if a.temperature > 0 else "")
    os.makedirs(a.out, exist_ok=True)
    t_start = time.perf_counter()
    report = {"device": a.device, "clients": a.clients, "levels": a.levels, "requests_per_client": a.requests,
              "new_tokens": a.new, "kv_cache_dtype": a.kv_cache_dtype, "decode_gemm": a.decode_gemm,
              "exact_tc": a.exact_tc, "temperature": a.temperature, "top_p": a.top_p,
              "modes": modes, "models": {}, "complete": False}

    def save():  # whole or not at all (a run killed by a time limit keeps the previous levels)
        path = os.path.join(a.out, f"concurrency{suffix}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)

    last_level_s = 0.0

    def over_budget():  # no new model or level when it would likely end past the budget
        return bool(a.budget) and time.perf_counter() - t_start + 1.5 * last_level_s > a.budget

    sampling = dict(temperature=a.temperature, top_p=a.top_p) if a.temperature > 0 else {}
    tmp = tempfile.TemporaryDirectory(prefix="dflash2_bench_")
    stopped = False
    for model in a.models:
        if over_budget():
            stopped = True
            break
        target, draft = slice_pair(tmp.name) if model == "slice" else (None, None)
        engines = {}
        for name in modes:
            method, spec = MODES[name]
            # graphs are captured in each level's warm-up round, not at load (quicker to start)
            kw = dict(method=method, device=a.device, max_batch_size=max(a.levels), max_seq_len=512,
                      speculation=spec, capture_at_load=False, kv_cache_dtype=a.kv_cache_dtype,
                      decode_gemm=a.decode_gemm)
            if target is not None:
                kw.update(target=target, draft=draft if method.startswith("dflash") else None)
            engines[name] = dflash2_rt.Engine(**kw)
        vocab = engines["ar"].vocab_size
        rows = []
        report["models"][model] = rows
        for C in a.levels:
            if over_budget():
                stopped = True
                break
            t_level = time.perf_counter()
            res = {}
            for name in modes:  # warm-up (the adaptive policy learns this batch size; graphs are captured)
                run_level(engines[name], C, 1, a.new, C, vocab, a.clients, sampling)
            for rep in range(a.repeat):  # the modes alternate; each keeps its best round
                for name in modes:
                    tok, dt, split = run_level(engines[name], C, a.requests, a.new, 1000 + C + 100 * rep, vocab,
                                                a.clients, sampling)
                    m = engines[name].metrics()
                    if name not in res or tok / dt > res[name]["tok_s"]:
                        dec = split.pop("decode_s")
                        res[name] = {"tok_s": tok / dt, "tokens": tok, "seconds": dt, "draft_len": m["draft_len"],
                                     "acceptance_length": m["acceptance_length"],
                                     "decode_split": {k[:-2]: v / dec for k, v in split.items()} if dec > 0 else {}}
            for name in modes:
                r = res[name]
                r["speedup_vs_ar"] = r["tok_s"] / res["ar"]["tok_s"]
                sp = " ".join(f"{k} {v:.0%}" for k, v in r["decode_split"].items())
                print(f"{model:5s} concurrency {C:3d}  {name:17s} {r['tok_s']:9.1f} tok/s  x{r['speedup_vs_ar']:.2f}  "
                      f"(draft len {r['draft_len']:.2f}, committed/seq/step {r['acceptance_length']:.2f}) [{sp}]",
                      flush=True)
            rows.append({"concurrency": C, **res})
            save()
            last_level_s = time.perf_counter() - t_level
        for e in engines.values():
            e.close()
        if stopped:
            break
    dflash2_rt.ops.set_exact_tc(exact_tc_was)
    report["complete"] = not stopped
    report["seconds"] = time.perf_counter() - t_start
    save()
    lines = []
    for model, rows in report["models"].items():
        lines += [f"**{model}** ({a.device})", "",
                  "| concurrency | " + " | ".join(f"{n} tok/s" + ("" if n == "ar" else " (vs ar)") for n in modes) + " |",
                  "| ---: |" + " ---: |" * len(modes)]
        for r in rows:
            cells = [f"{r[n]['tok_s']:.1f}" + ("" if n == "ar" else f" ({r[n]['speedup_vs_ar']:.2f}x)") for n in modes]
            lines.append(f"| {r['concurrency']} | " + " | ".join(cells) + " |")
        lines.append("")
    if stopped:
        lines.append(f"stopped by --budget {a.budget:g} s after the levels above")
    table = "\n".join(lines)
    print()
    print(table)
    with open(os.path.join(a.out, f"concurrency{suffix}.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    rows = report["models"].get("pair") or next(iter(report["models"].values()), [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    levels = [r["concurrency"] for r in rows]
    for name in modes:
        ax.plot(levels, [r[name]["tok_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(x) for x in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s (all requests)")
    ax.set_title(f"{'bundled pair' if 'pair' in report['models'] else 'slice'}, greedy, {a.device}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, f"concurrency{suffix}.png"), dpi=100)
    print("wrote", os.path.join(a.out, f"concurrency{suffix}.png"))


if __name__ == "__main__":
    main()
