"""Automatic prefix caching: requests that share a long system prompt, with the cache on and
off, in the same run.

Each round sends --requests requests whose prompts are one --system-tokens system prompt
followed by a distinct --tail-tokens user part, --concurrency at a time (closed loop, one
client thread driving them), --new greedy tokens each, to one engine with prefix_caching on
and one with it off (each round a new system prompt, so every round starts cold; the two
engines alternate). Reported per setting, median over --repeat rounds: the requests' time to
first token (stats prefill_s: the prompt's prefill), the round's wall time and tokens/s, the
prompt tokens taken from the cache; every output is checked equal between the two engines.
Prints a table and writes <out>/prefix_cache[_<device>].json.

    python bench/prefix_cache.py [--device cpu|cuda] [--method dflash2|ar|mtp|dflash]
        [--system-tokens 1500] [--tail-tokens 24] [--requests 8] [--concurrency 2] [--new 32]
"""
import argparse
import json
import os
import statistics
import time

import dflash2_rt

HERE = os.path.dirname(os.path.abspath(__file__))


def run_round(eng, prompts, concurrency, new):
    t0 = time.perf_counter()
    queue = list(enumerate(prompts))
    pending, out = {}, {}
    while queue or pending:
        while queue and len(pending) < concurrency:
            i, p = queue.pop(0)
            pending[eng.submit(p, max_new_tokens=new, stop_token_ids=[])] = i
        for rid, _, finished, res in eng._e.poll(list(pending), 0.1):
            if finished:
                out[pending.pop(rid)] = res
    dt = time.perf_counter() - t0
    res = [out[i] for i in range(len(prompts))]
    stats = [dict(r.stats) for r in res]
    return {"seconds": dt, "tok_s": sum(len(r.token_ids) for r in res) / dt,
            "ttft_ms": statistics.median(1e3 * s["prefill_s"] for s in stats),
            "cached_tokens": sum(s["cached_tokens"] for s in stats),
            "prompt_tokens": sum(len(p) for p in prompts)}, [list(r.token_ids) for r in res]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="dflash2", choices=["ar", "mtp", "dflash", "dflash2"])
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--tail-tokens", type=int, default=24)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    engines = {on: dflash2_rt.Engine(method=a.method, device=a.device, max_batch_size=a.concurrency,
                                     prefix_caching=on) for on in (True, False)}
    vocab = engines[True].vocab_size
    if a.system_tokens + a.tail_tokens + a.new + 16 > engines[True].max_seq_len:
        raise SystemExit(f"the prompts do not fit max_seq_len {engines[True].max_seq_len}")

    def prompts(r):
        system = [(r * 7919 + j * 37) % (vocab - 2) + 2 for j in range(a.system_tokens)]
        return [system + [(r * 31 + i * 101 + j * 13) % (vocab - 2) + 2 for j in range(a.tail_tokens)]
                for i in range(a.requests)]

    for eng in engines.values():  # warm-up (another system prompt)
        run_round(eng, prompts(10 ** 6)[:2], a.concurrency, 4)
    runs = {True: [], False: []}
    for r in range(a.repeat):
        outs = {}
        for on in (True, False):
            row, outs[on] = run_round(engines[on], prompts(r), a.concurrency, a.new)
            runs[on].append(row)
        if outs[True] != outs[False]:
            raise SystemExit(f"round {r}: outputs differ with the prefix cache on and off")
    rows = {}
    print(f"{a.method} on {a.device}: {a.requests} requests x ({a.system_tokens} shared + {a.tail_tokens} own prompt "
          f"tokens, {a.new} new), {a.concurrency} at a time; median of {a.repeat} rounds; outputs equal")
    print(f"{'prefix_caching':>15} {'ttft ms':>9} {'round s':>8} {'tok/s':>8} {'cached / prompt tokens':>24}")
    for on in (True, False):
        med = {k: statistics.median(x[k] for x in runs[on]) for k in runs[on][0]}
        rows["on" if on else "off"] = {**med, "runs": runs[on]}
        print(f"{'on' if on else 'off':>15} {med['ttft_ms']:9.1f} {med['seconds']:8.2f} {med['tok_s']:8.1f} "
              f"{int(med['cached_tokens']):>11} / {int(med['prompt_tokens'])}")
    on, off = rows["on"], rows["off"]
    print(f"on / off: ttft {on['ttft_ms'] / off['ttft_ms']:.2f}x, tokens/s {on['tok_s'] / off['tok_s']:.2f}x")
    for eng in engines.values():
        eng.close()
    os.makedirs(a.out, exist_ok=True)
    suffix = "" if a.device == "cpu" else "_" + a.device.replace(":", "")
    path = os.path.join(a.out, f"prefix_cache{suffix}.json")
    with open(path, "w") as f:
        json.dump({"config": vars(a), "rows": rows, "outputs_equal": True}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
