"""Step 4: the drafter's training data: corpus prompts continued by the target itself,
generated with our runtime (``Engine(method="ar")``, the same BF16 weights it serves).

Prompts are random windows of the training split (length uniform in [32, 160], seeded);
each is continued by 160 tokens, greedy for 3 of 4 prompts and sampled at temperature 1.0 /
top-p 0.95 for the rest (stop tokens disabled). Written to WORK/gen.npz: ``tokens`` [n, 320]
(prompt + continuation, right-padded with -1) and ``prompt_len`` [n].
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

NEW_TOKENS = 160


def prompts(ids: np.ndarray, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng([seed, 11])
    lens = rng.integers(32, 161, n)
    starts = rng.integers(0, ids.size - 200, n)
    return [ids[s:s + l].astype(np.int64).tolist() for s, l in zip(starts, lens)]


def _without_mtp(tdir: str, view: str) -> str:
    """A view of the target (links to its files) whose config says it has no MTP layer."""
    import json
    import shutil
    shutil.rmtree(view, ignore_errors=True)
    os.makedirs(view)
    for f in os.listdir(tdir):
        if f != "config.json":
            os.symlink(os.path.abspath(os.path.join(tdir, f)), os.path.join(view, f))
    with open(os.path.join(tdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 0
    with open(os.path.join(view, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return view


def run(work: str, out: str, n: int = 1024, seed: int = 0, batch: int = 8, threads: int = 1) -> dict:
    # OpenMP threads that spin while waiting are very slow on a shared (oversubscribed) CPU
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dflash2_rt import Engine
    from dflash2_rt import CheckpointError
    tdir = os.path.join(out, "target")
    try:
        eng = Engine(target=tdir, method="ar", max_batch_size=batch, max_seq_len=512, num_threads=threads)
    except CheckpointError:  # the MTP layer is not trained yet (this step can run alongside mtp.py)
        tdir = _without_mtp(tdir, os.path.join(work, "target_no_mtp"))
        eng = Engine(target=tdir, method="ar", max_batch_size=batch, max_seq_len=512, num_threads=threads)
    ids = np.load(os.path.join(work, "train_ids.npy"))
    ps = prompts(ids, n, seed)
    width = 160 + NEW_TOKENS
    toks = np.full((n, width), -1, np.int32)
    plen = np.zeros(n, np.int32)
    t0 = time.time()
    for i in range(0, n, batch):
        chunk = ps[i:i + batch]
        greedy = (i // batch) % 4 != 3
        res = eng.generate(chunk, max_new_tokens=NEW_TOKENS, temperature=0.0 if greedy else 1.0,
                           top_p=1.0 if greedy else 0.95, seed=seed * 100003 + i, stop_token_ids=[])
        for j, (p, r) in enumerate(zip(chunk, res)):
            seq = p + list(r.token_ids)
            toks[i + j, :len(seq)] = seq
            plen[i + j] = len(p)
        if (i // batch) % 16 == 0:
            print(f"gen {i + len(chunk)}/{n} {time.time() - t0:.0f}s", flush=True)
    np.savez(os.path.join(work, "gen.npz"), tokens=toks, prompt_len=plen)
    return {"sequences": n, "seconds": time.time() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--n", type=int, default=1024)
    a = ap.parse_args(argv)
    print(run(a.work, a.out, n=a.n))


if __name__ == "__main__":
    main()
