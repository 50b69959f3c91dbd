"""An independent torch reference of the GLM-5.x MTP (next-n prediction) layer.

transformers does not build the MTP layer (it ignores ``model.layers.{L}.*``), so this is
written from the reference notes (DeepSeek-V3 style, as vLLM/SGLang run it):

    e = embed(token t+1)                              # layer's own embed_tokens if stored, else the main one
    u = eh_proj(cat[RMS(e; enorm), RMS(h_main; hnorm)])   # embedding first
    x = DecoderLayer(u)                               # MLA + DSA indexer + MoE, own caches, positions 0, 1, ...
    logits = lm_head(RMS(x; shared_head.norm))        # layer's own shared_head.head if stored, else lm_head

h_main is the main model's final hidden state after model.norm at position t. Row i of
the MTP stream is at rotary position i (the position of h_main), counted over every call,
so calling ``step`` repeatedly extends one causal sequence (its own latent + indexer cache).
The decoder layer is transformers' ``GlmMoeDsaDecoderLayer`` (the same MLA + indexer + MoE
math as the main layers) with the MTP weights loaded into it; the norms are
``GlmMoeDsaRMSNorm`` with ``rms_norm_eps``.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from safetensors.torch import load_file

from transformers.cache_utils import DynamicCache
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaRMSNorm,
    GlmMoeDsaRotaryEmbedding,
)

from glm_fixtures import fuse_experts, hf_config_from_dir, mtp_config


def _load_all(path) -> dict:
    path = os.fspath(path)
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


class MtpReference:
    """``MtpReference(ckpt_dir)`` or ``MtpReference(ckpt_dir, tensors={name: array})`` (e.g.
    dequantized weights); ``step(next_token_ids, h_main) -> logits [n, vocab]``."""

    def __init__(self, path, tensors: dict | None = None):
        cfg = hf_config_from_dir(path)
        self.L = L = cfg.num_hidden_layers
        if not getattr(cfg, "num_nextn_predict_layers", 0):
            raise ValueError(f"{path}: config has no num_nextn_predict_layers")
        raw = _load_all(path) if tensors is None else {k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}
        t = {k: v.float() for k, v in raw.items()}
        p = f"model.layers.{L}."
        self.cfg = mcfg = mtp_config(cfg)
        eps = cfg.rms_norm_eps
        H = cfg.hidden_size

        self.embed = t.get(p + "embed_tokens.weight", t["model.embed_tokens.weight"])
        self.head = t.get(p + "shared_head.head.weight", t["lm_head.weight"])
        self.eh_proj = t[p + "eh_proj.weight"]
        if tuple(self.eh_proj.shape) != (H, 2 * H):
            raise ValueError(f"eh_proj must be [{H}, {2 * H}], found {list(self.eh_proj.shape)}")
        self.enorm, self.hnorm, self.fnorm = (GlmMoeDsaRMSNorm(H, eps) for _ in range(3))
        with torch.no_grad():
            self.enorm.weight.copy_(t[p + "enorm.weight"])
            self.hnorm.weight.copy_(t[p + "hnorm.weight"])
            self.fnorm.weight.copy_(t[p + "shared_head.norm.weight"])

        self.layer = GlmMoeDsaDecoderLayer(mcfg, L).eval()
        layer_state = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
        for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "embed_tokens.weight", "shared_head.head.weight"):
            layer_state.pop(k, None)
        missing, unexpected = self.layer.load_state_dict(fuse_experts(layer_state), strict=False)
        if missing or unexpected:
            raise KeyError(f"MTP layer: missing {missing}, unexpected {unexpected}")
        self.rotary = GlmMoeDsaRotaryEmbedding(mcfg)
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.cfg)
        self.length = 0

    @torch.no_grad()
    def step(self, next_token_ids, h_main) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(next_token_ids, dtype=np.int64))
        h = torch.as_tensor(np.asarray(h_main, dtype=np.float32))
        n = ids.shape[0]
        if h.shape != (n, self.embed.shape[1]):
            raise ValueError(f"h_main must be [{n}, {self.embed.shape[1]}], found {list(h.shape)}")
        e = self.embed[ids]
        u = torch.nn.functional.linear(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1), self.eh_proj)[None]
        pos = torch.arange(self.length, self.length + n)[None]
        cos_sin = self.rotary(u, pos)
        total = self.length + n
        # additive causal mask [1, 1, n, total] as transformers builds it for eager attention
        allowed = torch.arange(total)[None, :] <= pos[0][:, None]
        mask = torch.zeros(n, total).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        x, _ = self.layer(u, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True,
                          position_embeddings=cos_sin, prev_topk_indices=None)
        self.length = total
        return torch.nn.functional.linear(self.fnorm(x[0]), self.head).numpy()
