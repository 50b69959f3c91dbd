"""Tiny random GLM-5.x (``glm_moe_dsa``) checkpoints built with transformers, and the HF
oracle loaded back from them.

``build_model(path, variant)`` creates a ``GlmMoeDsaForCausalLM`` from ``GlmMoeDsaConfig``
(fp32, every weight drawn from a seeded torch generator, so a variant is the same on every
run), saves it with ``save_pretrained`` (optionally BF16, optionally sharded) and, where the
variant asks for it, post-processes the checkpoint the way real GLM-5.x checkpoints differ
from what transformers writes:

* ``mtp``: transformers does not build the MTP layer; its tensors
  ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}`` plus a full decoder layer
  (MLA + indexer + MoE, per-expert names) are drawn here and added to the checkpoint.
* ``strip_config``: config keys removed from config.json so that the runtime must derive
  them (``indexer_types`` from ``index_topk_freq`` / ``index_skip_topk_offset`` or
  ``index_topk_pattern``; ``mlp_layer_types`` from ``first_k_dense_replace``).
* ``extra_indexers``: indexer tensors also on "shared" layers (some exports have them; the
  runtime must ignore them).

What ``save_pretrained`` writes (transformers 5.24): routed experts as per-expert 2-D
tensors ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (the in-memory
fused ``experts.gate_up_proj`` [E, 2I, H] is split back on save, gate rows first), the
router as ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``, the indexer as
``self_attn.indexer.{wq_b,wk,weights_proj}.weight`` + ``self_attn.indexer.k_norm.{weight,bias}``
(only on "full" layers). :func:`split_experts` / :func:`fuse_experts` convert between the
two layouts for state dicts built here.
"""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Optional

import numpy as np
import torch

import transformers
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

transformers.logging.set_verbosity_error()
try:  # loading bars of from_pretrained / save_pretrained
    transformers.utils.logging.disable_progress_bar()
except AttributeError:  # pragma: no cover
    pass

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
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
    max_position_embeddings=1024,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    initializer_range=0.05,
)

# name -> (config overrides, build options)
VARIANTS = {
    # 4 layers (1 dense + 3 MoE), every layer "full", with an MTP layer (layer 4).
    "tiny": ({}, dict(mtp=True)),
    # IndexShare as an explicit per-layer list.
    "indexshare_list": ({"indexer_types": ["full", "shared", "full", "shared"]}, {}),
    # IndexShare derived from index_topk_freq / index_skip_topk_offset (indexer_types not in
    # config.json): layers 0, 1, 3 full, 2 and 4 shared; mlp_layer_types derived too.
    "indexshare_freq": ({"num_hidden_layers": 5, "index_topk_freq": 2, "index_skip_topk_offset": 2},
                        dict(strip_config=("indexer_types", "mlp_layer_types", "layer_types"))),
    # IndexShare from an "F"/"S" pattern string, with (ignored) indexer tensors on shared layers.
    "indexshare_pattern": ({"index_topk_pattern": "FSSF"},
                           dict(strip_config=("indexer_types",), extra_indexers=True)),
    # group-limited routing: 8 experts in 2 groups, only the best group is eligible.
    "ngroup": ({"n_group": 2, "topk_group": 1}, {}),
    # BF16 storage (router bias kept F32 as in the real checkpoints).
    "bf16": ({}, dict(dtype="bf16")),
    # several shards + model.safetensors.index.json.
    "sharded": ({}, dict(max_shard_size="100KB")),
}


# ---------------------------------------------------------------------------- configs


def make_config(**overrides) -> GlmMoeDsaConfig:
    d = copy.deepcopy(TINY_CONFIG)
    d.update(overrides)
    cfg = GlmMoeDsaConfig(**d)
    cfg._attn_implementation = "eager"
    return cfg


def mtp_config(cfg: GlmMoeDsaConfig) -> GlmMoeDsaConfig:
    """A config in which layer index L = num_hidden_layers exists as a full (indexer) MoE
    layer, for instantiating the MTP decoder layer with transformers' module."""
    L = cfg.num_hidden_layers
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    d["num_hidden_layers"] = L + 1
    d["mlp_layer_types"] = list(cfg.mlp_layer_types[:L]) + ["sparse"]
    d["indexer_types"] = list(cfg.indexer_types[:L]) + ["full"]
    # the same attention type as the config's layers: transformers names it by version
    # ('indexed_attention' in 5.25; 'deepseek_sparse_attention' in 5.17, which rejects the other)
    d["layer_types"] = list(cfg.layer_types[:L]) + [cfg.layer_types[L - 1] if L else "indexed_attention"]
    out = GlmMoeDsaConfig.from_dict(d)
    out._attn_implementation = "eager"
    return out


def load_config_dict(path) -> dict:
    with open(os.path.join(os.fspath(path), "config.json"), encoding="utf-8") as f:
        return json.load(f)


def hf_config_from_dir(path) -> GlmMoeDsaConfig:
    """The HF config of a checkpoint directory, ignoring any quantization_config."""
    d = load_config_dict(path)
    d.pop("quantization_config", None)
    cfg = GlmMoeDsaConfig.from_dict(d)
    cfg._attn_implementation = "eager"
    return cfg


# ---------------------------------------------------------------------------- weights


def randomize_(module: torch.nn.Module, seed: int, std: float) -> None:
    """Deterministic random weights for every parameter and float buffer of ``module``:
    matrices ~ N(0, std); norm weights ~ 1 + 0.1 N(0,1); biases (indexer k_norm) ~ 0.1 N;
    router e_score_correction_bias ~ 0.02 N (same order as the sigmoid score spread, so the
    bias changes which experts are selected)."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters())
    tensors.update({n: b for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                v = 0.02 * r
            elif t.dim() >= 2:
                v = std * r
            elif name.endswith(".bias"):
                v = 0.1 * r
            else:  # norm weights
                v = 1.0 + 0.1 * r
            t.copy_(v.to(t.dtype))


_FUSED_RE = re.compile(r"^((?:.*\.)?mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^((?:.*\.)?mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def split_experts(state: dict) -> dict:
    """In-memory HF layout -> checkpoint layout: ``experts.gate_up_proj`` [E, 2I, H] ->
    ``experts.{e}.gate_proj.weight`` = rows [:I], ``up_proj.weight`` = rows [I:];
    ``experts.down_proj`` [E, H, I] -> ``experts.{e}.down_proj.weight``."""
    out = {}
    for name, t in state.items():
        m = _FUSED_RE.match(name)
        if not m:
            out[name] = t
            continue
        base, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def fuse_experts(state: dict) -> dict:
    """Checkpoint layout -> in-memory HF layout (inverse of split_experts)."""
    out, experts = {}, {}
    for name, t in state.items():
        m = _EXPERT_RE.match(name)
        if m:
            base, e, kind = m.group(1), int(m.group(2)), m.group(3)
            experts.setdefault(base, {}).setdefault(e, {})[kind] = t
        else:
            out[name] = t
    for base, per in experts.items():
        n = max(per) + 1
        missing = [e for e in range(n) if set(per.get(e, {})) != {"gate", "up", "down"}]
        if missing:
            raise KeyError(f"{base}: incomplete experts {missing}")
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]], 0) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([per[e]["down"] for e in range(n)])
    return out


def _to_torch(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))


# ---------------------------------------------------------------------------- building


def _mtp_tensors(cfg: GlmMoeDsaConfig, seed: int, own_head: bool) -> dict:
    """Random tensors of the MTP layer (index L = num_hidden_layers), checkpoint names."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    L, H = cfg.num_hidden_layers, cfg.hidden_size
    mcfg = mtp_config(cfg)
    layer = GlmMoeDsaDecoderLayer(mcfg, L)
    randomize_(layer, seed + 1000, cfg.initializer_range)
    state = split_experts({k: v.detach().clone() for k, v in layer.state_dict().items()})
    g = torch.Generator().manual_seed(seed + 2000)
    p = f"model.layers.{L}."
    out = {p + k: v for k, v in state.items()}
    out[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    out[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    out[p + "eh_proj.weight"] = cfg.initializer_range * torch.randn(H, 2 * H, generator=g)
    out[p + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    if own_head:  # distinct values, so a runtime that ignores them is caught
        out[p + "embed_tokens.weight"] = cfg.initializer_range * torch.randn(cfg.vocab_size, H, generator=g)
        out[p + "shared_head.head.weight"] = cfg.initializer_range * torch.randn(cfg.vocab_size, H, generator=g)
    return out


def _extra_indexer_tensors(cfg: GlmMoeDsaConfig, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 3000)
    out = {}
    D, Hn = cfg.index_head_dim, cfg.index_n_heads
    for i, kind in enumerate(cfg.indexer_types[: cfg.num_hidden_layers]):
        if kind != "shared":
            continue
        p = f"model.layers.{i}.self_attn.indexer."
        out[p + "wq_b.weight"] = torch.randn(Hn * D, cfg.q_lora_rank, generator=g)
        out[p + "wk.weight"] = torch.randn(D, cfg.hidden_size, generator=g)
        out[p + "k_norm.weight"] = torch.randn(D, generator=g)
        out[p + "k_norm.bias"] = torch.randn(D, generator=g)
        out[p + "weights_proj.weight"] = torch.randn(Hn, cfg.hidden_size, generator=g)
    return out


def add_tensors(path, extra: dict, dtype: Optional[torch.dtype] = None) -> None:
    """Adds ``extra`` ({name: tensor}) to the checkpoint at ``path``: into model.safetensors,
    or into the last shard (updating model.safetensors.index.json)."""
    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        target = sorted(set(index["weight_map"].values()))[-1]
    else:
        index, target = None, "model.safetensors"
    fpath = os.path.join(path, target)
    tensors = load_file(fpath)
    for name, t in extra.items():
        t = _to_torch(t)
        if dtype is not None and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(dtype)
        tensors[name] = t.contiguous()
        if index is not None:
            index["weight_map"][name] = target
    save_file(tensors, fpath, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        with open(index_path, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


# A two-layer slice (dense + MoE) with GLM-5.3's attention dimensions (64 heads, q_lora 2048,
# kv_lora 512, rope 64, nope 192, v 256, indexer 32 x 128, index_topk 2048), small vocabulary
# and experts (config overrides of the "tiny" variant): tests/test_cuda_engine.py and
# bench/bench_concurrency.py --models slice.
REAL_DIMS = dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=64, num_key_value_heads=64,
                 q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
                 index_n_heads=32, index_head_dim=128, index_topk=2048, vocab_size=512, intermediate_size=512,
                 moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=4,
                 max_position_embeddings=4096, initializer_range=0.02)


def build_model(path, variant: str = "tiny", seed: int = 0, **opts) -> str:
    """Writes the checkpoint of ``variant`` (see VARIANTS; ``opts`` override its build
    options: dtype 'f32'|'bf16', max_shard_size, mtp, mtp_own_head, strip_config,
    extra_indexers, config=dict of extra config overrides) to ``path``; returns the path."""
    overrides, options = VARIANTS[variant]
    options = dict(options)
    options.update(opts)
    overrides = dict(overrides)
    overrides.update(options.pop("config", {}) or {})
    dtype = options.pop("dtype", "f32")
    max_shard_size = options.pop("max_shard_size", None)
    mtp = options.pop("mtp", False)
    mtp_own_head = options.pop("mtp_own_head", False)
    strip = tuple(options.pop("strip_config", ()))
    extra_indexers = options.pop("extra_indexers", False)
    if options:
        raise TypeError(f"build_model: unknown options {sorted(options)}")

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if mtp:
        overrides.setdefault("num_nextn_predict_layers", 1)
    cfg = make_config(**overrides)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    randomize_(model, seed, cfg.initializer_range)
    tdtype = None
    if dtype == "bf16":
        tdtype = torch.bfloat16
        model = model.to(torch.bfloat16)
        for mod in model.modules():  # the real checkpoints keep the router bias in F32
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
    elif dtype != "f32":
        raise ValueError(f"dtype must be 'f32' or 'bf16', found {dtype!r}")
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)

    extra = {}
    if mtp:
        extra.update(_mtp_tensors(cfg, seed, mtp_own_head))
    if extra_indexers:
        extra.update(_extra_indexer_tensors(cfg, seed))
    if extra:
        add_tensors(path, extra, tdtype)
    if strip:
        d = load_config_dict(path)
        for k in strip:
            d.pop(k, None)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(d, f, indent=2)
    return path


# ---------------------------------------------------------------------------- the oracle


def load_hf(path) -> GlmMoeDsaForCausalLM:
    """The transformers model of a (non-quantized) checkpoint, in fp32, eager attention."""
    m = GlmMoeDsaForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def hf_from_tensors(config_dir, tensors: dict) -> GlmMoeDsaForCausalLM:
    """A fp32 transformers model with the config of ``config_dir`` and the weights
    ``tensors`` ({checkpoint name: array}, e.g. from dequantize_checkpoint); MTP-layer
    tensors are ignored. Raises KeyError on missing or unexpected weights."""
    cfg = hf_config_from_dir(config_dir)
    L = cfg.num_hidden_layers
    keep = {}
    for name, v in tensors.items():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= L:
            continue
        keep[name] = _to_torch(np.asarray(v, np.float32)).float()
    model = GlmMoeDsaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(fuse_experts(keep), strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise KeyError(f"hf_from_tensors: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def hf_logits(model, ids) -> np.ndarray:
    """float32 [n, vocab] logits of one teacher-forced sequence."""
    return model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()


@torch.no_grad()
def hf_hidden_states(model, ids) -> list:
    """HF ``output_hidden_states``: [embeddings, after layer 0, ..., after layer L-1];
    NB the last entry is after model.norm (transformers replaces it with last_hidden_state)."""
    out = model(torch.tensor([list(ids)], dtype=torch.long), output_hidden_states=True)
    return [h[0].float().numpy() for h in out.hidden_states]


@torch.no_grad()
def hf_final_hidden(model, ids) -> np.ndarray:
    """The main model's final hidden state after model.norm, [n, hidden] (h_main for MTP)."""
    return model.model(torch.tensor([list(ids)], dtype=torch.long)).last_hidden_state[0].float().numpy()


@torch.no_grad()
def hf_greedy(model, prompt, max_new_tokens: int) -> tuple[list, list]:
    """transformers generate(do_sample=False) with stopping disabled: (tokens, per-step
    top1 - top2 logit margins)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         attention_mask=torch.ones_like(ids))
    toks = out.sequences[0, ids.shape[1]:].tolist()
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return toks, margins


def prompt(seed: int, n: int, vocab: int = TINY_CONFIG["vocab_size"]) -> list:
    """A deterministic random prompt of ``n`` token ids."""
    return np.random.default_rng(1000 + seed).integers(0, vocab, n).tolist()
