"""Step 3: train the target's MTP layer (layer index L = num_hidden_layers) as a
next-next-token head on the frozen target, and add its tensors to the target checkpoint.

DeepSeek-V3 / GLM-5.x form (what our runtime implements, see tests/mtp_ref.py):
    e = embed(x[t+1]); u = eh_proj([RMS(e; enorm); RMS(h[t]; hnorm)])   (embedding first)
    y = DecoderLayer(u)   (MLA + DSA indexer (full) + MoE, causal, rotary positions 0, 1, ...)
    logits = lm_head(RMS(y; shared_head.norm)), trained to predict x[t+2]
h[t] = the frozen target's final hidden state after model.norm; embed and lm_head are the
target's (frozen, not stored again). The decoder layer starts as a copy of the target's last
layer; eh_proj starts as [I | I]. AdamW lr 1e-3, batch 8 x 256, seed 0. The frozen target is
the saved BF16 checkpoint (run in fp32), i.e. exactly the weights the runtime serves.
"""
from __future__ import annotations

import argparse
import os
import re
import time

import numpy as np
import torch

from dflash2_rt.train import common

MTP_KEYS = ("enorm", "hnorm", "eh_proj", "shared_norm")


class MtpHead(torch.nn.Module):
    def __init__(self, cfg, last_layer_state: dict):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm,
                                                                         GlmMoeDsaRotaryEmbedding)
        H = cfg.hidden_size
        self.L = cfg.num_hidden_layers
        self.mcfg = common.mtp_layer_config(cfg)
        self.layer = GlmMoeDsaDecoderLayer(self.mcfg, self.L)
        own = self.layer.state_dict()
        init = {k: v for k, v in last_layer_state.items() if k in own and v.shape == own[k].shape}
        self.layer.load_state_dict(init, strict=False)  # the indexer (absent on a shared layer) keeps its init
        self.enorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.shared_norm = GlmMoeDsaRMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():
            self.eh_proj.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], 1))
        self.rotary = GlmMoeDsaRotaryEmbedding(self.mcfg)

    def forward(self, next_ids, h_main, embed, lm_head):
        B, S = next_ids.shape
        u = self.eh_proj(torch.cat([self.enorm(embed[next_ids]), self.hnorm(h_main)], -1))
        pos = torch.arange(S)[None].expand(B, S)
        cos_sin = self.rotary(u, pos)
        allowed = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
        mask = torch.zeros(S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None].expand(B, 1, S, S)
        y, _ = self.layer(u, attention_mask=mask, position_ids=pos, cache=None, use_cache=False,
                          position_embeddings=cos_sin, prev_topk_indices=None)
        return torch.nn.functional.linear(self.shared_norm(y), lm_head)

    def checkpoint_tensors(self) -> dict:
        p = f"model.layers.{self.L}."
        out = {p + k: v.detach() for k, v in common.to_checkpoint_names(self.layer.state_dict()).items()}
        out[p + "enorm.weight"] = self.enorm.weight.detach()
        out[p + "hnorm.weight"] = self.hnorm.weight.detach()
        out[p + "eh_proj.weight"] = self.eh_proj.weight.detach()
        out[p + "shared_head.norm.weight"] = self.shared_norm.weight.detach()
        return out


def load_target(tdir: str):
    from transformers import GlmMoeDsaForCausalLM
    common.quiet_transformers()
    m = GlmMoeDsaForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="eager")
    for p in m.parameters():
        p.requires_grad_(False)
    return m.eval()


def train(work: str, out: str, steps: int = 300, batch: int = 8, seq: int = 256, lr: float = 1e-3, seed: int = 0,
          time_limit: float = 900.0) -> dict:
    common.set_threads()
    tdir = os.path.join(out, "target")
    target = load_target(tdir)
    cfg = target.config
    cfg._attn_implementation = "eager"
    L = cfg.num_hidden_layers
    torch.manual_seed(seed)
    last = {k[len(f"model.layers.{L - 1}."):]: v for k, v in target.state_dict().items()
            if k.startswith(f"model.layers.{L - 1}.")}
    head = MtpHead(cfg, last)
    for n, p in head.named_parameters():
        p.requires_grad_(not n.startswith("layer.self_attn.indexer"))  # the indexer is no_grad in HF
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    ids = np.load(os.path.join(work, "train_ids.npy"))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    ck = os.path.join(work, "mtp_ckpt.pt")
    step, elapsed, log = 0, 0.0, []
    if os.path.exists(ck):
        s = torch.load(ck, weights_only=False)
        head.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        step, elapsed, log = s["step"], s["elapsed"], s["log"]
    t0 = time.time() - elapsed
    while step < steps:
        x = common.batch_windows(ids, np.random.default_rng([seed, 7, step]), batch, seq + 1)
        with torch.no_grad():
            h = target.model(x[:, :seq]).last_hidden_state  # after model.norm
        for g in opt.param_groups:
            g["lr"] = common.lr_at(step, steps, lr, 20)
        logits = head(x[:, 1:seq], h[:, :seq - 1], embed, lm_head)  # row t: h[t], embed(x[t+1]) -> x[t+2]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:seq + 1].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        log.append(loss.item())
        if step % 10 == 0:
            print(f"mtp step {step}/{steps} loss {np.mean(log[-10:]):.3f} {time.time() - t0:.0f}s", flush=True)
        if step % 25 == 0 or step == steps or time.time() - t0 > time_limit:
            common.atomic_save({"model": head.state_dict(), "opt": opt.state_dict(), "step": step,
                                "elapsed": time.time() - t0, "log": log}, ck)
        if time.time() - t0 > time_limit:
            break
    write(tdir, head.checkpoint_tensors())
    stats = {"steps": step, "train_seconds": time.time() - t0, "final_loss": float(np.mean(log[-25:]))}
    common.save_json(os.path.join(work, "mtp_stats.json"), stats)
    return stats


def write(tdir: str, extra: dict) -> None:
    """Adds the MTP tensors (BF16) to the target's model.safetensors."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(tdir, "model.safetensors")
    prefix = re.match(r"^(model\.layers\.\d+\.)", next(iter(extra))).group(1)
    tensors = {k: v for k, v in load_file(f).items() if not k.startswith(prefix)}  # replace an earlier MTP layer
    for k, v in extra.items():
        tensors[k] = common.to_bf16(k, v.float())
    save_file(dict(sorted(tensors.items())), f + ".tmp", metadata={"format": "pt"})
    os.replace(f + ".tmp", f)  # a new file: a runtime that has the old one mapped keeps reading it


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args(argv)
    print(train(a.work, a.out, steps=a.steps))


if __name__ == "__main__":
    main()
