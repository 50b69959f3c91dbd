"""What log-probabilities cost, and what a conversation's cached output saves, each against
its baseline in the same run.

1. logprobs: --requests greedy requests (--concurrency at a time, --new tokens each) with
   logprobs=None, 0 and --top, the three settings alternating per round, one engine; the
   outputs must be equal across settings. Reported: tokens/s (median over --repeat rounds)
   and the ratio to logprobs=None.
2. conversations (--turns turns of --new tokens, each next prompt = the previous prompt +
   output + a 4-token message) on an engine with prefix caching and on one without:
   time to first token of the later turns and the prompt tokens taken from the cache
   (outputs must be equal).
Prints tables and writes <out>/logprobs[_<device>].json.

    python bench/logprobs.py [--device cpu|cuda] [--method dflash2|ar|mtp|dflash]
        [--requests 8] [--concurrency 4] [--new 48] [--top 5] [--turns 4] [--repeat 3]
"""
import argparse
import json
import os
import statistics
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))


def run_round(eng, prompts, concurrency, new, logprobs):
    t0 = time.perf_counter()
    queue = list(enumerate(prompts))
    pending, out = {}, {}
    while queue or pending:
        while queue and len(pending) < concurrency:
            i, p = queue.pop(0)
            pending[eng.submit(p, max_new_tokens=new, stop_token_ids=[], logprobs=logprobs)] = i
        for rid, _, finished, res in eng._e.poll(list(pending), 0.1):
            if finished:
                out[pending.pop(rid)] = res
    dt = time.perf_counter() - t0
    res = [out[i] for i in range(len(prompts))]
    if logprobs is not None:
        assert all(len(r.logprobs) == len(r.token_ids) for r in res)
    return sum(len(r.token_ids) for r in res) / dt, [list(r.token_ids) for r in res]


def conversation(eng, first, turns, new):
    convo, ttft, cached, outs = list(first), [], [], []
    for t in range(turns):
        r = eng.generate([convo], max_new_tokens=new, stop_token_ids=[])[0]
        ttft.append(1e3 * r.stats["prefill_s"])
        cached.append(r.stats["cached_tokens"])
        outs.append(list(r.token_ids))
        convo = convo + list(r.token_ids) + [(t * 13 + j) % 3000 + 2 for j in range(4)]
    return ttft, cached, outs, len(convo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="dflash2", choices=["ar", "mtp", "dflash", "dflash2"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    report = {"device": a.device, "method": a.method, "args": vars(a)}

    eng = dflash2_rt.Engine(method=a.method, device=a.device, max_batch_size=a.concurrency)
    prompts = [[(j * (31 + 2 * i) + i) % 3000 + 2 for j in range(24 + 5 * i)] for i in range(a.requests)]
    settings = [None, 0, a.top]
    rates = {s: [] for s in settings}
    want = None
    run_round(eng, prompts[:2], a.concurrency, 8, None)  # warm-up
    for _ in range(a.repeat):
        for s in settings:
            tok_s, outs = run_round(eng, prompts, a.concurrency, a.new, s)
            assert want is None or outs == want, f"logprobs={s} changed the outputs"
            want = outs
            rates[s].append(tok_s)
    eng.close()
    base = statistics.median(rates[None])
    print(f"logprobs cost ({a.method}, {a.device}, {a.requests} requests x {a.new} tokens, concurrency {a.concurrency})")
    print("| logprobs | tok/s | vs none |\n| --- | ---: | ---: |")
    report["logprobs"] = {}
    for s in settings:
        m = statistics.median(rates[s])
        report["logprobs"][str(s)] = {"tok_s": m, "ratio": m / base, "rounds": rates[s]}
        print(f"| {s} | {m:.1f} | {m / base:.3f}x |")

    print(f"\nconversations ({a.turns} turns of {a.new} tokens)")
    res = {}
    for on in (True, False):
        e = dflash2_rt.Engine(method=a.method, device=a.device, max_batch_size=1, prefix_caching=on)
        res[on] = conversation(e, prompts[0], a.turns, a.new)
        if on:
            report["prefix_cache_generated"] = e.prefix_cache_generated
        e.close()
    assert res[True][2] == res[False][2], "the prefix cache changed a conversation's outputs"
    print("| turn | prompt tokens taken from the cache | ttft ms (cache) | ttft ms (no cache) |\n"
          "| ---: | ---: | ---: | ---: |")
    report["conversation"] = []
    for t in range(a.turns):
        row = {"turn": t, "cached_tokens": res[True][1][t], "ttft_ms": res[True][0][t],
               "ttft_ms_no_cache": res[False][0][t]}
        report["conversation"].append(row)
        print(f"| {t} | {row['cached_tokens']} | {row['ttft_ms']:.1f} | {row['ttft_ms_no_cache']:.1f} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "logprobs" + ("" if a.device == "cpu" else "_" + a.device.replace(":", "")) + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
