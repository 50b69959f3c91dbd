"""Shared helpers of the training recipe: the target's config, the HF model, saving."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch

# The default target: a small GLM-5.x (glm_moe_dsa) model. 4 layers: layer 0 dense, 1-3 MoE
# (8 routed experts, top-2, one shared expert); MLA; DSA indexer with IndexShare (layers 0 and
# 2 run the indexer, 1 and 3 reuse its top-k) and index_topk 64; one MTP layer (layer 4).
TARGET_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=16,  # many heads: an all-zero ReLU score (an exact tie at the top-k boundary) is rare
    index_head_dim=32,
    index_topk=64,
    indexer_types=["full", "shared", "full", "shared"],
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    max_position_embeddings=4096,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    initializer_range=0.02,
)


def set_threads(n: int = 0) -> None:
    """torch threads: n, else $DFLASH2_TRAIN_THREADS, else 1. On the shared 2-core machine the
    recipe was run on, one thread made a drafter step ~3x faster than two (the second core was
    busy with other jobs and torch's threads waited on each other); use 2+ on an idle machine."""
    torch.set_num_threads(n or int(os.environ.get("DFLASH2_TRAIN_THREADS", "1")))


def quiet_transformers() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass


def make_config(eos_token_id: int):
    from transformers import GlmMoeDsaConfig
    cfg = GlmMoeDsaConfig(**TARGET_CONFIG, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    cfg._attn_implementation = "eager"
    return cfg


def mtp_layer_config(cfg):
    """The config in which index L = num_hidden_layers exists as a full-indexer MoE layer
    (to instantiate the MTP decoder layer with transformers' module)."""
    from transformers import GlmMoeDsaConfig
    L = cfg.num_hidden_layers
    d = cfg.to_dict()
    d["num_hidden_layers"] = L + 1
    d["mlp_layer_types"] = list(cfg.mlp_layer_types[:L]) + ["sparse"]
    d["indexer_types"] = list(cfg.indexer_types[:L]) + ["full"]
    # the config's own attention type (its name depends on the transformers version)
    d["layer_types"] = list(cfg.layer_types[:L]) + [cfg.layer_types[L - 1] if L else "indexed_attention"]
    out = GlmMoeDsaConfig.from_dict(d)
    out._attn_implementation = "eager"
    return out


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def batch_windows(ids: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = rng.integers(0, ids.size - seq - 1, batch)
    return torch.from_numpy(np.stack([ids[s:s + seq + 1].astype(np.int64) for s in starts]))


_FUSED = re.compile(r"^((?:.*\.)?mlp\.experts)\.(gate_up_proj|down_proj)$")


def to_checkpoint_names(state: dict) -> dict:
    """In-memory fused experts -> per-expert 2-D checkpoint tensors (gate rows first)."""
    out = {}
    for name, t in state.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        base, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                g, u = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = g.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = u.contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def to_bf16(name: str, t: torch.Tensor) -> torch.Tensor:
    """Checkpoint dtype: BF16, except the router's e_score_correction_bias (F32 as in GLM-5.x)."""
    if not t.is_floating_point() or name.endswith("e_score_correction_bias"):
        return t.contiguous()
    return t.to(torch.bfloat16).contiguous()


def save_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def load_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)
