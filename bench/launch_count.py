"""Kernel launches per decode step of the CUDA backend, counted in its CPU emulation.

At small batches a decode step is mostly launches: GLM-5.3 has 78 layers, and each
kernel costs a few microseconds of launch and drain even inside a CUDA graph, whatever
its work. The emulated build (``-DDFLASH2_CUDA_EMULATE=ON``) runs the CUDA backend's
own launch code and counts every kernel it runs (``EMU_PROFILE``), so the count per step
is exact without a GPU. Each row runs AR decoding on the tiny fixture (4 layers: one
dense, three MoE, every layer with its indexer) twice, for 3 and 7 new tokens, and divides
the difference by the 4 extra steps; ``fused`` is this build's default, ``one by one``
the same engine with ``DFLASH2_FUSED_LAUNCHES=0`` (rope_many, cache_write_many, rms_norm_many,
linear_many, exact and skinny BF16, and the gated MLP's gate / up / silu_mul take their ops
one by one), measured in the same run.

    DFLASH2_RT_CORE_DIR=build/emu PYTHONPATH=python python bench/launch_count.py
    ... --gemm exact,bf16 --tp 1,2 --by-kernel

Counts, not times: what a launch costs on a GPU is for bench/device_check.sh to measure.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(r"emu:\s+[\d.]+ s\s+(\d+) launches\s+\d+ blocks\s+\d+ threads\s+(.*)")

CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import dflash2_rt, glm_fixtures as gf
eng = dflash2_rt.Engine(target={path!r}, method="ar", device="cuda", max_batch_size=1, max_seq_len=128,
                        prefill_gemm="exact", decode_gemm={gemm!r}, tensor_parallel={tp},
                        capture_at_load=False, pad_to_buckets=False)
out = eng.generate([gf.prompt(5, 7)], max_new_tokens={n}, stop_token_ids=[])
print("TOKENS", list(out[0].token_ids))
"""


def launches(path, gemm, tp, n, fused):
    env = dict(os.environ, EMU_PROFILE="all", EMU_DEVICES=str(max(tp, 1)),
               DFLASH2_FUSED_LAUNCHES="1" if fused else "0")
    code = CHILD.format(tests=os.path.join(HERE, "..", "tests"), path=path, gemm=gemm, tp=tp, n=n)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"launch_count: the emulated engine failed ({gemm}, tp {tp}):\n{r.stderr[-3000:]}")
    counts = {}
    for line in r.stderr.splitlines():
        m = ROW.match(line)
        if m:
            counts[m.group(2)] = int(m.group(1))
    tokens = [l for l in r.stdout.splitlines() if l.startswith("TOKENS")]
    return counts, tokens[-1] if tokens else ""


def per_step(path, gemm, tp, fused, lo=3, hi=7):
    a, ta = launches(path, gemm, tp, lo, fused)
    b, tb = launches(path, gemm, tp, hi, fused)
    steps = (hi - lo) * tp  # the profile counts every rank's kernels
    rows = {k: (b.get(k, 0) - a.get(k, 0)) / steps for k in set(a) | set(b)}
    return {k: v for k, v in rows.items() if v}, tb


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm", default="exact,bf16", help="decode_gemm values (comma separated)")
    ap.add_argument("--tp", default="1", help="tensor_parallel sizes (comma separated)")
    ap.add_argument("--by-kernel", action="store_true", help="each kernel's launches per step too")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import dflash2_rt
    if not dflash2_rt.build_info().get("cuda_emulated"):
        raise SystemExit("launch_count: needs the emulated build (cmake -DDFLASH2_CUDA_EMULATE=ON; "
                         "DFLASH2_RT_CORE_DIR=build/emu): it counts the kernels the emulator runs")
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import glm_fixtures as gf
    tmp = tempfile.mkdtemp(prefix="launch_count_")
    path = gf.build_model(os.path.join(tmp, "tiny"), "tiny")
    layers = 4
    results = []
    print(f"{'decode_gemm':>11} {'tp':>3} {'one by one':>11} {'fused':>7} {'per layer':>16} {'change':>8}")
    for gemm in args.gemm.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            base, tok0 = per_step(path, gemm, tp, False)
            fused, tok1 = per_step(path, gemm, tp, True)
            if tok0 != tok1:
                raise SystemExit(f"launch_count: fused and one-by-one tokens differ ({gemm}, tp {tp}): {tok0} {tok1}")
            nb, nf = sum(base.values()), sum(fused.values())
            print(f"{gemm:>11} {tp:>3} {nb:>11.1f} {nf:>7.1f} {nb / layers:>7.2f} -> {nf / layers:<6.2f} "
                  f"{(nf - nb) / nb:>+8.1%}")
            results.append(dict(decode_gemm=gemm, tp=tp, one_by_one=nb, fused=nf, by_kernel_fused=fused,
                                by_kernel_one_by_one=base))
            if args.by_kernel:
                for k in sorted(set(base) | set(fused), key=lambda k: -fused.get(k, 0)):
                    print(f"{'':>16}{base.get(k, 0):>11.2f} {fused.get(k, 0):>7.2f}  {k[:90]}")
    print("(AR decode steps of the tiny fixture, 4 layers; kernels per step per rank, counted by the CPU "
          "emulation of the CUDA backend)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
