"""Tiny DFlash 2 / DFlash 1 drafter checkpoints for tests, and a target/drafter pair with
known, high acceptance.

Nothing here imports the runtime: checkpoints are written with torch + safetensors, so the
fixtures and the reference (tests/dflash_ref.py) stay independent of the code under test.

Random drafters
---------------
``make_dflash2_drafter(target_dir, out_dir, ...)`` / ``make_dflash1_drafter(...)`` read the
target's config.json (hidden_size, vocab_size, num_hidden_layers, rms_norm_eps) and write
``config.json`` in the published format plus ``model.safetensors`` with the reference tensor
names (no ``model.`` prefix, no embedding, no lm_head). Random scales (``scale`` multiplies
all of them) are chosen so that every part of the drafter changes the draft:

* linear weights (fc, q/k/v/o, gate/up/down): N(0, (scale / sqrt(fan_in))^2), so a
  sublayer's output has about unit RMS for a unit-RMS input; the draft residual stream is
  then dominated by the layers, not by the (small) target embeddings.
* norm weights (hidden_norm, norm, input/post_attention_layernorm, q_norm, k_norm):
  1 + 0.1 N(0,1). q/k after their norms have unit RMS, so attention logits have std ~1
  (RoPE and the mask matter, attention is neither uniform nor one-hot).
* conv ``base_kernel`` [side, tap, H]: tap 0 = 1 + 0.25 N, tap 1 = 0.5 N (scale applies);
  ``kernel_projection`` N(0, (0.3 scale / sqrt(H))^2) so the dynamic part is ~0.3.
  ``identity_convs=True`` writes base[:, 0] = 1, base[:, 1] = 0, projection 0.
* selector: ``hidden_projection`` N(0, 1/H) (g ~ N(0,1) per rank for the unit-RMS final
  hidden), both codebooks N(0, sigma^2) with sigma^2 sqrt(rank) = ``selector_strength`` x
  the std of the draft logits (std(lm_head) * sqrt(H), read from the target). The selector
  bonus <A[pred] * g, B[c]> then has about the spread of the top-16 logits and changes the
  greedy path at a good fraction of positions. ``zero_successor=True`` zeroes the successor
  codebook (the walk then is the argmax of the logits).

The mask token defaults to ``vocab_size - 1``; the target layer ids default to
``round(linspace(0, T - 2, n))`` with n = min(num_layers, T - 1): never the last target
layer (HF's ``hidden_states[T]`` is after the final norm, see dflash_ref).

Self-drafting pair (high, exactly known acceptance)
---------------------------------------------------
``make_self_drafting_pair(root)`` writes a target and a DFlash 2 drafter built by hand.
Tokens 0..P-1 (P = ``period`` = 128) live on a circle. The target's embeddings are Fourier
features of x (3 low frequencies k = 1, 2, 3 and a "comb" of 16 frequencies 4, 8, .., 64,
one cos/sin pair each), one constant "DC" channel, and nothing else; the mask token
(vocab_size - 1) is only a unit vector u in its own channel. lm_head row j (< P) is
``sharpness * fourier(j - 1)``, so the target's logits are a kernel K(j - 1 - x) peaked at
j = x + 1: the target's greedy continuation is next(x) = (x + 1) mod P. Its layers keep
random weights (MLA + DSA indexer + MoE all run) but their output projections are scaled
by ``target_noise`` so they never flip the argmax (checked at build time).

The drafter (one layer; extra layers are exact pass-throughs) has fc = 0 (context rows
are zero: zero keys, zero values), zero MLP, identity convs, and an attention built so
that every mask position reads the anchor: the query of a mask row lives in one RoPE pair
of lowest frequency (q_proj reads u), the anchor's key reads the DC channel (masks and
context have zero keys), q_norm/k_norm weights give a score of 4 * 3 * 3 = 36 against 0
for every other key, so the softmax puts 1 - 1e-14 on the anchor in any mode (causal,
non-causal, sliding window >= block). v_proj copies the anchor's low-frequency features,
o_proj writes them back as c (E_low[a] + eps E_low[a + 1]) (a shift is a rotation of each
Fourier pair, so it is linear; eps breaks the symmetry of the kernel, so no two draft
logits tie). Every drafted position then has the same logits, a wide kernel peaked at
a + 1 whose top 16 are exactly a - 6 .. a + 9. The selector supplies the order: g is a
constant (hidden_projection reads u), the codebooks are comb features with
<C(x), C(y)> = 16 if x = y, else 0 or -1 (for |x - y| < 32), A[p] = C(p), B[c] = C(c - 1),
so the bonus 16 * kappa picks c = pred + 1 whenever it is a candidate: the draft is
a + 1, a + 2, ..., a + 7. For p in ``break_tokens`` A[p] = C(p + 1): the walk jumps
p -> p + 2 there, which the target rejects. Hence, from anchor a, the number of accepted
drafts is exactly min(7, distance from a to the next break token at or after a), and the
greedy output is last + 1, last + 2, ... (mod P) (tokens P..V-2 embed like x mod P).
``pair.expected_greedy(prompt, n)`` returns the tokens and the accepted count of every
verify step; ``pair.with_drafter(dir, is_causal=..., sliding_window=..., break_tokens=...,
num_draft_layers=...)`` writes another drafter for the same target.

Measured acceptance (the closed form; the reference's decode loop and the runtime both
reproduce every step's accepted count exactly): the default break set (25 of the 128
tokens, seed 7) gives a steady-state tau = PAIR_DEFAULT_TAU = 4.41 tokens per verify step,
with accepted counts 0..7 all occurring; prompt [3, 77, 12, 40] with 64 new tokens takes
17 verify steps, accepted [2, 7, 5, 0, 3, 2, 6, 7, 3, 6, 0, 3, 0, 0, 1, 0, 3], tau = 65/17
= 3.82; ``break_tokens=()`` gives tau = 8 (every draft accepted).

Other helpers: ``dflash1_from_dflash2`` (the same backbone weights as a DFlash 1
checkpoint), ``make_constant_dflash1_drafter`` (drafts one given token everywhere, for
sampling tests that need accepted one-hot drafts), ``make_tiny_target`` (a random
``glm_moe_dsa`` target without MTP), ``rewrite_config`` (bad-config tests).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

__all__ = [
    "read_target_config",
    "default_target_layer_ids",
    "spec_default_target_layer_ids",
    "make_dflash2_drafter",
    "make_dflash1_drafter",
    "make_constant_dflash1_drafter",
    "dflash1_from_dflash2",
    "rewrite_config",
    "make_tiny_target",
    "make_self_drafting_pair",
    "SelfDraftingPair",
    "PAIR_DEFAULT_TAU",
]

# Steady-state tokens per verify step of the default pair (closed form, SelfDraftingPair.steady_tau;
# the reference loop and the engine reproduce every step's accepted count exactly).
PAIR_DEFAULT_TAU = 4.41


# ---------------------------------------------------------------------------- helpers


def read_target_config(target_dir) -> dict:
    with open(os.path.join(os.fspath(target_dir), "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    return {
        "hidden_size": int(cfg["hidden_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "raw": cfg,
    }


def default_target_layer_ids(num_target_layers: int, n: int) -> list:
    """The fixtures' default taps: ``round(linspace(0, T - 2, n))`` (never the last layer)."""
    if n < 1:
        raise ValueError("need at least one target layer id")
    hi = max(num_target_layers - 2, 0)
    if n == 1:
        return [hi // 2]
    return [int(round(i * hi / (n - 1))) for i in range(n)]


def spec_default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """The rule a runtime applies when ``target_layer_ids`` is missing (reference notes):
    one draft layer -> [T // 2]; else evenly spread over 1 .. T - 3, rounded (Python round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _target_lm_head_std(target_dir) -> float:
    """std of the target's lm_head (for sizing the selector codebooks); 0.02 if unreadable."""
    from safetensors import safe_open

    d = os.fspath(target_dir)
    files = [f for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as st:
            if "lm_head.weight" in st.keys():
                return float(st.get_tensor("lm_head.weight").float().std())
    return 0.02


def _save(out_dir: str, config: dict, tensors: dict, dtype: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"dtype must be 'f32' or 'bf16', found {dtype!r}")
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    out = {k: v.detach().to(torch.float32).to(tdt).contiguous() for k, v in tensors.items()}
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def rewrite_config(draft_dir, *, drop: Iterable[str] = (), drop_dflash: Iterable[str] = (), **updates) -> dict:
    """Edits a written drafter's config.json in place (for bad-input tests): top-level keys
    in ``updates`` are set, ``drop`` removed; ``drop_dflash`` removes keys of dflash_config;
    ``dflash_config={...}`` merges into it. Returns the new config."""
    path = os.path.join(os.fspath(draft_dir), "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    dc_upd = updates.pop("dflash_config", None)
    cfg.update(updates)
    for k in drop:
        cfg.pop(k, None)
    if "dflash_config" in cfg:
        for k in drop_dflash:
            cfg["dflash_config"].pop(k, None)
        if dc_upd:
            cfg["dflash_config"].update(dc_upd)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return cfg


# ---------------------------------------------------------------------------- config


def _draft_config(*, v2: bool, tc: dict, num_layers: int, block_size: int, mask_token_id: int,
                  target_layer_ids: list, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                  conv_group_size: int, selector_rank: int, selector_top_k: int,
                  sliding_window: Optional[int], is_causal: Optional[bool], rope_theta: float,
                  max_position_embeddings: int) -> dict:
    H = tc["hidden_size"]
    layer_types = ["sliding_attention" if sliding_window else "full_attention"] * num_layers
    cfg = {
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": tc["vocab_size"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        "num_target_layers": tc["num_hidden_layers"],
    }
    if sliding_window:
        cfg["sliding_window"] = int(sliding_window)
        cfg["use_sliding_window"] = True
    if is_causal is not None:
        cfg["is_causal"] = bool(is_causal)
    if v2:
        cfg["dflash_config"] = {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "conv_kernel_size": 2,
            "conv_group_size": conv_group_size,
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        }
    else:
        cfg["block_size"] = block_size
        cfg["dflash_config"] = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    return cfg


def _resolve_common(target_dir, num_layers, mask_token_id, target_layer_ids, heads, kv_heads, intermediate,
                    conv_group_size, block_size):
    tc = read_target_config(target_dir)
    H, V, T = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    if mask_token_id is None:
        mask_token_id = V - 1
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(T, max(1, min(num_layers, T - 1)))
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if conv_group_size is not None and H % conv_group_size:
        raise ValueError(f"conv_group_size {conv_group_size} must divide hidden_size {H}")
    if block_size < 2:
        raise ValueError("block_size must be >= 2")
    if intermediate is None:
        intermediate = 2 * H
    return tc, H, V, int(mask_token_id), [int(i) for i in target_layer_ids], int(intermediate)


def _backbone(g: torch.Generator, *, H: int, n_taps: int, num_layers: int, heads: int, kv_heads: int,
              head_dim: int, inter: int, scale: float) -> dict:
    def lin(o, i):
        return torch.randn(o, i, generator=g, dtype=torch.float64) * (scale / math.sqrt(i))

    def nrm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)

    t = {"fc.weight": lin(H, n_taps * H), "hidden_norm.weight": nrm(H), "norm.weight": nrm(H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = lin(heads * head_dim, H)
        t[p + "self_attn.k_proj.weight"] = lin(kv_heads * head_dim, H)
        t[p + "self_attn.v_proj.weight"] = lin(kv_heads * head_dim, H)
        t[p + "self_attn.o_proj.weight"] = lin(H, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = nrm(head_dim)
        t[p + "self_attn.k_norm.weight"] = nrm(head_dim)
        t[p + "input_layernorm.weight"] = nrm(H)
        t[p + "post_attention_layernorm.weight"] = nrm(H)
        t[p + "mlp.gate_proj.weight"] = lin(inter, H)
        t[p + "mlp.up_proj.weight"] = lin(inter, H)
        t[p + "mlp.down_proj.weight"] = lin(H, inter)
    return t


# ---------------------------------------------------------------------------- drafters


def make_dflash2_drafter(target_dir, out_dir, *, num_layers: int = 2, block_size: int = 8,
                         mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: Optional[int] = None,
                         conv_group_size: int = 16, selector_rank: int = 32, selector_top_k: int = 16,
                         sliding_window: Optional[int] = None, is_causal: Optional[bool] = False, seed: int = 0,
                         identity_convs: bool = False, zero_successor: bool = False, scale: float = 1.0,
                         conv_scale: float = 1.0, selector_strength: float = 1.0, rope_theta: float = 1e6,
                         max_position_embeddings: int = 4096, dtype: str = "f32") -> str:
    """A random DFlash 2 drafter for the target at ``target_dir`` (see the module docstring
    for the scales). ``is_causal=None`` leaves the key out of config.json. Returns out_dir."""
    tc, H, V, mask, taps, inter = _resolve_common(target_dir, num_layers, mask_token_id, target_layer_ids, heads,
                                                   kv_heads, intermediate, conv_group_size, block_size)
    g = torch.Generator().manual_seed(int(seed))
    t = _backbone(g, H=H, n_taps=len(taps), num_layers=num_layers, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, inter=inter, scale=scale)
    G = H // conv_group_size
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            base = torch.zeros(2, 2, H, dtype=torch.float64)
            proj = torch.zeros(2 * 2 * G, H, dtype=torch.float64)
            if not identity_convs:
                base[:, 0] = 1.0 + 0.25 * conv_scale * torch.randn(2, H, generator=g, dtype=torch.float64)
                base[:, 1] = 0.5 * conv_scale * torch.randn(2, H, generator=g, dtype=torch.float64)
                proj = torch.randn(2 * 2 * G, H, generator=g, dtype=torch.float64) * (0.3 * conv_scale / math.sqrt(H))
            else:
                base[:, 0] = 1.0
            t[p + "base_kernel"] = base
            t[p + "kernel_projection.weight"] = proj
    logit_std = _target_lm_head_std(target_dir) * math.sqrt(H)
    sigma = math.sqrt(max(selector_strength, 0.0) * logit_std / math.sqrt(selector_rank))
    t["candidate_selector.hidden_projection.weight"] = (
        torch.randn(selector_rank, H, generator=g, dtype=torch.float64) / math.sqrt(H))
    t["candidate_selector.predecessor_codebook"] = sigma * torch.randn(V, selector_rank, generator=g,
                                                                       dtype=torch.float64)
    succ = sigma * torch.randn(V, selector_rank, generator=g, dtype=torch.float64)
    t["candidate_selector.successor_codebook"] = torch.zeros_like(succ) if zero_successor else succ
    cfg = _draft_config(v2=True, tc=tc, num_layers=num_layers, block_size=block_size, mask_token_id=mask,
                        target_layer_ids=taps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter,
                        conv_group_size=conv_group_size, selector_rank=selector_rank, selector_top_k=selector_top_k,
                        sliding_window=sliding_window, is_causal=is_causal, rope_theta=rope_theta,
                        max_position_embeddings=max_position_embeddings)
    out_dir = os.fspath(out_dir)
    _save(out_dir, cfg, t, dtype)
    return out_dir


def make_dflash1_drafter(target_dir, out_dir, *, num_layers: int = 2, block_size: int = 8,
                         mask_token_id: Optional[int] = None, target_layer_ids: Optional[Sequence[int]] = None,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: Optional[int] = None,
                         sliding_window: Optional[int] = None, is_causal: Optional[bool] = False, seed: int = 0,
                         scale: float = 1.0, rope_theta: float = 1e6, max_position_embeddings: int = 4096,
                         dtype: str = "f32") -> str:
    """A random DFlash 1 drafter (``DFlashDraftModel``: top-level block_size, no convs, no
    selector). Same backbone draws as make_dflash2_drafter with the same seed."""
    tc, H, V, mask, taps, inter = _resolve_common(target_dir, num_layers, mask_token_id, target_layer_ids, heads,
                                                   kv_heads, intermediate, None, block_size)
    g = torch.Generator().manual_seed(int(seed))
    t = _backbone(g, H=H, n_taps=len(taps), num_layers=num_layers, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, inter=inter, scale=scale)
    cfg = _draft_config(v2=False, tc=tc, num_layers=num_layers, block_size=block_size, mask_token_id=mask,
                        target_layer_ids=taps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter,
                        conv_group_size=16, selector_rank=0, selector_top_k=0, sliding_window=sliding_window,
                        is_causal=is_causal, rope_theta=rope_theta, max_position_embeddings=max_position_embeddings)
    out_dir = os.fspath(out_dir)
    _save(out_dir, cfg, t, dtype)
    return out_dir


def make_constant_dflash1_drafter(target_dir, out_dir, token: int, *, seed: int = 0, **kw) -> str:
    """A DFlash 1 drafter that drafts ``token`` at every position whatever the context (for
    sampling tests that need one-hot drafts the target often accepts: pick the target's
    most likely token). Random backbone, then: every o_proj = 0 and every down_proj = 0 but
    the last layer's, which is rank one: it maps the (constant) MLP input of the mask rows
    to a large multiple of lm_head[token], so that the final hidden state is ~lm_head[token]
    and the draft logits <lm_head[j], lm_head[token]> peak at j = token."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    out_dir = make_dflash1_drafter(target_dir, out_dir, seed=seed, **kw)
    tensors = {}
    d = os.fspath(target_dir)
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), framework="pt") as st:
                for name in ("model.embed_tokens.weight", "lm_head.weight"):
                    if name in st.keys():
                        tensors[name] = st.get_tensor(name).double()
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    mask, eps, L = cfg["dflash_config"]["mask_token_id"], cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    t = {k: v.double() for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()}
    for i in range(L):
        t[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        t[f"layers.{i}.mlp.down_proj.weight"].zero_()
    e = tensors["model.embed_tokens.weight"][mask]
    y0 = e * torch.rsqrt(e.pow(2).mean() + eps) * t[f"layers.{L - 1}.post_attention_layernorm.weight"]
    p = f"layers.{L - 1}.mlp."
    z0 = torch.nn.functional.silu(t[p + "gate_proj.weight"] @ y0) * (t[p + "up_proj.weight"] @ y0)
    row = tensors["lm_head.weight"][int(token)]
    target = row / row.norm() * (100.0 * e.norm() + 1.0)
    t[p + "down_proj.weight"] = torch.outer(target, z0) / z0.pow(2).sum()
    _save(out_dir, cfg, t, "f32")
    return out_dir


def dflash1_from_dflash2(src_dir, out_dir) -> str:
    """The same backbone weights as the DFlash 2 drafter at ``src_dir``, written as a DFlash 1
    checkpoint (conv and selector tensors dropped, config converted, dtype kept)."""
    from safetensors.torch import load_file, save_file

    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    with open(os.path.join(src_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    dc = dict(cfg.pop("dflash_config"))
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["block_size"] = dc["block_size"]
    cfg["dflash_config"] = {"mask_token_id": dc["mask_token_id"], "target_layer_ids": dc["target_layer_ids"]}
    t = load_file(os.path.join(src_dir, "model.safetensors"))
    keep = {k: v for k, v in t.items() if "_conv." not in k and not k.startswith("candidate_selector.")}
    os.makedirs(out_dir, exist_ok=True)
    save_file(keep, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return out_dir


# ---------------------------------------------------------------------------- targets

TINY_TARGET = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, index_topk=8, index_n_heads=16, index_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    initializer_range=0.05,
)


def _build_target_model(seed: int, **overrides):
    import transformers
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass
    d = dict(TINY_TARGET)
    d.update(overrides)
    cfg = GlmMoeDsaConfig(**d)
    torch.manual_seed(int(seed))
    model = GlmMoeDsaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(int(seed) + 17)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(cfg.initializer_range * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.02 * torch.randn(b.shape, generator=g))
    return model


def make_tiny_target(out_dir, *, seed: int = 0, **overrides) -> str:
    """A tiny random ``glm_moe_dsa`` target (3 layers, hidden 64, vocab 256, MLA + DSA
    indexer + MoE; TINY_TARGET overridable) written with ``save_pretrained``. No MTP layer
    (tests/glm_fixtures.py builds one)."""
    out_dir = os.fspath(out_dir)
    _build_target_model(seed, **overrides).save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------- self-drafting pair

_LOW = (1, 2, 3)                              # wide kernel: the drafter's logits
_COMB = tuple(4 * j for j in range(1, 17))    # sharp kernel (period 32 up to the low part)


def _fourier(x, freqs, period) -> np.ndarray:
    """[len(x), 2 len(freqs)] cos/sin pairs of 2 pi k x / period."""
    x = np.asarray(x, dtype=np.float64)[:, None]
    th = 2 * np.pi * np.asarray(freqs, dtype=np.float64)[None, :] * x / period
    out = np.empty((x.shape[0], 2 * len(freqs)))
    out[:, 0::2] = np.cos(th)
    out[:, 1::2] = np.sin(th)
    return out


def _rot_pair_block(theta: float, eps: float, c: float) -> np.ndarray:
    """c (I + eps R(theta)) on one (cos, sin) pair: maps f(a) to c (f(a) + eps f(a + 1))."""
    r = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    return c * (np.eye(2) + eps * r)


def _default_breaks(period: int, seed: int = 7) -> list:
    """About 1 in 5 tokens, irregular gaps: acceptance lengths of every size occur."""
    rng = np.random.default_rng(seed)
    return sorted(int(x) for x in rng.choice(period, size=period // 5, replace=False))


@dataclasses.dataclass
class SelfDraftingPair:
    target_dir: str
    draft_dir: str
    period: int
    vocab_size: int
    mask_token_id: int
    block_size: int
    break_tokens: tuple
    num_target_layers: int = 2

    def next_token(self, x: int) -> int:
        """The target's greedy successor of token x (any x but the mask token)."""
        return (int(x) % self.period + 1) % self.period

    def draft_from(self, anchor: int) -> list:
        """The drafter's greedy proposal after ``anchor`` (block_size - 1 tokens), valid as
        long as at most two breaks are met (after a third jump the wanted token leaves the
        candidate window a-6..a+9; only the prefix up to the first break matters for
        acceptance)."""
        out, p = [], int(anchor) % self.period
        for _ in range(self.block_size - 1):
            p = (p + (2 if p in self.break_tokens else 1)) % self.period
            out.append(p)
        return out

    def accepted_from(self, anchor: int) -> int:
        """Drafts the target accepts in the verify step whose anchor is ``anchor``."""
        a, p = 0, int(anchor) % self.period
        while a < self.block_size - 1 and p not in self.break_tokens:
            a += 1
            p = (p + 1) % self.period
        return a

    def expected_greedy(self, prompt: Sequence[int], max_new_tokens: int) -> dict:
        """Greedy speculative decoding of ``prompt`` (its last token must not be the mask):
        ``tokens`` (the output, = plain greedy), ``accepted`` (drafts accepted per verify
        step; the last step's count is before truncation to max_new_tokens), ``steps``, and
        ``tau`` = sum(accepted + 1) / steps (the prefill's first token is not counted)."""
        if max_new_tokens <= 0:
            return {"tokens": [], "accepted": [], "steps": 0, "tau": 1.0}
        tokens = [self.next_token(prompt[-1])]
        accepted = []
        while len(tokens) < max_new_tokens:
            anchor = tokens[-1]
            a = self.accepted_from(anchor)
            accepted.append(a)
            tokens.extend((anchor + i) % self.period for i in range(1, a + 2))
        tokens = tokens[:max_new_tokens]
        tau = sum(a + 1 for a in accepted) / len(accepted) if accepted else 1.0
        return {"tokens": tokens, "accepted": accepted, "steps": len(accepted), "tau": tau}

    def steady_tau(self, new_tokens: int = 400) -> float:
        """Tokens per verify step over long generations started from every token."""
        c = s = 0
        for start in range(self.period):
            r = self.expected_greedy([start], new_tokens)
            c += sum(a + 1 for a in r["accepted"])
            s += r["steps"]
        return c / s

    def with_drafter(self, draft_dir, *, break_tokens="same", is_causal: Optional[bool] = False,
                     sliding_window: Optional[int] = None, num_draft_layers: int = 1,
                     block_size: Optional[int] = None) -> "SelfDraftingPair":
        """Another hand-built drafter for the same target (e.g. causal, sliding window, no
        breaks); returns the pair that describes it."""
        breaks = self.break_tokens if break_tokens == "same" else break_tokens
        return _write_pair_drafter(self.target_dir, os.fspath(draft_dir), period=self.period,
                                   break_tokens=breaks, block_size=block_size or self.block_size,
                                   is_causal=is_causal, sliding_window=sliding_window,
                                   num_draft_layers=num_draft_layers, num_target_layers=self.num_target_layers)


def _pair_layout(H: int):
    n_low, n_comb = 2 * len(_LOW), 2 * len(_COMB)
    return n_low, n_comb, n_low + n_comb, n_low + n_comb + 1   # (.., .., DC channel, mask channel u)


def make_self_drafting_pair(root, *, break_tokens="default", period: int = 128, vocab_size: int = 256,
                            hidden_size: int = 64, num_target_layers: int = 2, num_draft_layers: int = 1,
                            block_size: int = 8, is_causal: Optional[bool] = False,
                            sliding_window: Optional[int] = None, target_noise: float = 0.1,
                            sharpness: float = 1.0, seed: int = 0, check: bool = True) -> SelfDraftingPair:
    """Writes ``root/target`` and ``root/draft`` (see the module docstring) and returns a
    SelfDraftingPair that predicts the greedy output and the accepted count of every verify
    step. ``break_tokens``: "default" (an irregular ~1/5 of the circle, steady-state tau
    4.41), an iterable of tokens < period, or () for full acceptance (tau = block_size).
    ``check`` verifies the target's rule with transformers on a few sequences (raises if a
    logit margin is < 2; the default build's smallest margin is about 6.7)."""
    if period % 32 or period < 64 or vocab_size < period + 1:
        raise ValueError("period must be a multiple of 32, >= 64, and < vocab_size")
    n_low, n_comb, DC, U = _pair_layout(hidden_size)
    if hidden_size < U + 1 or hidden_size % 16:
        raise ValueError(f"hidden_size must be a multiple of 16 and >= {U + 1}")
    root = os.fspath(root)
    tdir = os.path.join(root, "target")
    V, H, P = vocab_size, hidden_size, period
    mask = V - 1
    model = _build_target_model(seed, vocab_size=V, hidden_size=H, num_hidden_layers=num_target_layers,
                                initializer_range=0.02)
    ids = np.arange(V) % P
    feats = np.concatenate([_fourier(ids, _LOW, P), _fourier(ids, _COMB, P)], axis=1)
    emb = np.zeros((V, H))
    emb[:, : n_low + n_comb] = feats
    emb[:, DC] = 1.0
    emb[mask] = 0.0
    emb[mask, U] = 1.0
    head = np.zeros((V, H))
    head[:P, : n_low + n_comb] = sharpness * feats[(np.arange(P) - 1) % P]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(emb))
        model.lm_head.weight.copy_(torch.from_numpy(head))
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight") or "down_proj" in name:
                p.mul_(target_noise)
    model.save_pretrained(tdir)
    if check:
        _check_pair_target(model, P)
    breaks = _default_breaks(P) if break_tokens == "default" else break_tokens
    return _write_pair_drafter(tdir, os.path.join(root, "draft"), period=P, break_tokens=breaks,
                               block_size=block_size, is_causal=is_causal, sliding_window=sliding_window,
                               num_draft_layers=num_draft_layers, num_target_layers=num_target_layers)


def _write_pair_drafter(tdir: str, ddir: str, *, period: int, break_tokens, block_size: int,
                        is_causal: Optional[bool], sliding_window: Optional[int], num_draft_layers: int,
                        num_target_layers: int) -> SelfDraftingPair:
    if block_size > 10:
        raise ValueError("the candidate window a-6..a+9 covers block sizes up to 10")
    if sliding_window is not None and sliding_window < block_size:
        raise ValueError("the pair needs sliding_window >= block_size (every row must see the anchor)")
    tc = read_target_config(tdir)
    V, H, P = tc["vocab_size"], tc["hidden_size"], period
    mask = V - 1
    n_low, n_comb, DC, U = _pair_layout(H)
    heads, head_dim = H // 16, 16
    kv_heads = 2 if heads % 2 == 0 else 1
    breaks = sorted({int(b) % P for b in break_tokens})
    taps = default_target_layer_ids(num_target_layers, 1)
    inter = 2 * H
    t = _backbone(torch.Generator().manual_seed(0), H=H, n_taps=len(taps), num_layers=num_draft_layers,
                  heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter, scale=1.0)
    for k in list(t):                      # zero everything, unit norms: exact pass-through layers
        t[k] = torch.ones_like(t[k]) if k.endswith("norm.weight") else torch.zeros_like(t[k])
    G = H // 16
    for i in range(num_draft_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, 2, H, dtype=torch.float64)
            base[:, 0] = 1.0
            t[f"layers.{i}.{conv}.base_kernel"] = base
            t[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.zeros(4 * G, H, dtype=torch.float64)
    rope_pair = head_dim // 2 - 1          # NeoX pair (7, 15): the lowest RoPE frequency
    score_w = 3.0                          # q_norm/k_norm weight there: score 4 * 3 * 3 = 36
    c_o, eps = 1.0, 0.3
    p = "layers.0.self_attn."
    q = torch.zeros(heads * head_dim, H, dtype=torch.float64)
    for h in range(heads):
        q[h * head_dim + rope_pair, U] = 1.0
    k = torch.zeros(kv_heads * head_dim, H, dtype=torch.float64)
    for h in range(kv_heads):
        k[h * head_dim + rope_pair, DC] = 1.0
    v = torch.zeros(kv_heads * head_dim, H, dtype=torch.float64)
    for i in range(n_low):
        v[i, i] = 1.0                      # kv head 0 carries the anchor's low features
    o = torch.zeros(H, heads * head_dim, dtype=torch.float64)
    for j, kf in enumerate(_LOW):          # q head 0 reads kv head 0
        o[2 * j: 2 * j + 2, 2 * j: 2 * j + 2] = torch.from_numpy(_rot_pair_block(2 * math.pi * kf / P, eps, c_o))
    qn = torch.ones(head_dim, dtype=torch.float64)
    qn[rope_pair] = score_w
    t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"], t[p + "o_proj.weight"] = q, k, v, o
    t[p + "q_norm.weight"], t[p + "k_norm.weight"] = qn.clone(), qn.clone()
    rank = n_comb
    hp = torch.zeros(rank, H, dtype=torch.float64)
    hp[:, U] = 1.0                         # g = const: the bonus is 16 * kappa for c = pred + 1
    pred_rows = np.array([(x % P) + (1 if (x % P) in breaks else 0) for x in range(V)])
    t["candidate_selector.hidden_projection.weight"] = hp
    t["candidate_selector.predecessor_codebook"] = torch.from_numpy(_fourier(pred_rows % P, _COMB, P))
    t["candidate_selector.successor_codebook"] = torch.from_numpy(_fourier((np.arange(V) - 1) % P, _COMB, P))
    cfg = _draft_config(v2=True, tc=tc, num_layers=num_draft_layers, block_size=block_size, mask_token_id=mask,
                        target_layer_ids=taps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter,
                        conv_group_size=16, selector_rank=rank, selector_top_k=16, sliding_window=sliding_window,
                        is_causal=is_causal, rope_theta=1e6, max_position_embeddings=4096)
    _save(ddir, cfg, t, "f32")
    return SelfDraftingPair(target_dir=tdir, draft_dir=ddir, period=P, vocab_size=V, mask_token_id=mask,
                            block_size=block_size, break_tokens=tuple(breaks), num_target_layers=num_target_layers)


@torch.no_grad()
def _check_pair_target(model, period: int, n_seq: int = 6, length: int = 40) -> float:
    """Runs the target on random sequences of tokens < period; every position's argmax must
    be (token + 1) mod period with a logit margin >= 2. Returns the smallest margin."""
    rng = np.random.default_rng(123)
    worst = float("inf")
    for s in range(n_seq):
        ids = rng.integers(0, period, length)
        if s % 2:  # also the pair's own kind of text: a run of consecutive tokens
            ids = (ids[0] + np.arange(length)) % period
        lg = model(torch.tensor([ids.tolist()])).logits[0].double()
        want = torch.from_numpy((ids + 1) % period)
        right = lg.gather(1, want[:, None])[:, 0]
        other = lg.clone()
        other.scatter_(1, want[:, None], -float("inf"))
        margin = float((right - other.max(1).values).min())
        worst = min(worst, margin)
    if worst < 2.0:
        raise AssertionError(f"self-drafting target: greedy rule next = x + 1 holds with margin {worst:.3f} < 2")
    return worst
