"""Structured output's cost on the bundled pair: tokens/s and acceptance length of ar and
dflash2 without a constraint and under a JSON schema, a regular expression and a Lark
grammar (llguidance), greedy, the outputs checked equal to ar's; dflash2 with the masks only
(the drafter's drafts as they are) and with the drafts steered by the grammar
(GrammarConstraint.steer: the best selector candidate the grammar allows per position); and
the host time the constraint takes (its masks(), steer() and commit() calls) per step.

    python bench/structured.py [--requests 8] [--concurrency 4] [--new 64] [--device cpu]

Writes bench/results/structured.json. Each setting runs on one engine per method, the
methods alternating per round (--repeat rounds, the best kept) so machine noise hits both.
"""
import argparse
import json
import os
import sys
import time

import dflash2_rt
from dflash2_rt import structured

HERE = os.path.dirname(os.path.abspath(__file__))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "id": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 4}},
          "required": ["name", "id", "tags"], "additionalProperties": False}
SETTINGS = {
    "none": None,
    "json schema": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": r"(def [a-z_]{1,12}\(x\):\n    return x( [+*] [0-9]{1,3})?\n){1,4}"},
    "grammar": {"grammar": 'start: stmt+\nstmt: NAME " = " expr "\\n"\nexpr: NAME | NUM | expr " + " expr\n'
                           'NAME: /[a-z]{1,8}/\nNUM: /[0-9]{1,4}/'},
}
PROMPTS = ["def read_config(path):", "import os\n", "class Node:", "for i in range(10):", "x = ", "# parse the",
           "return ", "with open("]


class Timed:
    """A constraint that times another's calls (host seconds)."""

    def __init__(self, inner, clock, steering):
        self.inner, self.clock, self.steering = inner, clock, steering

    def masks(self, drafts, out):
        t = time.perf_counter()
        try:
            return self.inner.masks(drafts, out)
        finally:
            self.clock["masks_s"] += time.perf_counter() - t
            self.clock["masks_calls"] += 1

    def steer(self, cand, out):
        if not self.steering:
            return -1
        t = time.perf_counter()
        try:
            return self.inner.steer(cand, out)
        finally:
            self.clock["steer_s"] += time.perf_counter() - t

    def commit(self, tokens):
        t = time.perf_counter()
        try:
            self.inner.commit(tokens)
        finally:
            self.clock["commit_s"] += time.perf_counter() - t

    def done(self):
        return self.inner.done()


def run(eng, spec, n, conc, new, clock, steering):
    grammar = eng._grammar(spec, "bench") if spec is not None else None
    t0 = time.perf_counter()
    out, pending, i = [None] * n, {}, 0
    steps = toks = 0
    while i < n or pending:
        while i < n and len(pending) < conc:
            kw = {}
            if grammar is not None:
                kw["constraint"] = Timed(grammar.constraint(), clock, steering)
            pending[eng.submit(PROMPTS[i % len(PROMPTS)], max_new_tokens=new, **kw)] = i
            i += 1
        for rid in list(pending):
            u = eng.poll(rid, timeout=0.002)
            if u.finished:
                r = u.result
                out[pending.pop(rid)] = r
                steps += r.stats["verify_steps"]
                toks += r.stats["generated_tokens"]
    dt = time.perf_counter() - t0
    return out, toks / dt, toks / max(1, steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "structured.json"))
    a = ap.parse_args()
    structured._llguidance()
    engs = {m: dflash2_rt.Engine(method=m, device=a.device, max_batch_size=a.concurrency, max_seq_len=512)
            for m in ("ar", "dflash2")}
    rows = []
    modes = {"ar": ("ar", False), "dflash2 masks": ("dflash2", False), "dflash2 steered": ("dflash2", True)}
    try:
        for name, spec in SETTINGS.items():
            best = {}
            for _ in range(a.repeat):
                for mode, (m, steering) in modes.items():
                    if spec is None and steering:
                        continue
                    clock = dict(masks_s=0.0, masks_calls=0, commit_s=0.0, steer_s=0.0)
                    res, tps, acc = run(engs[m], spec, a.requests, a.concurrency, a.new, clock, steering)
                    if mode not in best or tps > best[mode]["tok_s"]:
                        best[mode] = dict(tok_s=tps, acceptance=acc, res=res, clock=clock)
            ref = [r.token_ids for r in best["ar"]["res"]]
            for mode, b in best.items():
                c = b["clock"]
                same = [r.token_ids for r in b["res"]] == ref
                steps = sum(r.stats["verify_steps"] for r in b["res"]) + len(b["res"])
                row = dict(setting=name, mode=mode, tok_s=round(b["tok_s"], 1),
                           vs_ar=round(b["tok_s"] / best["ar"]["tok_s"], 3),
                           acceptance_length=round(b["acceptance"], 2), equal_to_ar=same,
                           finished_by_grammar=sum(r.finish_reason == "stop" for r in b["res"]) if spec else None,
                           constraint_ms_per_step=round(1e3 * (c["masks_s"] + c["commit_s"] + c["steer_s"]) / steps, 3),
                           steer_ms_per_step=round(1e3 * c["steer_s"] / steps, 3),
                           mask_ms_per_call=round(1e3 * c["masks_s"] / max(1, c["masks_calls"]), 3))
                rows.append(row)
                print(f"{name:12s} {mode:16s} {row['tok_s']:8.1f} tok/s  x{row['vs_ar']:.2f} vs ar  acceptance "
                      f"{row['acceptance_length']:5.2f}  constraint {row['constraint_ms_per_step']:.3f} ms/request-step "
                      f"(steer {row['steer_ms_per_step']:.3f}; {row['mask_ms_per_call']:.3f} ms per masks())  "
                      f"== ar: {same}", flush=True)
    finally:
        for e in engs.values():
            e.close()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(args=vars(a), rows=rows), f, indent=1)
    if not all(r["equal_to_ar"] for r in rows):
        print("dflash2 differs from ar under a constraint", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
