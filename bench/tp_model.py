"""Tensor-parallel communication model: per step and per layer, the collectives the engine
issues at TP 2 / 4 for batch 1 / 8 / 32 (AR decode and DFlash 2 verify of 8-token blocks),
their sizes, the estimated NVLink time on GB300 and H200, and the step's compute time
(memory roofline) beside it; and how evenly the two ways of splitting the routed experts
load the ranks (every expert sliced vs whole experts per rank). The counts are the engine's
own: ``--check`` runs the bundled default pair at TP 2 on the CPU and compares
Engine.tp_collectives() with the formula.

    python bench/tp_model.py [--context 4096] [--check] [--json bench/results/tp_model.json]

What the engine issues (cpp/src/model/glm_model.cpp), per target forward of T tokens:
  1 all-reduce of the embedding rows [T, H] (vocabulary-parallel table)
  2 all-reduces per decoder layer [T, H]: after o_proj (heads split) and after the MLP
    block (dense / shared-expert intermediate split, routed experts split by expert:
    routed and shared partial sums are added before the one all-reduce)
  1 all-gather of the logits [R, V] (vocabulary-parallel LM head; R = rows sampled: B for
    AR, B x 8 for a DFlash 2 verify); a step whose requests are all greedy gathers each
    rank's (max, id) pairs [N, R, 2] instead ("argmax gather" below). The times below
    count the logits gather (a sampled step: the worst case).
The DFlash drafter is split across the ranks like the target (heads, MLP intermediate):
1 + 2 x its layers all-reduces of [8 B, H] per draft, and one broadcast of rank 0's context
features [rows, H] per append ("draft forward" below: its time split, and on rank 0 alone,
where it stays whole when its heads do not divide). A decode step runs as one unit of every
rank (one CUDA graph per rank), so rank 0's drafted ids reach the others by a broadcast
inside it ([max_batch_size + 1, 7] I32) besides the append's features ([8 B, H] F32):
"draft bcast" below (outside such steps -- MTP, propose -- the ids are event-ordered peer
copies instead).
The DFlash drafter's LM head over the block runs on the target's vocabulary shards (each
rank its V / N rows, then one all-gather of every rank's top 16 (value, id) per row):
printed as "draft head" -- per rank, the gather, and what the full head on rank 0 alone
would take. The MTP layer (method "mtp") adds 2 all-reduces + 1 all-gather per draft.

Time of one collective on N ranks (ring/NVLS bus model of nccl-tests doc/PERFORMANCE.md):
  all-reduce  t = alpha + 2 (N - 1) / N * S / B
  all-gather  t = alpha + (N - 1) / N * S / B      (S: the gathered output's bytes)
  broadcast   t = alpha + S / B                    (nccl-tests: bus bandwidth = algorithm bandwidth)
B is the application-level bandwidth per direction and alpha the small-message latency:
  H200 (NVLink 4): 900 GB/s is both directions at wire speed; NCCL reaches about 370 GB/s
    per direction (NCCL maintainer, github.com/NVIDIA/nccl/issues/1442); HBM3e 4.8 TB/s
    (NVIDIA H200 datasheet).
  GB300 (NVLink 5): 1.8 TB/s total, 900 GB/s per direction (verda.com/blog/
    gb300-nvl72-architecture; NVIDIA GB300 NVL72 page); HBM3e 8 TB/s (same sources).
    Application-level B assumed at the same 82 % of wire speed as Hopper: 740 GB/s.
  alpha: about 6 us for a small all-reduce on 2 H100s over NVLink SHARP with CUDA graphs
    (github.com/NVIDIA/nccl/issues/1259); used for every size and both machines (it grows
    with the rank count and without graphs: an optimistic floor, to be measured).
  Measured elsewhere at TP 4 (small messages): NCCL 8.5-9.2 us on H100 (sglang #2904) and
    24-29 us on GB300 (vllm #37756): "NCCL (cited)" below uses 8.5 / 24 us.
The engine's collectives over peer memory (cpp/src/backend/cuda/p2p_allreduce.h: up to
8 MiB per rank; all-reduces one-shot to 512 KiB, two-shot past it), "peer" below:
  one-shot all-reduce  t = a + (N - 1) S / B        (each rank reads every other rank's S)
  two-shot all-reduce  t = 2 a + 2 (N - 1) / N S / B (two waits)
  all-gather           t = a + (N - 1) / N S / B
  broadcast            t = a + S / B
  a: custom one-shot all-reduces measured at 3.7-4.8 us on 4x H100 (sglang #2904) and 7-9 us
    on GB300 (vllm #37756): 3.7 us for H200, 7 us for GB300.
Compute (roofline lower bound): the bytes one rank reads per step / HBM bandwidth: its
weight slices (attention and dense / shared MLP BF16 as in GLM-5.3-NVFP4, routed experts
NVFP4 at 0.5625 B/param, experts touched by T tokens under uniform top-8 routing), its LM
head slice, and the replicated latent + indexer caches at the given context.

Attention arithmetic (a floor on its time, next to that memory time): per token and layer the
absorbed sparse MLA multiplies its N-th of the heads against min(context, index_topk) latent
rows, (kv_lora + rope) multiply-adds per key and head for the scores and kv_lora for the
values; the DSA indexer (replicated on every rank, IndexShare's 21 layers) index_heads x
index_head_dim per key over the whole context. At the fp32 SIMT peak (the engine's kernels
today: attention.cu scores in fp32 on the CUDA cores) and at the tensor cores' dense peak
(BF16 for MLA, FP8 for the indexer: what a tensor-core kernel could reach):
  H200: FP32 67 TFLOPS, BF16 989, FP8 1979 dense (NVIDIA H200 datasheet);
  GB300: FP32 80 TFLOPS, BF16 2500, FP8 5000 dense (verda.com/blog/gb300-nvl72-architecture).
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

GLM53 = dict(vocab_size=154880, hidden_size=6144, num_hidden_layers=78, intermediate_size=12288,
             num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
             v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048, n_routed_experts=256,
             num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3,
             full_indexer_layers=21)  # GLM-5.2/5.3 IndexShare (freq 4, offset 3): 21 of 78 layers run the indexer

# incoai/GLM-5.3-DFlash2 (shared/reference/dflash2-drafter.md): 6 Qwen3 layers with dynamic convs
DRAFT53 = dict(hidden_size=6144, intermediate_size=12288, num_layers=6, num_heads=64, num_kv_heads=8, head_dim=128,
               n_taps=6, conv_group_size=16, sliding_window=2048, block_size=8)

MACHINES = {
    "GB300": dict(link_GBps=740.0, wire_GBps=900.0, hbm_TBps=8.0, alpha_us=6.0, alpha_nccl_cited_us=24.0,
                  alpha_peer_us=7.0, fp32_TFLOPS=80.0, bf16_TFLOPS=2500.0, fp8_TFLOPS=5000.0),
    "H200": dict(link_GBps=370.0, wire_GBps=450.0, hbm_TBps=4.8, alpha_us=6.0, alpha_nccl_cited_us=8.5,
                 alpha_peer_us=3.7, fp32_TFLOPS=67.0, bf16_TFLOPS=989.0, fp8_TFLOPS=1979.0),
}
PEER_MAX_BYTES = 8 << 20  # per rank (p2p_allreduce.h default_max_bytes)
ONE_SHOT_MAX_BYTES = 512 << 10
ACT_BYTES = 2  # BF16 activations in the collectives (the CPU engine reduces F32: twice these sizes)


def collectives(c, T, R, N):
    """[(kind, where, bytes, count)] of one target forward of T tokens with R logit rows."""
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    row = T * H * ACT_BYTES
    return [("all_reduce", "embedding", row, 1),
            ("all_reduce", "o_proj (per layer)", row, L),
            ("all_reduce", "MLP / MoE (per layer)", row, L),
            ("all_gather", "logits (F32)", R * V * 4, 1)]


def coll_time_us(kind, S, N, m):
    f = {"all_reduce": 2 * (N - 1) / N, "all_gather": (N - 1) / N, "broadcast": 1.0}[kind]
    return m["alpha_us"] + f * S / (m["link_GBps"] * 1e3)  # GB/s = 1e3 bytes/us


def peer_time_us(kind, S, N, m):
    """The collective over peer memory, or NCCL's (at alpha_us) past the peer path's limit."""
    per_rank = S / N if kind == "all_gather" else S
    if per_rank > PEER_MAX_BYTES:
        return coll_time_us(kind, S, N, m)
    a, B = m["alpha_peer_us"], m["link_GBps"] * 1e3
    if kind == "all_reduce":
        return a + (N - 1) * S / B if S <= ONE_SHOT_MAX_BYTES else 2 * a + 2 * (N - 1) / N * S / B
    return a + ((N - 1) / N if kind == "all_gather" else 1.0) * S / B


def weights_bytes_per_rank(c, T, N):
    H, L = c["hidden_size"], c["num_hidden_layers"]
    nh, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    kv, vh, ql = c["kv_lora_rank"], c["v_head_dim"], c["q_lora_rank"]
    bf16 = 2
    attn_split = (ql * nh * qk + kv * nh * (c["qk_nope_head_dim"] + vh) + nh * vh * H) / N
    attn_repl = H * ql + H * (kv + c["qk_rope_head_dim"])
    indexer = ql * c["index_n_heads"] * c["index_head_dim"] + H * c["index_head_dim"] + H * c["index_n_heads"]
    per_layer_attn = (attn_split + attn_repl) * bf16
    n_dense = c["first_k_dense_replace"]
    dense = n_dense * 3 * H * c["intermediate_size"] / N * bf16
    E, k, Fm = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    touched = E * (1 - (1 - k / E) ** T)  # expected distinct experts for T tokens, uniform routing
    moe_layers = L - n_dense
    routed = moe_layers * touched / N * 3 * H * Fm * 0.5625
    shared = moe_layers * c["n_shared_experts"] * 3 * H * Fm / N * bf16
    router = moe_layers * H * E * bf16
    head = c["vocab_size"] / N * H * bf16
    return L * per_layer_attn + c["full_indexer_layers"] * indexer * bf16 + dense + routed + shared + router + head


def draft_bytes(d, B, context, N=1):
    """Bytes one DFlash 2 draft step reads on one rank with the drafter split N ways (N = 1:
    the whole drafter on rank 0, as the engine runs it): every layer's projections and
    convs (BF16; q / k / v / o and the MLP split by heads / intermediate, the convs
    replicated), fc over the step's appended context rows (8 per sequence), and the
    context K / V in the sliding window (BF16 draft cache, its kv heads split)."""
    H, I, hd = d["hidden_size"], d["intermediate_size"], d["head_dim"]
    proj = (d["num_heads"] * hd * H * 2 + 2 * d["num_kv_heads"] * hd * H + 3 * H * I) / N
    convs = 2 * 4 * (H // d["conv_group_size"]) * H
    fc = H * d["n_taps"] * H
    kv = B * min(context, d["sliding_window"]) * 2 * d["num_kv_heads"] * hd / N
    return (d["num_layers"] * (proj + convs + kv) + fc) * 2


def cache_bytes_per_rank(c, B, context):
    # latent [c 512 | k_pe 64] BF16 per token per layer, read for min(context, top-k) keys;
    # indexer keys (FP8, 128) read in full by every indexer layer's scoring
    L = c["num_hidden_layers"]
    lat = B * L * min(context, c["index_topk"]) * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    idx = B * c["full_indexer_layers"] * context * c["index_head_dim"] * 1
    return lat + idx


def attention_flops_per_rank(c, T, context, N):
    """(MLA, indexer) floating-point operations of one target forward of T tokens on one rank
    (a multiply-add = 2): the sparse absorbed MLA over its nh / N heads and min(context,
    index_topk) keys in every layer, the indexer over the whole context in its layers."""
    keys = min(context, c["index_topk"])
    kv, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    mla = 2 * T * (c["num_attention_heads"] / N) * keys * ((kv + rope) + kv) * c["num_hidden_layers"]
    idx = 2 * T * c["index_n_heads"] * c["index_head_dim"] * context * c["full_indexer_layers"]
    return mla, idx


def model(c, context):
    rows = []
    for method, per_seq in (("ar", 1), ("dflash2 verify", 8)):
        for N in (2, 4):
            for B in (1, 8, 32):
                T = B * per_seq
                R = T
                cs = collectives(c, T, R, N)
                n_ar = sum(n for k, _, _, n in cs if k == "all_reduce")
                n_ag = sum(n for k, _, _, n in cs if k == "all_gather")
                ar_bytes = cs[0][2]
                ag_bytes = cs[-1][2]
                entry = dict(method=method, tp=N, batch=B, tokens=T, all_reduces=n_ar, all_reduce_bytes=ar_bytes,
                             all_gathers=n_ag, logits_gather_bytes=ag_bytes,
                             argmax_gather_bytes=R * N * 8)
                for name, m in MACHINES.items():
                    # the DFlash drafter's LM head over the block, BF16, full vocabulary on rank 0
                    draft_head = (c["vocab_size"] * c["hidden_size"] * 2 / (m["hbm_TBps"] * 1e6)
                                  if per_seq > 1 else 0.0)
                    comm = sum(n * coll_time_us(k, S, N, m) for k, _, S, n in cs)
                    cited = dict(m, alpha_us=m["alpha_nccl_cited_us"])
                    comm_cited = sum(n * coll_time_us(k, S, N, cited) for k, _, S, n in cs)
                    comm_peer = sum(n * peer_time_us(k, S, N, m) for k, _, S, n in cs)
                    comm_bw_only = sum(n * (coll_time_us(k, S, N, m) - m["alpha_us"]) for k, _, S, n in cs)
                    weights = weights_bytes_per_rank(c, T, N)
                    cache = cache_bytes_per_rank(c, B, context)
                    compute = (weights + cache) / (m["hbm_TBps"] * 1e6)  # TB/s = 1e6 bytes/us
                    mla_f, idx_f = attention_flops_per_rank(c, T, context, N)
                    attn_simt = (mla_f + idx_f) / (m["fp32_TFLOPS"] * 1e6)  # TFLOPS = 1e6 flop/us
                    attn_tc = mla_f / (m["bf16_TFLOPS"] * 1e6) + idx_f / (m["fp8_TFLOPS"] * 1e6)
                    entry[name] = dict(comm_us=round(comm, 1), comm_latency_us=round(comm - comm_bw_only, 1),
                                       comm_bandwidth_us=round(comm_bw_only, 1), compute_us=round(compute, 1),
                                       comm_share=round(comm / (comm + compute), 3),
                                       comm_nccl_cited_us=round(comm_cited, 1), comm_peer_us=round(comm_peer, 1),
                                       comm_peer_share=round(comm_peer / (comm_peer + compute), 3),
                                       draft_head_rank0_us=round(draft_head, 1),
                                       draft_head_split_us=round(draft_head / N, 1),
                                       # the shards' top 16 (value, id) per drafted row, all-gathered
                                       draft_head_gather_us=round(coll_time_us("all_gather", N * B * 7 * 16 * 8, N, m)
                                                                  if per_seq > 1 else 0.0, 1),
                                       # the draft forward (without its LM head): on rank 0 alone (a drafter
                                       # that does not split), and split over the N ranks as the engine runs
                                       # it (2 all-reduces of [8 B, H] BF16 per layer and one for the embedding)
                                       draft_rank0_us=round(draft_bytes(DRAFT53, B, context) / (m["hbm_TBps"] * 1e6), 1)
                                       if per_seq > 1 else 0.0,
                                       draft_split_us=round(draft_bytes(DRAFT53, B, context, N) / (m["hbm_TBps"] * 1e6)
                                                            + (2 * DRAFT53["num_layers"] + 1)
                                                            * coll_time_us("all_reduce", T * c["hidden_size"] * ACT_BYTES,
                                                                           N, m), 1) if per_seq > 1 else 0.0,
                                       # rank 0's context features of the step's append (F32) and drafted ids,
                                       # broadcast in the step
                                       draft_bcast_us=round(coll_time_us("broadcast", B * 8 * c["hidden_size"] * 4, N, m)
                                                            + coll_time_us("broadcast", (B + 1) * 7 * 4, N, m)
                                                            if per_seq > 1 else 0.0, 1),
                                       per_layer_comm_us=round(2 * coll_time_us("all_reduce", ar_bytes, N, m), 2),
                                       # attention arithmetic at the fp32 SIMT peak (today's kernels) and
                                       # at the tensor cores' (BF16 MLA, FP8 indexer)
                                       attn_simt_us=round(attn_simt, 1), attn_tc_us=round(attn_tc, 1),
                                       attn_simt_over_compute=round(attn_simt / compute, 3))
                rows.append(entry)
    return rows


def expert_balance(c, trials=300, seed=0):
    """Routed-expert bytes on the slowest rank, experts split (every rank a 1/N slice of each
    touched expert: touched / N expert-equivalents on every rank) vs expert parallelism
    (rank r owns experts [r E/N, (r+1) E/N): the most-loaded rank's touched experts), for T
    tokens under uniform top-k routing (Monte Carlo; real routing is skewed, which only
    widens the gap)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    out = []
    for N in (2, 4):
        for T in (1, 8, 64, 256):
            ep, split = [], []
            for _ in range(trials):
                touched = np.unique(np.argsort(rng.random((T, E)), axis=1)[:, :k])
                ep.append(np.bincount(touched // (E // N), minlength=N).max())
                split.append(len(touched) / N)
            out.append(dict(tp=N, tokens=T, split_per_rank=round(float(np.mean(split)), 2),
                            ep_slowest_rank=round(float(np.mean(ep)), 2),
                            ep_over_split=round(float(np.mean(ep) / np.mean(split)), 3)))
    return out


def check_counts():
    """The bundled default pair at TP 2 on the CPU: collectives counted by the engine vs the
    formula (1 + 2 L all-reduces and 1 all-gather per target forward; per draft 1 all-gather,
    its LM head on the vocabulary shards, and 1 + 2 Ld all-reduces, the drafter split across
    the ranks; at least 2 broadcasts per DFlash step run as one unit)."""
    import dflash2_rt


    out = {}
    for method in ("ar", "dflash2"):
        eng = dflash2_rt.Engine(method=method, tensor_parallel=2, max_batch_size=1)
        L = eng.config["num_hidden_layers"]
        with open(os.path.join(dflash2_rt.engine.default_pair()[1], "config.json")) as f:
            Ld = json.load(f)["num_hidden_layers"] if eng.draft_ranks > 1 else 0
        H = eng.config["hidden_size"]
        prompt = list(range(2, 40))
        m0 = eng.metrics()
        before, head0 = eng.tp_collectives(), m0["draft_head_gathers"]
        (r,) = eng.generate([prompt], max_new_tokens=24, stop_token_ids=[])
        after = eng.tp_collectives()
        d = {k: after[k] - before[k] for k in after}
        units = eng.metrics()["steps_as_one_unit"] - m0["steps_as_one_unit"]
        # one logits gather per target forward, one top-k gather per draft (its head on the shards)
        drafts = eng.metrics()["draft_head_gathers"] - head0
        forwards = d["all_gather_calls"] - drafts
        bcasts = 2 * units if method == "dflash2" else 0
        formula = forwards * (1 + 2 * L) + drafts * (1 + 2 * Ld)
        ok = d["all_reduce_calls"] == formula and (d["broadcast_calls"] >= bcasts if bcasts else d["broadcast_calls"] == 0)
        steps = r.stats.get("verify_steps", len(r.token_ids))
        out[method] = dict(target_forwards=forwards, steps=steps, all_reduce_calls=d["all_reduce_calls"],
                           all_reduce_bytes=d["all_reduce_bytes"], all_gather_bytes=d["all_gather_bytes"],
                           drafts=drafts, draft_ranks=eng.draft_ranks, formula_all_reduces=formula,
                           steps_as_one_unit=units,
                           broadcast_calls=d["broadcast_calls"], formula_broadcasts=bcasts, matches=ok, hidden_size=H,
                           layers=L)
        eng.close()
    return out


def print_table(rows, cols, per_machine):
    """One line per row: method, TP, batch, then cols [(title, width, f(row))], then for each
    machine per_machine [(title, key, f(value))] (the first title prefixed by the machine)."""
    head = [f"{'method':15s} {'TP':>2s} {'B':>3s}"] + [f"{t:>{w}s}" for t, w, _ in cols]
    for m in MACHINES:
        head.append("|")
        head += [f"{(m + ' ' + t) if i == 0 else t:>{len(m) + len(t) + 1 if i == 0 else 8}s}"
                 for i, (t, _, _) in enumerate(per_machine)]
    hdr = " ".join(head)
    print(hdr)
    print("-" * len(hdr))
    for e in rows:
        line = [f"{e['method']:15s} {e['tp']:2d} {e['batch']:3d}"] + [f"{f(e):>{w}s}" for _, w, f in cols]
        for m in MACHINES:
            line.append("|")
            line += [f"{f(e[m][k]):>{len(m) + len(t) + 1 if i == 0 else 8}s}" for i, (t, k, f) in enumerate(per_machine)]
        print(" ".join(line))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="tokens of context per sequence (cache reads)")
    ap.add_argument("--check", action="store_true", help="also count the CPU engine's collectives at TP 2")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "tp_model.json"))
    args = ap.parse_args()
    c = dict(GLM53)
    rows = model(c, args.context)
    print(f"GLM-5.3, context {args.context}; activations BF16 in all-reduces, F32 logits; alpha "
          f"{MACHINES['H200']['alpha_us']} us; link GB300 {MACHINES['GB300']['link_GBps']:.0f} GB/s, "
          f"H200 {MACHINES['H200']['link_GBps']:.0f} GB/s per direction")
    us, pct = (lambda v: f"{v:.0f}us"), (lambda v: f"{v:.1%}")
    print_table(rows, [("AR/step", 7, lambda e: str(e["all_reduces"])),
                       ("AR size", 9, lambda e: f"{e['all_reduce_bytes'] / 1024:.0f}KB"),
                       ("logits AG", 10, lambda e: f"{e['logits_gather_bytes'] / 2**20:.1f}MB")],
                [("comm", "comm_us", us), ("compute", "compute_us", us), ("share", "comm_share", pct)])
    print("the same collectives with NCCL at the latencies measured at TP 4 (cited) and over peer memory "
          "(the engine's kernels, p2p_allreduce.h; cited latencies, never measured here):")
    print_table(rows, [], [("NCCL", "comm_us", us), ("cited", "comm_nccl_cited_us", us),
                           ("peer", "comm_peer_us", us), ("share", "comm_peer_share", pct)])
    print("per layer: 2 all-reduces; e.g. dflash2 B=32 TP=4: "
          + ", ".join(f"{m} {next(e for e in rows if e['method'].startswith('dflash2') and e['tp'] == 4 and e['batch'] == 32)[m]['per_layer_comm_us']} us"
                      for m in MACHINES))
    d = next(e for e in rows if e["method"].startswith("dflash2") and e["tp"] == 4)
    print("draft head (the DFlash drafter's LM head over the block, BF16, batch 1) on the vocabulary shards at TP 4: "
          + ", ".join(f"{m} {d[m]['draft_head_split_us']} us per rank + {d[m]['draft_head_gather_us']} us "
                      f"top-k gather (full vocabulary on rank 0 alone: {d[m]['draft_head_rank0_us']} us)"
                      for m in MACHINES))
    print("draft forward (the DFlash 2 drafter without its head, BF16) at TP 4, on rank 0 alone "
          "-> split over the ranks (as the engine runs it; estimates): "
          + ", ".join(f"{m} " + " / ".join(f"B={e['batch']} {e[m]['draft_rank0_us']} -> {e[m]['draft_split_us']} us "
                                            f"(step {e[m]['compute_us'] + e[m]['comm_us']:.0f} us)" for e in rows
                                            if e["method"].startswith("dflash2") and e["tp"] == 4)
                      for m in MACHINES))
    print("draft bcast (a DFlash 2 step: rank 0's context features and drafted ids, two broadcasts) at TP 4: "
          + ", ".join(f"{m} " + " / ".join(f"B={e['batch']} {e[m]['draft_bcast_us']} us" for e in rows
                                            if e["method"].startswith("dflash2") and e["tp"] == 4)
                      for m in MACHINES))
    print("attention arithmetic per step and rank (sparse MLA + the indexer), floors at the fp32 SIMT peak "
          "(attention.cu today) and at the tensor cores' (BF16 / FP8), beside the memory time above:")
    print_table(rows, [], [("mem", "compute_us", us), ("SIMT", "attn_simt_us", us), ("TC", "attn_tc_us", us),
                           ("SIMT/mem", "attn_simt_over_compute", lambda v: f"{v:.2f}x")])
    bal = expert_balance(c)
    print("routed experts read by the slowest rank (expert-equivalents), uniform top-8 routing:")
    print(f"{'TP':>3s} {'tokens':>6s} {'split':>7s} {'EP':>7s} {'EP/split':>8s}")
    for b in bal:
        print(f"{b['tp']:3d} {b['tokens']:6d} {b['split_per_rank']:7.2f} {b['ep_slowest_rank']:7.2f} "
              f"{b['ep_over_split']:8.2f}")
    result = dict(config=c, context=args.context, machines=MACHINES, act_bytes=ACT_BYTES, rows=rows,
                  expert_balance=bal)
    if args.check:
        chk = check_counts()
        result["cpu_engine_check"] = chk
        for m, v in chk.items():
            print(f"CPU engine TP=2 {m}: {v['target_forwards']} target forwards, {v['drafts']} drafts (drafter on "
                  f"{v['draft_ranks']} ranks), {v['all_reduce_calls']} all-reduces (formula {v['formula_all_reduces']}), "
                  f"{v['steps_as_one_unit']} steps as one unit, {v['broadcast_calls']} broadcasts (at least "
                  f"{v['formula_broadcasts']}): "
                  f"{'match' if v['matches'] else 'MISMATCH'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
