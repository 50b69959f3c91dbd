"""What a long prompt arriving costs the streams already decoding, with and without chunked
prefill interleaved with decode steps (`prefill_tokens_per_step`), every setting in the
same run.

R requests decode (short prompts, greedy); once each has its first tokens, one request with
a long prompt arrives. The scheduler either runs that prompt whole before the next decode
step (`prefill_tokens_per_step=0`), or at most `budget` of its tokens between two steps (the
default: one chunk, max_step_tokens). Measured from the client, as a user of the engine sees
it (one thread, the engine's own multi-request poll):
  stall_ms    the longest gap between two token arrivals of any running stream from the
              newcomer's submission to its first token (inter-token latency while it prefills)
  ttft_ms     the newcomer's time to its first token
  window_tok  tokens the running streams received meanwhile
  decode_tok_s the running streams' tokens / s over the whole run
Settings alternate within each round (--repeat rounds; the median is reported) so machine
noise hits each alike. Prints a table and writes <out>/prefill_stall[_<device>].json.

    python bench/prefill_stall.py [--device cpu|cuda] [--method dflash2|ar|mtp|dflash]
        [--running 4] [--prompt-tokens 3000] [--new 160] [--budgets 0 -1 64] [--repeat 3]
"""
import argparse
import json
import os
import statistics
import sys
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))


def run_once(eng, running, prompt_tokens, new, seed, vocab):
    short = [[(seed * 131 + i * 31 + j * 17) % (vocab - 2) + 2 for j in range(12 + i)] for i in range(running)]
    long_p = [(seed * 7 + j * 37) % (vocab - 2) + 2 for j in range(prompt_tokens)]
    rids = [eng.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in short]
    t0 = time.perf_counter()
    arrivals = {r: [] for r in rids}
    done = set()
    started = set()
    while len(started) < len(rids):  # every running stream decoding
        for rid, toks, finished, _ in eng._e.poll(rids, 0.1):
            if toks:
                arrivals[rid].append((time.perf_counter(), len(toks)))
                started.add(rid)
            if finished:
                done.add(rid)
    t_sub = time.perf_counter()
    newcomer = eng.submit(long_p, max_new_tokens=4, stop_token_ids=[])
    t_first = None
    pending = set(rids) - done | {newcomer}
    while pending:
        for rid, toks, finished, _ in eng._e.poll(list(pending), 0.1):
            now = time.perf_counter()
            if rid == newcomer:
                if toks and t_first is None:
                    t_first = now
            elif toks:
                arrivals[rid].append((now, len(toks)))
            if finished:
                pending.discard(rid)
    t_end = time.perf_counter()
    if t_first is None:
        raise RuntimeError("the long prompt's request produced no token")
    stall, window_tok = 0.0, 0
    for rid in rids:
        times = [t for t, _ in arrivals[rid]]
        prev = max([t for t in times if t <= t_sub], default=t_sub)
        for t, n in arrivals[rid]:
            if t_sub < t <= t_first:
                window_tok += n
                stall = max(stall, t - prev)
                prev = t
        # the gap open when the newcomer's first token came
        nxt = [t for t in times if t > t_first]
        if nxt and prev < t_first:
            stall = max(stall, nxt[0] - prev)
    total = sum(n for rid in rids for _, n in arrivals[rid])
    return {"stall_ms": 1e3 * stall, "ttft_ms": 1e3 * (t_first - t_sub), "window_tok": window_tok,
            "decode_tok_s": total / (t_end - t0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="dflash2", choices=["ar", "mtp", "dflash", "dflash2"])
    ap.add_argument("--running", type=int, default=4, help="requests decoding when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new", type=int, default=160, help="tokens each running request generates")
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, -1, 64],
                    help="prefill_tokens_per_step settings (0 = no limit, -1 = the default: max_step_tokens)")
    ap.add_argument("--max-step-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    engines = {}
    for b in args.budgets:
        eng = dflash2_rt.Engine(method=args.method, device=args.device, max_batch_size=args.running + 1,
                                max_step_tokens=args.max_step_tokens,
                                prefill_tokens_per_step=None if b < 0 else b)
        engines[b] = eng
        run_once(eng, args.running, min(args.prompt_tokens, 64), 8, 99, eng.vocab_size)  # warm-up
    need = args.prompt_tokens + 4 + 16
    if need > engines[args.budgets[0]].max_seq_len:
        sys.exit(f"--prompt-tokens {args.prompt_tokens} does not fit max_seq_len {engines[args.budgets[0]].max_seq_len}")
    runs = {b: [] for b in args.budgets}
    for r in range(args.repeat):
        for b in args.budgets:
            runs[b].append(run_once(engines[b], args.running, args.prompt_tokens, args.new, r, engines[b].vocab_size))
    rows = []
    base = statistics.median(x["stall_ms"] for x in runs[args.budgets[0]])
    print(f"{args.method} on {args.device}: {args.running} streams decoding, a {args.prompt_tokens}-token prompt "
          f"arrives (max_step_tokens {args.max_step_tokens}); median of {args.repeat}")
    print(f"{'prefill_tokens_per_step':>24} {'stall ms':>9} {'vs first':>8} {'ttft ms':>8} {'window tok':>10} "
          f"{'decode tok/s':>12}")
    for b in args.budgets:
        med = {k: statistics.median(x[k] for x in runs[b]) for k in runs[b][0]}
        label = f"{engines[b].prefill_tokens_per_step}" + (" (no limit)" if engines[b].prefill_tokens_per_step == 0
                                                          else " (default)" if b < 0 else "")
        rows.append({"prefill_tokens_per_step": engines[b].prefill_tokens_per_step, "default": b < 0, **med,
                     "stall_vs_first": med["stall_ms"] / base if base else None, "runs": runs[b]})
        print(f"{label:>24} {med['stall_ms']:9.1f} {med['stall_ms'] / base:7.2f}x {med['ttft_ms']:8.1f} "
              f"{med['window_tok']:10.0f} {med['decode_tok_s']:12.1f}")
    for eng in engines.values():
        eng.close()
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.device == "cpu" else "_" + args.device.replace(":", "")
    path = os.path.join(args.out, f"prefill_stall{suffix}.json")
    with open(path, "w") as f:
        json.dump({"config": vars(args), "build": str(dflash2_rt.build_info().get("cpu_isa")), "rows": rows}, f,
                  indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
