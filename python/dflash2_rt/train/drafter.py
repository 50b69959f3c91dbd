"""Step 5: the DFlash 2 drafter, its torch module (the same math as
cpp/src/model/dflash_drafter.cpp) and its training on target-generated continuations.

Architecture (published DFlash2 format, no embedding / lm_head: the target's are used):
1 Qwen3-style layer (hidden 256 = the target's, 4 query heads / 2 KV heads of 64, SwiGLU
768), NeoX RoPE (theta 1e4), non-causal inside the block, block size 8, two-tap dynamic
convs (groups of 16 channels) around both sublayers, a candidate selector (rank 64, top-16),
context features = the target's hidden states after layers [0, 1, 2] (HF
``hidden_states[1..3]``; the last target layer is avoided because HF's last entry is after
the final norm).

Training (recipe of ../shared/reference/dflash2-drafter.md): per step 8 target-generated
sequences x 16 random anchors inside the generated continuation; block [anchor, MASK x 7]
sees only context strictly before the anchor; loss = block cross-entropy with weight
exp(-(k-1)/4) at block position k, plus 0.5 x the selector's cross-entropy over the top-16
candidates with teacher-forced true predecessors (positions whose true token is not among
them are skipped). AdamW lr 2e-3 (warmup 50, cosine to 10%), seed 0. The target's features
are computed once (fp16 cache in WORK/feats.npy) from the saved BF16 target.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dflash2_rt.train import common

DRAFT_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
DFLASH_CONFIG = dict(block_size=8, target_layer_ids=[0, 1, 2], conv_kernel_size=2, conv_group_size=16,
                     selector_rank=64, selector_top_k=16)
GAMMA = 4.0
SELECTOR_WEIGHT = 0.5


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_neox(x, pos, theta: float):
    """x [..., T, heads, d] rotated at positions pos [..., T] (NeoX half split)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = (pos.to(torch.float64)[..., None] * inv).to(torch.float32)[..., None, :]  # [..., T, 1, d/2]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


class DynConv(nn.Module):
    """Two-tap grouped dynamic conv: conv(x, base[side], dyn[side]) with x[t-1] = 0 at block position 0."""

    def __init__(self, H: int, group: int):
        super().__init__()
        self.G, self.gs = H // group, group
        base = torch.zeros(2, 2, H)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(H, 4 * self.G, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, y):  # y [..., B, H]
        dyn = self.kernel_projection(y).unflatten(-1, (2, 2, self.G))  # [..., B, side, tap, G]
        return self.apply(y, 0, dyn), dyn

    def apply(self, x, side: int, dyn):
        k = self.base_kernel[side][None] + dyn[..., side, :, :].repeat_interleave(self.gs, -1)  # [..., B, 2, H]
        prev = F.pad(x, (0, 0, 1, 0))[..., :-1, :]  # x[t-1], zero at t = 0
        return k[..., 0, :] * x + k[..., 1, :] * prev


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, kvh, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.kvh, self.hd = nh, kvh, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, kvh * hd, bias=False)
        self.v_proj = nn.Linear(H, kvh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])


class Layer(nn.Module):
    def __init__(self, c: dict, group: int):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.self_attn = Attention(c)
        self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, I, bias=False)
        self.mlp.up_proj = nn.Linear(H, I, bias=False)
        self.mlp.down_proj = nn.Linear(I, H, bias=False)
        self.attention_conv = DynConv(H, group)
        self.mlp_conv = DynConv(H, group)


class Selector(nn.Module):
    def __init__(self, H: int, V: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(H, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.ones(V, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(V, rank))

    def scores(self, g, pred, vals, cand):
        """score(b) = U(b) + <A[pred] * g, B[cand(b)]>; g [..., R], pred [...], vals/cand [..., K]."""
        a = self.predecessor_codebook[pred] * g
        return vals + torch.einsum("...r,...kr->...k", a, self.successor_codebook[cand])


class DFlash2Draft(nn.Module):
    """The drafter. ``embed`` / ``lm_head`` are the target's (frozen buffers, not saved)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, mask_token_id: int, num_target_layers: int,
                 cfg: dict = DRAFT_CONFIG, dcfg: dict = DFLASH_CONFIG):
        super().__init__()
        self.c, self.d = dict(cfg), dict(dcfg)
        H, V = cfg["hidden_size"], embed.shape[0]
        self.V, self.B, self.mask_id, self.T = V, dcfg["block_size"], mask_token_id, num_target_layers
        self.register_buffer("embed", embed.float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.float().clone(), persistent=False)
        self.fc = nn.Linear(len(dcfg["target_layer_ids"]) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(cfg, dcfg["conv_group_size"]) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.candidate_selector = Selector(H, V, dcfg["selector_rank"])

    def init_weights(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in sorted(self.named_parameters()):
                if n.endswith("kernel_projection.weight") or n.endswith("base_kernel") or n.endswith("norm.weight"):
                    continue
                if n.endswith("predecessor_codebook"):
                    p.copy_(1.0 + 0.02 * torch.randn(p.shape, generator=g))
                elif n.endswith("successor_codebook"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
                else:
                    std = 0.02 / math.sqrt(2 * len(self.layers)) if n.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(std * torch.randn(p.shape, generator=g))

    # --------------------------------------------------------------------- forward
    def context_kv(self, feats):
        """feats [S, N, n_taps*H] -> per layer (K [S, N, kvh, hd] with k_norm + RoPE at 0..N-1, V)."""
        ctx = self.hidden_norm(self.fc(feats))
        S, N, _ = ctx.shape
        pos = torch.arange(N)[None].expand(S, N)
        out = []
        for L in self.layers:
            a = L.self_attn
            k = a.k_norm(a.k_proj(ctx).unflatten(-1, (a.kvh, a.hd)))
            out.append((rope_neox(k, pos, self.c["rope_theta"]), a.v_proj(ctx).unflatten(-1, (a.kvh, a.hd))))
        return out

    def blocks(self, kv, anchors_tok, anchor_pos, ctx_len=None):
        """Runs blocks [anchor, MASK x (B-1)]: anchors_tok / anchor_pos [S, J]; block j of sequence
        s sees context keys n < anchor_pos[s, j] (and n < ctx_len[s] if given). Returns the final
        hidden states h [S, J, B, H] (after the final norm)."""
        S, J = anchors_tok.shape
        B = self.B
        ids = torch.full((S, J, B), self.mask_id, dtype=torch.long)
        ids[:, :, 0] = anchors_tok
        pos = anchor_pos[..., None] + torch.arange(B)  # [S, J, B]
        x = self.embed[ids]
        scale = 1.0 / math.sqrt(self.c["head_dim"])
        for L, (Kc, Vc) in zip(self.layers, kv):
            a = L.self_attn
            grp = a.nh // a.kvh
            N = Kc.shape[1]
            y = L.input_layernorm(x)
            y, dyn = L.attention_conv.prepare(y)
            q = rope_neox(a.q_norm(a.q_proj(y).unflatten(-1, (a.nh, a.hd))), pos, self.c["rope_theta"])
            kb = rope_neox(a.k_norm(a.k_proj(y).unflatten(-1, (a.kvh, a.hd))), pos, self.c["rope_theta"])
            vb = a.v_proj(y).unflatten(-1, (a.kvh, a.hd))
            Kc_h, Vc_h = Kc.repeat_interleave(grp, 2), Vc.repeat_interleave(grp, 2)  # [S, N, nh, hd]
            kb_h, vb_h = kb.repeat_interleave(grp, 3), vb.repeat_interleave(grp, 3)  # [S, J, B, nh, hd]
            sc = torch.einsum("sjbhd,snhd->sjbhn", q, Kc_h) * scale
            allowed = torch.arange(N)[None, None, :] < anchor_pos[..., None]  # [S, J, N]
            if ctx_len is not None:
                allowed = allowed & (torch.arange(N)[None, None, :] < ctx_len[:, None, None])
            sc = sc.masked_fill(~allowed[:, :, None, None, :], float("-inf"))
            sb = torch.einsum("sjbhd,sjchd->sjbhc", q, kb_h) * scale
            p = torch.softmax(torch.cat([sc, sb], -1), -1)
            o = torch.einsum("sjbhn,snhd->sjbhd", p[..., :N], Vc_h) + torch.einsum("sjbhc,sjchd->sjbhd", p[..., N:], vb_h)
            o = L.attention_conv.apply(a.o_proj(o.flatten(-2)), 1, dyn)
            x = x + o
            y = L.post_attention_layernorm(x)
            y, dyn2 = L.mlp_conv.prepare(y)
            m = L.mlp.down_proj(F.silu(L.mlp.gate_proj(y)) * L.mlp.up_proj(y))
            x = x + L.mlp_conv.apply(m, 1, dyn2)
        return self.norm(x)

    def logits(self, h):
        return F.linear(h[..., 1:, :], self.lm_head)  # block positions 1..B-1

    @torch.no_grad()
    def greedy_block(self, feats, anchor: int, use_selector: bool = True):
        """The greedy draft after a context of N tokens (feats [N, n_taps*H]) with the anchor at
        position N: (tokens [B-1], candidates [B-1][K] or None)."""
        N = feats.shape[0]
        kv = self.context_kv(feats[None].float())
        h = self.blocks(kv, torch.tensor([[anchor]]), torch.tensor([[N]]))[0, 0]
        lg = self.logits(h)  # [B-1, V]
        if not use_selector:
            return lg.argmax(-1).tolist(), None
        K = self.d["selector_top_k"]
        vals, cand = torch.topk(lg, K, -1)
        g = self.candidate_selector.hidden_projection(h[1:])
        pred, toks = anchor, []
        for t in range(self.B - 1):
            s = self.candidate_selector.scores(g[t], torch.tensor(pred), vals[t], cand[t])
            pred = int(cand[t, int(torch.argmax(s))])
            toks.append(pred)
        return toks, cand.tolist()

    def loss(self, feats, tokens, anchor_pos):
        """feats [S, N, nt*H], tokens [S, N] (long), anchor_pos [S, J] with anchor_pos + B - 1 < len."""
        kv = self.context_kv(feats)
        anchors = torch.gather(tokens, 1, anchor_pos)
        h = self.blocks(kv, anchors, anchor_pos)
        lg = self.logits(h)  # [S, J, B-1, V]
        B = self.B
        lab_pos = anchor_pos[..., None] + torch.arange(1, B)
        labels = torch.gather(tokens, 1, lab_pos.flatten(1)).view_as(lab_pos)  # [S, J, B-1]
        w = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / GAMMA)
        ce = F.cross_entropy(lg.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
        block_loss = (ce * w).sum() / (w.sum() * labels.shape[0] * labels.shape[1])
        # selector: teacher-forced predecessors (anchor, then the true tokens)
        K = self.d["selector_top_k"]
        vals, cand = torch.topk(lg.detach(), K, -1)
        preds = torch.gather(tokens, 1, (lab_pos - 1).flatten(1)).view_as(lab_pos)
        g = self.candidate_selector.hidden_projection(h[..., 1:, :])
        sc = self.candidate_selector.scores(g, preds, vals, cand)
        hit = cand == labels[..., None]
        ok = hit.any(-1)
        tgt = hit.float().argmax(-1)
        sel = F.cross_entropy(sc[ok], tgt[ok]) if ok.any() else sc.sum() * 0
        with torch.no_grad():
            acc = (lg.argmax(-1) == labels).float()
            cum = torch.cumprod(acc, -1).sum(-1).mean()  # expected accepted drafts per block (argmax)
        return block_loss + SELECTOR_WEIGHT * sel, {"block": block_loss.item(), "sel": sel.item(),
                                                   "acc1": acc[..., 0].mean().item(), "tau": 1 + cum.item()}

    # --------------------------------------------------------------------- checkpoint
    def config_json(self) -> dict:
        c = self.c
        return {
            "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
            "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
            "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "vocab_size": self.V,
            "num_target_layers": self.T, "rope_theta": c["rope_theta"], "rms_norm_eps": c["rms_norm_eps"],
            "hidden_act": "silu", "max_position_embeddings": 4096, "attention_bias": False,
            "layer_types": ["full_attention"] * c["num_hidden_layers"], "use_sliding_window": False,
            "sliding_window": None, "is_causal": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "dflash_config": dict(self.d, mask_token_id=self.mask_id),
        }

    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(dict(sorted(sd.items())), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        common.save_json(os.path.join(path, "config.json"), self.config_json())

    @classmethod
    def load(cls, path: str, embed, lm_head):
        from safetensors.torch import load_file
        cj = common.load_json(os.path.join(path, "config.json"))
        dc = dict(cj["dflash_config"])
        mask = dc.pop("mask_token_id")
        cfg = {k: cj[k] for k in DRAFT_CONFIG}
        m = cls(embed, lm_head, mask, cj["num_target_layers"], cfg, dc)
        m.load_state_dict({k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()})
        return m.eval()


# ------------------------------------------------------------------------- target side
def load_target(out: str):
    from dflash2_rt.train.mtp import load_target as lt
    return lt(os.path.join(out, "target"))


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layer_ids) -> torch.Tensor:
    """[S, N, n_taps*H]: the target's hidden states after layers layer_ids (HF hidden_states[id+1])."""
    hs = target.model(tokens, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], -1)


def build(out: str, seed: int = 0):
    target = load_target(out)
    tok = common.load_json(os.path.join(out, "target", "tokenizer.json"))
    mask_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|mask|>")
    m = DFlash2Draft(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), mask_id,
                     target.config.num_hidden_layers)
    m.init_weights(seed)
    return target, m


def cache_features(work: str, target, layer_ids, batch: int = 8) -> tuple:
    d = np.load(os.path.join(work, "gen.npz"))
    toks, plen = d["tokens"], d["prompt_len"]
    n, W = toks.shape
    path = os.path.join(work, "feats.npy")
    H = target.config.hidden_size
    shape = (n, W, len(layer_ids) * H)
    if os.path.exists(path):
        f = np.load(path, mmap_mode="r")
        if f.shape == shape:
            return toks, plen, f
    f = np.lib.format.open_memmap(path + ".tmp.npy", mode="w+", dtype=np.float16, shape=shape)
    t0 = time.time()
    for i in range(0, n, batch):
        x = torch.from_numpy(np.where(toks[i:i + batch] < 0, 0, toks[i:i + batch]).astype(np.int64))
        f[i:i + batch] = target_features(target, x, layer_ids).numpy().astype(np.float16)
        if (i // batch) % 16 == 0:
            print(f"features {i + len(x)}/{n} {time.time() - t0:.0f}s", flush=True)
    f.flush()
    del f
    os.replace(path + ".tmp.npy", path)
    return toks, plen, np.load(path, mmap_mode="r")


def train(work: str, out: str, steps: int = 1800, seqs: int = 8, anchors: int = 16, lr: float = 2e-3, seed: int = 0,
          time_limit: float = 1300.0) -> dict:
    common.set_threads()
    torch.manual_seed(seed)
    target, model = build(out, seed)
    ids = model.d["target_layer_ids"]
    toks, plen, feats = cache_features(work, target, ids)
    lens = (toks >= 0).sum(1)
    del target
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ck = os.path.join(work, "draft_ckpt.pt")
    step, elapsed, log = 0, 0.0, []
    if os.path.exists(ck):
        s = torch.load(ck, weights_only=False)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        step, elapsed, log = s["step"], s["elapsed"], s["log"]
        print(f"resumed at step {step}", flush=True)
    n = toks.shape[0]
    B = model.B
    t0 = time.time() - elapsed
    while step < steps:
        rng = np.random.default_rng([seed, 5, step])
        rows = np.sort(rng.choice(n, seqs, replace=False))
        N = int(lens[rows].max())
        tk = torch.from_numpy(np.where(toks[rows, :N] < 0, 0, toks[rows, :N]).astype(np.int64))
        ft = torch.from_numpy(np.asarray(feats[rows, :N], dtype=np.float32))
        lo = np.maximum(plen[rows] - 1, 1)
        hi = lens[rows] - B  # anchor + B - 1 <= len - 1
        ap = torch.from_numpy(np.stack([rng.integers(l, h + 1, anchors) for l, h in zip(lo, hi)]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = common.lr_at(step, steps, lr, 50)
        loss, st = model.loss(ft, tk, ap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        log.append(st)
        if step % 20 == 0:
            m = {k: float(np.mean([x[k] for x in log[-20:]])) for k in st}
            print(f"draft step {step}/{steps} " + " ".join(f"{k} {v:.3f}" for k, v in m.items()) +
                  f" {time.time() - t0:.0f}s", flush=True)
        if step % 50 == 0 or step == steps or time.time() - t0 > time_limit:
            common.atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                "elapsed": time.time() - t0, "log": log}, ck)
            model.save(os.path.join(out, "draft"))
        if time.time() - t0 > time_limit:
            print(f"time limit reached at step {step}", flush=True)
            break
    model.save(os.path.join(out, "draft"))
    m = {k: float(np.mean([x[k] for x in log[-50:]])) for k in log[-1]}
    stats = {"steps": step, "train_seconds": time.time() - t0, **m,
             "params": sum(p.numel() for p in model.parameters())}
    common.save_json(os.path.join(work, "draft_stats.json"), stats)
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--time-limit", type=float, default=1300.0)
    a = ap.parse_args(argv)
    print(train(a.work, a.out, steps=a.steps, time_limit=a.time_limit))


if __name__ == "__main__":
    main()
