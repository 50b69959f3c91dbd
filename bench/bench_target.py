"""Target model benchmark: dflash2_rt's AR decode and prefill against transformers'
GlmMoeDsaForCausalLM on the same checkpoint, in the same run, for a few model sizes; and
the peak resident memory while loading, against the checkpoint's bytes.

    python bench/bench_target.py [--quick] [--json bench/results/target_cpu.json]

Models are random `glm_moe_dsa` checkpoints built with transformers (fp32 weights, so both
sides read the same bytes); sizes below. Prints a table and writes JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # two OpenMP runtimes share 2 cores: see bench_gemm.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

SIZES = {
    # name: (hidden, layers, experts, moe_inter, dense_inter, vocab, heads)
    "small": (256, 4, 16, 256, 768, 8192, 4),
    "medium": (384, 6, 32, 384, 1024, 16384, 6),
}


def build(name, path):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    h, n, e, mi, di, v, nh = SIZES[name]
    cfg = GlmMoeDsaConfig(
        vocab_size=v, hidden_size=h, num_hidden_layers=n, intermediate_size=di, moe_intermediate_size=mi,
        num_attention_heads=nh, num_key_value_heads=nh, q_lora_rank=h // 2, kv_lora_rank=h // 4,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_topk=64, index_n_heads=8,
        index_head_dim=32, n_routed_experts=e, num_experts_per_tok=4, n_shared_experts=1,
        first_k_dense_replace=1, index_topk_freq=2, index_skip_topk_offset=1,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, max_position_embeddings=4096,
        eos_token_id=None)
    torch.manual_seed(0)
    m = GlmMoeDsaForCausalLM(cfg).eval()
    m.save_pretrained(path)
    params = sum(p.numel() for p in m.parameters())
    return m, params


def rss_child(path):
    """(RSS before loading, peak RSS after loading + one forward) of a fresh process, in
    bytes, from /proc (VmHWM is per address space, so exec resets it, unlike ru_maxrss)."""
    code = (
        "import dflash2_rt\n"
        "def kb(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key): return int(line.split()[1])\n"
        "base = kb('VmRSS')\n"
        f"e = dflash2_rt.Engine(target={path!r}, max_seq_len=512, max_batch_size=1)\n"
        "e.logits([1, 2, 3])\n"
        "print(base, kb('VmHWM'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) * 1024, int(out[1]) * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "target_cpu.json"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    import dflash2_rt

    threads = dflash2_rt.build_info()["num_threads"]
    torch.set_num_threads(threads)
    sizes = ["small"] if args.quick else list(SIZES)
    P, N = (32, 16) if args.quick else (args.prompt, args.new)
    rows = []
    for name in sizes:
        with tempfile.TemporaryDirectory() as d:
            hf, params = build(name, d)
            ck_bytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
            rng = np.random.default_rng(0)
            prompt = rng.integers(0, hf.config.vocab_size, P).tolist()
            eng = dflash2_rt.Engine(target=d, max_seq_len=P + N + 8, max_batch_size=1)
            # prefill: all-position logits of the prompt, both sides
            eng.logits(prompt)
            t0 = time.perf_counter(); eng.logits(prompt); ours_prefill = time.perf_counter() - t0
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                hf(ids)
                t0 = time.perf_counter(); hf(ids); hf_prefill = time.perf_counter() - t0
            # decode: greedy, N new tokens, both sides; decode time = total - prefill
            r = eng.generate([prompt], max_new_tokens=N, stop_token_ids=[])[0]
            ours_decode_tps = (r.stats["generated_tokens"] - 1) / r.stats["decode_s"]
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = hf.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
                hf_total = time.perf_counter() - t0
            hf_tokens = out[0, P:].tolist()
            hf_decode_tps = (N - 1) / max(hf_total - hf_prefill, 1e-9)
            base, peak = rss_child(d)
            row = {
                "model": name, "params": params, "checkpoint_bytes": ck_bytes, "prompt": P, "new_tokens": N,
                "ours_prefill_tok_s": P / ours_prefill, "hf_prefill_tok_s": P / hf_prefill,
                "ours_decode_tok_s": ours_decode_tps, "hf_decode_tok_s": hf_decode_tps,
                "decode_speedup": ours_decode_tps / hf_decode_tps, "prefill_speedup": hf_prefill / ours_prefill,
                "greedy_equal_to_hf": r.token_ids == hf_tokens,
                "load_peak_rss_delta_bytes": peak - base, "load_rss_over_checkpoint": (peak - base) / ck_bytes,
            }
            rows.append(row)
            print(f"  measured {name}", file=sys.stderr, flush=True)
    hdr = (f"{'model':>7} {'params':>8} | {'prefill tok/s ours':>18} {'hf':>8} {'x':>6} | {'decode tok/s ours':>17} "
           f"{'hf':>8} {'x':>6} | {'greedy==hf':>10} | {'load RSS / ckpt':>15}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['model']:>7} {r['params']/1e6:>7.1f}M | {r['ours_prefill_tok_s']:>18.1f} {r['hf_prefill_tok_s']:>8.1f} "
              f"{r['prefill_speedup']:>5.2f}x | {r['ours_decode_tok_s']:>17.1f} {r['hf_decode_tok_s']:>8.1f} "
              f"{r['decode_speedup']:>5.2f}x | {str(r['greedy_equal_to_hf']):>10} | {r['load_rss_over_checkpoint']:>14.2f}x")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"bench": "target_cpu", "threads": threads, "build_info": dflash2_rt.build_info(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
