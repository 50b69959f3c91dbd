"""Before/after benchmark of two builds of dflash2_rt, in the same run: the same workloads
(target prefill + AR decode on random glm_moe_dsa checkpoints, and ar / mtp / dflash /
dflash2 generation on the bundled default pair, greedy and T=1.0 / top-p 0.95) run in
child processes of each build, alternating A B A B ... so that machine noise hits both;
each figure is the best of the rounds; the table gives after / before.

    python bench/compare_builds.py --before /path/to/old/venv/bin/python [--after python]
        [--rounds 3] [--json bench/results/compare_builds.json]

A build is a Python interpreter that imports dflash2_rt (an installed wheel, or a dev build
through DFLASH2_RT_CORE_DIR / PYTHONPATH given with --after-env / --before-env K=V).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PAIR = os.path.join(HERE, "..", "python", "dflash2_rt", "models", "default")

CHILD = r'''
import json, os, sys, time
import dflash2_rt
root, pair = sys.argv[1], sys.argv[2]
out = {}
def best(fn, n=3):
    return min(fn() for _ in range(n))
# target: prefill (128 tokens) and AR decode (48 greedy tokens) at batch 1
for name in ("small", "medium"):
    path = os.path.join(root, name)
    eng = dflash2_rt.Engine(target=path, method="ar", max_batch_size=1, max_seq_len=512)
    prompt = [(i * 7919) % 1000 + 2 for i in range(128)]
    eng.logits(prompt[:8])
    def prefill():
        t = time.perf_counter(); eng.logits(prompt); return time.perf_counter() - t
    out[f"target/{name}/prefill_tok_s"] = 128 / best(prefill)
    def decode():
        r = eng.generate([prompt], max_new_tokens=48, stop_token_ids=[])[0]
        return r.stats["decode_s"] / max(1, r.stats["generated_tokens"] - 1)
    out[f"target/{name}/decode_tok_s"] = 1.0 / best(decode)
# speculative decoding on the bundled pair, concurrency 1
t, d = os.path.join(pair, "target"), os.path.join(pair, "draft")
prompts = [[(i * 31 + j * 17) % 4000 + 2 for j in range(64 + 16 * i)] for i in range(4)]
for mode, kw in (("greedy", dict(temperature=0.0)), ("t1_p095", dict(temperature=1.0, top_p=0.95))):
    for m in ("ar", "mtp", "dflash", "dflash2"):
        eng = dflash2_rt.Engine(target=t, draft=d if m.startswith("dflash") else None, method=m,
                                max_batch_size=1, max_seq_len=512)
        eng.generate([prompts[0]], max_new_tokens=4, stop_token_ids=[])
        def run():
            t0 = time.perf_counter(); gen = 0; host = 0.0; steps = 0
            for i, p in enumerate(prompts):
                r = eng.generate([p], max_new_tokens=96, stop_token_ids=[], seed=i, **kw)[0]
                gen += r.stats["generated_tokens"]; host += r.stats["host_s"]; steps += r.stats["verify_steps"]
            return (time.perf_counter() - t0) / gen, host / max(1, steps)
        rs = [run() for _ in range(3)]
        out[f"spec/{mode}/{m}/tok_s"] = 1.0 / min(r[0] for r in rs)
        out[f"spec/{mode}/{m}/host_ms_per_step"] = 1e3 * min(r[1] for r in rs)
print(json.dumps(out))
'''


def build_models(root):
    sys.path.insert(0, HERE)
    import bench_target  # noqa: E402  (random glm_moe_dsa checkpoints, same sizes as bench_target.py)
    for name in ("small", "medium"):
        p = os.path.join(root, name)
        if not os.path.exists(os.path.join(p, "config.json")):
            bench_target.build(name, p)


def run_child(python, env_pairs, root):
    env = dict(os.environ)
    env.pop("DFLASH2_RT_CORE_DIR", None)
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_WAIT_POLICY", "")
    env.pop("OMP_WAIT_POLICY")
    for kv in env_pairs:
        k, v = kv.split("=", 1)
        env[k] = v
    out = subprocess.run([python, "-c", CHILD, root, PAIR], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="python of the old build")
    ap.add_argument("--after", default=sys.executable, help="python of the new build (default: this one)")
    ap.add_argument("--before-env", nargs="*", default=[])
    ap.add_argument("--after-env", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "compare_builds.json"))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dflash2-compare-")
    build_models(root)
    res = {"before": [], "after": []}
    for r in range(args.rounds):
        for which, py, envp in (("before", args.before, args.before_env), ("after", args.after, args.after_env)):
            res[which].append(run_child(py, envp, root))
            print(f"round {r + 1}/{args.rounds}: {which} done", flush=True)
    keys = list(res["after"][0])
    best = {w: {k: max(x[k] for x in res[w]) if not k.endswith("host_ms_per_step") else min(x[k] for x in res[w])
                for k in keys} for w in res}
    print(f"\n{'metric':44s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for k in keys:
        b, a = best["before"][k], best["after"][k]
        print(f"{k:44s} {b:10.2f} {a:10.2f} {a / b if b else float('nan'):12.2f}x")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"rounds": args.rounds, "best": best, "all": res}, f, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
