"""Step 2: train the default glm_moe_dsa target (transformers' GlmMoeDsaForCausalLM, fp32) on
the stdlib corpus and save it BF16 with save_pretrained (+ tokenizer.json, generation_config).

Next-token cross-entropy on random 256-token windows, AdamW (peak lr 2e-3, warmup 50, cosine
to 10%), batch 8, seed 0, a fixed number of steps. The DSA indexer runs under no_grad in
transformers, so its (random, seeded) weights stay as initialised. Progress is checkpointed
to WORK/target_ckpt.pt every 25 steps; a restarted run resumes from it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np
import torch

from dflash2_rt.train import common


def build(eos: int, seed: int = 0):
    from transformers import GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(common.make_config(eos))
    return model


@torch.no_grad()
def eval_loss(model, ids: np.ndarray, seq: int = 256, n: int = 16) -> float:
    model.eval()
    rng = np.random.default_rng(1234)
    x = common.batch_windows(ids, rng, n, seq)
    losses = []
    for i in range(0, n, 4):
        b = x[i:i + 4]
        logits = model(b[:, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


def train(work: str, out: str, steps: int = 400, batch: int = 8, seq: int = 256, lr: float = 2e-3,
          seed: int = 0, time_limit: float = 1400.0) -> dict:
    common.set_threads()
    common.quiet_transformers()
    info = common.load_json(os.path.join(work, "corpus.json"))
    ids = np.load(os.path.join(work, "train_ids.npy"))
    ev = np.load(os.path.join(work, "eval_ids.npy"))
    model = build(info["eos_token_id"], seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    ck = os.path.join(work, "target_ckpt.pt")
    step, elapsed, log = 0, 0.0, []
    if os.path.exists(ck):
        s = torch.load(ck, weights_only=False)
        own = model.state_dict()
        keep = {k: v for k, v in s["model"].items() if k in own and v.shape == own[k].shape}
        if len(keep) != len(own):  # e.g. a checkpoint made with another indexer size: those keep their init
            print("resume: re-initialised", sorted(set(own) - set(keep)), flush=True)
        model.load_state_dict(keep, strict=False)
        opt.load_state_dict(s["opt"])
        step, elapsed, log = s["step"], s["elapsed"], s["log"]
        print(f"resumed at step {step}", flush=True)
    model.train()
    t0 = time.time() - elapsed
    while step < steps:
        rng = np.random.default_rng([seed, step])  # the batch depends only on the step: resumable
        x = common.batch_windows(ids, rng, batch, seq)
        for g in opt.param_groups:
            g["lr"] = common.lr_at(step, steps, lr, 50)
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        log.append(loss.item())
        if step % 10 == 0:
            print(f"step {step}/{steps} loss {np.mean(log[-10:]):.3f} {time.time() - t0:.0f}s", flush=True)
        if step % 25 == 0 or step == steps:
            common.atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                "elapsed": time.time() - t0, "log": log}, ck)
        if time.time() - t0 > time_limit:
            print(f"time limit reached at step {step}", flush=True)
            common.atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                "elapsed": time.time() - t0, "log": log}, ck)
            break
    el = eval_loss(model, ev)
    print(f"held-out loss {el:.3f}", flush=True)
    save(model, out, work)
    stats = {"steps": step, "train_seconds": time.time() - t0, "final_train_loss": float(np.mean(log[-25:])),
             "heldout_loss": el, "params": sum(p.numel() for p in model.parameters())}
    common.save_json(os.path.join(work, "target_stats.json"), stats)
    return stats


def save(model, out: str, work: str) -> None:
    tdir = os.path.join(out, "target")
    os.makedirs(tdir, exist_ok=True)
    m = model.to(torch.bfloat16)
    for mod in m.modules():  # the router bias stays F32 (as in GLM-5.x checkpoints)
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
    m.save_pretrained(tdir)
    model.float()
    tok = os.path.join(tdir, "tokenizer.json")
    if not os.path.exists(tok):
        shutil.copy(os.path.join(work, "tokenizer.json"), tok)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--time-limit", type=float, default=1400.0)
    a = ap.parse_args(argv)
    print(train(a.work, a.out, steps=a.steps, time_limit=a.time_limit))


if __name__ == "__main__":
    main()
