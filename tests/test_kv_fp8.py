"""FP8 KV caches (Engine kv_cache_dtype="fp8", cpp/src/ops/kv_fp8.h): the row format written by
cache_write / cache_write_many against an independent reference (torch's E4M3 rounding, numpy's
power-of-two scales), bytes for bytes on every backend; mla_attention and the indexer over FP8
rows bitwise the same ops over an F32 cache of the dequantized values wherever the SIMT kernels
run (the CPU; CUDA with the tensor-core switches off), and on CUDA's tensor cores the float64
reference's values to fp32 rounding (an FP8 row's values are exact BF16 ones)."""
import math

import numpy as np
import pytest
import torch

import dflash2_rt
import refs
from dflash2_rt import ops
from test_ops import (DEVICES, INDEXER_SCORE_CASES, MLA_CASES, SENTINEL, Guarded, check, make_pages, mla_args,
                      mla_inputs, mla_selection, need_device, page_lengths, rng_for, selection_is_reference,
                      step_tokens, to_dev, to_np)


# ----------------------------------------------------------------------------- the reference
def fp8_bytes(D):
    G = min(D, 128)
    return D + -(-4 * (D // G) // 16) * 16


def fp8_latent_bytes(kvl, rope):
    return -(-(fp8_bytes(kvl) + 2 * rope) // 16) * 16


def test_row_bytes_match_the_reference_layout():
    """ops.fp8_cache_row_bytes / fp8_latent_row_bytes (the engine's and the kernels' layout) are
    the reference's; sizes that cannot be grouped give 0. GLM-5.3: 656-byte latent rows
    (FlashMLA's fp8_ds_mla layout) and 144-byte index keys."""
    for D in (16, 32, 48, 64, 112, 128, 256, 384, 512, 1024):
        assert ops.fp8_cache_row_bytes(D) == fp8_bytes(D), D
        for rope in (0, 8, 16, 32, 64):
            assert ops.fp8_latent_row_bytes(D, rope) == fp8_latent_bytes(D, rope), (D, rope)
    for D in (0, 8, 24, 136, 200, 320):
        assert ops.fp8_cache_row_bytes(D) == 0 and ops.fp8_latent_row_bytes(D, 64) == 0, D
    assert ops.fp8_latent_row_bytes(512, 64) == 656 and ops.fp8_cache_row_bytes(128) == 144


def _scale_exp(amax):
    """The smallest e >= -100 with amax <= 448 * 2^e (0 for amax = 0), in exact float64."""
    e = np.zeros(amax.shape, np.int64)
    for i, a in enumerate(amax):
        if a == 0:
            continue
        k = int(math.floor(math.log2(a))) - 9
        while a > 448.0 * 2.0 ** k:
            k += 1
        while k > -100 and a <= 448.0 * 2.0 ** (k - 1):
            k -= 1
        e[i] = max(k, -100)
    return e


def fp8_ref_rows(x, tail=0):
    """x [R, D + tail] F32 -> (bytes [R, n] uint8, dequantized [R, D + tail] F32): the first D
    values in groups of min(D, 128), E4M3 codes of v / 2^e (torch's rounding) then the float32
    scales 2^e, zero-padded to 16 bytes; then `tail` BF16 values, the row padded to 16 bytes."""
    x = np.asarray(x, np.float32)
    R, W = x.shape
    D = W - tail
    G, qb = min(D, 128), fp8_bytes(D)
    n = qb if tail == 0 else fp8_latent_bytes(D, tail)
    out = np.zeros((R, n), np.uint8)
    deq = np.zeros((R, W), np.float32)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    for g in range(D // G):
        blk = x[:, g * G:(g + 1) * G].astype(np.float64)
        fin = np.isfinite(blk)
        e = _scale_exp(np.where(fin, np.abs(blk), 0.0).max(1))
        scaled = (blk / np.exp2(e.astype(np.float64))[:, None]).astype(np.float32)  # exact
        codes = torch.from_numpy(np.where(fin, scaled, 0.0).astype(np.float32)).to(torch.float8_e4m3fn)
        codes = codes.view(torch.uint8).numpy().copy()
        codes[~fin] = 0x7F
        out[:, g * G:(g + 1) * G] = codes
        out[:, D + 4 * g:D + 4 * g + 4] = np.exp2(e).astype(np.float32).reshape(R, 1).view(np.uint8)
        deq[:, g * G:(g + 1) * G] = table[codes] * np.exp2(e).astype(np.float32)[:, None]
    if tail:
        t16 = torch.from_numpy(np.ascontiguousarray(x[:, D:])).bfloat16()
        out[:, qb:qb + 2 * tail] = t16.view(torch.uint8).numpy().reshape(R, 2 * tail)
        deq[:, D:] = t16.float().numpy()
    return out, deq


def _rows(rng, R, D):
    """Rows of every magnitude: scales 1e-30 .. 1e30, a zero row, a row with NaN and inf, tiny
    values beside large ones (codes that round to zero or to subnormals)."""
    x = rng.standard_normal((R, D)) * np.exp(rng.uniform(-69, 69, (R, 1)))
    x[0] = 0.0
    if R > 2:
        x[1, 3], x[1, 5] = np.nan, -np.inf
        x[2] = rng.standard_normal(D) * np.exp(rng.uniform(-20, 3, D))
    return x.astype(np.float32)


def test_reference_quantizer_bounds():
    """The reference itself: every finite value within half a quantum of E4M3 (relative 2^-4)
    of its dequantized value above the group's subnormal range, each group's amax at most 448
    times its scale and above 224 times it (the scale is the smallest power of two)."""
    rng = np.random.default_rng(7)
    x = _rows(rng, 64, 256)
    b, deq = fp8_ref_rows(x)
    for g in range(2):
        blk = x[3:, g * 128:(g + 1) * 128].astype(np.float64)
        sc = b[3:, 256 + 4 * g:256 + 4 * g + 4].copy().view(np.float32)[:, 0].astype(np.float64)
        amax = np.abs(blk).max(1)
        assert (amax <= 448 * sc).all() and ((amax > 224 * sc) | (sc == 2.0 ** -100)).all()
        d = deq[3:, g * 128:(g + 1) * 128].astype(np.float64)
        big = np.abs(blk) >= 2.0 ** -6 * sc[:, None]
        assert (np.abs(d - blk)[big] <= np.abs(blk)[big] * 2.0 ** -4 + 1e-300).all()
    assert np.isnan(deq[1, 3]) and np.isnan(deq[1, 5]) and np.isfinite(np.delete(deq[1], [3, 5])).all()
    assert (deq[0] == 0).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_fp8_encoder_ties_subnormals_and_saturation(dev):
    """kv_fp8.h's integer E4M3 encoder (the CPU's and the GPU's one function) through
    cache_write, against torch's rounding: every E4M3 value, every midpoint between neighbours
    (ties to the even code), one float32 ulp either side of each, the subnormal range and
    values below half the smallest subnormal, both signs; each group holds 448, so its scale is
    1 and the codes are the values' own."""
    need_device(dev, "cache_write")
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    pos = np.unique(np.abs(finite[np.isfinite(finite)]))
    mids = (pos[1:] + pos[:-1]) / 2
    v = np.concatenate([pos, mids, np.nextafter(mids.astype(np.float32), np.float32(0)),
                        np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                        [2.0 ** -10, 2.0 ** -10 * 1.0000001, 2.0 ** -11, 1e-30, 447.99, 2.0 ** -9 * 1.5]])
    v = np.concatenate([v, -v]).astype(np.float32)
    G = 127
    n = -(-len(v) // G)
    x = np.zeros((n, 128), np.float32)
    x[:, 0] = 448.0
    x[:, 1:].reshape(-1)[:len(v)] = v
    slots = np.arange(n, dtype=np.int32)
    cache = to_dev(np.zeros((n, fp8_bytes(128)), np.uint8), dev)
    ops.cache_write(to_dev(x, dev), to_dev(slots, dev), cache)
    got = to_np(cache)
    assert (got[:, 128:132].copy().view(np.float32) == 1.0).all(), "a group holding 448 has scale 1"
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = np.argwhere(got[:, :128] != want)
    assert bad.size == 0, [(float(x[r, c]), int(got[r, c]), int(want[r, c])) for r, c in bad[:6]]


# ----------------------------------------------------------------------------- cache_write
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("D", [16, 48, 128, 256, 512])
def test_cache_write_fp8(dev, D):
    """cache_write into an FP8 cache: the written rows are the reference's bytes (codes, scales,
    the scales' zero padding), padding slots write nothing, the other rows and the guard columns
    beside the cache's rows are untouched; bad shapes are refused."""
    need_device(dev, "cache_write")
    rng = rng_for("cache_write_fp8", D)
    rows, T = 40, 12
    nb = fp8_bytes(D)
    src = _rows(rng, T, D)
    slots = rng.permutation(rows)[:T].astype(np.int32)
    slots[[4, 9]] = -1  # padding rows
    init = rng.integers(0, 256, (rows, nb + 16), dtype=np.uint8)  # 16 guard bytes after each row
    buf = to_dev(init, dev)
    ops.cache_write(to_dev(src, dev), to_dev(slots, dev), buf.slice(1, 0, nb))
    got = to_np(buf)
    want = init.copy()
    ref, _ = fp8_ref_rows(src)
    for t, s in enumerate(slots):
        if s >= 0:
            want[s, :nb] = ref[t]
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} bytes differ, first at (row, byte) {bad[:4].tolist()}"
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="FP8 cache"):
            ops.cache_write(src, slots, np.zeros((rows, nb + 4), np.uint8))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="multiple of 16"):
            ops.cache_write(src[:, :D - 8], slots, np.zeros((rows, nb), np.uint8))


@pytest.mark.parametrize("dev", DEVICES)
def test_cache_write_many_fp8(dev):
    """cache_write_many with FP8 caches among its pairs (a layer's latent c, its index keys)
    beside an F32 and a BF16 pair: every pair as its own cache_write (on CUDA one launch of the
    warp kernel for all of them), padding slots skipped."""
    need_device(dev, "cache_write_many")
    rng = rng_for("cache_write_many_fp8")
    rows, T = 30, 9
    slots = rng.permutation(rows)[:T].astype(np.int32)
    slots[3] = -1
    c = _rows(rng, T, 512)
    keys = _rows(rng, T, 128)
    pe = rng.standard_normal((T, 64)).astype(np.float32)
    pe16 = rng.standard_normal((T, 40)).astype(np.float32)
    caches = [np.zeros((rows, fp8_bytes(512)), np.uint8), np.zeros((rows, fp8_bytes(128)), np.uint8),
              np.full((rows, 64), 7.0, np.float32)]
    d_caches = [to_dev(a, dev) for a in caches]
    c16 = torch.zeros((rows, 40), dtype=torch.bfloat16)
    d_c16 = c16 if dev == "cpu" else dflash2_rt.from_dlpack(c16).to(dev)
    ops.cache_write_many([to_dev(c, dev), to_dev(keys, dev), to_dev(pe, dev), to_dev(pe16, dev)], to_dev(slots, dev),
                         d_caches + [d_c16])
    (ref_c, _), (ref_k, _) = fp8_ref_rows(c), fp8_ref_rows(keys)
    got16 = torch.from_dlpack(d_c16.to("cpu") if dev != "cpu" else d_c16).float().numpy()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        assert np.array_equal(to_np(d_caches[0])[s], ref_c[t]), f"latent row {t}"
        assert np.array_equal(to_np(d_caches[1])[s], ref_k[t]), f"key row {t}"
        assert np.array_equal(to_np(d_caches[2])[s], pe[t]), f"f32 row {t}"
        assert np.array_equal(got16[s], torch.from_numpy(pe16[t]).bfloat16().float().numpy()), f"bf16 row {t}"
    untouched = np.setdiff1d(np.arange(rows), slots)
    assert (to_np(d_caches[0])[untouched] == 0).all() and (to_np(d_caches[2])[untouched] == 7.0).all()


# ----------------------------------------------------------------------------- attention
def _fp8_latent(cache, kvl, rope, dev):
    """make_pages' F32 latent rows as FP8 rows (NaN rows of unused slots stay NaN codes) and
    the F32 cache of their dequantized values."""
    b, deq = fp8_ref_rows(cache, tail=rope)
    return to_dev(b, dev), deq


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", [MLA_CASES[1], MLA_CASES[3], MLA_CASES[5], MLA_CASES[7]],
                         ids=lambda c: "bs%d-h%d-lora%d-rope%d" % c)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_mla_attention_fp8_cache(dev, case, sparse):
    """mla_attention over an FP8 latent cache (codes + scales, rope in BF16): bitwise the op over
    the F32 cache of the dequantized values wherever the SIMT kernel runs (the CPU; CUDA with
    ops.mla_tc() off), and that the float64 reference's values; on CUDA's tensor cores (kv_lora
    128 / 512) the reference's values to fp32 rounding, not bitwise the SIMT kernel's (it ran),
    a token alone bitwise its row."""
    need_device(dev, "mla_attention")
    rng = rng_for("mla-fp8", case, sparse)
    bs, nh, kvl, rope = case
    cache, bt, seq, pos, q_lat, q_pe, scale = mla_inputs(rng, case)
    T = len(seq)
    kw, sel, sel_len = {}, None, None
    if sparse:
        sel, sel_len = mla_selection(rng, pos)
        kw = dict(sel=to_dev(sel, dev), sel_len=to_dev(sel_len, dev))
    c8, deq = _fp8_latent(cache, kvl, rope, dev)
    ref = refs.mla_attention(q_lat, q_pe, deq, seq, pos, bt, bs, sel, sel_len, scale)
    args = mla_args(dev, q_lat, q_pe, deq, seq, pos, bt)
    was = ops.mla_tc()
    try:
        ops.set_mla_tc(False)
        want = to_np(ops.mla_attention(*args, bs, scale, **kw)).copy()  # the F32 cache of the dequantized values
        check("mla_attention", want, ref)
        tc_shape = dev == "cuda" and kvl % 128 == 0 and kvl <= 512 and (kvl + rope) % 32 == 0
        for tc in ([False, True] if tc_shape else [False]):
            ops.set_mla_tc(tc)
            out = Guarded(q_lat.shape, dev)
            ops.mla_attention(args[0], args[1], c8, *args[3:], bs, scale, out=out.view, **kw)
            got = out.result()
            if tc:
                check("mla_attention", got, ref)
                assert not np.array_equal(got, want), "the tensor-core kernel did not run"
            else:
                assert np.array_equal(got, want), "FP8 cache != F32 cache of the dequantized values"
            t = T - 1
            one_kw = {k: to_dev(np.ascontiguousarray(v[t:t + 1]), dev)
                      for k, v in (("sel", sel), ("sel_len", sel_len)) if v is not None}
            one = to_np(ops.mla_attention(to_dev(q_lat[t:t + 1], dev), to_dev(np.ascontiguousarray(q_pe[t:t + 1]), dev),
                                          c8, to_dev(seq[t:t + 1], dev), to_dev(pos[t:t + 1], dev), args[5], bs, scale,
                                          **one_kw))
            assert np.array_equal(one[0], got[t]), f"a token alone over the FP8 cache (tc={tc})"
    finally:
        ops.set_mla_tc(was)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="FP8 latent cache"):
            ops.mla_attention(*args[:2], np.zeros((deq.shape[0], fp8_latent_bytes(kvl, rope) + 16), np.uint8),
                              *args[3:], bs, scale)


FP8_INDEXER_CASES = [c for c in INDEXER_SCORE_CASES if c[2] % 16 == 0]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", FP8_INDEXER_CASES, ids=lambda c: "bs%d-h%d-d%d" % c)
def test_indexer_fp8_cache(dev, case):
    """The indexer over FP8 index keys: indexer_scores bitwise the scores over the F32 cache of
    the dequantized keys wherever the SIMT kernel runs (the CPU; CUDA with ops.indexer_tc() off),
    the float64 reference's; on CUDA's tensor cores the reference's to fp32 rounding and not
    bitwise the SIMT scores; indexer_topk's selection the reference's in every mode."""
    need_device(dev, "indexer_scores")
    bs, nI, dI = case
    rng = rng_for("indexer-fp8", case)
    lengths = page_lengths(rng, bs, 4) + [150]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    b, deq = fp8_ref_rows(key_cache)
    k8 = to_dev(b, dev)
    seq, pos = step_tokens(rng, lengths, bs, 3)
    T, C = len(seq), bt.shape[1] * bs
    q = rng.standard_normal((T, nI, dI)).astype(np.float32)
    w = rng.standard_normal((T, nI)).astype(np.float32)
    dv = lambda a: to_dev(a, dev)  # noqa: E731

    def scores(cache):
        out = Guarded((T, C), dev)
        ops.indexer_scores(dv(q), dv(w), cache, dv(seq), dv(pos), dv(bt), bs, out=out.view)
        return out.result()

    mask = np.arange(C)[None, :] <= pos[:, None]
    was = ops.indexer_tc()
    try:
        ops.set_indexer_tc(False)
        want = scores(dv(deq))
        for t in range(T):
            n = int(pos[t]) + 1
            ref, _ = refs.indexer_scores(q[t], w[t], refs.paged_rows(deq, bt, int(seq[t]), n, bs))
            check("indexer_scores", want[t, :n], ref)
        tc_shape = dev == "cuda" and nI <= 64 and dI % 8 == 0
        for tc in ([False, True] if tc_shape else [False]):
            ops.set_indexer_tc(tc)
            got = scores(k8)
            assert (got[~mask] == SENTINEL).all(), "keys past a token's position were written"
            if tc:
                assert not np.array_equal(got[mask], want[mask]), "the tensor-core kernel did not run"
                for t in range(T):
                    n = int(pos[t]) + 1
                    ref, _ = refs.indexer_scores(q[t], w[t], refs.paged_rows(deq, bt, int(seq[t]), n, bs))
                    check("indexer_scores", got[t, :n], ref)
            else:
                assert np.array_equal(got[mask], want[mask]), "FP8 keys != F32 cache of the dequantized keys"
            selection_is_reference(rng, dev, k8, deq, seq, pos, bt, bs, nI, dI)
    finally:
        ops.set_indexer_tc(was)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="FP8 key cache"):
            ops.indexer_scores(q, w, np.zeros((deq.shape[0], fp8_bytes(dI) + 16), np.uint8), seq, pos, bt, bs)
