"""An independent torch reference of the DFlash 2 / DFlash 1 drafter, of ``propose`` and of
greedy speculative decoding, written from /work/shared/reference/dflash2-drafter.md.

The target is transformers' ``GlmMoeDsaForCausalLM`` in fp32 (the oracle the runtime's
target is tested against); the drafter runs here in float64 from the checkpoint's tensors.

    tgt = TargetRef(target_dir)
    drf = DraftRef(draft_dir, tgt)
    p = drf.propose(prompt_ids)     # .anchor, .tokens [B-1], .candidates [B-1][k], .logits, ...

Also the pieces on their own, for unit tests: ``rms_norm``, ``rope_neox``, ``conv2``
(the two-tap dynamic convolution), ``attention_mask``, ``selector_walk`` (greedy),
``selector_q`` (the sampled walk's proposal distribution for a fixed predecessor),
``selector_walk_sample`` and ``accept_block`` (lossless rejection sampling).

Interpretations of the notes (where they leave room):
* taps: HF ``hidden_states[id + 1]`` for every id; for id = T - 1 transformers returns the
  state *after* the final norm (it ties the last entry to last_hidden_state). The fixtures
  never use the last layer; ``TargetRef.taps`` raises for it unless ``allow_last=True``.
* The selector's unary U is the raw logit (softmax-shift invariance makes log-softmax the
  same for greedy and for q); top-k ties are broken by the lower token id.
* A sliding-window layer applies ``i - window < j`` to every key (context and block).
* Causality: ``dflash_config.causal`` if present, else top-level ``is_causal``, else
  non-causal, for every layer (``causal_for_layer``).
* The context rows are k_proj/v_proj of ctx directly (no input_layernorm), as the notes say.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence

import numpy as np
import torch

DT = torch.float64


# ---------------------------------------------------------------------------- config


@dataclasses.dataclass
class DraftConfig:
    v2: bool
    hidden_size: int
    intermediate_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list
    layer_types: list
    sliding_window: Optional[int]
    causal: bool
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    num_target_layers: Optional[int]


def spec_default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def causal_for_layer(cfg: dict, layer: int) -> bool:
    """The causality rule of the notes (one function): dflash_config.causal, else top-level
    is_causal, else non-causal. (Same for every layer.)"""
    dc = cfg.get("dflash_config") or {}
    if "causal" in dc:
        return bool(dc["causal"])
    if "is_causal" in cfg:
        return bool(cfg["is_causal"])
    return False


def parse_draft_config(cfg: dict, num_target_layers: Optional[int] = None) -> DraftConfig:
    """config.json dict -> DraftConfig with the defaults of the notes."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"not a DFlash drafter: architectures {cfg.get('architectures')}")
    v2 = arch == "DFlash2DraftModel"
    dc = cfg.get("dflash_config") or {}

    def pick(key, default=None):
        if key in dc:
            return dc[key]
        return cfg.get(key, default)

    H = int(cfg["hidden_size"])
    L = int(cfg["num_hidden_layers"])
    T = cfg.get("num_target_layers", num_target_layers)
    taps = pick("target_layer_ids")
    if taps is None:
        if T is None:
            raise ValueError("target_layer_ids missing and num_target_layers unknown")
        taps = spec_default_target_layer_ids(int(T), L)
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    layer_types = cfg.get("layer_types") or ["full_attention"] * L
    sw = cfg.get("sliding_window")
    return DraftConfig(
        v2=v2, hidden_size=H, intermediate_size=int(cfg["intermediate_size"]), num_layers=L,
        heads=int(cfg["num_attention_heads"]), kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
        head_dim=int(cfg.get("head_dim", 128)), vocab_size=int(cfg["vocab_size"]),
        eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        block_size=int(pick("block_size")), mask_token_id=int(pick("mask_token_id")),
        target_layer_ids=[int(i) for i in taps], layer_types=list(layer_types),
        sliding_window=None if sw is None else int(sw), causal=causal_for_layer(cfg, 0),
        conv_kernel_size=int(dc.get("conv_kernel_size", 2)), conv_group_size=int(dc.get("conv_group_size", 16)),
        selector_rank=int(dc.get("selector_rank", 256)), selector_top_k=int(dc.get("selector_top_k", 16)),
        num_target_layers=None if T is None else int(T),
    )


# ---------------------------------------------------------------------------- math pieces


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(DT)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(DT)


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D]; NeoX half-split pairs (i, i + D/2) rotated by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    inv = theta ** (-torch.arange(0, half, dtype=DT) * 2.0 / D)
    ang = positions.to(DT)[:, None] * inv[None, :]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The GLM target's layout (pairs (2i, 2i+1)); only for tests showing it differs."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D // 2, dtype=DT) * 2.0 / D)
    ang = positions.to(DT)[:, None] * inv[None, :]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def conv2(x: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group_size: int) -> torch.Tensor:
    """The two-tap dynamic depthwise convolution over one block.
    x [B, H]; base [2 taps, H]; dyn [B, 2 taps, G]. out[t, c] = sum_o (base[o, c] +
    dyn[t, o, c // group]) * x[t - o, c], with x[-1] = 0 (position 0 reads nothing before)."""
    B, H = x.shape
    coef = base.to(DT)[None, :, :] + dyn.to(DT).repeat_interleave(group_size, dim=-1)  # [B, 2, H]
    prev = torch.cat([torch.zeros(1, H, dtype=DT), x[:-1].to(DT)], 0)
    return coef[:, 0] * x.to(DT) + coef[:, 1] * prev


def conv_prepare(y: torch.Tensor, proj: torch.Tensor, base_kernel: torch.Tensor, group_size: int):
    """(conv(y, base[0], dyn side 0), dyn side 1); dyn = kernel_projection(y) viewed as
    [tokens, 2 sides, 2 taps, groups]."""
    B, H = y.shape
    G = H // group_size
    dyn = (y.to(DT) @ proj.to(DT).T).view(B, 2, 2, G)
    return conv2(y, base_kernel[0], dyn[:, 0], group_size), dyn[:, 1]


def conv_finish(z: torch.Tensor, dyn1: torch.Tensor, base_kernel: torch.Tensor, group_size: int):
    return conv2(z, base_kernel[1], dyn1, group_size)


def attention_mask(n_ctx: int, start: int, B: int, causal: bool, window: Optional[int]) -> torch.Tensor:
    """bool [B, n_ctx + B]: query at absolute position start + i may read key j (context
    keys at positions 0..n_ctx-1, block keys at start..start+B-1)."""
    qpos = torch.arange(start, start + B)[:, None]
    kpos = torch.cat([torch.arange(n_ctx), torch.arange(start, start + B)])[None, :]
    m = torch.ones(B, n_ctx + B, dtype=torch.bool)
    if causal:
        m &= kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m


def topk_desc(x: torch.Tensor, k: int):
    """(values, ids) of the k largest, descending; ties -> lower id first (deterministic)."""
    x = x.to(DT)
    ids = torch.arange(x.shape[-1])
    order = np.lexsort((ids.numpy(), -x.numpy()))[:k]
    idx = torch.from_numpy(order.astype(np.int64))
    return x[idx], idx


def selector_scores(U: torch.Tensor, cand: torch.Tensor, g: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    pred: int) -> torch.Tensor:
    """score(b) = U(b) + <A[pred] * g, B[cand(b)]> for one position. U, cand [k]; g [rank]."""
    return U.to(DT) + (A[int(pred)].to(DT) * g.to(DT)) @ B[cand].to(DT).T


def selector_walk(U: torch.Tensor, cand: torch.Tensor, g: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  anchor: int):
    """Greedy walk. U, cand [P, k] (P drafted positions); g [P, rank]. Returns (tokens [P],
    chosen index per position, score rows [P, k])."""
    pred = int(anchor)
    toks, idx, rows = [], [], []
    for t in range(U.shape[0]):
        s = selector_scores(U[t], cand[t], g[t], A, B, pred)
        b = int(torch.argmax(s))
        pred = int(cand[t, b])
        toks.append(pred)
        idx.append(b)
        rows.append(s)
    return toks, idx, torch.stack(rows) if rows else torch.zeros(0, U.shape[-1], dtype=DT)


def selector_q(U_t, cand_t, g_t, A, B, pred: int, temperature: float) -> torch.Tensor:
    """The sampled walk's proposal q_t over the k candidates for a fixed predecessor:
    softmax(score / T) (a one-hot argmax at T = 0)."""
    s = selector_scores(U_t, cand_t, g_t, A, B, pred)
    if temperature <= 0:
        q = torch.zeros_like(s)
        q[int(torch.argmax(s))] = 1.0
        return q
    return torch.softmax(s / float(temperature), dim=-1)


def selector_walk_sample(U, cand, g, A, B, anchor: int, temperature: float, rng: np.random.Generator):
    """Sampled walk: (tokens [P], q rows [P, k] as float64 numpy)."""
    pred = int(anchor)
    toks, qs = [], []
    for t in range(U.shape[0]):
        q = selector_q(U[t], cand[t], g[t], A, B, pred, temperature).numpy()
        b = int(rng.choice(len(q), p=q / q.sum()))
        pred = int(cand[t, b])
        toks.append(pred)
        qs.append(q)
    return toks, np.array(qs)


def accept_block(p_rows, draft_tokens, q_rows, cand_rows, rng: np.random.Generator):
    """Lossless acceptance of one block (the notes' rule). p_rows [B, V]: the target's
    (already temperature/top-p/top-k processed) distributions at the block's B positions;
    draft_tokens [B-1]; q_rows [B-1, k] and cand_rows [B-1, k] the proposal (q_rows=None:
    a one-hot proposal, i.e. greedy drafting). Returns (a accepted, bonus token)."""
    p_rows = np.asarray(p_rows, dtype=np.float64)
    n = len(draft_tokens)
    for i in range(n):
        p = p_rows[i]
        d = int(draft_tokens[i])
        if q_rows is None:
            qvec = np.zeros_like(p)
            qvec[d] = 1.0
        else:
            qvec = np.zeros_like(p)
            np.add.at(qvec, np.asarray(cand_rows[i], dtype=np.int64), np.asarray(q_rows[i], dtype=np.float64))
        u = rng.random()
        if u * qvec[d] < p[d]:
            continue
        resid = np.maximum(p - qvec, 0.0)
        mass = resid.sum()
        dist = resid / mass if mass > 0 else p / p.sum()
        return i, int(rng.choice(len(dist), p=dist))
    last = p_rows[n]
    return n, int(rng.choice(len(last), p=last / last.sum()))


def accept_greedy(target_argmax: Sequence[int], draft_tokens: Sequence[int]):
    """(a, bonus): the longest prefix with d_i == argmax p_{i-1}; bonus = argmax p_a."""
    a = 0
    while a < len(draft_tokens) and int(draft_tokens[a]) == int(target_argmax[a]):
        a += 1
    return a, int(target_argmax[a])


# ---------------------------------------------------------------------------- target


class TargetRef:
    """transformers' GlmMoeDsaForCausalLM in fp32: logits, tap hidden states, embed, lm_head."""

    def __init__(self, target_dir, model=None):
        import transformers
        from transformers import GlmMoeDsaForCausalLM

        transformers.logging.set_verbosity_error()
        try:
            transformers.utils.logging.disable_progress_bar()
        except AttributeError:  # pragma: no cover
            pass
        self.dir = os.fspath(target_dir)
        if model is None:
            model = GlmMoeDsaForCausalLM.from_pretrained(self.dir, dtype=torch.float32)
        self.model = model.eval()
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.vocab_size = int(self.model.config.vocab_size)
        self.hidden_size = int(self.model.config.hidden_size)
        self.embed = self.model.model.embed_tokens.weight.detach().to(DT)
        self.lm_head = self.model.lm_head.weight.detach().to(DT)

    @torch.no_grad()
    def run(self, ids: Sequence[int]):
        """(logits [n, V] fp32, hidden_states tuple: [embeddings, after layer 0, ...])."""
        out = self.model(torch.tensor([list(ids)], dtype=torch.long), output_hidden_states=True)
        return out.logits[0].float(), [h[0] for h in out.hidden_states]

    def taps(self, hidden_states, layer_ids, allow_last: bool = False) -> torch.Tensor:
        """[n, n_taps * H]: concat of hidden_states[id + 1] (output of layer id)."""
        for i in layer_ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"target layer id {i} out of range for a {self.num_layers}-layer target")
            if i == self.num_layers - 1 and not allow_last:
                raise ValueError("the last target layer's HF hidden state is after the final norm; "
                                 "pass allow_last=True to use it anyway")
        return torch.cat([hidden_states[i + 1].to(DT) for i in layer_ids], dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list:
        seq = list(prompt)
        for _ in range(max_new_tokens):
            lg = self.model(torch.tensor([seq], dtype=torch.long)).logits[0, -1]
            seq.append(int(torch.argmax(lg)))
        return seq[len(prompt):]


# ---------------------------------------------------------------------------- drafter


@dataclasses.dataclass
class Proposal:
    anchor: int
    tokens: list               # B-1 drafted tokens
    candidates: list           # [B-1][k] (DFlash 2), [] for DFlash 1
    logits: torch.Tensor       # [B-1, V] draft logits (positions 1..B-1)
    hidden: torch.Tensor       # [B, H] final normed hidden of the block
    unary: Optional[torch.Tensor] = None    # [B-1, k]
    g: Optional[torch.Tensor] = None        # [B-1, rank]
    scores: Optional[torch.Tensor] = None   # [B-1, k] walk scores along the path
    anchor_logits: Optional[torch.Tensor] = None  # [V] target logits the anchor came from


class DraftRef:
    """``use_selector=False`` drafts a DFlash 2 checkpoint with its convs but the argmax per
    position (the runtime's method 'dflash' on a DFlash 2 checkpoint, an ablation)."""

    def __init__(self, draft_dir, target: TargetRef, use_selector: bool = True):
        from safetensors.torch import load_file

        self.dir = os.fspath(draft_dir)
        with open(os.path.join(self.dir, "config.json"), encoding="utf-8") as f:
            self.raw_config = json.load(f)
        self.cfg = parse_draft_config(self.raw_config, target.num_layers)
        self.use_selector = bool(use_selector) and self.cfg.v2
        self.target = target
        t = {}
        for f in sorted(os.listdir(self.dir)):
            if f.endswith(".safetensors"):
                t.update(load_file(os.path.join(self.dir, f)))
        self.w = {k: v.to(DT) for k, v in t.items()}

    # -- pieces
    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """ctx = RMS(fc(concat taps); hidden_norm), [n, H]."""
        return rms_norm(feats.to(DT) @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.cfg.eps)

    def context_kv(self, layer: int, ctx: torch.Tensor):
        c, p = self.cfg, f"layers.{layer}.self_attn."
        n = ctx.shape[0]
        k = (ctx @ self.w[p + "k_proj.weight"].T).view(n, c.kv_heads, c.head_dim)
        k = rope_neox(rms_norm(k, self.w[p + "k_norm.weight"], c.eps), torch.arange(n), c.rope_theta)
        v = (ctx @ self.w[p + "v_proj.weight"].T).view(n, c.kv_heads, c.head_dim)
        return k, v

    def attention(self, layer: int, y: torch.Tensor, ctx_k, ctx_v, start: int) -> torch.Tensor:
        c, p = self.cfg, f"layers.{layer}.self_attn."
        B = y.shape[0]
        pos = torch.arange(start, start + B)
        q = (y @ self.w[p + "q_proj.weight"].T).view(B, c.heads, c.head_dim)
        q = rope_neox(rms_norm(q, self.w[p + "q_norm.weight"], c.eps), pos, c.rope_theta)
        k = (y @ self.w[p + "k_proj.weight"].T).view(B, c.kv_heads, c.head_dim)
        k = rope_neox(rms_norm(k, self.w[p + "k_norm.weight"], c.eps), pos, c.rope_theta)
        v = (y @ self.w[p + "v_proj.weight"].T).view(B, c.kv_heads, c.head_dim)
        K = torch.cat([ctx_k, k], 0)            # [n + B, kv, D]
        Vv = torch.cat([ctx_v, v], 0)
        sliding = c.layer_types[layer] == "sliding_attention" if layer < len(c.layer_types) else False
        window = c.sliding_window if sliding else None
        mask = attention_mask(ctx_k.shape[0], start, B, c.causal, window)
        rep = c.heads // c.kv_heads
        K = K.repeat_interleave(rep, dim=1)     # q head h reads kv head h // rep
        Vv = Vv.repeat_interleave(rep, dim=1)
        s = torch.einsum("bhd,jhd->hbj", q, K) / math.sqrt(c.head_dim)
        s = s.masked_fill(~mask[None], -float("inf"))
        a = torch.softmax(s, dim=-1)
        o = torch.einsum("hbj,jhd->bhd", a, Vv).reshape(B, c.heads * c.head_dim)
        return o @ self.w[p + "o_proj.weight"].T

    def mlp(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}.mlp."
        gt = y @ self.w[p + "gate_proj.weight"].T
        up = y @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gt) * up) @ self.w[p + "down_proj.weight"].T

    def block_forward(self, ctx: torch.Tensor, anchor: int, start: int) -> torch.Tensor:
        """Final normed hidden [B, H] of the block [anchor, MASK x (B-1)] at positions
        start..start+B-1 given context rows ctx [n, H] (positions 0..n-1)."""
        c = self.cfg
        B = c.block_size
        toks = torch.tensor([int(anchor)] + [c.mask_token_id] * (B - 1))
        x = self.target.embed[toks].clone()
        gs = c.conv_group_size
        for i in range(c.num_layers):
            p = f"layers.{i}."
            ck, cv = self.context_kv(i, ctx)
            r = x
            y = rms_norm(x, self.w[p + "input_layernorm.weight"], c.eps)
            if c.v2:
                y, d_att = conv_prepare(y, self.w[p + "attention_conv.kernel_projection.weight"],
                                        self.w[p + "attention_conv.base_kernel"], gs)
            y = self.attention(i, y, ck, cv, start)
            if c.v2:
                y = conv_finish(y, d_att, self.w[p + "attention_conv.base_kernel"], gs)
            x = r + y
            r = x
            y = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.eps)
            if c.v2:
                y, d_mlp = conv_prepare(y, self.w[p + "mlp_conv.kernel_projection.weight"],
                                        self.w[p + "mlp_conv.base_kernel"], gs)
            y = self.mlp(i, y)
            if c.v2:
                y = conv_finish(y, d_mlp, self.w[p + "mlp_conv.base_kernel"], gs)
            x = r + y
        return rms_norm(x, self.w["norm.weight"], c.eps)

    def draft(self, ctx: torch.Tensor, anchor: int, start: int) -> Proposal:
        """Greedy draft block: logits of positions 1..B-1 and the walk (DFlash 2) or the
        per-position argmax (DFlash 1)."""
        c = self.cfg
        h = self.block_forward(ctx, anchor, start)
        logits = h[1:] @ self.target.lm_head.T
        if not self.use_selector:
            toks = [int(topk_desc(row, 1)[1][0]) for row in logits]
            return Proposal(anchor=int(anchor), tokens=toks, candidates=[], logits=logits, hidden=h)
        k = c.selector_top_k
        U, cand = zip(*[topk_desc(row, k) for row in logits])
        U, cand = torch.stack(U), torch.stack(cand)
        g = h[1:] @ self.w["candidate_selector.hidden_projection.weight"].T
        A = self.w["candidate_selector.predecessor_codebook"]
        Bc = self.w["candidate_selector.successor_codebook"]
        toks, _, scores = selector_walk(U, cand, g, A, Bc, anchor)
        return Proposal(anchor=int(anchor), tokens=toks, candidates=cand.tolist(), logits=logits, hidden=h,
                        unary=U, g=g, scores=scores)

    def selector_parts(self, prop: Proposal):
        """(U, cand, g, A, B) of a DFlash 2 proposal, for selector_q / selector_walk_sample."""
        return (prop.unary, torch.tensor(prop.candidates), prop.g, self.w["candidate_selector.predecessor_codebook"],
                self.w["candidate_selector.successor_codebook"])

    def propose(self, token_ids: Sequence[int]) -> Proposal:
        """The engine's ``propose`` debugging call: prefill the target on token_ids (n tokens),
        anchor = argmax of the last logits, context = taps of all n tokens, block at
        positions n..n+B-1."""
        ids = list(token_ids)
        if not ids:
            raise ValueError("empty token list")
        logits, hs = self.target.run(ids)
        anchor = int(torch.argmax(logits[-1]))
        ctx = self.context(self.target.taps(hs, self.cfg.target_layer_ids))
        p = self.draft(ctx, anchor, len(ids))
        p.anchor_logits = logits[-1]
        return p

    # -- whole decode loop (greedy), slow but simple
    @torch.no_grad()
    def speculative_greedy(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids=()):
        """Greedy speculative decoding as in the notes, with the HF target re-run on the full
        sequence every step (no caches). Returns (tokens, accepted per verify step)."""
        seq = list(prompt)
        logits, hs = self.target.run(seq)
        out = [int(torch.argmax(logits[-1]))]
        accepted = []
        stops = set(int(s) for s in stop_token_ids)
        feats = self.target.taps(hs, self.cfg.target_layer_ids)      # rows for seq (= context)
        while len(out) < max_new_tokens and out[-1] not in stops:
            anchor = out[-1]
            start = len(seq) + len(out) - 1
            ctx = self.context(feats)
            prop = self.draft(ctx, anchor, start)
            run_ids = seq + out + prop.tokens
            lg, hs = self.target.run(run_ids)
            am = torch.argmax(lg[start:], dim=-1).tolist()   # p_0..p_{B-1}
            a, bonus = accept_greedy(am, prop.tokens)
            accepted.append(a)
            new = prop.tokens[:a] + [bonus]
            feats = self.target.taps(hs, self.cfg.target_layer_ids)[: start + a + 1]
            out.extend(new)
        out = out[:max_new_tokens]
        for i, t in enumerate(out):
            if t in stops:
                out = out[: i + 1]
                break
        return out, accepted
