"""Plain numpy/torch reference implementations used by the op harness (float64)."""
import math

import numpy as np
import torch

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def fp8_e4m3_to_f64(u8: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(u8, dtype=np.uint8)).view(torch.float8_e4m3fn)
    return t.to(torch.float64).numpy()


def f32_to_fp8_e4m3(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def bf16_round(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)


def dequant_fp8_block128(w_u8, scale):
    n, k = w_u8.shape
    s = np.repeat(np.repeat(scale.astype(np.float64), 128, 0), 128, 1)[:n, :k]
    return fp8_e4m3_to_f64(w_u8) * s


def dequant_nvfp4(packed, scale_u8, global_scale):
    n, kh = packed.shape
    lo, hi = packed & 15, packed >> 4
    codes = np.empty((n, 2 * kh), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = lo, hi
    s = np.repeat(fp8_e4m3_to_f64(scale_u8), 16, 1)
    return E2M1[codes] * s * np.float64(np.float32(global_scale))


def quantize_fp8_block128(w: np.ndarray):
    """Own simple quantizer: per 128x128 block amax/448."""
    n, k = w.shape
    sn, sk = -(-n // 128), -(-k // 128)
    scale = np.zeros((sn, sk), np.float32)
    q = np.zeros((n, k), np.uint8)
    for i in range(sn):
        for j in range(sk):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = f32_to_fp8_e4m3(blk / s)
    return q, scale


def fp8_quantize_act(x: np.ndarray):
    """linear_fp8's activation side (ops.h fp8_quantize_act), written independently: per row
    and block of 128 inputs, sa = float32(amax) / 448 (one fp32 division), codes =
    e4m3(float32(x / sa)) (torch's round-to-nearest-even conversion). Returns (codes as
    float64 [M, K], sa float32 [M, ceil(K / 128)]); amax = 0 gives sa = 0 and codes 0."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    nb = -(-k // 128)
    sa = np.zeros((m, nb), np.float32)
    codes = np.zeros((m, k), np.float64)
    for b in range(nb):
        blk = x[:, b * 128:(b + 1) * 128]
        s = (np.abs(blk).max(1) / np.float32(448)).astype(np.float32)
        sa[:, b] = s
        safe = np.where(s == 0, np.float32(1), s).astype(np.float32)
        q = fp8_e4m3_to_f64(f32_to_fp8_e4m3((blk / safe[:, None]).astype(np.float32)))
        codes[:, b * 128:(b + 1) * 128] = np.where(s[:, None] == 0, 0.0, q)
    return codes, sa


def linear_fp8(x: np.ndarray, w_u8: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """float64 [M, N]: sum over 128-input blocks of (x codes . w codes) * float32(sa * sw)."""
    codes, sa = fp8_quantize_act(x)
    wq = fp8_e4m3_to_f64(w_u8)
    n, k = wq.shape
    out = np.zeros((x.shape[0], n), np.float64)
    sw = np.repeat(np.asarray(w_scale, np.float32), 128, 0)[:n]  # [N, nb]
    for b in range(sa.shape[1]):
        p = codes[:, b * 128:(b + 1) * 128] @ wq[:, b * 128:(b + 1) * 128].T
        s = (sa[:, b][:, None] * sw[:, b][None, :]).astype(np.float32)
        out += p * s.astype(np.float64)
    return out


def quantize_nvfp4(w: np.ndarray):
    n, k = w.shape
    g = max(float(np.abs(w).max()) / (6 * 448), 1e-12)
    blocks = w.reshape(n, k // 16, 16)
    bs = np.abs(blocks).max(-1) / 6.0 / g
    scale_u8 = f32_to_fp8_e4m3(np.maximum(bs, 2.0 ** -9))
    s = fp8_e4m3_to_f64(scale_u8) * g
    vals = blocks / s[..., None]
    mags = np.abs(E2M1[:8])
    code = np.abs(np.abs(vals)[..., None] - mags).argmin(-1).astype(np.uint8)
    code |= (vals < 0).astype(np.uint8) << 3
    code = code.reshape(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale_u8, np.float32(g)


def rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return w.astype(np.float64) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def layer_norm(x, w, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w.astype(np.float64)
    return y + b.astype(np.float64) if b is not None else y


def rope(x, pos, theta, style):
    """x [T, H, D] -> rotated copy; angles computed in float32 as transformers does.

    inv_freq is the float32 value of 1 / theta^(2i/D) with the exponent formed in float32
    (an exactly rounded division) and the power taken in float64 (scalar math.pow, no numpy
    SIMD), then rounded to float32:
    the correctly rounded powf result, which glibc's powf (the runtime's std::pow) gives
    for these exponents. numpy's own float32 power is not used: its SIMD paths differ by
    host (AVX-512 builds use another implementation), and a 1-ulp change of inv_freq moves
    the float32 angle pos * inv_freq by up to pos * 2^-24 rad (NMSE ~1e-9 at pos ~ 5000).
    """
    t, h, d = x.shape
    half = d // 2
    expo = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)  # float32, as transformers
    base = float(np.float32(theta))
    power = np.array([math.pow(base, float(e)) for e in expo], np.float64).astype(np.float32)  # scalar libm pow
    inv = (np.float32(1.0) / power).astype(np.float32)  # float32 division (exactly rounded)
    ang = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)  # [T, half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x = x.astype(np.float64)
    out = x.copy()
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * c - b * s, b * c + a * s
    return out


def silu_mul(g, u):
    g = g.astype(np.float64)
    return g / (1 + np.exp(-g)) * u


def softmax(x, scale):
    z = x.astype(np.float64) * scale
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(-1, keepdims=True)


def topk(x, k):
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, -1), idx


# ----------------------------------------------------------------------------- new ops
# Written from the semantics documented in cpp/include/dflash2/ops.h, in float64, one
# token / row at a time with plain loops where that keeps them obviously right. Ops with a
# discrete decision (a top-k, an argmax, a sampled draw) also return the smallest margin
# of that decision, so a test can check that its random data is well-posed (an fp32 op
# and a float64 reference cannot be asked to agree on a near-tie that is not exact).


def f64(x):
    if isinstance(x, torch.Tensor):
        return x.double().numpy()
    return np.asarray(x, np.float64)


def add(a, b):
    return f64(a) + f64(b)


def argmax_first(x):
    """The documented rule: best = 0, then best = i whenever x[i] > x[best] (NaN compares
    false, so a NaN never wins unless it is at 0, and then nothing beats it)."""
    x = np.asarray(x)
    out = np.zeros(x.shape[0], np.int32)
    for r in range(x.shape[0]):
        best = 0
        for i in range(1, x.shape[1]):
            if x[r, i] > x[r, best]:
                best = i
        out[r] = best
    return out


def token_logprobs(x, ids):
    """(lp, lse) in float64: log-softmax of each row at ids, and the rows' log-sum-exp."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    return x[np.arange(x.shape[0]), np.asarray(ids)] - lse, lse


def apply_penalties(logits, row0, draft, draft_row, draft_len, seq, params, state, bias):
    """ops.apply_penalties in float32, one numpy operation per F32 rounding of the op (its
    results are exact functions of the inputs, so backends must match this bitwise)."""
    x = np.array(logits, np.float32, copy=True)
    f32 = np.float32
    for s in range(len(row0)):
        t, min_left = int(seq[s][0]), int(seq[s][1])
        if t < 0:
            continue
        pres, freq, rep = (f32(v) for v in params[s])
        st = np.asarray(state[t], np.int64)
        cnt0 = st & ((1 << 29) - 1)
        stop, prompt = (st >> 29) & 1, (st >> 30) & 1
        for j in range(int(draft_len[s]) + 1):
            c = cnt0.copy()
            for i in range(j):
                c[int(draft[int(draft_row[s])][i])] += 1
            y = (x[int(row0[s]) + j] + np.asarray(bias[t], np.float32)).astype(np.float32)
            m = ((c > 0) | (prompt == 1)) & (rep != f32(1))
            y[m] = np.where(y[m] > 0, y[m] / rep, y[m] * rep).astype(np.float32)
            h = c > 0
            y[h] = (y[h] - (freq * c[h].astype(np.float32)).astype(np.float32)).astype(np.float32)
            y[h] = (y[h] - pres).astype(np.float32)
            if j < min_left:
                y[stop == 1] = -np.finfo(np.float32).max
            x[int(row0[s]) + j] = y
    return x


def check_finite(x):
    return (~np.isfinite(np.asarray(x))).any(axis=1).astype(np.int32)


def paged_slot(block_table, s, p, bs):
    """Cache row of position p of sequence s: bt[s][p // bs] * bs + p % bs."""
    return int(block_table[s, p // bs]) * bs + p % bs


def paged_rows(cache, block_table, s, n, bs):
    """The first n logical rows (positions 0..n-1) of sequence s, gathered from the pages."""
    return np.stack([f64(cache[paged_slot(block_table, s, p, bs)]) for p in range(n)]) if n else \
        np.zeros((0, cache.shape[1]))


def cache_write(cache, src, slots):
    out = np.array(cache, copy=True)
    for t, sl in enumerate(slots):
        if sl >= 0:
            out[sl] = src[t]
    return out


def linear_heads(x, w):
    """y[t, g, :] = x[t, g, :] @ w[g]^T."""
    return np.einsum("tgk,gnk->tgn", f64(x), f64(w))


def _topk_margin(score, chosen, rest, robust_tie):
    """How far a top-k decision is from flipping: the gap between the worst chosen and the
    best rejected score. An exact tie across the boundary counts as well-posed (inf) only
    if robust_tie(i, j) says the op computes it as an exact tie too, else as 0."""
    if len(rest) == 0:
        return np.inf
    worst = min(chosen, key=lambda j: (score[j], -j))
    best_rej = max(rest, key=lambda j: (score[j], -j))
    gap = score[worst] - score[best_rej]
    if gap == 0:
        tied = [j for j in list(chosen) + list(rest) if score[j] == score[worst]]
        return np.inf if all(robust_tie(tied[0], j) for j in tied[1:]) else 0.0
    return gap


def indexer_scores(q, w, keys):
    """score(j) = sum_h (w[h] / sqrt(nI)) * relu(q[h] . k_j / sqrt(dI)) for q [nI, dI],
    w [nI], keys [n, dI]; also returns the per-head dot products [nI, n]."""
    nI, dI = q.shape
    d = f64(q) @ f64(keys).T / math.sqrt(dI)
    return (f64(w) / math.sqrt(nI)) @ np.maximum(d, 0.0), d


def indexer_topk(q, w, key_cache, seq, pos, block_table, bs, topk, zero_eps=1e-4):
    """Returns (sel rows: a list with None where sel_len is -1, sel_len, margin)."""
    sels, lens, margin = [], [], np.inf
    for t in range(q.shape[0]):
        p = int(pos[t])
        if p + 1 <= topk:
            sels.append(None)
            lens.append(-1)
            continue
        keys = paged_rows(key_cache, block_table, int(seq[t]), p + 1, bs)
        score, d = indexer_scores(q[t], w[t], keys)
        order = sorted(range(p + 1), key=lambda j: (-score[j], j))  # ties: the earlier key
        chosen, rest = order[:topk], order[topk:]
        sels.append(np.array(sorted(chosen), np.int32))
        lens.append(topk)

        def robust_tie(i, j):
            # identical key rows give bitwise identical scores in any precision; so do two
            # keys whose every head is clearly negative (score exactly 0 after the relu)
            same = np.array_equal(keys[i], keys[j])
            zero = (d[:, i] < -zero_eps).all() and (d[:, j] < -zero_eps).all()
            return same or zero

        margin = min(margin, _topk_margin(score, chosen, rest, robust_tie) / max(np.abs(score).max(), 1e-30))
    return sels, np.array(lens, np.int32), margin


def _softmax_rows(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def mla_attention(q_lat, q_pe, cache, seq, pos, block_table, bs, sel, sel_len, scale):
    """out[t, h] = sum_j softmax(s)_j c_j over K_t = sel[t, :sel_len[t]] (or 0..pos[t] when
    sel_len is None or sel_len[t] < 0); s_j = (q_lat . c_j + q_pe . k_pe_j) * scale."""
    T, nh, kvl = q_lat.shape
    out = np.zeros((T, nh, kvl))
    for t in range(T):
        p, s = int(pos[t]), int(seq[t])
        if sel_len is None or sel_len[t] < 0:
            keys = list(range(p + 1))
        else:
            keys = [int(j) for j in sel[t, :sel_len[t]]]
        rows = np.stack([f64(cache[paged_slot(block_table, s, j, bs)]) for j in keys])
        c, kpe = rows[:, :kvl], rows[:, kvl:]
        for h in range(nh):
            sc = (c @ f64(q_lat[t, h]) + kpe @ f64(q_pe[t, h])) * scale
            out[t, h] = _softmax_rows(sc) @ c
    return out


def block_attention(q, k, v, kv_cache, ctx_len, block_table, block, window, causal, scale, cbs):
    """Query (s, i) (position ctx_len[s] + i) attends to the context keys j < ctx_len[s] of
    sequence s with j > ctx_len[s] + i - window (all when window == 0) and to the block's
    keys k[s*B + j] for j < B (j <= i if causal); kv_cache rows are [k (kvh, hd) | v (kvh, hd)]."""
    T, nh, hd = q.shape
    kvh = k.shape[1]
    grp = nh // kvh
    out = np.zeros((T, nh, hd))
    for s in range(T // block):
        L = int(ctx_len[s])
        ctx = paged_rows(kv_cache, block_table, s, L, cbs).reshape(L, 2, kvh, hd)
        for i in range(block):
            r = s * block + i
            cj = [j for j in range(L) if window == 0 or j > L + i - window]
            bj = [j for j in range(block) if not causal or j <= i]
            for h in range(nh):
                kh = h // grp
                keys = np.concatenate([ctx[cj, 0, kh], f64(k[[s * block + j for j in bj], kh])])
                vals = np.concatenate([ctx[cj, 1, kh], f64(v[[s * block + j for j in bj], kh])])
                out[r, h] = _softmax_rows(keys @ f64(q[r, h]) * scale) @ vals
    return out


def moe_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """Returns (ids, weights, margin). s = sigmoid(logits), choice = s + bias; with groups,
    keep the topk_group groups with the best sums of their two best choices (a group of
    one expert: its choice); the top_k eligible experts (ties to the lower id), ascending;
    weights = s (/ their sum if norm_topk_prob) * scaling."""
    T, E = logits.shape
    per = E // n_group
    ids = np.zeros((T, top_k), np.int32)
    wts = np.zeros((T, top_k))
    margin = np.inf
    for t in range(T):
        s = 1.0 / (1.0 + np.exp(-f64(logits[t])))
        choice = s + f64(bias)
        eligible = list(range(E))
        if n_group > 1:
            gsum = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
            gorder = sorted(range(n_group), key=lambda g: (-gsum[g], g))
            kept = sorted(gorder[:topk_group])
            if topk_group < n_group:  # the group order on ties is not documented: no ties
                margin = min(margin, gsum[gorder[topk_group - 1]] - gsum[gorder[topk_group]])
            eligible = [e for g in kept for e in range(g * per, (g + 1) * per)]
        order = sorted(eligible, key=lambda e: (-choice[e], e))
        chosen, rest = order[:top_k], order[top_k:]
        same = lambda i, j: logits[t, i] == logits[t, j] and bias[i] == bias[j]  # noqa: E731
        margin = min(margin, _topk_margin(choice, chosen, rest, same))
        chosen = sorted(chosen)
        ids[t] = chosen
        w = s[chosen]
        if norm_topk_prob:
            w = w / w.sum()
        wts[t] = w * scaling
    return ids, wts, margin


def gated_expert(x, g, u, d):
    """down(silu(x g^T) * (x u^T)) for x [H] and dense float64 g, u [F, H], d [H, F]."""
    return d @ silu_mul(g @ x, u @ x)


def moe_experts(x, ids, weights, experts):
    """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]); experts: (g, u, d) float64."""
    x = f64(x)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += float(weights[t, j]) * gated_expert(x[t], *experts[int(ids[t, j])])
    return out


def dyn_conv(x, base, dyn, block):
    """out[r, c] = (base[0, c] + dyn[r, c // gs]) x[r, c] + (base[1, c] + dyn[r, G + c // gs]) x[r-1, c],
    the second term only when r is not the first row of its block."""
    x, base, dyn = f64(x), f64(base), f64(dyn)
    R, H = x.shape
    G = dyn.shape[1] // 2
    gs = H // G
    grp = np.arange(H) // gs
    out = np.zeros_like(x)
    for r in range(R):
        out[r] = (base[0] + dyn[r, grp]) * x[r]
        if r % block:
            out[r] += (base[1] + dyn[r, G + grp]) * x[r - 1]
    return out


def philox4x32_10(ctr, key):
    """Philox4x32-10 of a 4-word counter and a 2-word key (Salmon et al. 2011), in plain
    Python integers: an independent reference for the ops' random numbers."""
    M0, M1, W0, W1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c0, c1, c2, c3 = (int(v) & mask for v in ctr)
    k0, k1 = (int(v) & mask for v in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & mask, (k1 + W1) & mask
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
    return c0, c1, c2, c3


def philox_uniform(key, counter):
    """The ops' draw: a double in [0, 1) from the top 53 bits of words 1:0 of
    philox(counter = (lo, hi, 0, 0), key = (lo, hi))."""
    key, counter = int(key) & (2 ** 64 - 1), int(counter) & (2 ** 64 - 1)
    r = philox4x32_10((counter & 0xFFFFFFFF, counter >> 32, 0, 0), (key & 0xFFFFFFFF, key >> 32))
    return float(((r[1] << 32) | r[0]) >> 11) * 2.0 ** -53


def selector_walk(vals, cand, g, pred_book, succ_book, anchors, temperature, uniforms):
    """Returns (tokens, q or None, margin). Per sequence s, prev = anchors[s]; at step t
    a = pred_book[prev] * g[s, t], score_b = vals[s, t, b] + a . succ_book[cand[s, t, b]];
    greedy: the first best score; sampled: q = softmax(score / temperature) and the first b
    with u < q_0 + ... + q_b (u = uniforms[s, t], a float64)."""
    vals, g, pb, sb = f64(vals), f64(g), f64(pred_book), f64(succ_book)
    S, P, K = vals.shape
    tokens = np.zeros((S, P), np.int32)
    q = np.zeros((S, P, K)) if temperature > 0 else None
    margin = np.inf
    for s in range(S):
        prev = int(anchors[s])
        for t in range(P):
            a = pb[prev] * g[s, t]
            score = vals[s, t] + sb[cand[s, t]] @ a
            if temperature <= 0:
                b = int(np.argmax(score))  # numpy: the first maximum
                others = [j for j in range(K) if score[j] != score[b]]
                if others:
                    margin = min(margin, score[b] - max(score[others]))
                # an exact tie is well-posed only if the op computes it exactly too: the same
                # value and the same successor-codebook row (e.g. duplicated rows)
                for j in range(K):
                    if j != b and score[j] == score[b] and (
                            vals[s, t, j] != vals[s, t, b] or not np.array_equal(sb[cand[s, t, j]], sb[cand[s, t, b]])):
                        margin = 0.0
            else:
                qq = _softmax_rows(score / temperature)
                q[s, t] = qq
                u = float(uniforms[s, t])
                cum = np.cumsum(qq)
                b = int(np.searchsorted(cum, u, side="right"))  # first b with u < cum[b]
                b = min(b, K - 1)
                margin = min(margin, float(np.abs(cum - u).min()))
            prev = int(cand[s, t, b])
            tokens[s, t] = prev
    return tokens, q, margin
