"""What repetition control costs (presence / frequency / repetition penalties, logit_bias,
min_tokens), against plain requests in the same run.

--requests greedy requests (--concurrency at a time, --new tokens each) under four settings,
alternating per round on one engine: none; repetition_penalty 1.2; every control at once
(presence 0.5, frequency 0.5, repetition 1.2, a bias on 8 tokens, min_tokens 8); and half the
requests with every control beside plain ones (mixed). Reported: tokens/s (median over
--repeat rounds), the ratio to none, and the mean acceptance length (the drafter does not see
the penalties, so fewer of its drafts survive them). The speculative outputs are checked
against --method ar's under the same settings (greedy: token for token).
Prints a table and writes <out>/penalties[_<device>].json.

    python bench/penalties.py [--device cpu|cuda] [--method dflash2|mtp|dflash]
        [--requests 8] [--concurrency 4] [--new 48] [--repeat 3]
"""
import argparse
import json
import os
import statistics
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))
ALL = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
           logit_bias={t: 1.5 for t in range(100, 108)}, min_tokens=8)
SETTINGS = {"none": lambda i: {}, "repetition 1.2": lambda i: dict(repetition_penalty=1.2),
            "all": lambda i: ALL, "mixed (half all)": lambda i: ALL if i % 2 else {}}


def run_round(eng, prompts, concurrency, new, kw_of):
    t0 = time.perf_counter()
    queue = list(enumerate(prompts))
    pending, out = {}, {}
    while queue or pending:
        while queue and len(pending) < concurrency:
            i, p = queue.pop(0)
            pending[eng.submit(p, max_new_tokens=new, stop_token_ids=[], **kw_of(i))] = i
        for rid, _, finished, res in eng._e.poll(list(pending), 0.1):
            if finished:
                out[pending.pop(rid)] = res
    dt = time.perf_counter() - t0
    res = [out[i] for i in range(len(prompts))]
    acc = statistics.mean(r.stats["acceptance_length"] for r in res)
    return sum(len(r.token_ids) for r in res) / dt, acc, [list(r.token_ids) for r in res]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="dflash2", choices=["ar", "mtp", "dflash", "dflash2"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    report = {"device": a.device, "method": a.method, "args": vars(a), "settings": {}}
    prompts = [[(j * (31 + 2 * i) + i) % 3000 + 2 for j in range(24 + 5 * i)] for i in range(a.requests)]

    eng = dflash2_rt.Engine(method=a.method, device=a.device, max_batch_size=a.concurrency)
    run_round(eng, prompts[:2], a.concurrency, 8, lambda i: {})  # warm-up
    rates = {s: [] for s in SETTINGS}
    accs, outs = {}, {}
    for _ in range(a.repeat):
        for s, kw_of in SETTINGS.items():
            tok_s, acc, o = run_round(eng, prompts, a.concurrency, a.new, kw_of)
            assert outs.get(s, o) == o, f"{s}: greedy outputs changed between rounds"
            rates[s].append(tok_s)
            accs[s], outs[s] = acc, o
    eng.close()
    if a.method != "ar":  # lossless: ar's greedy tokens under the same settings
        ar = dflash2_rt.Engine(method="ar", device=a.device, max_batch_size=a.concurrency)
        for s, kw_of in SETTINGS.items():
            assert run_round(ar, prompts, a.concurrency, a.new, kw_of)[2] == outs[s], f"{s}: {a.method} != ar"
        ar.close()
    assert outs["none"] != outs["all"]
    base = statistics.median(rates["none"])
    print(f"repetition control cost ({a.method}, {a.device}, {a.requests} requests x {a.new} tokens, "
          f"concurrency {a.concurrency}; outputs checked against ar)")
    print("| setting | tok/s | vs none | acceptance length |\n| --- | ---: | ---: | ---: |")
    for s in SETTINGS:
        m = statistics.median(rates[s])
        report["settings"][s] = {"tok_s": m, "ratio": m / base, "acceptance_length": accs[s], "rounds": rates[s]}
        print(f"| {s} | {m:.1f} | {m / base:.3f}x | {accs[s]:.2f} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "penalties" + ("" if a.device == "cpu" else "_" + a.device.replace(":", "")) + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
