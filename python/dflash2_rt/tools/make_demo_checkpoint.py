"""Writes a tiny, deterministic, random-weight checkpoint shaped like GLM-5.x
(``glm_moe_dsa``): BF16 weights, F32 router tensors, a ``config.json``, sharded with a
``model.safetensors.index.json``. numpy only (no torch).

    python -m dflash2_rt.tools.make_demo_checkpoint OUT_DIR [--shards N] [--seed S]
    dflash2-rt inspect OUT_DIR

The weights are random: the checkpoint is for exercising loading and tooling, not for
producing meaningful text.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from ..checkpoint import INDEX_NAME, f32_to_bf16_bits, plan_shards, save_sharded

# A miniature of the GLM-5.x configuration (same field names, tiny sizes).
DEMO_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 4096,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 8,
    "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
    "index_topk": 64,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,
    "eos_token_id": [1, 2],
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
    "dflash2_rt_demo": "random weights for testing the tooling; not a real model",
}


def demo_tensors(seed: int = 0) -> dict:
    """{name: (uint16 bits, "BF16") or float32 array} for DEMO_CONFIG."""
    c = DEMO_CONFIG
    rng = np.random.default_rng(seed)
    h, v = c["hidden_size"], c["vocab_size"]
    heads, nope, rope, vdim = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    out: dict = {}

    def bf16(name: str, *shape: int, scale: float = 0.02, center: float = 0.0) -> None:
        w = (center + scale * rng.standard_normal(shape)).astype(np.float32)
        out[name] = (f32_to_bf16_bits(w), "BF16")

    def f32(name: str, *shape: int, scale: float = 0.02) -> None:
        out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)

    bf16("model.embed_tokens.weight", v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        bf16(p + "input_layernorm.weight", h, scale=0.05, center=1.0)
        bf16(p + "post_attention_layernorm.weight", h, scale=0.05, center=1.0)
        a = p + "self_attn."
        bf16(a + "q_a_proj.weight", qr, h)
        bf16(a + "q_a_layernorm.weight", qr, scale=0.05, center=1.0)
        bf16(a + "q_b_proj.weight", heads * (nope + rope), qr)
        bf16(a + "kv_a_proj_with_mqa.weight", kvr + rope, h)
        bf16(a + "kv_a_layernorm.weight", kvr, scale=0.05, center=1.0)
        bf16(a + "kv_b_proj.weight", heads * (nope + vdim), kvr)
        bf16(a + "o_proj.weight", h, heads * vdim)
        ix = a + "indexer."
        bf16(ix + "wq_b.weight", c["index_n_heads"] * c["index_head_dim"], qr)
        bf16(ix + "wk.weight", c["index_head_dim"], h)
        bf16(ix + "k_norm.weight", c["index_head_dim"], scale=0.05, center=1.0)
        bf16(ix + "k_norm.bias", c["index_head_dim"])
        bf16(ix + "weights_proj.weight", c["index_n_heads"], h)
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            bf16(m + "gate_proj.weight", c["intermediate_size"], h)
            bf16(m + "up_proj.weight", c["intermediate_size"], h)
            bf16(m + "down_proj.weight", h, c["intermediate_size"])
        else:
            f = c["moe_intermediate_size"]
            f32(m + "gate.weight", c["n_routed_experts"], h)
            f32(m + "gate.e_score_correction_bias", c["n_routed_experts"], scale=0.01)
            for e in range(c["n_routed_experts"]):
                bf16(f"{m}experts.{e}.gate_proj.weight", f, h)
                bf16(f"{m}experts.{e}.up_proj.weight", f, h)
                bf16(f"{m}experts.{e}.down_proj.weight", h, f)
            bf16(m + "shared_experts.gate_proj.weight", f, h)
            bf16(m + "shared_experts.up_proj.weight", f, h)
            bf16(m + "shared_experts.down_proj.weight", h, f)
    bf16("model.norm.weight", h, scale=0.05, center=1.0)
    bf16("lm_head.weight", v, h)
    return out


def _nbytes(value) -> int:
    return (value[0] if isinstance(value, tuple) else value).nbytes


def write_demo_checkpoint(out_dir: str, shards: int = 2, seed: int = 0) -> list:
    """Writes the demo checkpoint into out_dir (created if needed) in exactly
    min(shards, number of tensors) shards; returns the shard paths."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, found {shards}")
    tensors = demo_tensors(seed)
    sizes = {n: _nbytes(t) for n, t in tensors.items()}
    want = min(shards, len(sizes))
    # The smallest shard size limit that gives at most `want` shards.
    lo, hi = max(sizes.values()), sum(sizes.values())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(plan_shards(sizes, mid)) <= want:
            hi = mid
        else:
            lo = mid + 1
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):  # stale shards of an earlier run with another --shards
        if old.startswith("model-") and old.endswith(".safetensors"):
            os.remove(os.path.join(out_dir, old))
    paths = save_sharded(out_dir, tensors, lo, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(DEMO_CONFIG, f, indent=2)
        f.write("\n")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash2_rt.tools.make_demo_checkpoint",
                                 description="Write a tiny deterministic GLM-shaped BF16/F32 checkpoint (random weights).")
    ap.add_argument("out_dir", metavar="OUT_DIR")
    ap.add_argument("--shards", type=int, default=2, help="number of safetensors shards (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = ap.parse_args(argv)
    try:
        paths = write_demo_checkpoint(args.out_dir, args.shards, args.seed)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(paths)} shard(s), {INDEX_NAME} and config.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
