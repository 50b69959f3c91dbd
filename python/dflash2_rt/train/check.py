"""Checks of a made pair: the runtime's target logits equal transformers', the runtime's
greedy DFlash 2 / DFlash (selector off) draft blocks equal the torch drafter's, and
speculative greedy generation equals plain autoregressive generation.

    python -m dflash2_rt.train.check --work W --out OUT
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from dflash2_rt.train import common


def eval_prompts(work: str, n: int = 4, length: int = 160, seed: int = 3) -> list:
    ev = np.load(os.path.join(work, "eval_ids.npy"))
    rng = np.random.default_rng(seed)
    return [ev[s:s + length].astype(np.int64).tolist() for s in rng.integers(0, ev.size - length, n)]


def run(work: str, out: str, n: int = 4) -> dict:
    import dflash2_rt
    from dflash2_rt.train import drafter as D
    common.set_threads()
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "draft")
    target = D.load_target(out)
    ps = eval_prompts(work, n)
    res = {}
    eng = dflash2_rt.Engine(target=tdir, method="ar", num_threads=2)
    errs = []
    for p in ps:
        with torch.no_grad():
            ref = target(torch.tensor([p])).logits[0].numpy()
        got = eng.logits(p)
        errs.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
    res["target_logits_max_rel_err"] = max(errs)
    if os.path.exists(os.path.join(ddir, "config.json")):
        model = D.DFlash2Draft.load(ddir, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())
        ids = model.d["target_layer_ids"]
        for method, sel in (("dflash2", True), ("dflash", False)):
            e = dflash2_rt.Engine(target=tdir, draft=ddir, method=method, num_threads=2)
            same = 0
            for p in ps:
                pr = e.propose(p)
                with torch.no_grad():
                    anchor = int(target(torch.tensor([p])).logits[0, -1].argmax())
                    feats = D.target_features(target, torch.tensor([p]), ids)[0]
                toks, _ = model.greedy_block(feats, anchor, use_selector=sel)
                ok = int(pr.anchor) == anchor and list(pr.tokens) == toks
                same += ok
                if not ok:
                    print(f"{method}: runtime {pr.anchor} {list(pr.tokens)} vs torch {anchor} {toks}")
            res[f"{method}_propose_equal"] = f"{same}/{len(ps)}"
        ar = eng.generate(ps, max_new_tokens=48, stop_token_ids=[])
        for method in ("mtp", "dflash", "dflash2"):
            e = dflash2_rt.Engine(target=tdir, draft=None if method == "mtp" else ddir, method=method, num_threads=2)
            sp = e.generate(ps, max_new_tokens=48, stop_token_ids=[])
            res[f"{method}_lossless"] = all(a.token_ids == b.token_ids for a, b in zip(ar, sp))
            res[f"{method}_acceptance"] = float(np.mean([r.stats["acceptance_length"] for r in sp]))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--n", type=int, default=4)
    a = ap.parse_args(argv)
    print(run(a.work, a.out, a.n))


if __name__ == "__main__":
    main()
