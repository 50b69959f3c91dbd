"""Throughput at concurrency 1, 4, 8, 16, 32 on one engine: ar vs dflash2 with the full
block every step ("fixed") vs dflash2 with adaptive speculation, in the same run.

Each concurrency level runs C client threads in a closed loop (each submits a request,
waits for it, submits the next) against one Engine per mode (max_batch_size 32), greedy,
mixed prompt lengths; a warm-up round (not measured) lets the adaptive policy learn. The
modes alternate within each level (--repeat rounds each, the best kept) so that machine
noise hits all three alike. Prints a table and writes bench/results/concurrency.{json,md,png}.

    python bench/bench_concurrency.py [--levels 1 4 8 16 32] [--requests 3] [--new 64]
"""
import argparse
import json
import os
import threading
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = [("ar", "ar", "fixed"), ("dflash2 fixed", "dflash2", "fixed"), ("dflash2 adaptive", "dflash2", "adaptive")]


def prompts(n, seed):
    return [[(seed * 977 + i * 31 + j * 17) % 4000 + 2 for j in range(16 + (i * 13) % 80)] for i in range(n)]


def run_level(eng, C, per_client, new, seed):
    """C closed-loop clients, per_client requests each: (committed tokens, seconds)."""
    ps = prompts(C * per_client, seed)
    tokens = [0] * C
    errors = []

    def client(c):
        try:
            for k in range(per_client):
                r = eng.generate([ps[c * per_client + k]], max_new_tokens=new, stop_token_ids=[])[0]
                tokens[c] += len(r.token_ids)
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
    return sum(tokens), dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--requests", type=int, default=3, help="requests per client per measured round")
    ap.add_argument("--new", type=int, default=64, help="tokens per request")
    ap.add_argument("--repeat", type=int, default=3, help="measured rounds per mode and level (best kept)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    engines = {name: dflash2_rt.Engine(method=m, max_batch_size=max(a.levels), max_seq_len=512, speculation=s)
               for name, m, s in MODES}
    rows = []
    for C in a.levels:
        res = {}
        for name, _, _ in MODES:  # warm-up (the adaptive policy learns this batch size)
            run_level(engines[name], C, 1, a.new, seed=C)
        for rep in range(a.repeat):  # the modes alternate; each keeps its best round
            for name, _, _ in MODES:
                tok, dt = run_level(engines[name], C, a.requests, a.new, seed=1000 + C + 100 * rep)
                m = engines[name].metrics()
                if name not in res or tok / dt > res[name]["tok_s"]:
                    res[name] = {"tok_s": tok / dt, "tokens": tok, "seconds": dt, "draft_len": m["draft_len"],
                                 "acceptance_length": m["acceptance_length"]}
        for name, _, _ in MODES:
            r = res[name]
            print(f"concurrency {C:3d}  {name:17s} {r['tok_s']:8.1f} tok/s  (draft len {r['draft_len']:.2f}, "
                  f"committed/seq/step {r['acceptance_length']:.2f})", flush=True)
        rows.append({"concurrency": C, **res})
    for e in engines.values():
        e.close()
    lines = ["| concurrency | ar tok/s | dflash2 fixed tok/s (vs ar) | dflash2 adaptive tok/s (vs ar) | adaptive draft length |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ar = r["ar"]["tok_s"]
        fx, ad = r["dflash2 fixed"], r["dflash2 adaptive"]
        lines.append(f"| {r['concurrency']} | {ar:.1f} | {fx['tok_s']:.1f} ({fx['tok_s'] / ar:.2f}x) | "
                     f"{ad['tok_s']:.1f} ({ad['tok_s'] / ar:.2f}x) | {ad['draft_len']:.2f} |")
    table = "\n".join(lines)
    print()
    print(table)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "concurrency.json"), "w", encoding="utf-8") as f:
        json.dump({"levels": a.levels, "requests_per_client": a.requests, "new_tokens": a.new, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, "concurrency.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, _, _ in MODES:
        ax.plot(a.levels, [r[name]["tok_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(a.levels)
    ax.set_xticklabels([str(x) for x in a.levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s (all requests)")
    ax.set_title("bundled pair, greedy, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "concurrency.png"), dpi=100)
    print("wrote", os.path.join(a.out, "concurrency.png"))


if __name__ == "__main__":
    main()
