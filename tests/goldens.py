"""Golden outputs of the engine: token streams and logit hashes, recorded once and compared
bitwise by tests/test_goldens.py.

Why: the engine is refactored (host loops moved into ops, the runtime split into drafter /
verifier / sampler) under the rule that outputs stay *bitwise identical*. These goldens
pin what "identical" means: for every method (ar, mtp, dflash, dflash2), greedy and seeded
sampling, batch 1 and 4, on the bundled default pair and on the test fixtures, the token
ids, verify-step counts, and a SHA-256 of the float32 bytes of teacher-forced logits.

Record (only when an output change is intended, e.g. a new sampler; say so in the commit):
    python tests/goldens.py --record            # writes tests/data/goldens.json

The fixture checkpoints are built by torch from seeds (tests/glm_fixtures.py,
tests/dflash_fixtures.py). The record keeps a hash of each fixture's weights: on a host
where torch draws different weights, the fixture cases are skipped with that reason
(the bundled pair is a file, so its cases always run).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_PATH = os.path.join(HERE, "data", "goldens.json")
if HERE not in sys.path:
    sys.path.insert(0, HERE)

METHODS = ("ar", "mtp", "dflash", "dflash2")
# (name, sampling kwargs): greedy, the published setting (T=1, top-p 0.95), and top-k
MODES = (
    ("greedy", dict(temperature=0.0)),
    ("t1_p095", dict(temperature=1.0, top_p=0.95, seed=1234)),
    ("t07_k20", dict(temperature=0.7, top_k=20, seed=99)),
)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def dir_hash(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _prompts(vocab: int, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    lens = [5, 17, 9, 30][:n]
    return [[int(x) for x in rng.integers(2, vocab - 1, L)] for L in lens]


def fixture_paths(root: str) -> dict:
    """Builds (or reuses) the fixture checkpoints under root: the tiny target with an MTP
    layer, an IndexShare + group-limited variant, BF16, and DFlash 2 / DFlash 1 drafters."""
    import dflash_fixtures as F
    import glm_fixtures as G

    out = {}
    def build(name, fn):
        p = os.path.join(root, name)
        if not os.path.exists(os.path.join(p, "config.json")):
            fn(p)
        out[name] = p
    build("tiny", lambda p: G.build_model(p, "tiny"))
    build("ngroup", lambda p: G.build_model(p, "ngroup"))
    build("indexshare_list", lambda p: G.build_model(p, "indexshare_list"))
    build("bf16", lambda p: G.build_model(p, "bf16"))
    build("d2", lambda p: F.make_dflash2_drafter(out["tiny"], p, seed=1))
    build("d2_sw_causal", lambda p: F.make_dflash2_drafter(out["tiny"], p, seed=4, sliding_window=12, is_causal=True))
    build("d1", lambda p: F.make_dflash1_drafter(out["tiny"], p, seed=1))
    return out


def _engine(target, draft, method, **kw):
    import dflash2_rt
    return dflash2_rt.Engine(target=target, draft=draft, method=method, device="cpu", max_batch_size=4,
                             max_seq_len=256, **kw)


def _gen_cases(eng, prompts, new_tokens):
    out = {}
    for mode, kw in MODES:
        for bs in (1, 4):
            res = eng.generate(prompts[:bs], max_new_tokens=new_tokens, stop_token_ids=[], **kw)
            out[f"{mode}/b{bs}"] = {
                "tokens": [list(map(int, r.token_ids)) for r in res],
                "verify_steps": [int(r.stats["verify_steps"]) for r in res],
            }
    return out


def compute_bundled() -> dict:
    """The bundled default pair: every method, every mode, batch 1 and 4, plus logit hashes."""
    import dflash2_rt
    V = 4096
    prompts = _prompts(V, 4, 7)
    rec = {}
    ar = dflash2_rt.Engine(method="ar", max_batch_size=4, max_seq_len=512)
    rec["logits"] = [sha(ar.logits(p)) for p in prompts]
    for m in METHODS:
        eng = dflash2_rt.Engine(method=m, max_batch_size=4, max_seq_len=512)
        rec[m] = _gen_cases(eng, prompts, 24)
        if m != "ar":
            p = eng.propose(prompts[1])
            rec[m]["propose"] = {"anchor": int(p.anchor), "tokens": list(map(int, p.tokens)),
                                 "candidates": [list(map(int, c)) for c in p.candidates]}
    return rec


def compute_fixtures(paths: dict) -> dict:
    rec = {"weights": {k: dir_hash(v) for k, v in paths.items()}}
    V = 256
    prompts = _prompts(V, 4, 11)
    logits = {}
    for t in ("tiny", "ngroup", "indexshare_list", "bf16"):
        eng = _engine(paths[t], None, "ar")
        logits[t] = [sha(eng.logits(p)) for p in prompts]
        if t != "tiny":  # greedy streams of the variants (batch 4)
            res = eng.generate(prompts, max_new_tokens=16, stop_token_ids=[])
            logits[t + "/greedy_b4"] = [list(map(int, r.token_ids)) for r in res]
    rec["logits"] = logits
    combos = [("ar", None), ("mtp", None), ("dflash2", "d2"), ("dflash", "d2"), ("dflash2", "d2_sw_causal"),
              ("dflash", "d1")]
    for method, d in combos:
        eng = _engine(paths["tiny"], None if d is None else paths[d], method)
        key = method if d is None else f"{method}:{d}"
        rec[key] = _gen_cases(eng, prompts, 20)
        if method != "ar":
            p = eng.propose(prompts[2])
            rec[key]["propose"] = {"anchor": int(p.anchor), "tokens": list(map(int, p.tokens)),
                                   "candidates": [list(map(int, c)) for c in p.candidates]}
    return rec


def dumps(obj, ind: str = "") -> str:
    """JSON with lists of numbers on one line (readable diffs of token streams)."""
    if isinstance(obj, dict):
        items = [f'{ind} {json.dumps(k)}: {dumps(obj[k], ind + " ")}' for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + ind + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        return "[\n" + ",\n".join(ind + " " + dumps(x, ind + " ") for x in obj) + "\n" + ind + "]"
    return json.dumps(obj)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help=f"write {GOLDEN_PATH}")
    ap.add_argument("--root", default=None, help="where to build the fixtures (default: a temporary directory)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import tempfile
    import torch
    torch.set_num_threads(1)
    root = args.root or tempfile.mkdtemp(prefix="dflash2-goldens-")
    rec = {"bundled": compute_bundled(), "fixtures": compute_fixtures(fixture_paths(root))}
    if args.record:
        os.makedirs(os.path.dirname(GOLDEN_PATH), exist_ok=True)
        with open(GOLDEN_PATH, "w", encoding="utf-8") as f:
            f.write(dumps(rec) + "\n")
        print("wrote", GOLDEN_PATH)
    else:
        print(dumps(rec)[:4000])


if __name__ == "__main__":
    main()
