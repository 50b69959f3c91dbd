"""Makes the bundled default model pair: corpus + tokenizer, target, MTP layer, drafter data,
drafter, checks. Every step is seeded; rerunning a finished step resumes from its checkpoint
in WORK (delete WORK to start over).

    python -m dflash2_rt.train.make_default_pair --out python/dflash2_rt/models/default

Runtime on a 2-core CPU shared with other jobs (the run that made the committed pair):
corpus + tokenizer ~3 min, target ~30 min (400 steps), MTP ~9 min (300 steps), data ~5 min
(1024 sequences), drafter ~16 min (1800 steps, after ~3 min of feature caching), checks ~1 min.
One torch thread per job (see common.set_threads). Each training step stops at its --time-limit
(wall clock), so on a faster machine more steps run, up to the fixed step counts; the step
counts reached are recorded in OUT/recipe.json. Needs torch, transformers 5.x, tokenizers,
safetensors and a built dflash2_rt (the drafter's data comes from our runtime).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--target-time-limit", type=float, default=1900.0)
    ap.add_argument("--mtp-steps", type=int, default=300)
    ap.add_argument("--gen-n", type=int, default=1024)
    ap.add_argument("--draft-steps", type=int, default=1800)
    ap.add_argument("--draft-time-limit", type=float, default=1300.0)
    a = ap.parse_args(argv)
    from dflash2_rt.train import check, corpus, drafter, gen_data, mtp, target

    os.makedirs(a.work, exist_ok=True)
    times, stats = {}, {}
    t = time.time()
    stats["corpus"] = {k: v for k, v in corpus.run(a.work, a.out).items() if k != "heldout_files"}
    times["corpus"] = time.time() - t
    t = time.time()
    stats["target"] = target.train(a.work, a.out, steps=a.target_steps, time_limit=a.target_time_limit)
    times["target"] = time.time() - t
    t = time.time()
    stats["mtp"] = mtp.train(a.work, a.out, steps=a.mtp_steps)
    times["mtp"] = time.time() - t
    t = time.time()
    stats["gen_data"] = gen_data.run(a.work, a.out, n=a.gen_n)
    times["gen_data"] = time.time() - t
    t = time.time()
    stats["draft"] = drafter.train(a.work, a.out, steps=a.draft_steps, time_limit=a.draft_time_limit)
    times["draft"] = time.time() - t
    t = time.time()
    stats["check"] = check.run(a.work, a.out)
    times["check"] = time.time() - t
    shutil.copy(os.path.join(a.work, "corpus.json"), os.path.join(a.out, "corpus.json"))
    with open(os.path.join(a.out, "recipe.json"), "w") as f:
        json.dump({"stats": stats, "seconds": times}, f, indent=1)
    print(json.dumps({"stats": stats, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
