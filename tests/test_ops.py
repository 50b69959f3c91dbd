"""Backend-parity harness (in the style of llama.cpp's test-backend-ops).

Every op runs on every backend (cpu always; cuda where the build has it and a GPU is
present) on random shapes including odd sizes, and is compared with a plain float64
numpy/torch reference (tests/refs.py) by normalized mean squared error with a per-op
threshold, after checking for NaN/Inf. Outputs are written into a buffer with guard
regions on both sides that must come back untouched. A CUDA op plugs in by adding its
name to CUDA_OPS.
"""
import math
import zlib

import numpy as np
import pytest
import torch

import dflash2_rt
from dflash2_rt import ops

import refs
from conftest import cuda_or_skip

DEVICES = ["cpu", "cuda"]
# Ops with a CUDA implementation (cpp/src/backend/cuda, registered in register.cpp);
# "embedding" runs the CUDA gather_rows.
CUDA_OPS = {"rms_norm", "layer_norm", "rope", "silu_mul", "softmax", "embedding", "copy", "add", "gather_rows",
            "argmax", "check_finite", "cache_write", "dyn_conv", "indexer_topk", "indexer_scores", "mla_attention",
            "block_attention",
            "moe_route", "moe_experts", "topk", "selector_walk", "linear", "linear_heads", "embedding_shard",
            "linear_bf16", "linear_fp8", "fp8_quantize_act", "linear_nvfp4", "moe_experts_fp8", "moe_experts_nvfp4",
            "resolve_tokens",
            "next_after_accept", "argmax_shard", "argmax_merge", "accept_greedy", "topk_merge", "rope_many",
            "cache_write_many", "token_logprobs", "apply_penalties", "count_tokens"}
GUARD = 64
SENTINEL = np.float32(-12345.678)
ISENTINEL = np.int32(-777777)

# per-op NMSE thresholds (fp32 results vs float64 references)
TOL = {
    "linear": 1e-11,
    # vs float64 over the same BF16-rounded operands: fp32 summation order only (CPU), or
    # the tensor cores' fp32 accumulation (CUDA); not rounding x gives ~1e-6
    "linear_bf16": 1e-10,
    # vs float64 over the same E4M3 codes and fp32 block-scale products: the CPU's fp32 block
    # sums and fused accumulation; the GPU's FP8 tensor-core sums inside a block carry fewer
    # bits (DeepSeek-V3 reports ~14), so its bound is wider. Not quantizing x gives ~1e-3.
    "linear_fp8": 1e-10,  # [2.4e-15]
    "linear_fp8_cuda": 1e-6,
    # vs float64 over the quantized activations (ops.nvfp4_quantize_act, bitwise against an
    # independent reference in test_quantize.py) and the dequantized weight: fp32 order only
    # (the GPU scales by alpha once at the end); not quantizing x gives ~1e-3
    "linear_nvfp4": 1e-10,
    # the GPU's block-scaled FP4 MMA: if its sums carry fewer bits than fp32 (as Hopper's FP8
    # ones do), the order-only bound above is too tight; until measured, FP8's bound
    "linear_nvfp4_cuda": 1e-6,
    "rms_norm": 1e-12,
    "layer_norm": 1e-12,
    "rope": 1e-12,
    "silu_mul": 1e-12,
    "softmax": 1e-12,
    "embedding": 0.0,
    "gated_mlp": 1e-10,
    # The new ops. Worst NMSE measured (cpu, avx2+fma GEMM) in brackets; a wrong key,
    # expert, tap, window edge or scale gives > 1e-4. Index outputs (argmax, check_finite,
    # indexer_topk, moe_route ids, selector_walk tokens) and data movement (copy,
    # gather_rows, cache_write, and add: one correctly rounded fp32 add per element) are
    # compared exactly instead. The thresholds cover fp32 rounding only: ~50-500x the
    # measured worst, so a generic (non-FMA) GEMM or another compiler's contraction still
    # passes; the float64 references differ by ~1e-16 between hosts (AVX-512 numpy), far
    # below. Every decision (a top-k boundary, an argmax, a sampled draw) is made on
    # inputs whose margin is > MARGIN, so fp32 and float64 agree on it.
    "copy": 0.0, "gather_rows": 0.0, "cache_write": 0.0,  # moves bits: compared bitwise
    "add": 2.0 ** -48,  # one rounding per element: |err| <= 2^-24 |ref|, NMSE <= 2^-48 (and bitwise
    #                     equal to the float64 sum rounded once to fp32)
    "linear_heads": 1e-11,  # the dense linear per head: linear's threshold [1.7e-14]
    "indexer_scores": 1e-12,  # fp32 dots over dI <= 256, fp32 head sums [~1e-15]
    "mla_attention": 1e-12,  # fp32 scores over kv_lora + rope <= 192, exp, weighted sum [4.8e-15]
    "block_attention": 1e-12,  # same with hd <= 32 and up to ~60 keys [2.1e-14]
    "moe_route": 1e-12,  # fp32 sigmoid, one division, one multiply [5.9e-15]
    "moe_experts": 1e-11,  # three chained fp32 GEMMs + silu, as gated_mlp [2.4e-14]
    "dyn_conv": 1e-12,  # two fp32 multiply-adds per element [2.5e-15]
    "selector_walk": 1e-10,  # q: softmax of fp32 scores / temperature (0.6: errors x1.7) [2.5e-13]
}


def need_device(dev, op):
    if dev == "cuda":
        cuda_or_skip()
        if op not in CUDA_OPS:
            pytest.skip(f"{op} is not implemented on the CUDA backend yet")
        if op == "linear_bf16" and not ops.linear_bf16_available("cuda:0"):
            pytest.skip("this build has no CUTLASS tensor-core GEMM for this GPU's architecture")
        if op == "linear_nvfp4" and not ops.linear_nvfp4_available("cuda:0"):
            pytest.skip("this build has no NVFP4 W4A4 CUTLASS GEMM for this GPU's architecture (sm_100a / sm_103a only)")
        if op == "moe_experts_nvfp4" and not ops.linear_nvfp4_available("cuda:0"):
            pytest.skip("this build has no NVFP4 grouped CUTLASS GEMM for this GPU's architecture (sm_100a / sm_103a only)")
        if op == "moe_experts_fp8" and not ops.linear_fp8_available("cuda:0"):
            pytest.skip("this build has no FP8 grouped CUTLASS GEMM for this GPU's architecture (sm_90a only)")
        if op == "linear_fp8" and not ops.linear_fp8_available("cuda:0"):
            pytest.skip("this build has no FP8 block-128 CUTLASS GEMM for this GPU's architecture (sm_90a only)")


def to_dev(a, dev):
    t = dflash2_rt.from_dlpack(a)
    return t if dev == "cpu" else t.to(dev)


def to_np(t):
    t = t.to("cpu") if t.device != "cpu" else t
    if t.dtype in ("BF16", "F8_E4M3"):
        return torch.from_dlpack(t).float().numpy()
    return np.from_dlpack(t).copy()


class Guarded:
    """An output of `shape` (F32, or I32 for index outputs) in the middle of a buffer with
    sentinel guards. `init` gives the output's starting contents (an in-place op, an output
    the op may leave untouched); otherwise it starts as sentinels too."""

    def __init__(self, shape, dev, dtype=np.float32, init=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sentinel = SENTINEL if self.dtype == np.float32 else ISENTINEL
        self.n = int(np.prod(shape))
        host = np.full(self.n + 2 * GUARD, self.sentinel, self.dtype)
        if init is not None:
            host[GUARD:GUARD + self.n] = np.asarray(init, self.dtype).reshape(-1)
        self.buf = to_dev(host, dev)
        self.view = self.buf.slice(0, GUARD, GUARD + self.n).reshape(list(self.shape))

    def result(self):
        all_ = to_np(self.buf)
        assert (all_[:GUARD] == self.sentinel).all(), "op wrote before its output"
        assert (all_[GUARD + self.n:] == self.sentinel).all(), "op wrote past its output"
        return all_[GUARD:GUARD + self.n].reshape(self.shape)


def check(name, got, ref, tol=None):
    tol = TOL[name] if tol is None else tol
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{name}: NaN/Inf in output"
    err = float(((got - ref) ** 2).sum())
    nrm = float((ref ** 2).sum())
    nmse = err / nrm if nrm > 0 else err
    assert nmse <= tol, f"{name}: NMSE {nmse:.3e} > {tol:.1e}"


def rng_for(*key):
    """A generator seeded from `key` the same way in every process: hash() of a tuple that
    holds strings is randomised per process (PYTHONHASHSEED), crc32 of its repr is not."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ----------------------------------------------------------------------------- linear
# (3, 4096, 24) and (2, 4096, 20): on CUDA each column group's K split over 4 blocks
LINEAR_SHAPES = [(1, 64, 32), (3, 100, 17), (5, 129, 33), (8, 256, 96), (17, 48, 50), (1, 1000, 7), (4, 8, 1),
                 (3, 4096, 24)]
NVFP4_SHAPES = [(1, 64, 32), (3, 160, 17), (7, 256, 40), (9, 48, 5), (1, 2048, 13), (2, 4096, 20)]


def make_weight(fmt, n, k, rng):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    if fmt == "f32":
        return ops.Weight.dense(w), w.astype(np.float64)
    if fmt == "bf16":
        t = refs.bf16_round(w)
        return ops.Weight.dense(t), t.double().numpy()
    if fmt == "f16":
        w16 = w.astype(np.float16)
        return ops.Weight.dense(w16), w16.astype(np.float64)
    if fmt == "fp8":
        q, s = refs.quantize_fp8_block128(w)
        wt = ops.Weight.fp8_block128(torch.from_numpy(q).view(torch.float8_e4m3fn), s)
        return wt, refs.dequant_fp8_block128(q, s)
    if fmt == "nvfp4":
        p, s, g = refs.quantize_nvfp4(w)
        wt = ops.Weight.nvfp4(p, torch.from_numpy(s).view(torch.float8_e4m3fn), float(g))
        return wt, refs.dequant_nvfp4(p, s, g)
    raise ValueError(fmt)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8", "nvfp4"])
def test_linear(dev, fmt):
    need_device(dev, "linear")
    shapes = NVFP4_SHAPES if fmt == "nvfp4" else LINEAR_SHAPES
    for (m, k, n) in shapes:
        rng = rng_for("linear", fmt, m, k, n)
        w, wref = make_weight(fmt, n, k, rng)
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = Guarded((m, n), dev)
        ops.linear(to_dev(x, dev), w if dev == "cpu" else w.to(dev), out=out.view)
        check("linear", out.result(), x.astype(np.float64) @ wref.T)
        # the Weight's own dequantization agrees with the independent reference
        np.testing.assert_allclose(np.from_dlpack(w.dequantize()), wref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8", "nvfp4"])
def test_linear_row_independent_of_batch_and_threads(fmt):
    """Numerics contract: a row of a batch is bitwise equal to the row computed alone,
    whatever the thread count (decode == verify, so greedy speculation stays lossless)."""
    rng = rng_for("rowind", fmt)
    n, k, m = 70, 272, 13
    w, _ = make_weight(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    full = np.from_dlpack(ops.linear(x, w)).copy()
    for i in range(m):
        one = np.from_dlpack(ops.linear(x[i:i + 1], w))
        assert np.array_equal(one[0], full[i]), f"row {i} differs when computed alone"
    for j in range(0, m - 3, 4):
        part = np.from_dlpack(ops.linear(x[j:j + 3], w))
        assert np.array_equal(part, full[j:j + 3])
    before = dflash2_rt.build_info()["num_threads"]
    try:
        dflash2_rt._core.set_num_threads(1)
        single = np.from_dlpack(ops.linear(x, w)).copy()
    finally:
        dflash2_rt._core.set_num_threads(before)
    assert np.array_equal(single, full)


def test_linear_accumulate_and_strided_rows():
    rng = rng_for("acc")
    w, wref = make_weight("bf16", 20, 40, rng)
    xbig = rng.standard_normal((6, 64)).astype(np.float32)
    x = xbig[:, 8:48]  # rows strided by 64
    y0 = rng.standard_normal((6, 20)).astype(np.float32)
    y = y0.copy()
    ops.linear(x, w, out=y, accumulate=True)
    check("linear", y, y0 + x.astype(np.float64) @ wref.T)


def test_linear_errors():
    w = ops.Weight.dense(np.zeros((4, 8), np.float32), "blk.w")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"x has 7 features but the weight expects 8"):
        ops.linear(np.zeros((2, 7), np.float32), w)
    with pytest.raises(ValueError, match=r"y must be \[2, 4\]"):
        ops.linear(np.zeros((2, 8), np.float32), w, out=np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="must be F32"):
        ops.linear(np.zeros((2, 8), np.float16), w)
    with pytest.raises(dflash2_rt.CheckpointError, match=r"weight_scale_inv must be F32\[1, 1\]"):
        ops.Weight.fp8_block128(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), np.zeros((2, 1), np.float32))
    with pytest.raises(dflash2_rt.CheckpointError, match="divisible by 16"):
        ops.Weight.nvfp4(np.zeros((4, 4), np.uint8), torch.zeros(4, 0, dtype=torch.float8_e4m3fn), 1.0)
    with pytest.raises(dflash2_rt.CheckpointError, match="weight_scale_2 must be a positive finite"):
        ops.Weight.nvfp4(np.zeros((4, 8), np.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), float("nan"))


# The exact form on the tensor cores (ops.set_exact_tc): token tiles of 8 (FP8 / NVFP4) and 16
# (BF16) rows, several of them, K tails (not a multiple of the 128 / 256-input stages, nor of
# an FP8 block), K split over CTAs (4096 inputs, few features), more than 256 rows (two
# launches), a column slice of a wider weight's rows.
EXACT_TC_SHAPES = [(1, 64, 32), (3, 100, 17), (9, 129, 33), (17, 256, 96), (33, 48, 50), (1, 1000, 7),
                   (8, 4096, 24), (300, 200, 40)]


def exact_tc_weight(fmt, n, k, rng):
    if fmt == "nvfp4":  # K % 16 == 0
        k = (k + 15) // 16 * 16
    return k, make_weight(fmt, n, k, rng)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_linear_exact_tc(dev, fmt):
    """ops.set_exact_tc(True): linear of BF16 / FP8 / NVFP4 weights on the tensor cores with x
    split into three BF16 planes keeps linear's numerics (NMSE <= linear's 1e-11 against
    float64, where rounding x to BF16 alone gives ~1e-6), takes another path than the SIMT
    kernel on CUDA (some bits differ: the sums' order), and leaves the CPU untouched (bitwise);
    a row alone equals the row in any batch (bitwise; across token tiles and launches);
    accumulate adds to y; linear_many and gated_mlp under the switch are linear one by one,
    bitwise."""
    need_device(dev, "linear")
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    cases = []
    for (m, k, n) in EXACT_TC_SHAPES:
        rng = rng_for("linear-exact-tc", fmt, m, k, n)
        k, (w, wref) = exact_tc_weight(fmt, n, k, rng)
        x = rng.standard_normal((m, k)).astype(np.float32) * np.float32(3.0)
        cases.append((x, w, wref))

    def run():
        outs = []
        for x, w, _ in cases:
            out = Guarded((x.shape[0], w.out_features), dev)
            ops.linear(to_dev(x, dev), on(w), out=out.view)
            outs.append(out.result())
        return outs

    tc, simt = on_and_off(ops.exact_tc, ops.set_exact_tc, run)
    # the emulator sums in k order with fp32 rounding (1e-14 here, as the SIMT kernel); a
    # GPU's MMA accumulation may round otherwise, so there linear's own bound
    tol = 1e-12 if dflash2_rt.build_info().get("cuda_emulated") else None
    for (x, w, wref), got in zip(cases, tc):
        check("linear", got, x.astype(np.float64) @ wref.T, tol)
    same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(tc, simt))
    assert same == (dev == "cpu"), "the switch should change the CUDA kernel (and nothing on the CPU)"

    was = ops.exact_tc()
    ops.set_exact_tc(True)
    try:
        rng = rng_for("linear-exact-tc-rows", fmt)
        k, (w, wref) = exact_tc_weight(fmt, 40, 272, rng)
        x = rng.standard_normal((37, k)).astype(np.float32)
        full = to_np(ops.linear(to_dev(x, dev), on(w)))
        for lo, hi in ((0, 1), (5, 6), (36, 37), (3, 12), (8, 25)):
            part = to_np(ops.linear(to_dev(x[lo:hi], dev), on(w)))
            assert np.array_equal(part.view(np.uint32), full[lo:hi].view(np.uint32)), (lo, hi)
        # accumulate into strided rows
        y0 = rng.standard_normal((37, 48)).astype(np.float32)
        yb = to_dev(y0.copy(), dev)
        ops.linear(to_dev(x, dev), on(w), out=yb.slice(1, 4, 44), accumulate=True)
        got = to_np(yb)
        check("linear", got[:, 4:44], y0[:, 4:44].astype(np.float64) + x.astype(np.float64) @ wref.T)
        assert np.array_equal(got[:, :4], y0[:, :4]) and np.array_equal(got[:, 44:], y0[:, 44:])
        # linear_many and the exact gated MLP: linear one by one, bitwise
        w2, _ = make_weight(fmt, 24, k, rng)
        w3, _ = make_weight("f32", 8, k, rng)  # not the exact form's: the SIMT kernel beside it
        xd = to_dev(x[:9], dev)
        many = [to_np(t) for t in ops.linear_many(xd, [on(w), on(w2), on(w3)])]
        for t, ww in zip(many, (w, w2, w3)):
            one = to_np(ops.linear(xd, on(ww)))
            assert np.array_equal(t.view(np.uint32), one.view(np.uint32))
        wg, _ = make_weight(fmt, 48, k, rng)
        wu, _ = make_weight(fmt, 48, k, rng)
        wd, _ = make_weight(fmt, 16, 48, rng)
        got = to_np(ops.gated_mlp(xd, on(wg), on(wu), on(wd), numerics="exact"))
        h = ops.silu_mul(ops.linear(xd, on(wg)), ops.linear(xd, on(wu)))
        want = to_np(ops.linear(h, on(wd)))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    finally:
        ops.set_exact_tc(was)


# ----------------------------------------------------------------------------- linear_bf16
# More than one 128-row tile, K not a multiple of the 64-wide k-tile nor of 8 (padded), N not
# a multiple of 4 (the CUDA path's staged store), besides linear's shapes.
TC_SHAPES = LINEAR_SHAPES + [(130, 256, 72), (64, 136, 200), (3, 70, 66)]


def nmse(got, ref):
    ref = np.asarray(ref, np.float64)
    return float(((np.asarray(got, np.float64) - ref) ** 2).sum() / (ref ** 2).sum())


def bf16_operands(x, w):
    """linear_bf16's operands: bf16(x) and bf16(the weight's own f32 dequantization)."""
    xr = refs.bf16_round(x).double().numpy()
    wr = refs.bf16_round(np.from_dlpack(w.dequantize())).double().numpy()
    return xr, wr


# decode=True (the skinny kernel of generated tokens, gemm_sk.cu): K split over CTAs where N
# is small (20 x 2048: 16 splits, 7 x 4096: 32), token tiles of 32 (M 33, 130), two launches
# of 256 rows (M 260), N across 64-feature blocks and 16-feature warps (150, 70, 17).
SK_SHAPES = [(1, 2048, 20), (33, 4096, 7), (260, 160, 70), (8, 512, 150)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8", "nvfp4"])
@pytest.mark.parametrize("decode", [False, True])
def test_linear_bf16(dev, fmt, decode):
    need_device(dev, "linear_bf16")
    if decode and dev == "cpu":
        pytest.skip("the CPU has one kernel for both (decode is a CUDA kernel choice)")
    shapes = NVFP4_SHAPES if fmt == "nvfp4" else TC_SHAPES
    if decode:
        shapes = shapes + SK_SHAPES
    for (m, k, n) in shapes:
        rng = rng_for("linear_bf16", fmt, m, k, n)
        w, wref = make_weight(fmt, n, k, rng)
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = Guarded((m, n), dev)
        ops.linear_bf16(to_dev(x, dev), w if dev == "cpu" else w.to(dev), out=out.view, decode=decode)
        got = out.result()
        xr, wr = bf16_operands(x, w)
        check("linear_bf16", got, xr @ wr.T)
        # the rounding really happens: far from the exact GEMM's result
        assert nmse(got, x.astype(np.float64) @ wref.T) > 1e-9, (m, k, n)


def on_and_off(get, set_, run):
    """run() with a process-wide switch on, then off (each read back), the switch restored
    after; returns both results."""
    was = get()
    try:
        set_(True)
        assert get()
        on = run()
        set_(False)
        assert not get()
        off = run()
    finally:
        set_(was)
    assert get() == was
    return on, off


@pytest.mark.parametrize("dev", DEVICES)
def test_dq_wgmma_switch(dev):
    """ops.set_dq_wgmma: the mainloop-dequantizing GEMM's two forms (on Hopper, and in the
    emulator's default sm_90, wgmma with on; mma.sync with off) both give linear_bf16's
    numerics over NVFP4 / FP8 / BF16 weights (K tails, N and M across tiles, 200 rows = 4
    m-tiles) and the grouped experts'; the switch reads back and is restored."""
    need_device(dev, "linear_bf16")
    rng = rng_for("dq-wgmma-switch")
    cases = [("nvfp4", 200, 208, 150), ("fp8", 130, 200, 136), ("bf16", 70, 264, 129)]
    weights = [(fmt, m, make_weight(fmt, n, k, rng), rng.standard_normal((m, k)).astype(np.float32))
               for (fmt, m, k, n) in cases]
    gate, up, down = ([make_weight("nvfp4", n, kk, rng)[0] for _ in range(3)] for (n, kk) in [(96, 64), (96, 64), (64, 96)])
    xe = rng.standard_normal((20, 64)).astype(np.float32)
    ids = np.array([[t % 3, (t + 1) % 3] for t in range(20)], np.int32)
    we = rng.uniform(0.1, 1.0, (20, 2)).astype(np.float32)
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))

    def run():
        outs = []
        for fmt, m, (w, _), x in weights:
            out = Guarded((m, w.out_features), dev)
            ops.linear_bf16(to_dev(x, dev), on(w), out=out.view)
            outs.append(out.result())
        outs.append(to_np(ops.moe_experts(to_dev(xe, dev), to_dev(ids, dev), to_dev(we, dev), [on(w) for w in gate],
                                          [on(w) for w in up], [on(w) for w in down], numerics="bf16")))
        return outs

    first, second = on_and_off(ops.dq_wgmma, ops.set_dq_wgmma, run)
    ref_e = to_np(ops.moe_experts(xe, ids, we, gate, up, down, numerics="bf16"))  # the CPU emulation
    for res in (first, second):
        for (fmt, m, (w, _), x), got in zip(weights, res):
            xr, wr = bf16_operands(x, w)
            check("linear_bf16", got, xr @ wr.T)
        assert nmse(res[-1], ref_e) <= 1e-5  # fp32 order may flip a BF16 rounding of silu(gate) * up


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt,decode", [("fp8", False), ("nvfp4", False),  # nvfp4 on Hopper: the mainloop-dequantizing kernel
                                        ("bf16", True), ("fp8", True), ("nvfp4", True)])
def test_linear_bf16_rows_independent_of_batch(dev, fmt, decode):
    """A prompt token's projection must not depend on the chunk around it (the same
    contract as linear): every row alone, and in slices, bitwise equal to the full batch.
    decode=True: a generated token's, the same in a decode step and in a verify block (K
    split over CTAs here: 2048 inputs for 40 features; rows past 256 in a second launch)."""
    need_device(dev, "linear_bf16")
    if decode and dev == "cpu":
        pytest.skip("the CPU has one kernel for both (decode is a CUDA kernel choice)")
    rng = rng_for("bf16rows", fmt, decode)
    n, k, m = (40, 2048, 300) if decode else (150, 208, 150)
    w, _ = make_weight(fmt, n, k, rng)
    w = w if dev == "cpu" else w.to(dev)
    x = rng.standard_normal((m, k)).astype(np.float32)
    full = to_np(ops.linear_bf16(to_dev(x, dev), w, decode=decode)).copy()
    for i in (0, 1, 31, 32, 63, 64, 127, 128, 149) + ((255, 256, 299) if decode else ()):
        one = to_np(ops.linear_bf16(to_dev(x[i:i + 1], dev), w, decode=decode))
        assert np.array_equal(one[0], full[i]), f"row {i} differs when computed alone"
    for j in (0, 5, 120) + ((250,) if decode else ()):
        part = to_np(ops.linear_bf16(to_dev(x[j:j + 17], dev), w, decode=decode))
        assert np.array_equal(part, full[j:j + 17]), f"rows {j}..{j + 16}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ypad", [0, 1])  # row stride N (aligned) or N + 1 (the staged store)
@pytest.mark.parametrize("decode", [False, True])
def test_linear_bf16_accumulate_and_strided_rows(dev, ypad, decode):
    need_device(dev, "linear_bf16")
    if decode and dev == "cpu":
        pytest.skip("the CPU has one kernel for both (decode is a CUDA kernel choice)")
    rng = rng_for("bf16acc", ypad)
    wc, _ = make_weight("bf16", 20, 40, rng)
    w = wc if dev == "cpu" else wc.to(dev)
    xbig = rng.standard_normal((6, 64)).astype(np.float32)
    x = xbig[:, 8:48]  # rows strided by 64
    y0 = rng.standard_normal((6, 20 + ypad)).astype(np.float32)
    ybuf = to_dev(y0.copy(), dev)  # (the CPU view shares memory)
    y = ybuf.slice(1, 0, 20)
    ops.linear_bf16(to_dev(np.ascontiguousarray(xbig), dev).slice(1, 8, 48), w, out=y, accumulate=True,
                    decode=decode)
    xr, wr = bf16_operands(x, wc)
    got = to_np(ybuf)
    check("linear_bf16", got[:, :20], y0[:, :20] + xr @ wr.T)
    assert np.array_equal(got[:, 20:], y0[:, 20:]), "wrote outside y's columns"


@pytest.mark.parametrize("fmt,lo", [("bf16", 4), ("f16", 4), ("nvfp4", 16), ("fp8", 128)])
def test_linear_bf16_decode_column_views_cuda(fmt, lo):
    """decode=True over a weight's column view (ops.Weight.cols): rows that start 8 bytes
    past a 16-byte boundary (BF16 / F16 from column 4, NVFP4 from 16: the element-wise
    loads) or aligned (FP8 from 128), a split K (2048 inputs, 24 features: 16 CTAs) with
    accumulate (the split reduction adds y), against the CPU on the same view."""
    need_device("cuda", "linear_bf16")
    rng = rng_for("bf16sk-cols", fmt)
    n, k, m = 24, 2048, 9
    wfull, _ = make_weight(fmt, n, k + 2 * lo, rng)
    wc = wfull.cols(lo, lo + k)
    xs = rng.standard_normal((m, k)).astype(np.float32)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    want = y0.copy()
    ops.linear_bf16(xs, wc, out=want, accumulate=True)
    yd = to_dev(y0.copy(), "cuda")
    ops.linear_bf16(to_dev(xs, "cuda"), wfull.to("cuda").cols(lo, lo + k), out=yd, accumulate=True, decode=True)
    check("linear_bf16", to_np(yd), want, tol=1e-10)


@pytest.mark.parametrize("fmt,g", [("nvfp4", 1 / 2688), ("nvfp4", 1e-30), ("nvfp4", 3.99), ("nvfp4", 4.0),
                                   ("nvfp4", 1e4), ("fp8", None), ("bf16", None), ("f16", None)])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prompt"])
def test_linear_bf16_dequantizes_bitwise_cuda(fmt, g, decode):
    """x = the identity gives y = bf16(W)^T (one nonzero product per output): bitwise the
    CPU's dequantization and rounding, over every E2M1 / E4M3 code, subnormal and largest
    scales, and NVFP4 global scales from 1e-30 to 1e4 (the pair decode below 4, field by
    field from 4), in the skinny kernel (decode=True) and in the mainloop-dequantizing one
    (prompt chunks of NVFP4 / FP8 weights; on Hopper, and the emulator's sm_90, its wgmma
    form; under EMU_SM=100 its mma.sync form)."""
    need_device("cuda", "linear_bf16")
    rng = rng_for("bf16sk-bitwise", fmt, g)
    n, k = 40, 96
    if fmt == "nvfp4":
        codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        sc = rng.integers(0, 0x7f, (n, k // 16), dtype=np.uint8)  # every E4M3 scale but NaN
        sc[0, :] = [0x01, 0x07, 0x08, 0x7e, 0x00, 0x38][: k // 16]
        w = ops.Weight.nvfp4(codes, torch.from_numpy(sc).view(torch.float8_e4m3fn), float(g))
    elif fmt == "fp8":
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7f) == 0x7f] = 0x7e
        scales = (rng.random(((n + 127) // 128, (k + 127) // 128)) * 1e-2 + 1e-30).astype(np.float32)
        w = ops.Weight.fp8_block128(torch.from_numpy(codes).view(torch.float8_e4m3fn), scales)
    else:
        w, _ = make_weight(fmt, n, k, rng)
    eye = np.eye(k, dtype=np.float32)
    want = to_np(ops.linear_bf16(eye, w))
    got = to_np(ops.linear_bf16(to_dev(eye, "cuda"), w.to("cuda"), decode=decode))
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"{int((got != want).sum())} of {got.size} weights differ"


def test_linear_bf16_errors_and_availability():
    w = ops.Weight.dense(np.zeros((4, 8), np.float32), "blk.w")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"linear_bf16\(blk.w\): x has 7 features"):
        ops.linear_bf16(np.zeros((2, 7), np.float32), w)
    with pytest.raises(ValueError, match=r"y must be \[2, 4\]"):
        ops.linear_bf16(np.zeros((2, 8), np.float32), w, out=np.zeros((2, 5), np.float32))
    assert ops.linear_bf16_available("cpu")
    assert "cpu" in dflash2_rt.build_info()["ops"]["linear_bf16"]


# ----------------------------------------------------------------------------- linear_fp8
# One and two 128-input blocks, K tails that are not multiples of 16 (the padded copy), N
# tails across a 128-row weight block and not a multiple of 4, M not a multiple of 4 and
# above one 128-row tile.
FP8_SHAPES = [(1, 128, 32), (3, 100, 17), (5, 129, 33), (8, 256, 96), (130, 256, 72), (64, 136, 200), (3, 70, 66),
              (4, 384, 130)]


def fp8_weight(n, k, rng):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    q, s = refs.quantize_fp8_block128(w)
    return ops.Weight.fp8_block128(torch.from_numpy(q).view(torch.float8_e4m3fn), s), q, s


def fp8_inputs(m, k, rng):
    """Rows with a wide dynamic range: per-block amax from ~1e-3 to ~1e2, an all-zero block
    and values that land in E4M3's subnormal range once scaled."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 2, (m, 1))).astype(np.float32)
    if m > 1 and k > 128:
        x[1, :128] = 0.0
    if m > 2:
        x[2, ::7] *= np.float32(1e-4)
    return x


@pytest.mark.parametrize("dev", DEVICES)
def test_fp8_quantize_act(dev):
    """Bitwise: the CPU and CUDA kernels against an independent numpy/torch quantizer."""
    need_device(dev, "fp8_quantize_act")
    for (m, k) in [(1, 128), (3, 200), (5, 129), (4, 1), (2, 384), (7, 1000)]:
        rng = rng_for("fp8q", m, k)
        x = fp8_inputs(m, k, rng)
        codes, sa = refs.fp8_quantize_act(x)
        want = (codes * np.repeat(sa, 128, 1)[:, :k].astype(np.float64)).astype(np.float32)
        out = Guarded((m, k), dev)
        ops.fp8_quantize_act(to_dev(x, dev), out=out.view)
        got = out.result()
        assert np.array_equal(got, want), f"[{m}, {k}]: {np.abs(got - want).max()}"
        # E4M3 has 3 mantissa bits: each value within half a step (2^-4 relative, or the
        # subnormal step 2^-9 sa)
        step = np.maximum(np.abs(x) * 2.0 ** -4, np.repeat(sa, 128, 1)[:, :k] * 2.0 ** -9)
        assert (np.abs(got.astype(np.float64) - x) <= step * 1.0001).all()
    # a non-finite input poisons its own block only
    x = np.ones((2, 300), np.float32)
    x[0, 5], x[1, 290] = np.nan, np.inf
    got = to_np(ops.fp8_quantize_act(to_dev(x, dev)))
    assert np.isnan(got[0, :128]).all() and np.isnan(got[1, 256:]).all()
    assert np.isfinite(got[0, 128:]).all() and np.isfinite(got[1, :256]).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_fp8(dev):
    need_device(dev, "linear_fp8")
    for (m, k, n) in FP8_SHAPES:
        rng = rng_for("linear_fp8", m, k, n)
        w, q, s = fp8_weight(n, k, rng)
        x = fp8_inputs(m, k, rng)
        out = Guarded((m, n), dev)
        ops.linear_fp8(to_dev(x, dev), w if dev == "cpu" else w.to(dev), out=out.view)
        got = out.result()
        check("linear_fp8", got, refs.linear_fp8(x, q, s), TOL["linear_fp8_cuda" if dev == "cuda" else "linear_fp8"])
        # the activations really are quantized: far from the exact GEMM over the same weight
        assert nmse(got, x.astype(np.float64) @ refs.dequant_fp8_block128(q, s).T) > 1e-6, (m, k, n)


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_fp8_rows_independent_of_batch(dev):
    """The same contract as linear: a row alone, and in slices, bitwise equal to the batch."""
    need_device(dev, "linear_fp8")
    rng = rng_for("fp8rows")
    n, k, m = 72, 200, 150
    w, _, _ = fp8_weight(n, k, rng)
    w = w if dev == "cpu" else w.to(dev)
    x = fp8_inputs(m, k, rng)
    full = to_np(ops.linear_fp8(to_dev(x, dev), w)).copy()
    for i in (0, 1, 63, 64, 127, 128, 149):
        one = to_np(ops.linear_fp8(to_dev(x[i:i + 1], dev), w))
        assert np.array_equal(one[0], full[i]), f"row {i} differs when computed alone"
    for j in (0, 5, 120):
        part = to_np(ops.linear_fp8(to_dev(x[j:j + 17], dev), w))
        assert np.array_equal(part, full[j:j + 17]), f"rows {j}..{j + 16}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ypad", [0, 1])
def test_linear_fp8_accumulate_strided_rows_and_sliced_weight(dev, ypad):
    """x rows strided, y accumulated into a view (ypad = 0: contiguous, M % 4 == 0, so on
    CUDA the kernel's own in-place epilogue, beta = 1; ypad = 1: strided, the staged store),
    and the weight a column slice of a wider one (tensor parallelism: codes and scales strided)."""
    need_device(dev, "linear_fp8")
    rng = rng_for("fp8acc", ypad)
    wfull, q, s = fp8_weight(40, 384, rng)
    wc = wfull.cols(128, 384)
    w = wc if dev == "cpu" else wc.to(dev)
    xbig = fp8_inputs(8, 300, rng)
    x = xbig[:, 20:276]
    y0 = rng.standard_normal((8, 40 + ypad)).astype(np.float32)
    ybuf = to_dev(y0.copy(), dev)
    y = ybuf.slice(1, 0, 40)
    ops.linear_fp8(to_dev(np.ascontiguousarray(xbig), dev).slice(1, 20, 276), w, out=y, accumulate=True)
    got = to_np(ybuf)
    tol = TOL["linear_fp8_cuda" if dev == "cuda" else "linear_fp8"]
    check("linear_fp8", got[:, :40] - y0[:, :40], refs.linear_fp8(x, q[:, 128:], s[:, 1:]), max(tol, 1e-9))
    assert np.array_equal(got[:, 40:], y0[:, 40:]), "wrote outside y's columns"


def test_linear_fp8_errors_and_availability():
    w = ops.Weight.dense(np.zeros((4, 8), np.float32), "blk.w")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"linear_fp8\(blk.w\): the weight must be FP8"):
        ops.linear_fp8(np.zeros((2, 8), np.float32), w)
    wf, _, _ = fp8_weight(4, 8, rng_for("fp8err"))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"x has 7 features"):
        ops.linear_fp8(np.zeros((2, 7), np.float32), wf)
    assert ops.linear_fp8_available("cpu")
    assert "cpu" in dflash2_rt.build_info()["ops"]["linear_fp8"]
    with pytest.raises(ValueError, match="out"):
        ops.fp8_quantize_act(np.zeros((2, 8), np.float32), out=np.zeros((2, 9), np.float32))


# ----------------------------------------------------------------------------- linear_nvfp4
# K multiples of 16, some not of 32 (the padded copy), N past a 128-row scale atom and not a
# multiple of 4, M past 128 rows.
NVFP4_W4A4_SHAPES = NVFP4_SHAPES + [(130, 96, 72), (5, 208, 130), (64, 512, 256)]


def nvfp4_weight(n, k, rng, input_scale):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    p, s, g = refs.quantize_nvfp4(w)
    wt = ops.Weight.nvfp4(p, torch.from_numpy(s).view(torch.float8_e4m3fn), float(g), float(input_scale))
    return wt, refs.dequant_nvfp4(p, s, g)


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_nvfp4(dev):
    need_device(dev, "linear_nvfp4")
    for (m, k, n) in NVFP4_W4A4_SHAPES:
        rng = rng_for("linear_nvfp4", m, k, n)
        x = fp8_inputs(m, k, rng)
        input_scale = float(np.abs(x).max()) / (6 * 448)
        w, wref = nvfp4_weight(n, k, rng, input_scale)
        out = Guarded((m, n), dev)
        ops.linear_nvfp4(to_dev(x, dev), w if dev == "cpu" else w.to(dev), out=out.view)
        got = out.result()
        xq = np.from_dlpack(ops.nvfp4_quantize_act(x, input_scale)).astype(np.float64)
        check("linear_nvfp4", got, xq @ wref.T, TOL["linear_nvfp4_cuda" if dev == "cuda" else "linear_nvfp4"])
        assert nmse(got, x.astype(np.float64) @ wref.T) > 1e-5, (m, k, n)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ypad", [0, 1])
def test_linear_nvfp4_rows_independent_and_accumulate(dev, ypad):
    need_device(dev, "linear_nvfp4")
    rng = rng_for("nvfp4rows", ypad)
    n, k, m = 72, 208, 150
    x = fp8_inputs(m, k, rng)
    wc, wref = nvfp4_weight(n, k, rng, float(np.abs(x).max()) / (6 * 448))
    w = wc if dev == "cpu" else wc.to(dev)
    full = to_np(ops.linear_nvfp4(to_dev(x, dev), w)).copy()
    for i in (0, 1, 127, 128, 149):
        one = to_np(ops.linear_nvfp4(to_dev(x[i:i + 1], dev), w))
        assert np.array_equal(one[0], full[i]), f"row {i} differs when computed alone"
    y0 = rng.standard_normal((m, n + ypad)).astype(np.float32)
    ybuf = to_dev(y0.copy(), dev)
    ops.linear_nvfp4(to_dev(x, dev), w, out=ybuf.slice(1, 0, n), accumulate=True)
    got = to_np(ybuf)
    check("linear_nvfp4", got[:, :n], y0[:, :n].astype(np.float64) + full,
          TOL["linear_nvfp4_cuda" if dev == "cuda" else "linear_nvfp4"])
    assert np.array_equal(got[:, n:], y0[:, n:]), "wrote outside y's columns"


@pytest.mark.parametrize("dev", DEVICES)
def test_linear_nvfp4_prepared_scales(dev):
    """Weight.prepare_nvfp4_scales (what the engine does at load under NVFP4 numerics): on a
    GPU with the W4A4 GEMM the scales are kept in the block-scaled layout and linear_nvfp4
    gives bitwise the result of the per-call swizzle (padded N and K included); elsewhere it
    does nothing and says so; slices and copies drop it."""
    rng = rng_for("nvfp4prep")
    for (m, k, n) in [(3, 64, 40), (5, 208, 72), (130, 96, 130)]:
        x = fp8_inputs(m, k, rng)
        wc, _ = nvfp4_weight(n, k, rng, float(np.abs(x).max()) / (6 * 448))
        assert not wc.prepare_nvfp4_scales() and not wc.nvfp4_scales_prepared  # the CPU: nothing to do
        if dev == "cpu":
            continue
        need_device(dev, "linear_nvfp4")
        w = wc.to(dev)
        want = to_np(ops.linear_nvfp4(to_dev(x, dev), w)).copy()
        assert w.prepare_nvfp4_scales() and w.nvfp4_scales_prepared
        got = to_np(ops.linear_nvfp4(to_dev(x, dev), w))
        assert np.array_equal(got, want), (m, k, n)
        assert not w.rows(0, 16).nvfp4_scales_prepared and not w.cols(0, 32).nvfp4_scales_prepared
        assert not w.to(dev).nvfp4_scales_prepared
    w0, _ = nvfp4_weight(8, 32, rng, 0.0)  # no input_scale: not W4A4, nothing to prepare
    assert not w0.prepare_nvfp4_scales()


def test_linear_nvfp4_errors_and_availability():
    rng = rng_for("nvfp4err")
    w0, _ = nvfp4_weight(4, 32, rng, 0.0)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="input_scale"):
        ops.linear_nvfp4(np.zeros((2, 32), np.float32), w0)
    wf, _, _ = fp8_weight(4, 32, rng)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="must be NVFP4"):
        ops.linear_nvfp4(np.zeros((2, 32), np.float32), wf)
    w1, _ = nvfp4_weight(4, 32, rng, 1e-39)  # subnormal: 1 / input_scale overflows
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="input_scale"):
        ops.linear_nvfp4(np.zeros((2, 32), np.float32), w1)
    assert ops.linear_nvfp4_available("cpu")
    # on the CPU a non-finite activation makes its output row NaN (the GPU's FP4 MMA decides
    # for itself what a NaN block scale gives: see README)
    w2, _ = nvfp4_weight(4, 32, rng, 0.01)
    x = np.ones((2, 32), np.float32)
    x[1, 3] = np.inf
    y = np.from_dlpack(ops.linear_nvfp4(x, w2))
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


# ----------------------------------------------------------------------------- norms
NORM_SHAPES = [(1, 1), (3, 7), (2, 64), (5, 129), (4, 1000), (2, 6144), (33, 48)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rms_norm(dev, wdtype):
    need_device(dev, "rms_norm")
    for shape in NORM_SHAPES:
        rng = rng_for("rms", wdtype, shape)
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        if wdtype == "bf16":
            wt = refs.bf16_round(w)
            wref = wt.double().numpy()
        else:
            wt, wref = w, w
        out = Guarded(shape, dev)
        ops.rms_norm(to_dev(x, dev), to_dev(wt, dev), 1e-5, out=out.view)
        check("rms_norm", out.result(), refs.rms_norm(x, wref, 1e-5))


@pytest.mark.parametrize("dev", DEVICES)
def test_rms_norm_many(dev):
    """rms_norm_many: a layer's q_a and latent norms (the latent a column slice of a wider
    projection), the drafter's per-head q / k norms in place, a 6144-wide row: each output
    bitwise the rms_norm call it stands for (on CUDA one kernel whose block is the widest
    item's: the narrower items' extra threads add zeros), and within float rounding of the
    float64 reference. Items of another weight dtype, or an output that is another item's
    input, take rms_norm one by one, in order."""
    need_device(dev, "rms_norm")
    rng = rng_for("rms-many")
    t = 3
    qa = (rng.standard_normal((t, 1536)) * 2).astype(np.float32)
    kva = rng.standard_normal((t, 576)).astype(np.float32)       # [latent 512 | k_pe 64]
    q = rng.standard_normal((t, 4, 128)).astype(np.float32)
    wide = rng.standard_normal((t, 6144)).astype(np.float32)
    odd = rng.standard_normal((t, 37)).astype(np.float32)        # element-by-element access
    w = {n: rng.standard_normal(n).astype(np.float32) for n in (1536, 512, 128, 6144, 37)}
    wb = refs.bf16_round(w[512])

    def run(many, case):
        xs = [to_dev(a.copy(), dev) for a in (qa, kva, q, wide, odd)]
        qa_d, kva_d, q_d, wide_d, odd_d = xs
        outs = [to_dev(np.zeros(shape, np.float32), dev)
                for shape in ((t, 1536), (t, 512), (t, 6144), (t, 37), (t, 37))]
        items = {"layer": [(qa_d, w[1536], 1e-6, outs[0]), (kva_d.slice(1, 0, 512), w[512], 1e-6, outs[1]),
                           (q_d, w[128], 1e-5, q_d), (wide_d, w[6144], 1e-6, outs[2])],
                 "odd": [(odd_d, w[37], 1e-6, outs[3]), (kva_d.slice(1, 1, 38), w[37], 1e-6, outs[4])],
                 "mixed_access": [(odd_d, w[37], 1e-6, outs[3]), (qa_d, w[1536], 1e-6, outs[0])],
                 "wdtype": [(qa_d, w[1536], 1e-6, outs[0]), (kva_d.slice(1, 0, 512), wb, 1e-6, outs[1])],
                 "chained": [(qa_d, w[1536], 1e-6, outs[0]), (outs[0], w[1536], 1e-6, outs[0])]}[case]
        ws = [to_dev(np.asarray(it[1]), dev) if isinstance(it[1], np.ndarray) else to_dev(it[1], dev)
              for it in items]
        if many:
            ops.rms_norm_many([it[0] for it in items], ws, [it[2] for it in items], [it[3] for it in items])
        else:
            for it, wd in zip(items, ws):
                ops.rms_norm(it[0], wd, it[2], out=it[3])
        return [to_np(b) for b in xs + outs]

    for case in ("layer", "odd", "mixed_access", "wdtype", "chained"):
        got, want = run(True, case), run(False, case)
        for g, wt in zip(got, want):
            assert np.array_equal(g.view(np.uint32), wt.view(np.uint32)), case
    got = run(True, "layer")
    check("rms_norm", got[5], refs.rms_norm(qa, w[1536], 1e-6))
    check("rms_norm", got[6], refs.rms_norm(kva[:, :512], w[512], 1e-6))
    check("rms_norm", got[2], refs.rms_norm(q, w[128], 1e-5))
    check("rms_norm", got[7], refs.rms_norm(wide, w[6144], 1e-6))
    with pytest.raises(ValueError, match="2 inputs, 1 weights"):
        ops.rms_norm_many([to_dev(qa, dev), to_dev(qa, dev)], [to_dev(w[1536], dev)], [1e-6, 1e-6],
                          [to_dev(qa.copy(), dev), to_dev(qa.copy(), dev)])
    with pytest.raises(ValueError, match=r"w must be \[512\]"):
        ops.rms_norm_many([to_dev(qa, dev), to_dev(kva[:, :512].copy(), dev)],
                          [to_dev(w[1536], dev), to_dev(w[128], dev)], [1e-6, 1e-6],
                          [to_dev(qa.copy(), dev), to_dev(kva[:, :512].copy(), dev)])


@pytest.mark.parametrize("dev", DEVICES)
def test_fused_launches_switch(dev):
    """ops.set_fused_launches: off, rms_norm_many and the exact gated MLP take their ops one by
    one (CUDA: separate kernels), with the same bits as on; the switch reads back."""
    need_device(dev, "linear")
    rng = rng_for("fused-switch")
    xs = [rng.standard_normal((2, n)).astype(np.float32) for n in (1536, 512)]
    ws = [rng.standard_normal(n).astype(np.float32) for n in (1536, 512)]
    wg, _ = make_weight("fp8", 64, 2048, rng)
    wu, _ = make_weight("fp8", 64, 2048, rng)
    wd, _ = make_weight("bf16", 32, 64, rng)
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    x = to_dev(rng.standard_normal((3, 2048)).astype(np.float32), dev)

    def run():
        outs = [to_dev(np.zeros_like(a), dev) for a in xs]
        ops.rms_norm_many([to_dev(a, dev) for a in xs], [to_dev(w, dev) for w in ws], [1e-6, 1e-6], outs)
        return [to_np(o) for o in outs] + [to_np(ops.gated_mlp(x, on(wg), on(wu), on(wd), numerics="exact"))]

    fused, single = on_and_off(ops.fused_launches, ops.set_fused_launches, run)
    for f, o in zip(fused, single):
        assert np.array_equal(f.view(np.uint32), o.view(np.uint32))


def test_rms_norm_3d_and_strided_rows():
    rng = rng_for("rms3d")
    xb = rng.standard_normal((3, 4, 80)).astype(np.float32)
    w64 = rng.standard_normal(64).astype(np.float32)
    x = xb[:, :, 8:72]  # rows of 64 at a uniform stride of 80: fine
    check("rms_norm", np.from_dlpack(ops.rms_norm(x, w64, 1e-6)), refs.rms_norm(x, w64, 1e-6))
    w80 = rng.standard_normal(80).astype(np.float32)
    x2 = xb[:, 1:3, :]  # row strides 80 and 320: not one uniform row stride
    with pytest.raises(ValueError, match="evenly strided rows"):
        ops.rms_norm(x2, w80, 1e-6)
    x3 = xb.reshape(12, 80)[::2]  # every other row: evenly strided
    check("rms_norm", np.from_dlpack(ops.rms_norm(x3, w80, 1e-6)), refs.rms_norm(x3, w80, 1e-6))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(dev, bias):
    need_device(dev, "layer_norm")
    for shape in NORM_SHAPES:
        rng = rng_for("ln", bias, shape)
        x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        b = rng.standard_normal(shape[-1]).astype(np.float32) if bias else None
        out = Guarded(shape, dev)
        ops.layer_norm(to_dev(x, dev), to_dev(w, dev), None if b is None else to_dev(b, dev), 1e-6, out=out.view)
        ref = refs.layer_norm(x, w, b, 1e-6)
        check("layer_norm", out.result(), ref, tol=1e-10 if shape[-1] == 1 else None)


# ----------------------------------------------------------------------------- rope
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_rope(dev, style):
    need_device(dev, "rope")
    for (t, h, d, theta) in [(1, 1, 2, 1e4), (5, 3, 64, 1e6), (7, 2, 128, 8e6), (3, 64, 32, 1e4)]:
        rng = rng_for("rope", style, t, h, d)
        x = rng.standard_normal((t, h, d)).astype(np.float32)
        pos = rng.integers(0, 5000, t).astype(np.int64)
        xt = to_dev(x.copy(), dev)
        ops.rope(xt, to_dev(pos, dev), theta, style)
        check("rope", to_np(xt), refs.rope(x, pos, theta, style))


def test_rope_in_place_on_a_slice_of_a_wider_projection():
    """GLM's q is [nope 192 | rope 64] per head: RoPE applies to a strided slice in place."""
    rng = rng_for("rope-slice")
    q = rng.standard_normal((4, 3, 96)).astype(np.float32)
    orig = q.copy()
    pos = np.array([0, 1, 17, 4000], np.int32)
    ops.rope(q[:, :, 64:], pos, 1e6, "interleaved")  # numpy view: zero-copy, in place
    np.testing.assert_array_equal(q[:, :, :64], orig[:, :, :64])
    check("rope", q[:, :, 64:], refs.rope(orig[:, :, 64:], pos, 1e6, "interleaved"))
    with pytest.raises(ValueError, match="rotary dim must be even"):
        ops.rope(q[:, :, :3], pos, 1e6, "neox")
    with pytest.raises(ValueError, match="style must be"):
        ops.rope(q, pos, 1e6, "yarn")


@pytest.mark.parametrize("dev", DEVICES)
def test_rope_many(dev):
    """rope_many: a decode layer's q_pe, k_pe and the indexer's q / k rope slices (strided
    views of wider projections, different head counts) rotated as rope does each, bit for bit
    (on CUDA one kernel); rotary dims that differ, or a tensor given twice, take rope one by
    one (the same tensor is then rotated twice, as two rope calls would)."""
    need_device(dev, "rope_many")
    rng = rng_for("rope-many")
    t = 5
    pos = rng.integers(0, 3000, t).astype(np.int32)
    q = rng.standard_normal((t, 3, 96)).astype(np.float32)     # [nope 32 | rope 64] per head
    kva = rng.standard_normal((t, 1, 80)).astype(np.float32)   # [c 16 | k_pe 64]
    qi = rng.standard_normal((t, 4, 128)).astype(np.float32)   # [rope 64 | rest]
    ki = rng.standard_normal((t, 1, 128)).astype(np.float32)
    odd = rng.standard_normal((t, 2, 32)).astype(np.float32)   # another rotary dim

    def run(many, with_odd, twice=False):
        bufs = [to_dev(a.copy(), dev) for a in (q, kva, qi, ki, odd)]
        qb, kb, qib, kib, ob = bufs
        vs = [qb.slice(2, 32, 96), kb.slice(2, 16, 80), qib.slice(2, 0, 64), kib.slice(2, 0, 64)]
        if with_odd:
            vs.append(ob)
        if twice:
            vs.append(vs[0])
        if many:
            ops.rope_many(vs, to_dev(pos, dev), 1e6, "interleaved")
        else:
            for v in vs:
                ops.rope(v, to_dev(pos, dev), 1e6, "interleaved")
        return [to_np(b) for b in bufs]

    for with_odd, twice in [(False, False), (True, False), (False, True)]:
        got, want = run(True, with_odd, twice), run(False, with_odd, twice)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (with_odd, twice)
    ref = refs.rope(q[:, :, 32:], pos, 1e6, "interleaved")
    check("rope", run(True, False)[0][:, :, 32:], ref)
    with pytest.raises(ValueError, match="rotary dim must be even"):
        ops.rope_many([to_dev(q.copy(), dev), to_dev(q[:, :, :3].copy(), dev)], to_dev(pos, dev), 1e6)


# ----------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dev", DEVICES)
def test_silu_mul(dev):
    need_device(dev, "silu_mul")
    for shape in [(1, 1), (3, 17), (8, 2048), (2, 3, 5)]:
        rng = rng_for("silu", shape)
        g = (rng.standard_normal(shape) * 4).astype(np.float32)
        u = rng.standard_normal(shape).astype(np.float32)
        out = Guarded(shape, dev)
        ops.silu_mul(to_dev(g, dev), to_dev(u, dev), out=out.view)
        check("silu_mul", out.result(), refs.silu_mul(g, u))


@pytest.mark.parametrize("dev", DEVICES)
def test_softmax(dev):
    need_device(dev, "softmax")
    for shape, scale in [((1, 1), 1.0), ((3, 17), 0.5), ((4, 1000), 1 / 16), ((2, 2, 33), 3.0)]:
        rng = rng_for("softmax", shape)
        x = (rng.standard_normal(shape) * 5).astype(np.float32)
        x[..., 0] = -np.inf  # masked entries
        if shape[-1] == 1:
            x[...] = 2.0
        out = Guarded(shape, dev)
        ops.softmax(to_dev(x, dev), scale, out=out.view)
        got = out.result()
        check("softmax", got, refs.softmax(x, scale))
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dev", DEVICES)
def test_topk(dev):
    need_device(dev, "topk")
    for (r, d, k) in [(1, 1, 1), (3, 17, 5), (2, 154880 // 16, 16), (4, 300, 300), (5, 64, 8)]:
        rng = rng_for("topk", r, d, k)
        x = rng.integers(-20, 20, (r, d)).astype(np.float32)  # many ties
        v, i = ops.topk(to_dev(x, dev), k)
        rv, ri = refs.topk(x, k)
        np.testing.assert_array_equal(to_np(v), rv)
        np.testing.assert_array_equal(to_np(i), ri)
    # long rows with small k: on a GPU each 4096-id chunk's top k, merged by topk_merge
    # (ops.wide_rows(); one block per row with the switch off): ties across chunks, +0 / -0,
    # NaN (last), -inf, a short last chunk, a row whose top k all sit in the last chunk
    long = rng_for("topk-long").integers(-30, 30, (5, 12300)).astype(np.float32)
    long[0, ::7] = 29.0  # ties everywhere: the lowest ids
    long[1] = -0.0
    long[1, 9000::3] = 0.0
    long[2, :] = np.nan
    long[2, [5, 4100, 12299]] = [1.0, -np.inf, 2.0]  # 3 numbers, then NaNs by id
    long[3, -20:] = 100.0 + np.arange(20, dtype=np.float32)
    long[4, 4096:8192] = -np.inf
    was = ops.wide_rows()
    try:
        for wide in (True, False):
            ops.set_wide_rows(wide)
            for k in (1, 16, 64, 100):
                v, i = ops.topk(to_dev(long, dev), k)
                rv, ri = refs.topk(long, k)
                np.testing.assert_array_equal(to_np(i), ri, err_msg=f"wide={wide} k={k}")
                np.testing.assert_array_equal(to_np(v), rv)
    finally:
        ops.set_wide_rows(was)
    with pytest.raises(ValueError, match="exceeds the row length"):
        ops.topk(np.zeros((2, 3), np.float32), 4)


def test_topk_nan_ranks_last():
    x = np.array([[1.0, np.nan, 3.0, -np.inf, 2.0]], np.float32)
    v, i = ops.topk(x, 4)
    assert np.from_dlpack(i).tolist() == [[2, 4, 0, 3]]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("tdtype", ["f32", "bf16"])
def test_embedding(dev, tdtype):
    need_device(dev, "embedding")
    rng = rng_for("emb", tdtype)
    table = rng.standard_normal((97, 33)).astype(np.float32)
    tt = refs.bf16_round(table) if tdtype == "bf16" else table
    tref = tt.float().numpy() if tdtype == "bf16" else table
    for ids in [np.array([0], np.int32), np.array([5, 96, 5, 0, 13], np.int64)]:
        out = Guarded((len(ids), 33), dev)
        ops.embedding(to_dev(tt, dev), to_dev(ids, dev), out=out.view)
        check("embedding", out.result(), tref[ids])
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"token id 97 at position 1 is outside the vocabulary \[0, 97\)"):
        ops.embedding(table, np.array([1, 97], np.int32))
    with pytest.raises(ValueError, match="token id -1"):
        ops.embedding(table, np.array([-1], np.int64))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("tdtype", ["f32", "bf16"])
def test_embedding_shard(dev, tdtype):
    # vocab-parallel embedding: each shard writes its own rows and zeros elsewhere, and
    # the shards' outputs sum to the full embedding exactly (one non-zero term per element)
    need_device(dev, "embedding_shard")
    rng = rng_for("embshard", tdtype)
    table = rng.standard_normal((96, 24)).astype(np.float32)
    tt = refs.bf16_round(table) if tdtype == "bf16" else table
    tref = tt.float().numpy() if tdtype == "bf16" else table
    ids = np.array([0, 95, 31, 32, 64, 7, 63], np.int32)
    total = np.zeros((len(ids), 24), np.float32)
    for first in (0, 32, 64):
        shard = tt[first:first + 32]
        out = Guarded((len(ids), 24), dev)
        ops.embedding_shard(to_dev(shard, dev), to_dev(ids, dev), first, out=out.view)
        got = out.result()
        local = (ids >= first) & (ids < first + 32)
        check("embedding", got[local], tref[ids[local]])
        assert not got[~local].any()
        total += got
    np.testing.assert_array_equal(total, tref[ids])
    with pytest.raises(ValueError, match="first must be >= 0"):
        ops.embedding_shard(table, np.array([1], np.int32), -1)


def test_gated_mlp():
    rng = rng_for("mlp")
    d, f, m = 48, 80, 5
    wg, rg = make_weight("bf16", f, d, rng)
    wu, ru = make_weight("fp8", f, d, rng)
    wd, rd = make_weight("nvfp4", d, f, rng)
    x = rng.standard_normal((m, d)).astype(np.float32)
    got = np.from_dlpack(ops.gated_mlp(x, wg, wu, wd))
    x64 = x.astype(np.float64)
    ref = refs.silu_mul(x64 @ rg.T, x64 @ ru.T) @ rd.T
    check("gated_mlp", got, ref)
    with pytest.raises(ValueError, match="down takes 48 features but gate produces 80"):
        ops.gated_mlp(x, wg, wu, wg)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmts", [("bf16", "bf16", "bf16"), ("nvfp4", "nvfp4", "fp8"), ("fp8", "fp8", "nvfp4"),
                                  ("bf16", "fp8", "f32")], ids=lambda f: "-".join(f))
def test_gated_mlp_bf16_decode(dev, fmts):
    """numerics='bf16', decode=True (the shared expert and dense MLPs of decode / verify
    chunks): bitwise the three linear_bf16(decode=True) and silu_mul it stands for (on CUDA
    one unit: x rounded once, gate and up reduced straight into bf16(silu(gate) * up), down;
    gate and up of different formats take the steps one by one), and within fp32 summation
    order of a float64 reference over the rounded operands. K split over CTAs (2048 inputs),
    feature tails, more than 256 rows (two row chunks)."""
    need_device(dev, "linear_bf16")
    rng = rng_for("mlp-bf16-decode", *fmts)
    d, f = 2048, 144
    wg, rg = make_weight(fmts[0], f, d, rng)
    wu, ru = make_weight(fmts[1], f, d, rng)
    wd, rd = make_weight(fmts[2], 96, f, rng)
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    for m in (1, 9, 300):
        x = rng.standard_normal((m, d)).astype(np.float32)
        xd = to_dev(x, dev)
        got = to_np(ops.gated_mlp(xd, on(wg), on(wu), on(wd), numerics="bf16", decode=True))
        g = ops.linear_bf16(xd, on(wg), decode=True)
        u = ops.linear_bf16(xd, on(wu), decode=True)
        h = ops.silu_mul(g, u)
        steps = to_np(ops.linear_bf16(h, on(wd), decode=True))
        assert np.array_equal(got.view(np.uint32), steps.view(np.uint32)), (m, np.abs(got - steps).max())
        xr = refs.bf16_round(x).double().numpy()
        rb = [refs.bf16_round(np.from_dlpack(w.dequantize())).double().numpy() for w in (wg, wu, wd)]
        hr = refs.bf16_round(_silu_mul32((xr @ rb[0].T).astype(np.float32),
                                         (xr @ rb[1].T).astype(np.float32))).double().numpy()
        check("linear_bf16", got, hr @ rb[2].T, 1e-8)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("numerics", ["exact", "bf16", "fp8"])
def test_linear_many(dev, numerics):
    """linear_many: several projections of one x (GLM-5.3's q_a / kv_a / indexer wk /
    weights_proj), each bitwise the single linear_as call it stands for, for prompt and decode
    chunks (on CUDA, decode with BF16 numerics: x rounded once for every weight, then the
    skinny kernel per weight: split and unsplit, formats with different k-stages, an FP8
    weight that 'fp8' numerics sends to linear_fp8 beside ones it sends to linear_bf16)."""
    need_device(dev, "linear_bf16" if numerics != "exact" else "linear")
    if numerics == "fp8" and not ops.linear_fp8_available(dev if dev == "cpu" else "cuda:0"):
        pytest.skip("no FP8 GEMM for this device in this build")
    rng = rng_for("linear-many", numerics)
    k = 1024
    ws = [make_weight(f, n, k, rng)[0] for f, n in [("bf16", 576), ("nvfp4", 200), ("fp8", 128), ("f32", 32)]]
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    single = {"exact": lambda x, w, d: ops.linear(x, w),
              "bf16": lambda x, w, d: ops.linear_bf16(x, w, decode=d),
              "fp8": lambda x, w, d: (ops.linear_fp8(x, w) if w.format == "fp8-block128"
                                      else ops.linear_bf16(x, w, decode=d))}[numerics]
    for m in (1, 7):
        x = to_dev(rng.standard_normal((m, k)).astype(np.float32), dev)
        for decode in (False, True):
            got = ops.linear_many(x, [on(w) for w in ws], numerics=numerics, decode=decode)
            assert len(got) == len(ws)
            for w, g in zip(ws, got):
                want = to_np(single(x, on(w), decode))
                assert np.array_equal(to_np(g).view(np.uint32), want.view(np.uint32)), (m, decode, w.format)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("numerics", ["exact", "bf16"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_linear_many_one_launch(dev, numerics, fmt):
    """linear_many over weights of one format (on CUDA one kernel for up to four of them:
    GLM-5.3's q_a / kv_a / indexer wk / weights_proj, q_b / indexer wq_b, a shared expert's
    gate / up; exact: the SIMT GEMV, bf16 decode: the skinny tensor-core kernel): each output
    bitwise the single call, with different K splits in one launch (K = 4096), five weights
    (four in one launch, then one), 1 and 7 rows; exact also against the float64 reference."""
    need_device(dev, "linear_bf16" if numerics == "bf16" else "linear")
    rng = rng_for("linear-many-exact", fmt, numerics)
    k = 4096
    ws = [make_weight(fmt, n, k, rng) for n in (576, 200, 32, 8, 48)]
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    single = (lambda x, w: ops.linear(x, w)) if numerics == "exact" else \
        (lambda x, w: ops.linear_bf16(x, w, decode=True))
    for m in (1, 7):
        xn = rng.standard_normal((m, k)).astype(np.float32)
        x = to_dev(xn, dev)
        got = ops.linear_many(x, [on(w) for w, _ in ws], numerics=numerics, decode=numerics == "bf16")
        for (w, wref), g in zip(ws, got):
            want = to_np(single(x, on(w)))
            assert np.array_equal(to_np(g).view(np.uint32), want.view(np.uint32)), (m, w.out_features)
            if numerics == "exact":
                check("linear", to_np(g), xn.astype(np.float64) @ wref.T)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "f32"])
def test_gated_mlp_exact_one_launch(dev, fmt):
    """gated_mlp with exact numerics (a dense MLP or shared expert with decode_gemm='exact'):
    bitwise linear(gate), linear(up), silu_mul and linear(down) one by one (on CUDA gate, up and
    silu_mul are one launch of the many-GEMM kernel: gate's and up's blocks of a column block
    count on one counter and the last writes silu(gate) * up). K = 4096 with 96 features
    (K split over blocks), K = 256 with 1000 features (several column groups per block, a
    tail), 1 / 7 rows, 300 rows (one by one: over the kernel's 256), gate and up of different
    formats (one by one)."""
    need_device(dev, "linear")
    rng = rng_for("mlp-exact-one-launch", fmt)
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    for d, f, up_fmt in ((4096, 96, fmt), (256, 1000, fmt), (1024, 64, "bf16" if fmt != "bf16" else "fp8")):
        wg, rg = make_weight(fmt, f, d, rng)
        wu, ru = make_weight(up_fmt, f, d, rng)
        wd, _ = make_weight("bf16", 40, f, rng)
        for m in (1, 7, 300) if d == 256 else (1, 7):
            xn = rng.standard_normal((m, d)).astype(np.float32)
            x = to_dev(xn, dev)
            got = to_np(ops.gated_mlp(x, on(wg), on(wu), on(wd), numerics="exact"))
            h = ops.silu_mul(ops.linear(x, on(wg)), ops.linear(x, on(wu)))
            want = to_np(ops.linear(h, on(wd)))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (d, f, m, np.abs(got - want).max())
            if m == 1:
                x64 = xn.astype(np.float64)
                check("gated_mlp", got, refs.silu_mul(x64 @ rg.T, x64 @ ru.T) @ np.from_dlpack(wd.dequantize()).T)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("numerics,decode", [("exact", False), ("bf16", True)])
def test_gated_mlp_accumulate(dev, numerics, decode):
    """gated_mlp(..., accumulate=True) (a shared expert added to the routed experts' sum, a
    dense MLP to the residual): out + the plain result, bit for bit."""
    need_device(dev, "linear_bf16" if numerics == "bf16" else "linear")
    rng = rng_for("mlp-acc", numerics)
    d, f = 1024, 96
    wg, _ = make_weight("bf16", f, d, rng)
    wu, _ = make_weight("bf16", f, d, rng)
    wd, _ = make_weight("fp8", 256, f, rng)
    on = (lambda w: w) if dev == "cpu" else (lambda w: w.to(dev))
    for m in (1, 6):
        x = to_dev(rng.standard_normal((m, d)).astype(np.float32), dev)
        base = rng.standard_normal((m, 256)).astype(np.float32)
        plain = to_np(ops.gated_mlp(x, on(wg), on(wu), on(wd), numerics=numerics, decode=decode))
        out = to_dev(base.copy(), dev)
        ops.gated_mlp(x, on(wg), on(wu), on(wd), out=out, numerics=numerics, decode=decode, accumulate=True)
        want = base + plain
        assert np.array_equal(to_np(out).view(np.uint32), want.view(np.uint32)), m


def test_op_errors_are_clear():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"w must be \[8\]"):
        ops.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="must have the same shape"):
        ops.silu_mul(x, np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="expected an array supporting DLPack"):
        ops.rms_norm([1.0, 2.0], np.ones(2, np.float32))
    with pytest.raises(ValueError, match="unsupported DLPack dtype"):
        ops.softmax(np.zeros((2, 2), np.complex64))


# ============================================================================= new ops
# copy, add, gather_rows, argmax, check_finite, cache_write, linear_heads, indexer_topk,
# mla_attention, block_attention, moe_route, moe_experts, dyn_conv, selector_walk: every
# one against an independent float64 reference written from ops.h (tests/refs.py).
# Index / selection outputs must match exactly; a reference with a discrete decision
# reports its smallest margin, and random data is redrawn until the decision is well-posed
# (an exact tie is kept only where the op must compute it exactly too, e.g. duplicated rows).
MARGIN = 1e-4  # relative (indexer) or absolute (routing, selector) distance from a flip


def well_posed(make, ref, tries=50):
    """Draws inputs with make(attempt) until ref(inputs) reports a margin > MARGIN."""
    for attempt in range(tries):
        inputs = make(attempt)
        out = ref(inputs)
        if out[-1] > MARGIN:
            return inputs, out
    raise AssertionError("could not draw well-posed inputs")


def i32(x):
    return np.ascontiguousarray(x, np.int32)


def make_pages(rng, lengths, bs, width, spare=2):
    """A paged cache layer holding lengths[s] rows of sequence s in shuffled blocks.

    Returns (cache [blocks * bs, width] F32, block_table I32 [S, max_blocks + 1]). Rows that
    hold no token are NaN and unused block-table entries are -1: an op that reads past a
    sequence, or through an entry it should not need, produces a NaN or fails validation."""
    nblk = [-(-L // bs) for L in lengths]
    total = sum(nblk) + spare
    perm = rng.permutation(total).astype(np.int32)
    bt = np.full((len(lengths), max(nblk) + 1), -1, np.int32)
    cache = np.full((total * bs, width), np.nan, np.float32)
    k = 0
    for s, (L, n) in enumerate(zip(lengths, nblk)):
        bt[s, :n] = perm[k:k + n]
        k += n
        for p in range(L):
            cache[refs.paged_slot(bt, s, p, bs)] = rng.standard_normal(width)
    return cache, bt


def page_lengths(rng, bs, n):
    """n sequence lengths that end exactly on a page boundary, one past it, and random."""
    out = []
    for i in range(n):
        pages = int(rng.integers(1, 4))
        out.append([pages * bs, pages * bs + 1, int(rng.integers(1, 4 * bs + 2))][i % 3])
    return out


def step_tokens(rng, lengths, bs, per_seq, extra=()):
    """The tokens of a step: per sequence its last position, the last and first positions
    of a random page, random earlier positions and `extra` ones (where they exist), in a
    shuffled order (each token is computed alone)."""
    seq, pos = [], []
    for s, L in enumerate(lengths):
        ps = {L - 1}
        page = int(rng.integers(1, L // bs + 1)) if L >= bs else 0
        ps.update(p for p in (page * bs - 1, page * bs) if 0 <= p < L)
        ps.update(int(p) for p in rng.integers(0, L, per_seq))
        ps.update(p for p in extra if 0 <= p < L)
        for p in sorted(ps):
            seq.append(s)
            pos.append(p)
    order = rng.permutation(len(seq))
    return i32(np.array(seq)[order]), i32(np.array(pos)[order])


# ----------------------------------------------------------------------------- data movement
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_copy_strided_3d(dev, dtype):
    need_device(dev, "copy")
    rng = rng_for("copy", dtype)
    npt = np.float32 if dtype == "f32" else np.int32
    for shape in [(1, 1, 1), (3, 5, 7), (4, 2, 33), (2, 17, 1)]:
        a, b, c = shape
        big = (rng.standard_normal((a + 2, b + 3, c + 4)) * 100).astype(npt)
        src = to_dev(big, dev).slice(0, 1, 1 + a).slice(1, 2, 2 + b).slice(2, 3, 3 + c)  # strided views
        dst = Guarded((a + 1, b + 2, c + 5), dev, npt)
        dview = dst.view.slice(0, 1, 1 + a).slice(1, 0, b).slice(2, 4, 4 + c)
        ops.copy(src, out=dview)
        exp = np.full(dst.shape, dst.sentinel, npt)
        exp[1:, :b, 4:4 + c] = big[1:1 + a, 2:2 + b, 3:3 + c]
        np.testing.assert_array_equal(dst.result(), exp)  # exact, nothing else touched
    # the transpose of a contiguous 5-D tensor (a permuted view), into a contiguous dst
    x = np.arange(2 * 3 * 4 * 5 * 6).astype(npt).reshape(2, 3, 4, 5, 6)
    xt = x.transpose(4, 2, 0, 3, 1)
    out = Guarded(xt.shape, dev, npt)
    ops.copy(to_dev(xt, dev) if dev == "cpu" else to_dev(np.ascontiguousarray(xt), dev), out=out.view)
    np.testing.assert_array_equal(out.result(), xt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16, torch.float16])
def test_copy_any_strides_both_sides_cpu(dtype):
    """Non-unit strides in the last dimension too (host views only)."""
    rng = rng_for("copy-steps", str(dtype))
    for shape in [(1, 1, 1), (3, 5, 7), (4, 2, 33)]:
        base = torch.from_numpy(rng.standard_normal((shape[0] * 2, shape[1] + 3, shape[2] * 3 + 1)) * 100)
        src = base.to(dtype)[::2, 1:1 + shape[1], ::3][:, :, :shape[2]]
        dst_big = torch.full((shape[0] + 1, shape[1] * 2, shape[2] * 2 + 2), -777, dtype=dtype)
        dst = dst_big[1:, ::2, 2::2][:, :, :shape[2]]
        assert tuple(src.shape) == tuple(dst.shape) == shape
        ref_big = dst_big.clone()
        ref_big[1:, ::2, 2::2][:, :, :shape[2]] = src
        ops.copy(src, out=dst)
        assert torch.equal(dst_big, ref_big)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
def test_copy_widens_into_f32(dev, src_dtype):
    need_device(dev, "copy")
    rng = rng_for("copy-widen", str(src_dtype))
    for shape in [(1, 1, 1), (3, 4, 9), (5, 1, 130)]:
        base = torch.from_numpy(rng.standard_normal((shape[0], shape[1] * 2, shape[2] + 4)).astype(np.float32) * 10)
        src = base.to(src_dtype)[:, ::2, 3:3 + shape[2]]
        out = Guarded(shape, dev)
        if dev == "cpu":
            ops.copy(to_dev(src, dev), out=out.view)
        else:  # the same strided view, on the device: [a, b, 2, c + 4][:, :, 0, 3:3 + c]
            a, b, c = shape
            dsrc = to_dev(base.to(src_dtype), dev).reshape([a, b, 2, c + 4]).slice(2, 0, 1).slice(3, 3, 3 + c)
            ops.copy(dsrc, out=out.view.reshape([a, b, 1, c]))
        np.testing.assert_array_equal(out.result(), src.float().numpy())  # widening is exact
    # strided F32 dst from F16
    src = torch.from_numpy(rng.standard_normal((4, 6)).astype(np.float16))
    if dev == "cpu":  # a numpy view
        dst_big = np.full((8, 7), SENTINEL, np.float32)
        ops.copy(src, out=dst_big[::2, 1:])
        np.testing.assert_array_equal(dst_big[::2, 1:], src.float().numpy())
        assert (dst_big[1::2] == SENTINEL).all() and (dst_big[:, 0] == SENTINEL).all()
    else:  # rows 0, 2, 4, 6 and columns 1.. of an [8, 7] device buffer, as [4, 1, 6]
        dst = Guarded((4, 2, 7), dev)
        ops.copy(to_dev(src, dev).reshape([4, 1, 6]), out=dst.view.slice(1, 0, 1).slice(2, 1, 7))
        got = dst.result()
        np.testing.assert_array_equal(got[:, 0, 1:], src.float().numpy())
        assert (got[:, 1] == SENTINEL).all() and (got[:, 0, 0] == SENTINEL).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_add(dev):
    need_device(dev, "add")
    for shape in [(1, 1), (3, 17), (4, 1000), (2, 3, 5), (7, 4096)]:
        rng = rng_for("add", shape)
        a = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3], shape)).astype(np.float32)
        b = rng.standard_normal(shape).astype(np.float32)
        ref = refs.add(a, b)
        # one fp32 add per element: the float64 sum of two floats rounded once to fp32
        ref32 = ref.astype(np.float32)
        out = Guarded(shape, dev)
        ops.add(to_dev(a, dev), to_dev(b, dev), out=out.view)
        got = out.result()
        check("add", got, ref)
        np.testing.assert_array_equal(got, ref32)
        for alias in ["a", "b"]:  # the residual add: out is one of the inputs
            g = Guarded(shape, dev, init=a if alias == "a" else b)
            other = to_dev(b if alias == "a" else a, dev)
            if alias == "a":
                ops.add(g.view, other, out=g.view)
            else:
                ops.add(other, g.view, out=g.view)
            np.testing.assert_array_equal(g.result(), ref32)
    # rows strided by a wider tensor
    rng = rng_for("add-strided")
    wide = rng.standard_normal((5, 40)).astype(np.float32)
    b = rng.standard_normal((5, 24)).astype(np.float32)
    got = to_np(ops.add(to_dev(wide, dev).slice(1, 8, 32), to_dev(b, dev)))
    np.testing.assert_array_equal(got, refs.add(wide[:, 8:32], b).astype(np.float32))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("sdtype", ["f32", "bf16", "f16"])
def test_gather_rows(dev, sdtype):
    need_device(dev, "gather_rows")
    rng = rng_for("gather", sdtype)
    for (n, d) in [(1, 1), (97, 33), (5, 1000), (300, 7)]:
        src = rng.standard_normal((n, d)).astype(np.float32)
        st = refs.bf16_round(src) if sdtype == "bf16" else (src.astype(np.float16) if sdtype == "f16" else src)
        sref = refs.f64(st)
        for idx in [np.array([0], np.int32), i32(rng.integers(0, n, 11)), i32(np.full(4, n - 1))]:
            out = Guarded((len(idx), d), dev)
            ops.gather_rows(to_dev(st, dev), to_dev(idx, dev), out=out.view)
            np.testing.assert_array_equal(out.result(), sref[idx])
    src = np.zeros((6, 4), np.float32)
    for idx, bad, at in [([0, 6], 6, 1), ([-1], -1, 0), ([2, 7, 1], 7, 1)]:
        with pytest.raises(dflash2_rt.InvalidArgumentError, match=rf"gather_rows: index {bad} at position {at}"):
            ops.gather_rows(src, np.array(idx, np.int32))


@pytest.mark.parametrize("dev", DEVICES)
def test_resolve_tokens(dev):
    """Verify passes planned with references to drafts on the device: t < 0 -> src.flat[-t - 1]."""
    need_device(dev, "resolve_tokens")
    rng = rng_for("resolve_tokens")
    src = i32(rng.integers(0, 150000, (5, 7)))  # a drafter's [rows, K] drafts
    for T in [0, 1, 9, 300, 5000]:  # 5000: more than one block of threads per grid pass
        tok = i32(rng.integers(0, 1000, T))
        if T:
            refs_at = rng.random(T) < 0.6
            flat = rng.integers(0, src.size, T)
            tok[refs_at] = -(flat[refs_at] + 1)
            want = np.where(refs_at, src.reshape(-1)[flat], tok)
        else:
            want = tok.copy()
        t = to_dev(tok, dev)
        ops.resolve_tokens(t, to_dev(src, dev))
        np.testing.assert_array_equal(to_np(t), want)
    # the first and the last element, and 0 (a real token id) is left alone
    t = to_dev(i32([-1, 0, -35, 7]), dev)
    ops.resolve_tokens(t, to_dev(src, dev))
    np.testing.assert_array_equal(to_np(t), [src.flat[0], 0, src.flat[34], 7])
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"resolve_tokens: reference -36 at position 1"):
            ops.resolve_tokens(i32([-1, -36]), src)
    else:  # a reference past the source stays negative on the device
        t = to_dev(i32([-1, -36, 3]), dev)
        ops.resolve_tokens(t, to_dev(src, dev))
        np.testing.assert_array_equal(to_np(t), [src.flat[0], -36, 3])
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"resolve_tokens: argument 'src' must be I32"):
        ops.resolve_tokens(i32([1]), src.astype(np.int64))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"resolve_tokens: src must be contiguous"):
        ops.resolve_tokens(i32([1]), dflash2_rt.from_dlpack(src).slice(1, 0, 3))


@pytest.mark.parametrize("dev", DEVICES)
def test_next_after_accept(dev):
    """The token after each verify row once acceptance is known: accepted drafts, then the
    bonus (also for the rows past the accepted ones), and each sequence's last committed row."""
    need_device(dev, "next_after_accept")
    rng = rng_for("next_after_accept")
    K = 7
    drafts = i32(rng.integers(0, 150000, (6, K)))
    # sequences: all accepted, none, some, no drafts at all, a short draft (room), a later draft row
    lens = [7, 7, 7, 0, 3, 7]
    acc = [7, 0, 4, 0, 2, 5]
    drow = [0, 1, 2, 0, 3, 5]
    row0 = np.cumsum([0] + [n + 1 for n in lens[:-1]])
    T = int(row0[-1] + lens[-1] + 1) + 3  # + rows of no sequence (padding): left alone
    bonus = i32(rng.integers(0, 150000, len(lens)))
    nxt = np.full(T, -5, np.int32)
    want = nxt.copy()
    for k, (n, a, d, r0) in enumerate(zip(lens, acc, drow, row0)):
        for j in range(n + 1):
            want[r0 + j] = drafts[d, j] if j < a else bonus[k]
    want_last = (row0 + np.array(acc)).astype(np.int32)
    t_next, t_last = to_dev(nxt, dev), to_dev(np.zeros(len(lens), np.int32), dev)
    ops.next_after_accept(*[to_dev(x, dev) for x in (i32(row0), i32(drow), i32(lens), i32(acc), bonus, drafts)],
                          t_next, t_last)
    np.testing.assert_array_equal(to_np(t_next), want)
    np.testing.assert_array_equal(to_np(t_last), want_last)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"next_after_accept: sequence 0 has rows"):
            ops.next_after_accept(i32([0]), i32([0]), i32([3]), i32([4]), i32([1]), drafts, i32([0] * 8), i32([0]))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"next_after_accept: drafts must be I32 \[N, K\]"):
        ops.next_after_accept(i32([0]), i32([0]), i32([3]), i32([1]), i32([1]), i32([1, 2]), i32([0] * 8), i32([0]))


@pytest.mark.parametrize("dev", DEVICES)
def test_argmax(dev):
    need_device(dev, "argmax")
    # (4, 40000): 16-byte-aligned rows through the CUDA kernel's four-deep float4 loop (row 3:
    # a single maximum in a vector's last lane); (2, 154883): row 0 aligned with a 3-element
    # tail, row 1 misaligned (the scalar loop)
    for (r, v) in [(1, 1), (3, 17), (5, 1000), (2, 154880 // 16), (9, 2), (4, 40000), (2, 154883)]:
        rng = rng_for("argmax", r, v)
        x = rng.integers(-5, 5, (r, v)).astype(np.float32)  # many ties: the lowest id wins
        x[0] = 3.0  # a row of equal values: 0
        if r > 2:
            x[1] = -np.inf
            x[2, :] = -np.inf
            x[2, -1] = -1e30  # the only finite value, last
        if r > 3:
            x[3, min(v - 1, 4099)] = 100.0  # one maximum (4099 = 4 * 1024 + 3)
        out = Guarded((r,), dev, np.int32)
        ops.argmax(to_dev(x, dev), out=out.view)
        got = out.result()
        np.testing.assert_array_equal(got, refs.argmax_first(x))
        np.testing.assert_array_equal(got, x.argmax(1))  # numpy agrees: the first maximum
    # the documented NaN rule (comparisons with NaN are false)
    x = np.array([[np.nan, 1, 2], [1, np.nan, 3], [4, 4, np.nan]], np.float32)
    np.testing.assert_array_equal(to_np(ops.argmax(to_dev(x, dev))), [0, 2, 0])
    # long rows (on a GPU split over 4096-id chunks, ops.wide_rows(), and merged by each row's
    # last block; and one block per row with the switch off): NaN first, a chunk of NaNs
    # before the maximum, the maximum tied across chunks, -0 / +0 ties, the maximum last
    long = rng_for("argmax-long").integers(-5, 5, (6, 9000)).astype(np.float32)
    long[0, 0] = np.nan
    long[1, 0] = -100.0
    long[1, 1:4097] = np.nan
    long[2, [100, 5000, 8999]] = 50.0
    long[3] = -0.0
    long[3, 7000] = 0.0
    long[4, -1] = 1e30
    long[5] = -np.inf
    want = np.array([0, 4097 + int(np.argmax(long[1, 4097:])), 100, 0, 8999, 0], np.int32)
    np.testing.assert_array_equal(refs.argmax_first(long), want)
    was = ops.wide_rows()
    try:
        for wide in (True, False):
            ops.set_wide_rows(wide)
            np.testing.assert_array_equal(to_np(ops.argmax(to_dev(long, dev))), want)
    finally:
        ops.set_wide_rows(was)
    # strided rows
    wide = rng_for("argmax-wide").standard_normal((4, 50)).astype(np.float32)
    np.testing.assert_array_equal(to_np(ops.argmax(to_dev(wide, dev).slice(1, 10, 40))), wide[:, 10:40].argmax(1))


@pytest.mark.parametrize("dev", DEVICES)
def test_check_finite(dev):
    need_device(dev, "check_finite")
    rng = rng_for("finite")
    for v in [1, 5, 1000, 4099, 40000]:  # 40000: the CUDA kernel's four-deep float4 loop
        x = rng.standard_normal((9, v)).astype(np.float32)
        x[1, 0] = np.nan
        x[2, -1] = np.inf
        x[3, min(v - 1, v // 2 | 3)] = -np.inf  # alone, in a float4's last lane where rows are long
        x[4, :] = np.float32(3.4e38)  # large but finite (x * 0 is 0)
        x[5, :] = np.float32(-1e-45)  # denormal
        x[6, 0] = -0.0
        x[7, ::2] = np.nan  # several
        x[8, -1] = np.inf
        x[8, 0] = -np.inf
        was = ops.wide_rows()
        try:
            for wide in (True, False):  # long rows on a GPU: split over 4096-id chunks, or one block per row
                ops.set_wide_rows(wide)
                out = Guarded((9,), dev, np.int32)
                ops.check_finite(to_dev(x, dev), out=out.view)
                got = out.result()
                np.testing.assert_array_equal(got, refs.check_finite(x))
                np.testing.assert_array_equal(got, [0, 1, 1, 1, 0, 0, 0, 1, 1])
        finally:
            ops.set_wide_rows(was)
    wide = np.zeros((3, 20), np.float32)
    wide[1, 2] = np.nan  # outside the slice below
    wide[2, 12] = np.inf
    np.testing.assert_array_equal(to_np(ops.check_finite(to_dev(wide, dev).slice(1, 5, 15))), [0, 0, 1])


@pytest.mark.parametrize("dev", DEVICES)
def test_token_logprobs(dev):
    """log-softmax at chosen ids and the rows' log-sum-exp against float64 (to F32 rounding:
    the sums run in double), every row length the kernel's loops take, strided rows,
    non-finite rows (NaN in both outputs), large logits (no overflow: the max comes first)."""
    need_device(dev, "token_logprobs")
    rng = rng_for("token-logprobs")
    for v in [1, 3, 1000, 4099, 40000]:
        x = (rng.standard_normal((7, v)) * 4).astype(np.float32)
        x[3] += np.float32(1e4)  # exp(x) alone would overflow
        x[4, 0] = np.nan
        x[5, -1] = np.inf
        ids = rng.integers(0, v, 7).astype(np.int32)
        ids[6] = v - 1
        lp, lse = Guarded((7,), dev, np.float32), Guarded((7,), dev, np.float32)
        ops.token_logprobs(to_dev(x, dev), to_dev(ids, dev), lp.view, lse.view)
        got_lp, got_lse = lp.result(), lse.result()
        ok = [0, 1, 2, 3, 6]
        want_lp, want_lse = refs.token_logprobs(x[ok], ids[ok])
        np.testing.assert_allclose(got_lse[ok], want_lse, rtol=2e-7, atol=0)
        # lp is taken from the F32 lse: off by up to half an ulp of lse (row 3: lse ~ 1e4)
        assert (np.abs(got_lp[ok] - want_lp) <= 2e-6 + 6e-8 * np.abs(want_lse) + 1.2e-7 * np.abs(want_lp)).all()
        np.testing.assert_array_equal(got_lp[ok], (x[ok, ids[ok]].astype(np.float64) - got_lse[ok]).astype(np.float32))
        assert np.isnan(got_lp[[4, 5]]).all() and np.isnan(got_lse[[4, 5]]).all()
        if dev == "cuda":  # the CPU op's answer: the same double sums but for their order
            c_lp, c_lse = ops.token_logprobs(x, ids)
            assert (np.abs(got_lp[ok] - to_np(c_lp)[ok]) <= 1e-6 + 1.2e-7 * np.abs(want_lse)).all()
    wide = (rng.standard_normal((3, 20)) * 3).astype(np.float32)
    wide[1, 2] = np.nan  # outside the slice below
    lp, lse = ops.token_logprobs(to_dev(wide, dev).slice(1, 5, 15), to_dev(np.array([0, 9, 4], np.int32), dev))
    want_lp, want_lse = refs.token_logprobs(wide[:, 5:15], [0, 9, 4])
    np.testing.assert_allclose(to_np(lp), want_lp, rtol=2e-7, atol=2e-6)
    np.testing.assert_allclose(to_np(lse), want_lse, rtol=2e-7)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="outside the row"):
            ops.token_logprobs(wide, np.array([0, 20, 1], np.int32))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="ids"):
            ops.token_logprobs(wide, np.array([0, 1], np.int32))


@pytest.mark.parametrize("dev", DEVICES)
def test_apply_penalties(dev):
    """Presence / frequency / repetition penalties, logit bias and min_tokens' stop mask over
    verify blocks, bitwise against refs.apply_penalties (every operation one F32 rounding):
    each row counts the drafts before it, a sequence without a table row is untouched,
    repeated drafts count twice, positive and negative logits, rows past draft_len untouched."""
    need_device(dev, "apply_penalties")
    rng = rng_for("apply-penalties")
    for V, K in [(7, 3), (300, 8), (4099, 15)]:
        S, B = 5, 6
        lens = np.array([0, K, 2, K - 1, 1], np.int32)
        row0 = np.zeros(S, np.int32)
        row0[1:] = np.cumsum(lens + 1)[:-1]
        M = int(row0[-1] + lens[-1] + 1) + 2  # two rows after the last block: untouched
        logits = (rng.standard_normal((M, V)) * 3).astype(np.float32)
        draft = rng.integers(0, min(V, 6), (S + 1, K)).astype(np.int32)  # few ids: repeats
        draft_row = np.array([5, 0, 2, 1, 3], np.int32)
        state = rng.integers(0, 3, (B, V)).astype(np.int32)
        state |= (rng.random((B, V)) < 0.2).astype(np.int32) << 29  # stop tokens
        state |= (rng.random((B, V)) < 0.3).astype(np.int32) << 30  # prompt tokens
        bias = np.where(rng.random((B, V)) < 0.1, rng.uniform(-5, 5, (B, V)), 0).astype(np.float32)
        seq = np.array([[4, 1], [1, 3], [-1, 9], [0, 0], [5, 1]], np.int32)
        params = np.array([[0.5, 0.25, 1.3], [-0.7, 1.1, 0.8], [2, 2, 2], [0.0, 0.3, 1.0], [1.5, -2.0, 2.5]],
                          np.float32)
        want = refs.apply_penalties(logits, row0, draft, draft_row, lens, seq, params, state, bias)
        x = to_dev(logits.copy(), dev)
        ops.apply_penalties(x, to_dev(row0, dev), to_dev(draft, dev), to_dev(draft_row, dev), to_dev(lens, dev),
                            to_dev(seq, dev), to_dev(params, dev), to_dev(state, dev), to_dev(bias, dev))
        got = to_np(x)
        np.testing.assert_array_equal(got, want)
        r2 = int(row0[2])
        np.testing.assert_array_equal(got[r2:r2 + 3], logits[r2:r2 + 3])  # no table row
        np.testing.assert_array_equal(got[-2:], logits[-2:])
        assert (got != logits).any()
    # K = 0 drafts (the first tokens of prompts: one row per sequence)
    x = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    st = np.zeros((2, 50), np.int32)
    st[1, 7] = 2
    want = refs.apply_penalties(x, [0, 1, 2], np.zeros((1, 0), np.int32), [0, 0, 0], [0, 0, 0],
                                [[1, 0], [-1, 0], [0, 0]], [[1, 1, 1]] * 3, st, np.ones((2, 50), np.float32))
    xd = to_dev(x.copy(), dev)
    ops.apply_penalties(xd, to_dev(np.arange(3, dtype=np.int32), dev), to_dev(np.zeros((1, 0), np.int32), dev),
                        to_dev(np.zeros(3, np.int32), dev), to_dev(np.zeros(3, np.int32), dev),
                        to_dev(np.array([[1, 0], [-1, 0], [0, 0]], np.int32), dev),
                        to_dev(np.ones((3, 3), np.float32), dev), to_dev(st, dev),
                        to_dev(np.ones((2, 50), np.float32), dev))
    np.testing.assert_array_equal(to_np(xd), want)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="table row"):
            ops.apply_penalties(x.copy(), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                                np.zeros(1, np.int32), np.array([[2, 0]], np.int32), np.ones((1, 3), np.float32), st,
                                np.zeros((2, 50), np.float32))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="repetition penalty > 0"):
            ops.apply_penalties(x.copy(), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                                np.zeros(1, np.int32), np.array([[0, 0]], np.int32),
                                np.array([[0, 0, 0]], np.float32), st, np.zeros((2, 50), np.float32))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="vocabulary"):
            ops.apply_penalties(x.copy(), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                                np.zeros(1, np.int32), np.array([[0, 0]], np.int32), np.ones((1, 3), np.float32),
                                st[:, :49], np.zeros((2, 49), np.float32))


@pytest.mark.parametrize("dev", DEVICES)
def test_count_tokens(dev):
    """state[rows[i], ids[i]] += 1, repeated entries counted each time, negative rows skipped."""
    need_device(dev, "count_tokens")
    st = np.zeros((3, 9), np.int32)
    st[2, 4] = 1 << 30  # a flag bit stays
    rows = np.array([0, 2, 2, -1, 0, 2, 1], np.int32)
    ids = np.array([3, 4, 4, 8, 3, 0, 8], np.int32)
    want = st.copy()
    d = to_dev(st.copy(), dev)
    ops.count_tokens(d, to_dev(rows, dev), to_dev(ids, dev))
    for r, i in zip(rows, ids):
        if r >= 0:
            want[r, i] += 1
    np.testing.assert_array_equal(to_np(d), want)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="outside the table"):
            ops.count_tokens(st, np.array([0], np.int32), np.array([9], np.int32))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="outside the table"):
            ops.count_tokens(st, np.array([3], np.int32), np.array([0], np.int32))


@pytest.mark.parametrize("dev", DEVICES)
def test_mask_logits(dev):
    """Structured output's token masks: a clear bit puts -FLT_MAX at that token of the row the
    mask names, a set bit leaves the logit bit for bit, rows < 0 and unnamed rows untouched,
    the vocabulary's last partial word and words past it (W wider than needed) handled."""
    need_device(dev, "mask_logits")
    rng = rng_for("mask-logits")
    fmax = np.finfo(np.float32).max
    for V, extra in [(5, 0), (64, 1), (4099, 0), (154880 // 16, 2)]:
        M, R = 7, 5
        W = (V + 31) // 32 + extra
        logits = (rng.standard_normal((M, V)) * 3).astype(np.float32)
        logits[0, 0] = np.inf  # a masked non-finite value is masked too
        bits = rng.random((R, W * 32)) < 0.3
        bits[1] = False  # nothing allowed
        bits[2] = True   # everything allowed
        masks = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
        rows = np.array([0, 3, 5, -1, 6], np.int32)
        want = logits.copy()
        for r, row in enumerate(rows):
            if row >= 0:
                want[row, ~bits[r, :V]] = -fmax
        x = to_dev(logits.copy(), dev)
        ops.mask_logits(x, to_dev(rows, dev), to_dev(masks, dev))
        got = to_np(x)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got[[1, 2, 4]], logits[[1, 2, 4]])
        assert (got[3] == -fmax).all() and np.array_equal(got[5], logits[5])
    if dev == "cpu":
        x = np.zeros((2, 40), np.float32)
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="outside the logits"):
            ops.mask_logits(x, np.array([2], np.int32), np.zeros((1, 2), np.int32))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="a bit per token"):
            ops.mask_logits(x, np.array([0], np.int32), np.zeros((1, 1), np.int32))


@pytest.mark.parametrize("dev", DEVICES)
def test_argmax_shard_and_merge_equal_argmax(dev):
    """Greedy decoding over a vocabulary split in N shards without gathering the logits: each
    shard's (max, id) pair, merged in shard order, is argmax over the whole row (the first
    maximum, also across shard boundaries), and the merged flag is check_finite's."""
    need_device(dev, "argmax_shard")
    # (5, 160000, 4): shards of 40000, through the CUDA kernel's four-deep float4 loop
    for (r, v, n) in [(1, 12, 2), (7, 64, 4), (5, 1000, 2), (3, 154880 // 64, 4), (9, 6, 3), (5, 160000, 4)]:
        rng = rng_for("argmax_shard", r, v, n)
        x = rng.integers(-4, 4, (r, v)).astype(np.float32)  # many ties, across shards too
        x[0] = 2.0  # every id ties: 0
        if r > 2:
            x[1, :] = -np.inf
            x[1, -1] = -1e30  # the only finite value is in the last shard
            x[2, v // n + 1] = np.nan  # a non-finite row: flagged
        if r > 4:
            x[3, v - 1] = np.inf
            x[4, :] = -3.0
            x[4, v // n] = 5.0  # the first id of shard 1 wins
            x[4, 2 * v // n - 1] = 5.0  # a tie later in the same row: the earlier id stays
        vs = v // n
        pairs = np.zeros((n, r, 2), np.float32)
        for k in range(n):
            out = Guarded((r, 2), dev, np.float32)
            ops.argmax_shard(to_dev(np.ascontiguousarray(x[:, k * vs:(k + 1) * vs]), dev), k * vs, out=out.view)
            pairs[k] = out.result()
        finite = refs.check_finite(x) == 0
        for i in range(r):
            for k in range(n):
                sh = x[i, k * vs:(k + 1) * vs]
                if np.all(np.isfinite(sh)):
                    assert pairs[k, i, 0] == sh.max() and pairs[k, i, 1] == k * vs + sh.argmax()
                else:
                    assert np.isnan(pairs[k, i, 0]) and pairs[k, i, 1] == k * vs
        ids, flags = Guarded((r,), dev, np.int32), Guarded((r,), dev, np.int32)
        ops.argmax_merge(to_dev(pairs, dev), ids=ids.view, flags=flags.view)
        got_ids, got_flags = ids.result(), flags.result()
        np.testing.assert_array_equal(got_flags, refs.check_finite(x))
        np.testing.assert_array_equal(got_ids[finite], x.argmax(1)[finite])
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="exact in F32"):
        ops.argmax_shard(to_dev(np.zeros((1, 4), np.float32), dev), (1 << 24) - 2)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"argmax_merge: pairs must be F32 \[N >= 1, R, 2\]"):
        ops.argmax_merge(to_dev(np.zeros((2, 3, 3), np.float32), dev))


@pytest.mark.parametrize("dev", DEVICES)
def test_topk_shard_and_merge_equal_topk(dev):
    """The drafter's LM head split by vocabulary: each shard's topk (positions in the shard),
    all-gathered and merged, is topk over the whole row -- values, ids and their order, with
    ties (within and across shards, +0 / -0 too) to the lower id and NaN last -- also for a
    merged k below the shards' k, and read from the packed layout the engine gathers (the
    shard's values and ids side by side in one F32 buffer, the ids as I32 bits)."""
    need_device(dev, "topk_merge")
    for (r, v, n, kin, k) in [(1, 12, 2, 3, 3), (6, 64, 4, 16, 16), (5, 1000, 2, 16, 9), (3, 154880 // 64, 4, 16, 16),
                              (4, 9, 3, 3, 2)]:
        rng = rng_for("topk_merge", r, v, n, kin)
        x = rng.integers(-3, 3, (r, v)).astype(np.float32)  # many ties, across shards too
        x[0] = 1.0  # every id ties: 0 .. k-1
        if r > 2:
            x[1, :] = -0.0
            x[1, ::3] = 0.0  # +0 == -0: the lower ids first, whichever sign
            x[2, : v // 2] = np.nan  # NaN last
        if r > 3:
            x[3, v - 1] = np.inf  # the last id of the last shard first
        vs = v // n
        packed = np.zeros((n, r, 2 * kin), np.float32)  # [values | ids as I32 bits] per shard row
        for s in range(n):
            sv, si = ops.topk(to_dev(np.ascontiguousarray(x[:, s * vs:(s + 1) * vs]), dev), kin)
            packed[s, :, :kin] = to_np(sv)
            packed[s, :, kin:] = to_np(si).view(np.float32)
        vals = packed[:, :, :kin]
        idx = packed.view(np.int32)[:, :, kin:]
        out_v, out_i = Guarded((r, k), dev), Guarded((r, k), dev, np.int32)
        ops.topk_merge(to_dev(vals, dev), to_dev(idx, dev), vs, values=out_v.view, indices=out_i.view)
        rv, ri = ops.topk(x, k)  # the CPU topk over the whole rows
        got_v, got_i = out_v.result(), out_i.result()
        np.testing.assert_array_equal(got_i, to_np(ri))
        np.testing.assert_array_equal(got_v.view(np.int32), to_np(rv).view(np.int32))  # bitwise: -0 stays -0
        np.testing.assert_array_equal(got_i[0], np.arange(k))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"values and indices must be \[2, k <= 3\]"):
        ops.topk_merge(to_dev(np.zeros((2, 2, 3), np.float32), dev), to_dev(np.zeros((2, 2, 3), np.int32), dev), 4,
                       values=to_dev(np.zeros((2, 4), np.float32), dev), indices=to_dev(np.zeros((2, 4), np.int32), dev))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="shard_size 2 must be >= k"):
        ops.topk_merge(to_dev(np.zeros((2, 2, 3), np.float32), dev), to_dev(np.zeros((2, 2, 3), np.int32), dev), 2)
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="outside the shard's 4 positions"):
            ops.topk_merge(np.zeros((2, 2, 3), np.float32), np.full((2, 2, 3), 4, np.int32), 4)


@pytest.mark.parametrize("dev", DEVICES)
def test_accept_greedy_equals_accept(dev):
    """Greedy acceptance from the target's argmax ids equals accept over the logits with every
    temperature 0: accepted prefixes of every length, the bonus after them, ar rows (no draft)."""
    need_device(dev, "accept_greedy")
    rng = rng_for("accept_greedy")
    S, K, V = 6, 5, 40
    lens = np.array([5, 5, 3, 0, 1, 5], np.int32)
    row0 = np.concatenate([[0], np.cumsum(lens + 1)[:-1]]).astype(np.int32)
    M = int((lens + 1).sum())
    logits = rng.standard_normal((M, V)).astype(np.float32)
    ids = logits.argmax(1).astype(np.int32)
    drafts = rng.integers(0, V, (S + 1, K)).astype(np.int32)
    draft_row = np.array([2, 0, 1, 6, 3, 4], np.int32)
    for s, keep in enumerate([5, 2, 3, 0, 0, 0]):  # accept this many: copy the target's ids
        drafts[draft_row[s], :keep] = ids[row0[s]:row0[s] + keep]
    drafts[draft_row[5], 0] = ids[row0[5]]
    drafts[draft_row[5], 1] = (ids[row0[5] + 1] + 1) % V  # rejected at 1
    got_a, got_b = ops.accept_greedy(to_dev(ids, dev), to_dev(row0, dev), to_dev(drafts, dev),
                                     to_dev(draft_row, dev), to_dev(lens, dev))
    zeros_f, ones_f = np.zeros(S, np.float32), np.ones(S, np.float32)
    want_a, want_b = ops.accept(logits, row0, drafts, draft_row, lens, None, None, zeros_f, ones_f,
                                np.zeros(S, np.int32), np.zeros((S, 2), np.int64))
    np.testing.assert_array_equal(to_np(got_a), to_np(want_a))
    np.testing.assert_array_equal(to_np(got_b), to_np(want_b))
    np.testing.assert_array_equal(to_np(got_a), [5, 2, 3, 0, 0, 1])
    if dev == "cpu":
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="accept_greedy: sequence 0 needs ids rows"):
            ops.accept_greedy(ids[:3], row0, drafts, draft_row, lens)


# ----------------------------------------------------------------------------- paged caches
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bs", [1, 3, 16])
def test_cache_write(dev, bs):
    need_device(dev, "cache_write")
    rng = rng_for("cache_write", bs)
    d = 37
    lengths = page_lengths(rng, bs, 4)
    nblk = [-(-L // bs) for L in lengths]
    total = sum(nblk) + 2
    perm = rng.permutation(total).astype(np.int32)
    bt = np.full((len(lengths), max(nblk) + 1), -1, np.int32)
    k = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = perm[k:k + n]
        k += n
    # the step writes the last few tokens of every sequence (a prefill chunk / verify
    # block) plus padding rows with slot -1
    seq, pos = [], []
    for s, L in enumerate(lengths):
        for p in range(max(0, L - 1 - int(rng.integers(0, 2 * bs + 2))), L):
            seq.append(s)
            pos.append(p)
    slots = [refs.paged_slot(bt, s, p, bs) for s, p in zip(seq, pos)] + [-1, -7]
    slots = i32(np.array(slots)[rng.permutation(len(slots))])
    src = rng.standard_normal((len(slots), d)).astype(np.float32)
    init = rng.standard_normal((total * bs, d)).astype(np.float32)
    cache = Guarded(init.shape, dev, init=init)
    ops.cache_write(to_dev(src, dev), to_dev(slots, dev), cache.view)
    got = cache.result()
    np.testing.assert_array_equal(got, refs.cache_write(init, src, slots))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="cache_write: slot"):
        ops.cache_write(src[:1], np.array([total * bs], np.int32), np.zeros((total * bs, d), np.float32))


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("wdtype", ["f32", "bf16", "f16"])
def test_linear_heads(dev, wdtype):
    need_device(dev, "linear_heads")
    for (t, g, n, k) in [(1, 1, 1, 1), (3, 4, 17, 33), (5, 2, 64, 128), (2, 3, 7, 100), (9, 1, 5, 256)]:
        rng = rng_for("linear_heads", wdtype, t, g, n, k)
        # x: a slice of a wider projection (rows strided); w: rows strided too
        xw = rng.standard_normal((t, g, k + 9)).astype(np.float32)
        w = (rng.standard_normal((g, n, k + 3)) * 0.1).astype(np.float32)
        ww = refs.bf16_round(w) if wdtype == "bf16" else (w.astype(np.float16) if wdtype == "f16" else w)
        out = Guarded((t, g, n), dev)
        ops.linear_heads(to_dev(xw, dev).slice(2, 5, 5 + k), to_dev(ww, dev).slice(2, 0, k), out=out.view)
        check("linear_heads", out.result(), refs.linear_heads(xw[:, :, 5:5 + k], ww[:, :, :k]))


INDEXER_CASES = [  # (block size, nI heads, dI, topk)
    (1, 1, 7, 1),
    (1, 3, 20, 4),
    (3, 4, 64, 5),
    (3, 2, 33, 8),
    (16, 5, 16, 16),
    (16, 4, 32, 7),
    (64, 32, 128, 16),  # GLM-5.3's indexer: 32 heads x 128
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: "bs%d-h%d-d%d-k%d" % c)
def test_indexer_topk(dev, case):
    need_device(dev, "indexer_topk")
    bs, nI, dI, topk = case
    rng = rng_for("indexer", case)
    lengths = page_lengths(rng, bs, 4) + [topk, topk + 1, 3 * topk + 5]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    # positions below, at and above topk (p + 1 <= topk: every causal key, sel untouched)
    seq, pos = step_tokens(rng, lengths, bs, 3, extra=(topk - 2, topk - 1, topk, topk + 1))
    T = len(seq)

    def make(attempt):
        q = rng.standard_normal((T, nI, dI)).astype(np.float32)
        w = rng.standard_normal((T, nI)).astype(np.float32)
        return q, w

    (q, w), (ref_sel, ref_len, _) = well_posed(
        make, lambda a: refs.indexer_topk(a[0], a[1], key_cache, seq, pos, bt, bs, topk))
    assert (ref_len == -1).any() and (ref_len == topk).any()
    sel = Guarded((T, topk), dev, np.int32)
    sel_len = Guarded((T,), dev, np.int32)
    args = [to_dev(a, dev) for a in (q, w, key_cache, seq, pos, bt)]
    ops.indexer_topk(*args[:3], *args[3:], bs, topk, sel=sel.view, sel_len=sel_len.view)
    got_sel, got_len = sel.result(), sel_len.result()
    np.testing.assert_array_equal(got_len, ref_len)
    for t in range(T):
        if ref_len[t] < 0:
            assert (got_sel[t] == ISENTINEL).all(), f"token {t} (pos {pos[t]} <= topk - 1): sel was written"
        else:
            np.testing.assert_array_equal(got_sel[t], ref_sel[t], err_msg=f"token {t} at position {pos[t]}")
            assert (np.diff(got_sel[t]) > 0).all(), "selection not ascending"


@pytest.mark.parametrize("dev", DEVICES)
def test_indexer_topk_many_tokens_long_contexts(dev):
    """A chunk whose score grid fills the GPU without help (50 tokens over contexts of 2000+
    keys: on CUDA each block scores 256 keys, 8 steps of its 4 warps, where a decode token's
    blocks take 32 each): the CPU's selection for every token, and each token alone (fewer
    keys per block) selects the same keys."""
    need_device(dev, "indexer_topk")
    rng = rng_for("indexer-long")
    bs, nI, dI, topk = 16, 4, 16, 24
    lengths = [2100, 2300]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    seq = i32([t % 2 for t in range(50)])
    pos = i32([int(rng.integers(1000, lengths[t % 2])) for t in range(50)])
    T = len(seq)

    def make(attempt):
        return (rng.standard_normal((T, nI, dI)).astype(np.float32), rng.standard_normal((T, nI)).astype(np.float32))

    (q, w), (ref_sel, ref_len, _) = well_posed(
        make, lambda a: refs.indexer_topk(a[0], a[1], key_cache, seq, pos, bt, bs, topk))
    args = [to_dev(a, dev) for a in (key_cache, bt)]
    sel, sel_len = ops.indexer_topk(to_dev(q, dev), to_dev(w, dev), args[0], to_dev(seq, dev), to_dev(pos, dev),
                                    args[1], bs, topk)
    got_sel, got_len = to_np(sel), to_np(sel_len)
    np.testing.assert_array_equal(got_len, ref_len)
    np.testing.assert_array_equal(got_sel, ref_sel)
    for t in (0, 17, 49):
        one_sel, one_len = ops.indexer_topk(to_dev(q[t:t + 1], dev), to_dev(w[t:t + 1], dev), args[0],
                                            to_dev(seq[t:t + 1], dev), to_dev(pos[t:t + 1], dev), args[1], bs, topk)
        assert to_np(one_len)[0] == got_len[t]
        np.testing.assert_array_equal(to_np(one_sel)[0], got_sel[t])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bs", [1, 3, 16])
def test_indexer_topk_exact_ties_go_to_the_earlier_key(dev, bs):
    need_device(dev, "indexer_topk")
    rng = rng_for("indexer-ties", bs)
    nI, dI, L = 3, 12, 40
    q = np.abs(rng.standard_normal((1, nI, dI))).astype(np.float32) + 0.1  # positive entries
    w = np.abs(rng.standard_normal((1, nI))).astype(np.float32) + 0.1
    # keys: two rows duplicated at many positions (exact ties with a nonzero score), a few
    # distinct positive rows, and distinct all-negative rows (every head's product < 0:
    # score exactly 0, tied with each other whatever their values)
    a = np.abs(rng.standard_normal(dI)).astype(np.float32) * 2.0
    b = np.abs(rng.standard_normal(dI)).astype(np.float32)
    kind = rng.choice(["a", "b", "pos", "zero"], L, p=[0.15, 0.3, 0.1, 0.45])
    keys = np.empty((L, dI), np.float32)
    for p, kd in enumerate(kind):
        keys[p] = {"a": a, "b": b, "pos": np.abs(rng.standard_normal(dI)) * 0.5,
                   "zero": -np.abs(rng.standard_normal(dI)) - 0.05}[kd]
    score, _ = refs.indexer_scores(q[0], w[0], keys)
    distinct = np.unique(score)
    assert np.diff(distinct).min() > 1e-3 * np.abs(score).max(), "the distinct scores must be well apart"
    key_cache, bt = make_pages(rng, [L], bs, dI)
    for p in range(L):
        key_cache[refs.paged_slot(bt, 0, p, bs)] = keys[p]
    # topk values whose boundary falls inside the duplicated "a" / "b" groups and inside the zeros
    n_a, n_b, n_pos = (kind == "a").sum(), (kind == "b").sum(), (kind == "pos").sum()
    ranked = sorted(range(L), key=lambda j: (-score[j], j))
    for topk in sorted({max(1, n_a - 1), n_a + 1, n_a + n_b - 1, L - 3, L - 1, n_a + n_b + n_pos + 2}):
        sel, sel_len = ops.indexer_topk(*[to_dev(x, dev) for x in (q, w, key_cache, np.zeros(1, np.int32),
                                                                    np.array([L - 1], np.int32), bt)], bs, topk)
        exp_sel, exp_len, margin = refs.indexer_topk(q, w, key_cache, [0], [L - 1], bt, bs, topk)
        assert margin == np.inf
        np.testing.assert_array_equal(to_np(sel_len), exp_len)
        np.testing.assert_array_equal(to_np(sel)[0], exp_sel[0])
        np.testing.assert_array_equal(to_np(sel)[0], sorted(ranked[:topk]))


@pytest.mark.parametrize("dev", DEVICES)
def test_indexer_topk_contexts_longer_than_a_select_tile(dev):
    """Contexts of up to 20000 keys (CUDA's select walks them in tiles of 8192 positions, 8 per
    thread, and stops at the tile where the selection is complete) whose keys repeat 40 distinct
    rows (scores well apart, so every score is exactly tied with hundreds of others): the
    selection is the topk best, ties to the earlier key, for boundaries inside a tie group and
    tokens ending at, before and past a tile boundary."""
    need_device(dev, "indexer_topk")
    rng = rng_for("indexer-select-tiles")
    nI, dI, bs = 2, 8, 16
    q = np.abs(rng.standard_normal((1, nI, dI))).astype(np.float32) + 0.1
    w = np.abs(rng.standard_normal((1, nI))).astype(np.float32) + 0.1
    base = np.abs(rng.standard_normal(dI)).astype(np.float32) + 0.1
    pool = (base[None, :] * rng.permutation(0.5 + 0.04 * np.arange(40))[:, None]).astype(np.float32)
    pscore, _ = refs.indexer_scores(q[0], w[0], pool)
    assert np.diff(np.sort(pscore)).min() > 1e-4 * np.abs(pscore).max(), "the distinct scores must be well apart"
    lengths = [20000, 9000]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    which = [rng.integers(0, len(pool), L) for L in lengths]
    for s_, L in enumerate(lengths):
        for p in range(L):
            key_cache[refs.paged_slot(bt, s_, p, bs)] = pool[which[s_][p]]
    cases = [(0, 19999, 700), (0, 8191, 300), (0, 8192, 4096), (0, 16500, 9000), (1, 8999, 50), (1, 8193, 8100)]
    seq = i32([c[0] for c in cases])
    pos = i32([c[1] for c in cases])
    for t, (s_, p, topk) in enumerate(cases):
        score = pscore[which[s_][:p + 1]]
        ranked = sorted(range(p + 1), key=lambda j: (-score[j], j))
        want = np.sort(np.array(ranked[:topk], np.int32))
        sel, sel_len = ops.indexer_topk(*[to_dev(x, dev) for x in (q, w, key_cache, seq[t:t + 1], pos[t:t + 1], bt)],
                                        bs, topk)
        assert to_np(sel_len)[0] == topk
        np.testing.assert_array_equal(to_np(sel)[0], want, err_msg=f"token at {p} of sequence {s_}, topk {topk}")


@pytest.mark.parametrize("dev", DEVICES)
def test_indexer_topk_glm_sized(dev):
    """GLM-5's indexer shape (32 heads of 128, topk 2048, pages of 64) around the topk."""
    need_device(dev, "indexer_topk")
    rng = rng_for("indexer-glm")
    bs, nI, dI, topk = 64, 32, 128, 2048
    lengths = [topk, topk + 1, topk + 150]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    seq, pos = i32([0, 1, 2, 2]), i32([topk - 1, topk, topk + 149, topk + 63])
    (q, w), (ref_sel, ref_len, _) = well_posed(
        lambda a: (rng.standard_normal((4, nI, dI)).astype(np.float32), rng.standard_normal((4, nI)).astype(np.float32)),
        lambda a: refs.indexer_topk(a[0], a[1], key_cache, seq, pos, bt, bs, topk))
    sel = Guarded((4, topk), dev, np.int32)
    sel_len = Guarded((4,), dev, np.int32)
    ops.indexer_topk(*[to_dev(x, dev) for x in (q, w, key_cache, seq, pos, bt)], bs, topk, sel=sel.view,
                     sel_len=sel_len.view)
    got_sel, got_len = sel.result(), sel_len.result()
    np.testing.assert_array_equal(got_len, [-1, topk, topk, topk])
    assert (got_sel[0] == ISENTINEL).all()
    for t in range(1, 4):
        np.testing.assert_array_equal(got_sel[t], ref_sel[t])


MLA_CASES = [  # (block size, heads, kv_lora, rope)
    (1, 1, 8, 2),
    (1, 2, 16, 8),
    (3, 3, 33, 5),
    (3, 2, 64, 16),
    (16, 4, 64, 16),
    (16, 2, 128, 64),
    (64, 4, 512, 64),  # GLM-5's latent width
    (64, 16, 512, 64),  # GLM-5.3 at TP4: 16 heads per rank (the kernel's 16-head groups)
    (64, 64, 512, 64),  # GLM-5.3 at TP1: 64 heads
]


def mla_inputs(rng, case):
    bs, nh, kvl, rope = case
    lengths = page_lengths(rng, bs, 4) + [1, 2]
    cache, bt = make_pages(rng, lengths, bs, kvl + rope)
    seq, pos = step_tokens(rng, lengths, bs, 2, extra=(0, 1))
    T = len(seq)
    q_lat = rng.standard_normal((T, nh, kvl)).astype(np.float32)
    # q_pe: a strided slice of a wider projection
    q_wide = rng.standard_normal((T, nh, rope + 7)).astype(np.float32)
    q_pe = q_wide[:, :, 7:]
    return cache, bt, seq, pos, q_lat, q_pe, 1.0 / math.sqrt(kvl + rope)


def mla_selection(rng, pos):
    """A random selection per token (sel_len[t] distinct causal keys, in random order) for the
    tokens at position >= 2; -1 (every causal key) for the others."""
    T, W = len(pos), int(pos.max()) + 1
    sel = np.zeros((T, W), np.int32)
    sel_len = np.full(T, -1, np.int32)
    for t in range(T):
        p = int(pos[t])
        if p >= 2:
            n = int(rng.integers(1, p + 2))
            sel[t, :n] = rng.permutation(p + 1)[:n]
            sel_len[t] = n
    return sel, sel_len


def mla_args(dev, q_lat, q_pe, cache, seq, pos, bt):
    """The inputs on `dev`, q_pe still the strided slice of its wider base."""
    pe = to_dev(q_pe.base, dev).slice(2, 7, 7 + q_pe.shape[2])
    return [to_dev(q_lat, dev), pe] + [to_dev(x, dev) for x in (cache, seq, pos, bt)]



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: "bs%d-h%d-lora%d-rope%d" % c)
def test_mla_attention_dense(dev, case):
    need_device(dev, "mla_attention")
    rng = rng_for("mla-dense", case)
    cache, bt, seq, pos, q_lat, q_pe, scale = mla_inputs(rng, case)
    ref = refs.mla_attention(q_lat, q_pe, cache, seq, pos, bt, case[0], None, None, scale)
    out = Guarded(q_lat.shape, dev)
    ops.mla_attention(*mla_args(dev, q_lat, q_pe, cache, seq, pos, bt),
                      case[0], scale, out=out.view)  # no sel_len: every causal key
    got = out.result()
    check("mla_attention", got, ref)
    # sel given but sel_len undefined: still dense; sel_len all -1: dense too (on `dev`:
    # bitwise the same as `got`)
    T = len(seq)
    junk = to_dev(i32(np.zeros((T, 3))), dev)
    args = mla_args(dev, q_lat, q_pe, cache, seq, pos, bt)
    got2 = to_np(ops.mla_attention(*args, case[0], scale, sel=junk))
    np.testing.assert_array_equal(got2, got)
    got3 = to_np(ops.mla_attention(*args, case[0], scale, sel=junk, sel_len=to_dev(i32(np.full(T, -1)), dev)))
    np.testing.assert_array_equal(got3, got)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: "bs%d-h%d-lora%d-rope%d" % c)
def test_mla_attention_sparse(dev, case):
    need_device(dev, "mla_attention")
    rng = rng_for("mla-sparse", case)
    cache, bt, seq, pos, q_lat, q_pe, scale = mla_inputs(rng, case)
    T = len(seq)
    W = int(pos.max()) + 1 + 2
    sel = np.zeros((T, W), np.int32)
    sel_len = np.zeros(T, np.int32)
    for t in range(T):
        p = int(pos[t])
        mode = ["dense", "one", "two", "small", "full", "random"][t % 6]
        n = {"dense": -1, "one": 1, "two": min(2, p + 1), "small": min(3, p + 1), "full": p + 1,
             "random": int(rng.integers(1, p + 2))}[mode]
        keys = rng.permutation(p + 1)[:max(n, 0)]  # any order
        # columns past sel_len hold valid but wrong keys: reading them changes the result
        sel[t] = rng.integers(0, p + 1, W)
        sel[t, :len(keys)] = keys
        sel_len[t] = n
    ref = refs.mla_attention(q_lat, q_pe, cache, seq, pos, bt, case[0], sel, sel_len, scale)
    out = Guarded(q_lat.shape, dev)
    ops.mla_attention(*mla_args(dev, q_lat, q_pe, cache, seq, pos, bt),
                      case[0], scale, sel=to_dev(sel, dev), sel_len=to_dev(sel_len, dev), out=out.view)
    got = out.result()
    check("mla_attention", got, ref)
    # one selected key: out is that key's latent exactly up to the fp32 softmax of one score
    for t in np.nonzero(sel_len == 1)[0]:
        c = cache[refs.paged_slot(bt, int(seq[t]), int(sel[t, 0]), case[0]), :q_lat.shape[2]]
        np.testing.assert_allclose(got[t], np.broadcast_to(c, got[t].shape), rtol=1e-6, atol=1e-6)


def test_mla_attention_token_computed_alone():
    """A row of a verify block equals the same row decoded alone (bitwise)."""
    rng = rng_for("mla-alone")
    case = (3, 2, 33, 5)
    cache, bt, seq, pos, q_lat, q_pe, scale = mla_inputs(rng, case)
    full = np.from_dlpack(ops.mla_attention(q_lat, q_pe, cache, seq, pos, bt, 3, scale)).copy()
    for t in range(len(seq)):
        one = np.from_dlpack(ops.mla_attention(q_lat[t:t + 1], q_pe[t:t + 1], cache, seq[t:t + 1], pos[t:t + 1],
                                               bt, 3, scale))
        assert np.array_equal(one[0], full[t]), f"token {t} differs when computed alone"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_mla_attention_split_kv_equals_whole(dev, sparse, bf16):
    """200 tokens of a 400-token sequence at once (on CUDA: one block per token, keys walked
    in 64-key segments and folded in order) against tokens computed alone (on CUDA: split-KV,
    a block per segment, then the in-order combine): bitwise equal, so decode == verify
    whatever launch shape the batch size picks. With a BF16 cache (kv_lora 128: on CUDA the
    tensor-core kernel, 18 heads: two head tiles, the second partly padding) the same."""
    need_device(dev, "mla_attention")
    rng = rng_for("mla-split", sparse, bf16)
    bs, nh, kvl, rope, L = (16, 18, 128, 64, 400) if bf16 else (16, 2, 64, 16, 400)
    cache, bt = make_pages(rng, [L], bs, kvl + rope)
    if bf16:
        c16 = _bf16_tensor(cache, dev)
        cache = _bf16_host(c16).float().numpy()
    T = 200
    pos = i32(np.sort(rng.choice(L, T, replace=False)))
    seq = i32(np.zeros(T))
    q_lat = rng.standard_normal((T, nh, kvl)).astype(np.float32)
    q_pe = rng.standard_normal((T, nh, rope)).astype(np.float32)
    scale = 1.0 / math.sqrt(kvl + rope)
    extra = {}
    if sparse:
        W = 300
        sel = np.zeros((T, W), np.int32)
        sel_len = np.full(T, -1, np.int32)
        for t in range(T):
            p = int(pos[t])
            if p + 1 > W:  # as the indexer: a selection once there are more keys than columns
                sel[t] = rng.permutation(p + 1)[:W]
                sel_len[t] = int(rng.integers(W // 2, W + 1))
        extra = dict(sel=sel, sel_len=sel_len)
    dv = lambda a: to_dev(a, dev)  # noqa: E731
    kw = {k: dv(v) for k, v in extra.items()}
    dcache = c16 if bf16 else dv(cache)
    full = to_np(ops.mla_attention(dv(q_lat), dv(q_pe), dcache, dv(seq), dv(pos), dv(bt), bs, scale, **kw)).copy()
    ref = refs.mla_attention(q_lat, q_pe, cache, seq, pos, bt, bs, extra.get("sel"), extra.get("sel_len"), scale)
    check("mla_attention", full, ref)
    for t in (0, 1, 63, 64, 65, 130, 199):
        one_kw = {k: dv(np.ascontiguousarray(v[t:t + 1])) for k, v in extra.items()}
        one = to_np(ops.mla_attention(dv(q_lat[t:t + 1]), dv(q_pe[t:t + 1]), dcache, dv(seq[t:t + 1]),
                                      dv(pos[t:t + 1]), dv(bt), bs, scale, **one_kw))
        assert np.array_equal(one[0], full[t]), f"token {t} (position {int(pos[t])}) differs when computed alone"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", [MLA_CASES[2], MLA_CASES[5], MLA_CASES[6], MLA_CASES[8]],
                         ids=lambda c: "bs%d-h%d-lora%d-rope%d" % c)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_mla_attention_bf16_cache(dev, case, sparse):
    """mla_attention over a BF16 latent cache (Engine kv_cache_dtype="bf16"): the reference
    over the rounded values; bitwise the op over the F32 cache holding them, on the same
    device, wherever the SIMT kernel runs (the CPU; on CUDA with ops.mla_tc() off, and from a
    misaligned column view: BF16 rows widened exactly, 8 values per 16-byte load where the
    rows allow it, else one at a time); on CUDA's tensor cores (ops.mla_tc(), kv_lora 128 /
    512) the reference's values to fp32 rounding and not bitwise the SIMT kernel's (it ran).
    A token alone (split-KV on CUDA) equals its row of the batch bitwise in every mode."""
    need_device(dev, "mla_attention")
    rng = rng_for("mla-bf16", case, sparse)
    bs = case[0]
    cache, bt, seq, pos, q_lat, q_pe, scale = mla_inputs(rng, case)
    T, D = len(seq), cache.shape[1]
    kw = {}
    sel = sel_len = None
    if sparse:
        sel, sel_len = mla_selection(rng, pos)
        kw = dict(sel=to_dev(sel, dev), sel_len=to_dev(sel_len, dev))
    c16 = _bf16_tensor(cache, dev)
    rounded = _bf16_host(c16).float().numpy()
    # the same values at an odd column offset of wider rows: a misaligned BF16 view
    wide = _bf16_tensor(np.concatenate([np.zeros((cache.shape[0], 1), np.float32), rounded], axis=1), dev)
    views = {"aligned": c16, "misaligned": _bf16_cols(wide, 1, 1 + D)}
    ref = refs.mla_attention(q_lat, q_pe, rounded, seq, pos, bt, bs, sel, sel_len, scale)
    args = mla_args(dev, q_lat, q_pe, rounded, seq, pos, bt)
    want = to_np(ops.mla_attention(*args, bs, scale, **kw)).copy()  # the F32 cache of the rounded values
    check("mla_attention", want, ref)
    kvl, rope = case[2], case[3]
    tc_shape = dev == "cuda" and kvl % 128 == 0 and kvl <= 512 and (kvl + rope) % 32 == 0
    was = ops.mla_tc()
    try:
        for tc in ([False, True] if tc_shape else [False]):
            ops.set_mla_tc(tc)
            for name, view in views.items():
                out = Guarded(q_lat.shape, dev)
                ops.mla_attention(args[0], args[1], view, *args[3:], bs, scale, out=out.view, **kw)
                got = out.result()
                if tc and name == "aligned":
                    check("mla_attention", got, ref)
                    assert not np.array_equal(got, want), "the tensor-core kernel did not run"
                else:
                    assert np.array_equal(got, want), f"{name} BF16 cache != F32 cache of the rounded values (tc={tc})"
            t = T - 1  # a token alone (on CUDA split-KV where its keys span several segments)
            one_kw = {k: to_dev(np.ascontiguousarray(v[t:t + 1]), dev)
                      for k, v in (("sel", sel), ("sel_len", sel_len)) if v is not None}
            full = to_np(ops.mla_attention(args[0], args[1], c16, *args[3:], bs, scale, **kw)).copy()
            one = to_np(ops.mla_attention(to_dev(q_lat[t:t + 1], dev), to_dev(np.ascontiguousarray(q_pe[t:t + 1]), dev),
                                          c16, to_dev(seq[t:t + 1], dev), to_dev(pos[t:t + 1], dev), args[5], bs, scale,
                                          **one_kw))
            assert np.array_equal(one[0], full[t]), f"a token alone over the BF16 cache (tc={tc})"
    finally:
        ops.set_mla_tc(was)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", [INDEXER_CASES[3], INDEXER_CASES[5], INDEXER_CASES[6]],
                         ids=lambda c: "bs%d-h%d-d%d-k%d" % c)
def test_indexer_topk_bf16_cache(dev, case):
    """indexer_topk over BF16 index keys (Engine kv_cache_dtype="bf16"): the selection of
    the F32 cache holding the same rounded values, bitwise (scores and ties alike), from an
    aligned cache and a misaligned column view; and the reference's over the rounded keys."""
    need_device(dev, "indexer_topk")
    bs, nI, dI, topk = case
    rng = rng_for("indexer-bf16", case)
    lengths = page_lengths(rng, bs, 4) + [topk + 1, 3 * topk + 5]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    k16 = _bf16_tensor(key_cache, dev)
    rounded = _bf16_host(k16).float().numpy()
    wide = _bf16_tensor(np.concatenate([np.zeros((rounded.shape[0], 3), np.float32), rounded], axis=1), dev)
    seq, pos = step_tokens(rng, lengths, bs, 3, extra=(topk - 1, topk, topk + 1))
    T = len(seq)
    (q, w), (ref_sel, ref_len, _) = well_posed(
        lambda a: (rng.standard_normal((T, nI, dI)).astype(np.float32), rng.standard_normal((T, nI)).astype(np.float32)),
        lambda a: refs.indexer_topk(a[0], a[1], rounded, seq, pos, bt, bs, topk))
    dv = lambda a: to_dev(a, dev)  # noqa: E731

    def run(cache):
        sel = Guarded((T, topk), dev, np.int32)
        sel_len = Guarded((T,), dev, np.int32)
        ops.indexer_topk(dv(q), dv(w), cache, dv(seq), dv(pos), dv(bt), bs, topk, sel=sel.view, sel_len=sel_len.view)
        return sel.result(), sel_len.result()

    want_sel, want_len = run(dv(rounded))
    np.testing.assert_array_equal(want_len, ref_len)
    for t in range(T):
        if ref_len[t] >= 0:
            np.testing.assert_array_equal(want_sel[t], ref_sel[t])
    for name, view in (("aligned", k16), ("misaligned", _bf16_cols(wide, 3, 3 + dI))):
        got_sel, got_len = run(view)
        assert np.array_equal(got_len, want_len) and np.array_equal(got_sel, want_sel), name


def selection_is_reference(rng, dev, cache, values, seq, pos, bt, bs, nI, dI, topk=9):
    """indexer_topk over `cache` (on `dev`) selects the float64 reference's keys over `values` (the
    F32 values the cache holds) for random queries whose top-k boundary is clear of rounding."""
    T = len(seq)
    (q, w), (ref_sel, ref_len, _) = well_posed(
        lambda a: (rng.standard_normal((T, nI, dI)).astype(np.float32), rng.standard_normal((T, nI)).astype(np.float32)),
        lambda a: refs.indexer_topk(a[0], a[1], values, seq, pos, bt, bs, topk))
    dv = lambda a: to_dev(a, dev)  # noqa: E731
    sel, sel_len = ops.indexer_topk(dv(q), dv(w), cache, dv(seq), dv(pos), dv(bt), bs, topk)
    np.testing.assert_array_equal(to_np(sel_len), ref_len)
    for t in range(T):
        if ref_len[t] >= 0:
            np.testing.assert_array_equal(to_np(sel)[t], ref_sel[t])


INDEXER_SCORE_CASES = [  # (block size, nI, dI): the SIMT kernel's shapes, then the tensor-core kernel's
    (1, 3, 20),    # dI not a multiple of 8: SIMT for every cache
    (3, 2, 33),
    (3, 5, 16),    # tensor cores (BF16): one m-tile, 11 zero rows and 16 zero columns of padding
    (16, 20, 40),  # two m-tiles, dI padded to 64
    (64, 32, 128),  # GLM-5.3's indexer
    (4, 64, 256),  # the largest tensor-core shape: four m-tiles
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", INDEXER_SCORE_CASES, ids=lambda c: "bs%d-h%d-d%d" % c)
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_indexer_scores(dev, case, bf16):
    """indexer_scores, what indexer_topk selects from: the float64 reference over (rounded) keys
    0..pos, the rest of each row untouched; on CUDA's SIMT kernel (F32 caches; BF16 with
    ops.indexer_tc() off or a shape it does not take) bitwise the CPU's scores; on its tensor
    cores (BF16, at most 64 heads, dI a multiple of 8) the reference's to fp32 rounding, not
    bitwise the SIMT kernel's (it ran), a token alone bitwise its row of the batch, and
    indexer_topk's selection the reference's."""
    need_device(dev, "indexer_scores")
    bs, nI, dI = case
    rng = rng_for("indexer-scores", case, bf16)
    lengths = page_lengths(rng, bs, 4) + [150]
    key_cache, bt = make_pages(rng, lengths, bs, dI)
    if bf16:
        cache = _bf16_tensor(key_cache, dev)
        rounded = _bf16_host(cache).float().numpy()
    else:
        cache, rounded = to_dev(key_cache, dev), key_cache
    seq, pos = step_tokens(rng, lengths, bs, 3)
    T, C = len(seq), bt.shape[1] * bs
    q = rng.standard_normal((T, nI, dI)).astype(np.float32)
    w = rng.standard_normal((T, nI)).astype(np.float32)
    dv = lambda a: to_dev(a, dev)  # noqa: E731

    def scores(q_, w_, seq_, pos_):
        out = Guarded((len(seq_), C), dev)
        ops.indexer_scores(dv(q_), dv(w_), cache, dv(seq_), dv(pos_), dv(bt), bs, out=out.view)
        return out.result()

    got = scores(q, w, seq, pos)
    for t in range(T):
        n = int(pos[t]) + 1
        ref, _ = refs.indexer_scores(q[t], w[t], refs.paged_rows(rounded, bt, int(seq[t]), n, bs))
        check("indexer_scores", got[t, :n], ref)
        assert (got[t, n:] == SENTINEL).all(), f"token {t}: keys past its position were written"
    cpu = to_np(ops.indexer_scores(q, w, rounded, seq, pos, bt, bs))  # the CPU's, F32 cache of the same values
    tc_shape = dev == "cuda" and bf16 and nI <= 64 and dI % 8 == 0
    was = ops.indexer_tc()
    try:
        for tc in ([True, False] if tc_shape else [was]):
            ops.set_indexer_tc(tc)
            got = scores(q, w, seq, pos)
            mask = np.arange(C)[None, :] <= pos[:, None]
            if tc and tc_shape:
                assert not np.array_equal(got[mask], cpu[mask]), "the tensor-core kernel did not run"
                for t in (0, T - 1):  # a token alone: its row of the batch, bitwise
                    one = scores(q[t:t + 1], w[t:t + 1], seq[t:t + 1], pos[t:t + 1])
                    assert np.array_equal(one[0], got[t]), f"token {t} alone != its row"
                selection_is_reference(rng, dev, cache, rounded, seq, pos, bt, bs, nI, dI)
            else:
                assert np.array_equal(got[mask], cpu[mask]), f"SIMT scores != the CPU's (tc={tc})"
    finally:
        ops.set_indexer_tc(was)


BLOCK_ATTN_CASES = [  # (nh, kvh, hd, B, cache block size)
    (1, 1, 4, 1, 1),
    (2, 2, 5, 3, 3),
    (4, 2, 16, 4, 16),
    (3, 1, 8, 2, 3),
    (8, 2, 32, 5, 16),
    # blocks longer than the CUDA kernel's 8-row query groups, so a group starts past the
    # window (window 1, 2, 5 < 8): its context range is empty and only in-block keys count
    (4, 2, 8, 16, 4),
    (2, 1, 4, 10, 3),
]


def block_attn_inputs(rng, ctx, nh, kvh, hd, B, cbs):
    """A block-attention batch: the paged context of each sequence (ctx[s] keys, pages of
    cbs), q / k / v of its block of B rows, ctx_len and the softmax scale."""
    kv_cache, bt = make_pages(rng, ctx, cbs, 2 * kvh * hd)
    T = len(ctx) * B
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((T, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((T, kvh, hd)).astype(np.float32)
    return q, k, v, kv_cache, bt, i32(ctx), 1.0 / math.sqrt(hd)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", BLOCK_ATTN_CASES, ids=lambda c: "h%d-kv%d-d%d-B%d-cbs%d" % c)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_attention(dev, case, causal):
    need_device(dev, "block_attention")
    nh, kvh, hd, B, cbs = case
    rng = rng_for("block-attn", case, causal)
    # contexts: empty, ending on a page boundary, one past it, shorter than the block, long
    ctx = [0, 2 * cbs, 2 * cbs + 1, max(1, B - 1), 3 * cbs + 7]
    S = len(ctx)
    q, k, v, kv_cache, bt, ctx_len, scale = block_attn_inputs(rng, ctx, nh, kvh, hd, B, cbs)
    # window: full; 1 (no context key is visible to any query: j > L + i - 1 >= L - 1);
    # 2 (only the last context key, and only for i = 0); smaller than most contexts;
    # larger than every context
    for window in [0, 1, 2, 5, max(ctx) + B + 3]:
        ref = refs.block_attention(q, k, v, kv_cache, ctx_len, bt, B, window, causal, scale, cbs)
        out = Guarded(q.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (q, k, v, kv_cache, ctx_len, bt)], B, cbs, window=window,
                            causal=causal, scale=scale, out=out.view)
        got = out.result()
        check("block_attention", got, ref)
        if window == 1 and causal:  # the first query of a block sees only its own key
            for s in range(S):
                np.testing.assert_allclose(got[s * B], np.repeat(v[s * B], nh // kvh, axis=0), rtol=1e-6)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [(4, 2, 32, 8), (3, 1, 48, 5), (2, 1, 100, 4)], ids=lambda c: "h%d-kv%d-d%d-B%d" % c)
def test_block_attention_long_contexts(dev, causal, case):
    """Contexts of several key segments (the CUDA kernel folds keys in segments of at least
    256, and at a small batch gives each segment its own block, then combines them in order):
    against the reference (head dims of 1, 2 and 4 registers per lane, GQA groups that leave
    warps idle, windows, an empty context), and on CUDA the rows of a 3-block batch (split)
    bitwise equal to the same rows inside a batch of 480 blocks (one block walks every
    segment)."""
    need_device(dev, "block_attention")
    nh, kvh, hd, B = case
    cbs = 16
    rng = rng_for("block-attn-long", causal, case)
    ctx = [1500, 700, 0]
    S = len(ctx)
    q, k, v, kv_cache, bt, ctx_len, scale = block_attn_inputs(rng, ctx, nh, kvh, hd, B, cbs)
    for window in [0, B - 1, 600]:  # B - 1: later rows' windows start past the context
        ref = refs.block_attention(q, k, v, kv_cache, ctx_len, bt, B, window, causal, scale, cbs)
        out = Guarded(q.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (q, k, v, kv_cache, ctx_len, bt)], B, cbs, window=window,
                            causal=causal, scale=scale, out=out.view)
        got = out.result()
        check("block_attention", got, ref, tol=1e-10)
        if dev != "cuda":
            continue
        # the same blocks repeated 160 times: enough blocks (>= 160 x 2) that the kernel does not split
        R = 160
        qr, kr, vr = (np.concatenate([x] * R) for x in (q, k, v))
        big = Guarded(qr.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (qr, kr, vr, kv_cache, i32(ctx * R), np.concatenate([bt] * R))],
                            B, cbs, window=window, causal=causal, scale=scale, out=big.view)
        many = big.result()
        T = S * B
        for r in range(R):
            assert np.array_equal(many[r * T:(r + 1) * T], got), f"window {window}: copy {r} differs from the split rows"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [(16, 2, 128, 8), (32, 2, 64, 8), (6, 2, 32, 5), (2, 2, 16, 3), (4, 1, 48, 4)],
                         ids=lambda c: "h%d-kv%d-d%d-B%d" % c)
def test_block_attention_tensor_cores(dev, causal, case):
    """block_attention(tensor_cores=True), the drafter's under draft_gemm: on CUDA the BF16
    tensor-core kernel where it applies (head_dim 16 / 32 / 64 / 128; 48 takes the exact
    kernel), one 64-row tile per (block, kv head) or two (32 heads x 8 rows), contexts of
    one and of several 256-key segments (folded by the combine), windows, causal: within BF16
    rounding of the reference (NMSE <= 1e-4, and above 1e-9 where the kernel applies, so the
    BF16 path really ran), and a 4-block batch's rows bitwise equal to the same blocks
    inside a 40-block batch (the segmentation never depends on the batch). On the CPU the
    flag changes nothing (exact)."""
    need_device(dev, "block_attention")
    nh, kvh, hd, B = case
    cbs = 16
    rng = rng_for("block-attn-tc", causal, case)
    ctx = [1500, 700, 0, 33]
    S = len(ctx)
    q, k, v, kv_cache, bt, ctx_len, scale = block_attn_inputs(rng, ctx, nh, kvh, hd, B, cbs)
    tc = dev == "cuda" and hd in (16, 32, 64, 128)
    for window in [0, B - 1, 600]:
        ref = refs.block_attention(q, k, v, kv_cache, ctx_len, bt, B, window, causal, scale, cbs)
        out = Guarded(q.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (q, k, v, kv_cache, ctx_len, bt)], B, cbs, window=window,
                            causal=causal, scale=scale, out=out.view, tensor_cores=True)
        got = out.result()
        check("block_attention", got, ref, tol=1e-4 if tc else 1e-10)
        if tc:
            nmse = float(((got - ref) ** 2).sum() / (ref ** 2).sum())
            assert nmse > 1e-9, f"window {window}: NMSE {nmse:.2e}: the BF16 kernel did not run"
        if dev != "cuda":
            continue
        R = 10
        qr, kr, vr = (np.concatenate([x] * R) for x in (q, k, v))
        big = Guarded(qr.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (qr, kr, vr, kv_cache, i32(ctx * R), np.concatenate([bt] * R))],
                            B, cbs, window=window, causal=causal, scale=scale, out=big.view, tensor_cores=True)
        many = big.result()
        T = S * B
        for r in range(R):
            assert np.array_equal(many[r * T:(r + 1) * T], got), f"window {window}: copy {r} differs"


def _bf16_tensor(a, dev):
    """A torch BF16 tensor of float32 array `a` on `dev` (the ops take it through DLPack)."""
    t = torch.from_numpy(np.ascontiguousarray(a)).bfloat16()
    return t if dev == "cpu" else dflash2_rt.from_dlpack(t).to(dev)


def _bf16_host(t):
    """A torch CPU tensor of _bf16_tensor's result (a torch tensor or a device tensor)."""
    return t.clone() if isinstance(t, torch.Tensor) else torch.from_dlpack(t.to("cpu")).clone()


def _bf16_cols(t, a, b):
    return t[:, a:b] if isinstance(t, torch.Tensor) else t.slice(1, a, b)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bf16", [False, True])
def test_cache_write_many(dev, bf16):
    """cache_write_many: a layer's latent c and k_pe into two column slices of one cache
    (F32, or BF16: rounded to nearest even) and its index keys into another, with padding
    slots: bitwise the cache_write calls it stands for (on CUDA one kernel); a cache given
    twice over the same columns, or a source inside a cache, takes them one by one (the
    later write wins, as in order)."""
    need_device(dev, "cache_write_many")
    rng = rng_for("cache-write-many", bf16)
    rows, t = 40, 6
    slots = i32(rng.permutation(rows)[:t])
    slots[2] = -1
    src_c = rng.standard_normal((t, 48)).astype(np.float32)
    kva = rng.standard_normal((t, 64)).astype(np.float32)  # [c' 48 | k_pe 16]
    keys_src = rng.standard_normal((t, 24)).astype(np.float32)
    lat0 = rng.standard_normal((rows, 64)).astype(np.float32)
    keys0 = rng.standard_normal((rows, 24)).astype(np.float32)

    def run(many, same_twice=False):
        if bf16:
            lat, keys = _bf16_tensor(lat0, dev), _bf16_tensor(keys0, dev)
        else:
            lat, keys = to_dev(lat0.copy(), dev), to_dev(keys0.copy(), dev)
        kv = to_dev(kva, dev)
        srcs = [to_dev(src_c, dev), kv.slice(1, 48, 64), to_dev(keys_src, dev)]
        dsts = [_bf16_cols(lat, 0, 48), _bf16_cols(lat, 48, 64), keys]
        if same_twice:
            srcs, dsts = srcs + [kv.slice(1, 0, 16)], dsts + [_bf16_cols(lat, 48, 64)]
        sl = to_dev(slots, dev)
        if many:
            ops.cache_write_many(srcs, sl, dsts)
        else:
            for a, b in zip(srcs, dsts):
                ops.cache_write(a, sl, b)
        host = (lambda c: _bf16_host(c).float().numpy()) if bf16 else to_np
        return host(lat), host(keys)

    for twice in (False, True):
        got, want = run(True, twice), run(False, twice)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), twice
    lat, keys = run(True)
    ok = slots >= 0
    want_c = refs.bf16_round(src_c).float().numpy() if bf16 else src_c
    np.testing.assert_array_equal(lat[slots[ok], :48], want_c[ok])
    untouched = np.setdiff1d(np.arange(rows), slots[ok])
    lat_init = refs.bf16_round(lat0).float().numpy() if bf16 else lat0
    np.testing.assert_array_equal(lat[untouched], lat_init[untouched])
    with pytest.raises(ValueError, match="sources but"):
        ops.cache_write_many([to_dev(src_c, dev)], to_dev(slots, dev), [])


@pytest.mark.parametrize("dev", DEVICES)
def test_cache_write_bf16(dev):
    """cache_write into a BF16 cache (the DFlash drafter's under draft_gemm): each value
    rounded to nearest even as torch rounds float32 to bfloat16 (ties both ways, Inf, values
    past BF16's range, subnormals, -0; NaN stays NaN), padding slots skipped, the other rows
    untouched; D = 37 (the scalar kernel) and 64 (4 values per thread)."""
    need_device(dev, "cache_write")
    rng = rng_for("cache_write_bf16")
    for d in (37, 64):
        src = rng.standard_normal((6, d)).astype(np.float32)
        src[0, :6] = [np.inf, -np.inf, np.nan, 3.4e38, 1e-40, -0.0]
        src[1, :4] = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8)], np.float32)
        slots = i32([3, 0, -1, 7, 5, -2])
        init = rng.standard_normal((9, d)).astype(np.float32)
        cache = _bf16_tensor(init, dev)
        ops.cache_write(to_dev(src, dev), to_dev(slots, dev), cache)
        got = _bf16_host(cache)
        want = torch.from_numpy(init).bfloat16()
        for t, sl in enumerate(slots):
            if sl >= 0:
                want[sl] = torch.from_numpy(src[t]).bfloat16()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"D={d}: NaN positions"
        keep = ~torch.isnan(want)
        assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16)), f"D={d}: rounding"
    # into a column slice of a wider cache (the drafter writes K and V halves of [k | v] rows)
    src = rng.standard_normal((4, 16)).astype(np.float32)
    wide = _bf16_tensor(rng.standard_normal((6, 40)).astype(np.float32), dev)
    before = _bf16_host(wide)
    ops.cache_write(to_dev(src, dev), to_dev(i32([2, -1, 5, 0]), dev), _bf16_cols(wide, 16, 32))
    want = before.clone()
    for t, sl in enumerate([2, -1, 5, 0]):
        if sl >= 0:
            want[sl, 16:32] = torch.from_numpy(src[t]).bfloat16()
    assert torch.equal(_bf16_host(wide).view(torch.int16), want.view(torch.int16)), "column slice"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["exact", "tc"])
@pytest.mark.parametrize("case", [(16, 2, 128, 8), (6, 2, 32, 5), (4, 1, 48, 4)], ids=lambda c: "h%d-kv%d-d%d-B%d" % c)
def test_block_attention_bf16_cache(dev, tensor_cores, case):
    """block_attention over a BF16 context cache (the drafter's under draft_gemm): against the
    reference over the same cache values widened to float32, exact (NMSE <= 1e-10) or on the
    tensor cores (head_dim 16 / 32 / 64 / 128 on CUDA: NMSE <= 1e-4 and > 1e-9, and bitwise
    what the kernel gives over the F32 cache it rounds the same way), windows and causal
    included, contexts of one and of several segments."""
    need_device(dev, "block_attention")
    nh, kvh, hd, B = case
    cbs = 16
    rng = rng_for("block-attn-bf16", tensor_cores, case)
    ctx = [700, 0, 33]
    q, k, v, kv_cache, bt, ctx_len, scale = block_attn_inputs(rng, ctx, nh, kvh, hd, B, cbs)
    kv16 = _bf16_tensor(kv_cache, dev)
    kv_ref = _bf16_host(kv16).float().numpy()
    tc = tensor_cores and dev == "cuda" and hd in (16, 32, 64, 128)
    for causal, window in [(False, 0), (True, B - 1), (False, 600)]:
        ref = refs.block_attention(q, k, v, kv_ref, ctx_len, bt, B, window, causal, scale, cbs)
        out = Guarded(q.shape, dev)
        ops.block_attention(*[to_dev(x, dev) for x in (q, k, v)], kv16, *[to_dev(x, dev) for x in (ctx_len, bt)],
                            B, cbs, window=window, causal=causal, scale=scale, out=out.view, tensor_cores=tensor_cores)
        got = out.result()
        check("block_attention", got, ref, tol=1e-4 if tc else 1e-10)
        if tc:
            assert float(((got - ref) ** 2).sum() / (ref ** 2).sum()) > 1e-9, "the BF16 kernel did not run"
            f32 = Guarded(q.shape, dev)
            ops.block_attention(*[to_dev(x, dev) for x in (q, k, v, kv_cache, ctx_len, bt)], B, cbs, window=window,
                                causal=causal, scale=scale, out=f32.view, tensor_cores=True)
            assert np.array_equal(f32.result(), got), "BF16 cache != F32 cache rounded by the kernel"


# ----------------------------------------------------------------------------- MoE
ROUTE_CASES = [  # (E, n_group, topk_group, top_k)
    (8, 1, 1, 1),
    (8, 1, 1, 2),
    (13, 1, 1, 5),
    (16, 4, 2, 4),
    (12, 3, 1, 2),
    (12, 3, 3, 5),
    (64, 8, 4, 8),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "E%d-g%d-kg%d-k%d" % c)
@pytest.mark.parametrize("norm,scaling", [(True, 1.0), (True, 2.5), (False, 1.0), (False, 0.75)])
def test_moe_route(dev, case, norm, scaling):
    need_device(dev, "moe_route")
    E, ng, kg, k = case
    rng = rng_for("moe_route", case, norm, scaling)
    T = 9

    def make(attempt):
        logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.3).astype(np.float32)
        return logits, bias

    (logits, bias), (rid, rw, _) = well_posed(make, lambda a: refs.moe_route(a[0], a[1], k, ng, kg, norm, scaling))
    ids, w = Guarded((T, k), dev, np.int32), Guarded((T, k), dev)
    ops.moe_route(to_dev(logits, dev), to_dev(bias, dev), k, ng, kg, norm, scaling, ids=ids.view, weights=w.view)
    np.testing.assert_array_equal(ids.result(), rid)
    check("moe_route", w.result(), rw)


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_route_ties_go_to_the_lower_expert(dev):
    need_device(dev, "moe_route")
    # exact ties: equal logits and equal bias give bitwise equal choices
    logits = np.array([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0, 2.0, 0.0],    # 1, 3, 4, 6 tie for the top
                       [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],     # all tie
                       [0.0, 3.0, 0.0, 1.5, 0.0, 1.5, 0.0, 1.5]],    # 1, then 3, 5, 7 tie
                      np.float32)
    bias = np.zeros(8, np.float32)
    for k, exp in [(1, [[1], [0], [1]]), (2, [[1, 3], [0, 1], [1, 3]]), (3, [[1, 3, 4], [0, 1, 2], [1, 3, 5]])]:
        ids, w = ops.moe_route(to_dev(logits, dev), to_dev(bias, dev), k)
        np.testing.assert_array_equal(to_np(ids), exp)
        rid, rw, _ = refs.moe_route(logits, bias, k, 1, 1, True, 1.0)
        np.testing.assert_array_equal(rid, exp)
        check("moe_route", to_np(w), rw)
    # a bias breaks the tie: expert 6 (logit 2.0, bias +0.25) first, then 1 of 1, 3, 4
    bias2 = np.array([0, 0, 0, 0, 0, 0, 0.25, 0], np.float32)
    ids, _ = ops.moe_route(to_dev(logits[:1], dev), to_dev(bias2, dev), 2)
    np.testing.assert_array_equal(to_np(ids), [[1, 6]])
    # groups: E = 8 in 2 groups; group 1 (experts 4..7) clearly best; ties inside it go
    # to the lower id, and the dropped group's experts are never chosen even when tied
    logits = np.array([[1.0, -2.0, -2.0, -2.0, 1.0, 1.0, 1.0, 0.5]], np.float32)
    for kg, k, exp in [(1, 2, [[4, 5]]), (1, 3, [[4, 5, 6]]), (2, 3, [[0, 4, 5]])]:
        ids, w = ops.moe_route(to_dev(logits, dev), to_dev(bias, dev), k, 2, kg, False, 1.0)
        np.testing.assert_array_equal(to_np(ids), exp)
        np.testing.assert_array_equal(refs.moe_route(logits, bias, k, 2, kg, False, 1.0)[0], exp)
        check("moe_route", to_np(w), 1 / (1 + np.exp(-logits[0, exp[0]].astype(np.float64)))[None])


def make_experts(rng, E, H, F, wdtype):
    gate, up, down, ref = [], [], [], []
    for e in range(E):
        mats = []
        for (n, k) in [(F, H), (F, H), (H, F)]:
            w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
            if wdtype == "bf16":
                t = refs.bf16_round(w)
                mats.append((ops.Weight.dense(t, f"e{e}"), t.double().numpy()))
            else:
                mats.append((ops.Weight.dense(w, f"e{e}"), w.astype(np.float64)))
        gate.append(mats[0][0])
        up.append(mats[1][0])
        down.append(mats[2][0])
        ref.append(tuple(m[1] for m in mats))
    return gate, up, down, ref


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_moe_experts(dev, wdtype):
    need_device(dev, "moe_experts")
    rng = rng_for("moe_experts", wdtype)
    for (T, E, H, F, k) in [(1, 3, 8, 5, 1), (1, 6, 33, 17, 3), (6, 5, 24, 20, 2), (9, 8, 40, 31, 4),
                            (13, 4, 16, 48, 2)]:
        gate, up, down, eref = make_experts(rng, E, H, F, wdtype)
        x = rng.standard_normal((T, H)).astype(np.float32)
        # distinct experts per token, in ascending order (as moe_route gives them), with
        # the last expert never used and expert 0 used by every token when there are
        # several tokens (all routed to the same expert)
        ids = np.zeros((T, k), np.int32)
        for t in range(T):
            pool = rng.permutation(np.arange(1, E - 1))[:k - 1] if T > 1 else rng.permutation(E - 1)[:k - 1]
            first = 0 if T > 1 else int(rng.integers(0, E - 1))
            row = sorted({first, *map(int, pool)})
            while len(row) < k:
                row = sorted(set(row) | {int(rng.integers(0, E - 1))})
            ids[t] = row
        weights = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
        ref = refs.moe_experts(x, ids, weights, eref)
        out = Guarded((T, H), dev)
        ws = Guarded((ops.moe_workspace_floats(T, k, H, F, E),), dev)  # exactly the documented size
        on = (lambda ws_: ws_) if dev == "cpu" else (lambda ws_: [w.to(dev) for w in ws_])
        ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up), on(down),
                        out=out.view, workspace=ws.view)
        check("moe_experts", out.result(), ref)
        ws.result()  # the workspace's guards too
        assert (ids[:, :] != E - 1).all()
    # the binding sizes the workspace itself
    got = np.from_dlpack(ops.moe_experts(x, ids, weights, gate, up, down))
    check("moe_experts", got, ref)


def crowded_routing(rng, T, E, k, empty_two=False):
    """Top-k expert ids [T, k] (ascending per token): expert E - 1 never used, expert 0 by most
    tokens; with empty_two, expert 2 empty between used ones (its tokens moved to expert 3,
    which some then name twice)."""
    ids = np.zeros((T, k), np.int32)
    for t in range(T):
        row = [0] if t % 4 else []
        row += [int(e) for e in rng.permutation(np.arange(1, E - 1))[:k - len(row)]]
        ids[t] = sorted(row)
    if empty_two:
        ids[ids == 2] = 3
        assert not (ids == 2).any() and (ids == 3).any() and (ids == 1).any()
    return ids


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_moe_experts_exact_tc(dev, fmt):
    """ops.set_exact_tc(True): the exact routed experts on the tensor cores (x gathered as three
    BF16 planes, gate and up in one skinny grouped launch whose reduction writes silu(gate) * up
    as three planes, down to slot order) keep the exact numerics (NMSE against float64 as the
    SIMT kernels'; 1e-12 in the emulator, where dropping a plane exceeds it), change bits on
    CUDA only, and a token alone equals its row in the batch, bitwise. Cases: an empty expert
    between used ones, experts with more than one 8 / 16-token tile, K tails, K split over
    CTAs (H = 1024), 300 rows (past the arrival counters: the reduction kernels)."""
    need_device(dev, "moe_experts")
    rng = rng_for("moe-exact-tc", fmt)
    on = (lambda w: w) if dev == "cpu" else (lambda w: [v.to(dev) for v in w])
    tol = 1e-12 if dflash2_rt.build_info().get("cuda_emulated") and dev == "cuda" else None
    for case, (T, E, H, F, k) in enumerate([(6, 5, 208, 144, 2), (40, 6, 256, 160, 3), (7, 5, 1024, 64, 2),
                                            (150, 4, 64, 896, 2)]):
        mats = [[make_weight(fmt, n, kk, rng) for (n, kk) in [(F, H), (F, H), (H, F)]] for _ in range(E)]
        gate, up, down = ([m[i][0] for m in mats] for i in range(3))
        eref = [tuple(w for (_, w) in m) for m in mats]
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = crowded_routing(rng, T, E, k, empty_two=case == 0)
        weights = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
        ref = refs.moe_experts(x, ids, weights, eref)
        args = (to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up), on(down))
        tc, simt = on_and_off(ops.exact_tc, ops.set_exact_tc, lambda: to_np(ops.moe_experts(*args)))
        check("moe_experts", tc, ref, tol)
        check("moe_experts", simt, ref)
        assert np.array_equal(tc.view(np.uint32), simt.view(np.uint32)) == (dev == "cpu"), case
        was = ops.exact_tc()
        ops.set_exact_tc(True)
        try:
            for t in sorted({0, T // 2, T - 1}):
                one = to_np(ops.moe_experts(to_dev(x[t:t + 1], dev), to_dev(ids[t:t + 1], dev),
                                            to_dev(weights[t:t + 1], dev), on(gate), on(up), on(down)))
                assert np.array_equal(one[0].view(np.uint32), tc[t].view(np.uint32)), (case, t)
        finally:
            ops.set_exact_tc(was)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("numerics,decode", [("exact", False), ("bf16", True), ("bf16", False)])
def test_moe_experts_accumulate(dev, numerics, decode):
    """moe_experts(..., accumulate=True) (a single-rank MoE layer adds the routed experts' sum
    straight to the residual stream): out + the plain result, bit for bit (the sum formed
    first, then added once), on every expert path; and accumulate without an out is refused."""
    need_device(dev, "linear_bf16" if numerics == "bf16" else "moe_experts")
    rng = rng_for("moe-acc", numerics, decode)
    T, E, H, F, k = 5, 4, 64, 48, 2
    gate, up, down, _ = make_experts(rng, E, H, F, "bf16")
    x = to_dev(rng.standard_normal((T, H)).astype(np.float32), dev)
    ids = to_dev(np.array([[0, 1], [1, 2], [0, 2], [2, 0], [1, 0]], np.int32), dev)
    weights = to_dev(rng.uniform(0.05, 1.0, (T, k)).astype(np.float32), dev)
    on = (lambda ws_: ws_) if dev == "cpu" else (lambda ws_: [w.to(dev) for w in ws_])
    kw = dict(numerics=numerics, decode=decode)
    plain = to_np(ops.moe_experts(x, ids, weights, on(gate), on(up), on(down), **kw))
    base = rng.standard_normal((T, H)).astype(np.float32)
    out = to_dev(base.copy(), dev)
    ops.moe_experts(x, ids, weights, on(gate), on(up), on(down), out=out, accumulate=True, **kw)
    want = base + plain
    assert np.array_equal(to_np(out).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        ops.moe_experts(x, ids, weights, on(gate), on(up), on(down), accumulate=True, **kw)


@pytest.mark.parametrize("ids,weights", [
    ([[1, 1], [0, 2]], [[0.25, 0.5], [0.5, 0.5]]),  # expert 1 gets 2 rows of 2 tokens: fits
    ([[1, 1]], [[0.25, 0.5]]),  # 2 rows of 1 token: an expert gets up to T * top_k rows
    ([[2, 0, 2], [2, 2, 1]], [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]),
], ids=["fits", "T1", "T2-k3"])
def test_moe_experts_same_expert_twice_in_a_row(ids, weights):
    """ids naming one expert twice for a token: by the documented formula, out[t] is
    (w0 + w1) * expert(x[t]) (moe_route never does this, but moe_experts takes any ids)."""
    rng = rng_for("moe-dup", repr(ids))
    ids, weights = i32(ids), np.array(weights, np.float32)
    (T, k), E, H, F = ids.shape, 3, 16, 12
    gate, up, down, eref = make_experts(rng, E, H, F, "f32")
    x = rng.standard_normal((T, H)).astype(np.float32)
    out = Guarded((T, H), "cpu")
    ws = Guarded((ops.moe_workspace_floats(T, k, H, F, E),), "cpu")
    ops.moe_experts(x, ids, weights, gate, up, down, out=out.view, workspace=ws.view)
    check("moe_experts", out.result(), refs.moe_experts(x, ids, weights, eref))
    ws.result()


def _silu_mul32(g, u):
    g, u = np.float32(g), np.float32(u)
    with np.errstate(over="ignore"):  # exp(-g) = inf for g < -88: g / inf = -0, as in C
        return ((g / (np.float32(1) + np.exp(-g))) * u).astype(np.float32)


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_experts_fp8(dev):
    """numerics='fp8' (prompt chunks of FP8 checkpoints): every projection W8A8 as linear_fp8,
    against a float64 reference built from refs.linear_fp8 per slot (the fp32 intermediate
    rounded as the op rounds it); on CUDA the grouped GEMM. Tails: H and F not multiples of
    128, an expert with no token, one with most."""
    need_device(dev, "moe_experts_fp8")
    rng = rng_for("moe_fp8")
    # case 1: expert 0 empty (ids shifted by one); case 2: the last expert and expert 2 (a
    # middle one: its tokens moved to expert 3, which some then name twice) empty
    for case, (T, E, H, F, k) in enumerate([(5, 4, 208, 144, 2), (40, 6, 256, 128, 3)]):
        ws_ = []
        for _ in range(E):
            ws_.append([fp8_weight(F, H, rng), fp8_weight(F, H, rng), fp8_weight(H, F, rng)])
        gate = [w[0][0] for w in ws_]
        up = [w[1][0] for w in ws_]
        down = [w[2][0] for w in ws_]
        x = fp8_inputs(T, H, rng)
        ids = np.zeros((T, k), np.int32)
        for t in range(T):  # expert E - 1 never used; expert 0 by most tokens
            row = [0] if t % 4 else []
            row += [int(e) for e in rng.permutation(np.arange(1, E - 1))[:k - len(row)]]
            ids[t] = sorted(row)
        if case == 0:
            ids += 1
        else:
            ids[ids == 2] = 3
        assert not (ids == (0 if case == 0 else 2)).any()
        weights = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
        ref = np.zeros((T, H), np.float64)
        for t in range(T):
            for j in range(k):
                (_, qg, sg), (_, qu, su), (_, qd, sd) = ws_[ids[t, j]]
                g = refs.linear_fp8(x[t:t + 1], qg, sg).astype(np.float32)
                u = refs.linear_fp8(x[t:t + 1], qu, su).astype(np.float32)
                h = _silu_mul32(g, u)
                ref[t] += np.float64(weights[t, j]) * refs.linear_fp8(h, qd, sd)[0]
        on = (lambda w: w) if dev == "cpu" else (lambda w: [v.to(dev) for v in w])
        assert ops.moe_experts_fp8_available(dev if dev == "cpu" else "cuda:0", on(gate), on(up), on(down))
        out = Guarded((T, H), dev)
        ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up), on(down),
                        out=out.view, numerics="fp8")
        got = out.result()
        # on the GPU an E4M3 rounding of h may flip where the tensor cores' block sums and the
        # reference's differ: a step of 2^-4 (relative) in a few elements of h, each moving an
        # output row by that element's share. [CPU: 1.1e-14; H200, 2026-12-04: 2.3e-5 in the
        # first case (T 5, F 144: few elements, so one flip weighs much), over the 1e-5 first
        # guessed without a GPU]
        check("moe_experts", got, ref, 1e-4 if dev == "cuda" else 1e-10)
        exact = to_np(ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up),
                                      on(down)))
        assert nmse(got, exact) > 1e-6, "fp8 numerics gave the exact result"
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="FP8 block-128 experts"):
        g2, u2, d2, _ = make_experts(rng, 2, 16, 8, "f32")
        ops.moe_experts(np.zeros((1, 16), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32),
                        g2, u2, d2, numerics="fp8")
    assert not ops.moe_experts_fp8_available("cpu", g2, u2, d2)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8", "f32"])
@pytest.mark.parametrize("decode", [False, True], ids=["prompt", "decode"])
def test_moe_experts_bf16(dev, fmt, decode):
    """numerics='bf16': every projection as linear_bf16 (x, silu(gate) * up and the
    dequantized weights rounded to BF16, fp32 sums), against a float64 reference over the same
    rounded operands; on CUDA prompt chunks take the grouped GEMM that dequantizes in its main
    loop, decode chunks (decode=True) the skinny grouped GEMM of generated tokens, whose rows
    must also be bitwise the same for a token alone as in its batch. Cases: an empty expert
    between used ones, the last expert unused, experts with more than one 64-row (prompt) /
    32-token (decode) tile, N and K across 128-feature tiles, K tails (not multiples of 8 /
    32 where the format allows), K split over 2 (BF16 / F32 experts) and 4 - 8 (every
    format's gate and up at H = 1024) CTAs in the decode kernel, whose tiles' last CTAs write
    the results (one arrival counter per row and feature block) or, past the counters (300
    rows x 14 feature blocks), a reduction kernel: a token alone (counters) == its row in
    that batch (reduction kernel), bitwise."""
    need_device(dev, "moe_experts")
    rng = rng_for("moe_bf16", fmt)
    cases = [(6, 5, 208, 144, 2), (150, 4, 64, 48, 2), (40, 6, 256, 160, 3), (7, 5, 1024, 64, 2)]
    if decode:  # 300 rows x 14 feature blocks of gate | up: past the arrival counters, a reduction kernel
        cases.append((150, 4, 64, 896, 2))
    if fmt in ("bf16", "f32"):
        cases.append((9, 3, 40, 33, 2))
    for case, (T, E, H, F, k) in enumerate(cases):
        mats = [[make_weight(fmt, n, kk, rng) for (n, kk) in [(F, H), (F, H), (H, F)]] for _ in range(E)]
        gate, up, down = ([m[i][0] for m in mats] for i in range(3))
        rounded = [[refs.bf16_round(np.from_dlpack(w.dequantize())).double().numpy() for (w, _) in m] for m in mats]
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = crowded_routing(rng, T, E, k, empty_two=case == 0)
        weights = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
        xr = refs.bf16_round(x).double().numpy()
        ref = np.zeros((T, H), np.float64)
        for t in range(T):
            for j in range(k):
                wg, wu, wd = rounded[ids[t, j]]
                g = (xr[t] @ wg.T).astype(np.float32)
                u = (xr[t] @ wu.T).astype(np.float32)
                h = refs.bf16_round(_silu_mul32(g, u)).double().numpy()
                ref[t] += np.float64(weights[t, j]) * (h @ wd.T)
        on = (lambda w: w) if dev == "cpu" else (lambda w: [v.to(dev) for v in w])
        assert ops.moe_experts_bf16_available(dev if dev == "cpu" else "cuda:0", on(gate), on(up), on(down))
        out = Guarded((T, H), dev)
        ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up), on(down),
                        out=out.view, numerics="bf16", decode=decode)
        got = out.result()
        # fp32 sums of BF16 products: a BF16 rounding of silu(gate) * up flips where the fp32
        # and float64 sums straddle a rounding boundary (2^-8 in a rare element)
        check("moe_experts", got, ref, 1e-8)  # [CPU: 5e-15 without a flip, 4.3e-10 with one]
        if decode:  # a token's row alone == its row in the batch, bitwise (decode == verify)
            for t in sorted({0, T // 2, T - 1}):
                one = to_np(ops.moe_experts(to_dev(x[t:t + 1], dev), to_dev(ids[t:t + 1], dev),
                                            to_dev(weights[t:t + 1], dev), on(gate), on(up), on(down),
                                            numerics="bf16", decode=True))
                assert np.array_equal(one[0].view(np.uint32), got[t].view(np.uint32)), (case, t)
        exact = to_np(ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up),
                                      on(down)))
        assert nmse(got, exact) > 1e-9, "bf16 numerics gave the exact result"
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="'exact', 'bf16', 'fp8' or 'nvfp4'"):
        ops.moe_experts(np.zeros((1, 16), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32),
                        gate, up, down, numerics="fp4")


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_experts_nvfp4(dev):
    """numerics='nvfp4' (prompt chunks of NVFP4 checkpoints): every projection W4A4 as
    linear_nvfp4, each expert's activations quantized with its own input_scale (gate and up
    differing on one expert). On the CPU bitwise the composition of the CPU ops per slot; on
    CUDA the grouped block-scaled GEMM against it (the FP4 MMA's sums round differently, and
    an E2M1 rounding of silu(gate) * up may flip where they differ). Tails: an empty expert
    between used ones, the last expert unused, groups over 128 rows."""
    need_device(dev, "moe_experts_nvfp4")
    rng = rng_for("moe_nvfp4")
    for case, (T, E, H, F, k) in enumerate([(6, 5, 256, 160, 2), (150, 3, 64, 96, 2), (40, 6, 128, 64, 3)]):
        x = fp8_inputs(T, H, rng)
        base = float(np.abs(x).max()) / (6 * 448)
        gate, up, down = [], [], []
        for e in range(E):
            gs = base * (1.0 + 0.25 * e)
            gate.append(nvfp4_weight(F, H, rng, gs)[0])
            up.append(nvfp4_weight(F, H, rng, gs * (1.5 if e == 1 else 1.0))[0])
            down.append(nvfp4_weight(H, F, rng, 0.02 * (1.0 + 0.5 * e))[0])
        ids = np.zeros((T, k), np.int32)
        for t in range(T):  # expert E - 1 never used; expert 0 by most tokens
            row = [0] if t % 4 else []
            row += [int(e) for e in rng.permutation(np.arange(1, E - 1))[:k - len(row)]]
            ids[t] = sorted(row)
        if case == 0:  # expert 2 empty, between used ones
            ids[ids == 2] = 3
            assert not (ids == 2).any() and (ids == 1).any()
        weights = rng.uniform(0.05, 1.0, (T, k)).astype(np.float32)
        ref = np.zeros((T, H), np.float32)
        for t in range(T):
            for j in range(k):
                e = ids[t, j]
                g = ops.linear_nvfp4(x[t:t + 1], gate[e])
                u = ops.linear_nvfp4(x[t:t + 1], up[e])
                y = to_np(ops.linear_nvfp4(ops.silu_mul(g, u), down[e]))[0]
                ref[t] += y * weights[t, j]
        on = (lambda w: w) if dev == "cpu" else (lambda w: [v.to(dev) for v in w])
        assert ops.moe_experts_nvfp4_available(dev if dev == "cpu" else "cuda:0", on(gate), on(up), on(down))
        out = Guarded((T, H), dev)
        ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up), on(down),
                        out=out.view, numerics="nvfp4")
        got = out.result()
        if dev == "cpu":
            assert np.array_equal(got, ref), case
        else:  # an E2M1 flip of silu(gate) * up costs ~1e-4 here; a wrong layout or scale ~1
            check("moe_experts", got, ref, 1e-3)
        exact = to_np(ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), on(gate), on(up),
                                      on(down)))
        assert nmse(got, exact) > 1e-6, "nvfp4 numerics gave the exact result"
        if dev != "cpu":
            # the scales prepared at load (Weight.prepare_nvfp4_scales: no per-call swizzle):
            # bitwise the same; every expert's in cases 0 and 1, every other one's in case 2
            # (a mix: those not prepared are swizzled per call)
            pg, pu, pd = on(gate), on(up), on(down)
            for i, w in enumerate(pg + pu + pd):
                if case < 2 or i % 2 == 0:
                    assert w.prepare_nvfp4_scales() and w.nvfp4_scales_prepared
            prepared = to_np(ops.moe_experts(to_dev(x, dev), to_dev(ids, dev), to_dev(weights, dev), pg, pu, pd,
                                             numerics="nvfp4"))
            assert np.array_equal(prepared, got), case
    w0 = nvfp4_weight(32, 32, rng, 0.0)[0]  # no input_scale: W4A16 only
    assert not ops.moe_experts_nvfp4_available("cpu", [w0], [w0], [w0])
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="NVFP4 experts with an input_scale"):
        ops.moe_experts(np.zeros((1, 32), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32),
                        [w0], [w0], [w0], numerics="nvfp4")


# ----------------------------------------------------------------------------- DFlash drafter
DYN_CASES = [  # (blocks, B, H, G)
    (1, 1, 8, 1),
    (3, 2, 12, 3),
    (2, 5, 33, 11),
    (4, 4, 7, 7),
    (2, 16, 64, 8),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", DYN_CASES, ids=lambda c: "n%d-B%d-H%d-G%d" % c)
def test_dyn_conv(dev, case):
    need_device(dev, "dyn_conv")
    nb, B, H, G = case
    rng = rng_for("dyn_conv", case)
    R = nb * B
    x = rng.standard_normal((R, H)).astype(np.float32)
    base = rng.standard_normal((2, H)).astype(np.float32)
    wide = rng.standard_normal((R, 2 * G + 7)).astype(np.float32)
    dyn = wide[:, 3:3 + 2 * G]  # a strided column slice of a wider projection
    ref = refs.dyn_conv(x, base, dyn, B)
    out = Guarded((R, H), dev)
    dyn_dev = to_dev(wide, dev).slice(1, 3, 3 + 2 * G)  # strided on any device
    ops.dyn_conv(to_dev(x, dev), to_dev(base, dev), dyn_dev, B, out=out.view)
    got = out.result()
    check("dyn_conv", got, ref)
    # no tap across blocks: the first row of every block is the one-tap term alone
    np.testing.assert_allclose(got[::B], ref[::B], rtol=1e-6, atol=1e-6)
    # in place: out is x
    xin = Guarded((R, H), dev, init=x)
    ops.dyn_conv(xin.view, to_dev(base, dev), dyn_dev, B, out=xin.view)
    np.testing.assert_array_equal(xin.result(), got)  # same arithmetic, same result


SELECTOR_CASES = [  # (S, P, K, R, V)
    (1, 1, 1, 1, 3),
    (2, 4, 5, 8, 50),
    (3, 6, 8, 13, 100),
    (1, 9, 16, 32, 64),
]


def selector_inputs(rng, case, book_dtype):
    S, P, K, R, V = case
    vals = rng.standard_normal((S, P, K)).astype(np.float32)
    cand = i32(rng.integers(0, V, (S, P, K)))
    g = rng.standard_normal((S, P, R)).astype(np.float32)
    books = []
    for _ in range(2):
        b = rng.standard_normal((V, R)).astype(np.float32)
        books.append(refs.bf16_round(b) if book_dtype == "bf16" else (b.astype(np.float16) if book_dtype == "f16"
                                                                       else b))
    anchors = i32(rng.integers(0, V, S))
    return vals, cand, g, books[0], books[1], anchors


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", SELECTOR_CASES, ids=lambda c: "S%d-P%d-K%d-R%d-V%d" % c)
@pytest.mark.parametrize("book_dtype", ["f32", "bf16", "f16"])
def test_selector_walk_greedy(dev, case, book_dtype):
    need_device(dev, "selector_walk")
    rng = rng_for("selector-greedy", case, book_dtype)
    S, P, K = case[:3]
    inputs, (rtok, _, _) = well_posed(
        lambda a: selector_inputs(rng, case, book_dtype), lambda a: refs.selector_walk(*a, 0.0, None))
    tokens = Guarded((S, P), dev, np.int32)
    q = Guarded((S, P, K), dev)  # not written when greedy
    # On a device the op cannot read the temperatures, so q comes with an rng (q alone is refused)
    rng_state = None if dev == "cpu" else to_dev(np.zeros((S, 2), np.int64), dev)
    ops.selector_walk(*[to_dev(a, dev) for a in inputs], temperature=0.0, rng=rng_state, tokens=tokens.view,
                      q=q.view)
    np.testing.assert_array_equal(tokens.result(), rtok)
    assert (q.result() == SENTINEL).all(), "greedy walk wrote q"
    t2, q2 = ops.selector_walk(*[to_dev(a, dev) for a in inputs], temperature=0)
    np.testing.assert_array_equal(to_np(t2), rtok)
    assert q2 is None
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=r"temperature\[0\] must be finite and >= 0"):
        ops.selector_walk(*[to_dev(a, dev) for a in inputs], temperature=-1.0)


@pytest.mark.parametrize("dev", DEVICES)
def test_selector_walk_greedy_ties_go_to_the_first_candidate(dev):
    need_device(dev, "selector_walk")
    rng = rng_for("selector-ties")
    S, P, K, R, V = 2, 5, 6, 8, 40
    vals, cand, g, pred, succ, anchors = selector_inputs(rng, (S, P, K, R, V), "f32")
    # tokens 10 and 20 share their successor-codebook row (different predecessor rows):
    # with equal values they score exactly alike, and the first candidate must win
    succ[20] = succ[10]
    for s in range(S):
        for t in range(P):
            first, second = sorted(rng.choice(K, 2, replace=False))
            cand[s, t, first], cand[s, t, second] = (10, 20) if (s + t) % 2 else (20, 10)
            vals[s, t, first] = vals[s, t, second] = 50.0  # far above the rest
    tok, _ = ops.selector_walk(*[to_dev(a, dev) for a in (vals, cand, g, pred, succ, anchors)])
    rtok, _, margin = refs.selector_walk(vals, cand, g, pred, succ, anchors, 0.0, None)
    assert margin > MARGIN
    exp = np.where((np.arange(S)[:, None] + np.arange(P)[None]) % 2, 10, 20)
    np.testing.assert_array_equal(rtok, exp)
    np.testing.assert_array_equal(to_np(tok), exp)


def philox_uniforms(rng_rows, P):
    """The draws selector_walk takes: uniform(key_s, counter_s + t) for t < P."""
    return np.array([[refs.philox_uniform(k, c + t) for t in range(P)] for k, c in rng_rows])


def test_philox_reference_known_answers():
    """The reference Philox of tests/refs.py against Random123's known-answer vectors."""
    assert refs.philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)
    assert refs.philox4x32_10((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0)) == \
        (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", SELECTOR_CASES, ids=lambda c: "S%d-P%d-K%d-R%d-V%d" % c)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_selector_walk_sampled(dev, case, temperature):
    need_device(dev, "selector_walk")
    rng = rng_for("selector-sampled", case, temperature)
    S, P, K = case[:3]
    inputs = selector_inputs(rng, case, "bf16")
    (state,), (rtok, rq, _) = well_posed(
        lambda a: (np.stack([rng.integers(0, 2 ** 62, S), rng.integers(0, 2 ** 40, S)], 1).astype(np.int64),),
        lambda a: refs.selector_walk(*inputs, temperature, philox_uniforms(a[0], P)))
    tokens = Guarded((S, P), dev, np.int32)
    q = Guarded((S, P, K), dev)
    ops.selector_walk(*[to_dev(a, dev) for a in inputs], temperature=temperature, rng=to_dev(state, dev),
                      tokens=tokens.view, q=q.view)
    np.testing.assert_array_equal(tokens.result(), rtok)
    got_q = q.result()
    check("selector_walk", got_q, rq)
    np.testing.assert_allclose(got_q.sum(-1), 1.0, rtol=0, atol=1e-6)
    # per-sequence temperatures: sequence 0 greedy, the others sampled; the binding allocates q
    temps = np.full(S, temperature, np.float32)
    temps[0] = 0.0
    t1, q1 = ops.selector_walk(*[to_dev(a, dev) for a in inputs], temperature=to_dev(temps, dev), rng=to_dev(state, dev))
    vals, cand, g, pred, succ, anchors = inputs
    g0, _, _ = refs.selector_walk(vals[:1], cand[:1], g[:1], pred, succ, anchors[:1], 0.0, None)
    np.testing.assert_array_equal(to_np(t1)[0], g0[0])
    np.testing.assert_array_equal(to_np(t1)[1:], rtok[1:])


# ----------------------------------------------------------------------------- argument errors
def _f(*s):
    return np.zeros(s, np.float32)


def _i(*s):
    return np.zeros(s, np.int32)


def _w(n, k):
    return ops.Weight.dense(_f(n, k))


_BT = _i(2, 4)  # a block table of 2 sequences x 4 blocks (block 0), blocks of 4 rows
_SW = (_f(1, 2, 3), _i(1, 2, 3), _f(1, 2, 4), _f(10, 4), _f(10, 4), _i(1))  # selector_walk inputs

# (op call, the message: it names the op and the bad argument)
ARG_ERRORS = {
    "copy-shape": (lambda: ops.copy(_f(2, 3), out=_f(3, 2)), r"copy: 'src' .* and 'dst' .* same shape"),
    "copy-dtype": (lambda: ops.copy(_f(2, 3), out=np.zeros((2, 3), np.float16)), r"copy: src .* and dst .* same dtype"),
    "copy-i32-to-f32": (lambda: ops.copy(_i(2, 3), out=_f(2, 3)), r"copy: src I32.* and dst F32.* same dtype"),
    "add-shape": (lambda: ops.add(_f(2, 3), _f(2, 4)), r"add: 'a' .* and 'b' .* same shape"),
    "add-dtype": (lambda: ops.add(_f(2, 3), np.zeros((2, 3), np.float16)), r"add: argument 'b' must be F32"),
    "add-out": (lambda: ops.add(_f(2, 3), _f(2, 3), out=_i(2, 3)), r"add: argument 'out' must be F32"),
    "gather-src-1d": (lambda: ops.gather_rows(_f(5), _i(2)), r"gather_rows: src must be \[N, D\]"),
    "gather-idx-f32": (lambda: ops.gather_rows(_f(5, 3), _f(2)), r"gather_rows: argument 'idx' must be I32 or I64"),
    "gather-out": (lambda: ops.gather_rows(_f(5, 3), _i(2), out=_f(2, 4)), r"gather_rows: out must be \[2, 3\]"),
    "argmax-1d": (lambda: ops.argmax(_f(5)), r"argmax: argument 'x' must be F32 \[rows, cols\]"),
    "argmax-out": (lambda: ops.argmax(_f(2, 3), out=np.zeros(2, np.int64)), r"argmax: argument 'out' must be I32"),
    "argmax-out-len": (lambda: ops.argmax(_f(2, 3), out=_i(3)), r"argmax: argument 'out' must be I32 \[2\]"),
    "finite-flags": (lambda: ops.check_finite(_f(2, 3), out=_i(3)),
        r"check_finite: argument 'flags' must be I32 \[2\]"),
    "finite-f16": (lambda: ops.check_finite(np.zeros((2, 3), np.float16)), r"check_finite: argument 'x' must be F32"),
    "cache_write-width": (lambda: ops.cache_write(_f(2, 3), _i(2), _f(8, 4)),
        r"cache_write: src rows have 3 values but cache rows have 4"),
    "cache_write-slots": (lambda: ops.cache_write(_f(2, 3), _i(3), _f(8, 3)),
        r"cache_write: argument 'slots' must be I32 \[2\]"),
    "cache_write-slots-i64": (lambda: ops.cache_write(_f(2, 3), np.zeros(2, np.int64), _f(8, 3)),
        r"cache_write: argument 'slots' must be I32"),
    "linear_heads-x": (lambda: ops.linear_heads(_f(2, 3), _f(3, 4, 3)),
        r"linear_heads: argument 'x' must be F32 \[a, b, c\]"),
    "linear_heads-w": (lambda: ops.linear_heads(_f(2, 3, 5), _f(3, 4, 6)), r"linear_heads: x .* does not match w"),
    "linear_heads-w-i32": (lambda: ops.linear_heads(_f(2, 3, 5), _i(3, 4, 5)),
        r"linear_heads: argument 'w' must be F32, BF16 or F16"),
    "linear_heads-y": (lambda: ops.linear_heads(_f(2, 3, 5), _f(3, 4, 5), out=_f(2, 3, 5)),
        r"linear_heads: y must be \[2, 3, 4\]"),
    "indexer-q": (lambda: ops.indexer_topk(_f(2, 8), _f(2, 1), _f(8, 8), _i(2), _i(2), _BT, 4, 2),
        r"indexer_topk: argument 'q' must be F32 \[a, b, c\]"),
    "indexer-w": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 3), _f(8, 8), _i(2), _i(2), _BT, 4, 2),
        r"indexer_topk: w must be \[2, 2\]"),
    "indexer-keys": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 7), _i(2), _i(2), _BT, 4, 2),
        r"indexer_topk: key_cache rows have 7 values"),
    "indexer-seq": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(3), _i(2), _BT, 4, 2),
        r"indexer_topk: argument 'tok.seq' must be I32 \[2\]"),
    "indexer-topk": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(2), _i(2), _BT, 4, 0),
        r"indexer_topk: topk must be >= 1"),
    "indexer-block_size": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(2), _i(2), _BT, 0, 2),
        r"indexer_topk: block_size must be >= 1"),
    "indexer-sel": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(2), _i(2), _BT, 4, 2, sel=_i(2, 3)),
        r"indexer_topk: sel must be I32 \[2, 2\]"),
    "indexer-seq-range": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), i32([0, 5]), _i(2), _BT, 4, 2),
        r"indexer_topk: token 1 names block-table row 5"),
    "indexer-pos-range": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(2), i32([0, 99]), _BT, 4, 2),
        r"indexer_topk: token 1 at position 99 does not fit"),
    "indexer-block-range": (lambda: ops.indexer_topk(_f(2, 2, 8), _f(2, 2), _f(8, 8), _i(2), _i(2), np.full((2, 4), 9, np.int32), 4, 2),
        r"indexer_topk: block-table row 0 entry 0 = 9 is outside the cache"),
    "mla-q_pe": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 3, 4), _f(8, 12), _i(2), _i(2), _BT, 4, 1.0),
        r"mla_attention: q_pe .* does not match q_lat"),
    "mla-cache": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 2, 4), _f(8, 11), _i(2), _i(2), _BT, 4, 1.0),
        r"mla_attention: cache rows must hold kv_lora \+ rope = 12"),
    "mla-pos-i64": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 2, 4), _f(8, 12), _i(2), np.zeros(2, np.int64), _BT, 4, 1.0),
        r"mla_attention: argument 'tok.pos' must be I32"),
    "mla-sel_len": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 2, 4), _f(8, 12), _i(2), _i(2), _BT, 4, 1.0, sel=_i(2, 1), sel_len=i32([2, 0])),
        r"mla_attention: sel_len\[0\] = 2 exceeds the 1 selection columns"),
    "mla-sel-key": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 2, 4), _f(8, 12), _i(2), _i(2), _BT, 4, 1.0, sel=i32([[1], [0]]), sel_len=i32([1, 1])),
        r"mla_attention: token 0 at position 0 selects key 1 outside its causal range"),
    "mla-sel-missing": (lambda: ops.mla_attention(_f(2, 2, 8), _f(2, 2, 4), _f(8, 12), _i(2), _i(2), _BT, 4, 1.0, sel_len=i32([1, 1])),
        r"mla_attention: argument 'sel' is undefined"),
    "block_attn-blocks": (lambda: ops.block_attention(_f(5, 2, 4), _f(5, 1, 4), _f(5, 1, 4), _f(8, 8), _i(2), _BT, 2, 4),
        r"block_attention: 5 query rows are not whole blocks of 2"),
    "block_attn-gqa": (lambda: ops.block_attention(_f(4, 3, 4), _f(4, 2, 4), _f(4, 2, 4), _f(8, 16), _i(2), _BT, 2, 4),
        r"block_attention: k .* does not match q .* \(kv heads must divide"),
    "block_attn-v": (lambda: ops.block_attention(_f(4, 2, 4), _f(4, 1, 4), _f(4, 1, 5), _f(8, 8), _i(2), _BT, 2, 4),
        r"block_attention: 'k' .* and 'v' .* same shape"),
    "block_attn-kv_cache": (lambda: ops.block_attention(_f(4, 2, 4), _f(4, 1, 4), _f(4, 1, 4), _f(8, 9), _i(2), _BT, 2, 4),
        r"block_attention: kv_cache rows must hold \[k \| v\] = 8"),
    "block_attn-ctx_len": (lambda: ops.block_attention(_f(4, 2, 4), _f(4, 1, 4), _f(4, 1, 4), _f(8, 8), _i(3), _BT, 2, 4),
        r"block_attention: argument 'ctx_len' must be I32 \[2\]"),
    "block_attn-ctx-range": (lambda: ops.block_attention(_f(4, 2, 4), _f(4, 1, 4), _f(4, 1, 4), _f(8, 8), i32([0, 100]), _BT, 2, 4),
        r"block_attention: ctx_len\[1\] = 100 does not fit the block table"),
    "block_attn-window": (lambda: ops.block_attention(_f(4, 2, 4), _f(4, 1, 4), _f(4, 1, 4), _f(8, 8), _i(2), _BT, 2, 4, window=-1),
        r"block_attention: .*window >= 0"),
    "moe_route-bias": (lambda: ops.moe_route(_f(2, 8), _f(7), 2), r"moe_route: bias must be F32 \[8\]"),
    "moe_route-n_group": (lambda: ops.moe_route(_f(2, 8), _f(8), 2, 3, 1),
        r"moe_route: n_group 3 must divide 8 experts"),
    "moe_route-topk_group": (lambda: ops.moe_route(_f(2, 8), _f(8), 2, 2, 3),
        r"moe_route: topk_group must be in \[1, n_group = 2\]"),
    "moe_route-top_k": (lambda: ops.moe_route(_f(2, 8), _f(8), 5, 2, 1),
        r"moe_route: top_k = 5 must be in \[1, experts in the kept groups = 4\]"),
    "moe_route-ids": (lambda: ops.moe_route(_f(2, 8), _f(8), 2, ids=_i(2, 3)),
        r"moe_route: ids and weights must be \[2, 2\]"),
    "moe_experts-ids": (lambda: ops.moe_experts(_f(2, 4), _i(3, 1), _f(3, 1), [_w(3, 4)], [_w(3, 4)], [_w(4, 3)]),
        r"moe_experts: ids and weights must be \[2, top_k\]"),
    "moe_experts-down": (lambda: ops.moe_experts(_f(2, 4), _i(2, 1), _f(2, 1), [_w(3, 4)], [_w(3, 4)], [_w(5, 3)]),
        r"moe_experts: expert 0 has shapes .* down \[5, 3\]"),
    "moe_experts-counts": (lambda: ops.moe_experts(_f(2, 4), _i(2, 1), _f(2, 1), [_w(3, 4)], [_w(3, 4)], []),
        r"moe_experts: expected the same number \(>= 1\) of gate, up and down"),
    "moe_experts-workspace": (lambda: ops.moe_experts(_f(2, 4), _i(2, 1), _f(2, 1), [_w(3, 4)], [_w(3, 4)], [_w(4, 3)], workspace=_f(5)),
        r"moe_experts: workspace must hold 41 contiguous floats"),
    "moe_experts-id-range": (lambda: ops.moe_experts(_f(2, 4), i32([[0], [1]]), _f(2, 1), [_w(3, 4)], [_w(3, 4)], [_w(4, 3)]),
        r"moe_experts: expert id 1 of token 1 is outside \[0, 1\)"),
    "dyn_conv-blocks": (lambda: ops.dyn_conv(_f(5, 4), _f(2, 4), _f(5, 2), 2),
        r"dyn_conv: 5 rows are not whole blocks of 2"),
    "dyn_conv-block0": (lambda: ops.dyn_conv(_f(4, 4), _f(2, 4), _f(4, 2), 0),
        r"dyn_conv: 4 rows are not whole blocks of 0"),
    "dyn_conv-base": (lambda: ops.dyn_conv(_f(4, 4), _f(1, 4), _f(4, 2), 2), r"dyn_conv: base must be F32 \[2, 4\]"),
    "dyn_conv-dyn-odd": (lambda: ops.dyn_conv(_f(4, 4), _f(2, 4), _f(4, 3), 2), r"dyn_conv: dyn must be \[4, 2G\]"),
    "dyn_conv-dyn-G": (lambda: ops.dyn_conv(_f(4, 6), _f(2, 6), _f(4, 8), 2),
        r"dyn_conv: dyn must be \[4, 2G\] with G dividing 6"),
    "selector-cand": (lambda: ops.selector_walk(_SW[0], _f(1, 2, 3), *_SW[2:]),
        r"selector_walk: argument 'cand' must be I32"),
    "selector-g": (lambda: ops.selector_walk(*_SW[:2], _f(1, 3, 4), *_SW[3:]),
        r"selector_walk: g must be \[1, 2, rank\]"),
    "selector-book": (lambda: ops.selector_walk(*_SW[:3], _f(10, 5), *_SW[4:]),
        r"selector_walk: codebooks must be \[vocab, 4\]"),
    "selector-cand-range": (lambda: ops.selector_walk(_SW[0], np.full((1, 2, 3), 10, np.int32), *_SW[2:]),
        r"selector_walk: candidate 10 at \(0, 0, 0\) is outside \[0, 10\)"),
    "selector-anchor": (lambda: ops.selector_walk(*_SW[:5], i32([-1])), r"selector_walk: anchor -1 of sequence 0"),
    "selector-rng-missing": (lambda: ops.selector_walk(*_SW, temperature=1.0),
        r"selector_walk: argument 'rng' is undefined"),
    "selector-rng-f32": (lambda: ops.selector_walk(*_SW, temperature=1.0, rng=_f(1, 2)),
        r"selector_walk: argument 'rng' must be I64"),
    "selector-rng-shape": (lambda: ops.selector_walk(*_SW, temperature=1.0, rng=np.zeros((1, 3), np.int64)),
        r"selector_walk: rng must be I64 \[1, 2\]"),
    "selector-temperature": (lambda: ops.selector_walk(*_SW, temperature=float("nan")),
        r"selector_walk: temperature\[0\] must be finite"),
    "selector-temperature-shape": (lambda: ops.selector_walk(*_SW, temperature=_f(2)),
        r"selector_walk: temperature must be F32 \[1\]"),
    "selector-q": (lambda: ops.selector_walk(*_SW, temperature=1.0, rng=np.zeros((1, 2), np.int64), q=_f(1, 2, 4)),
        r"selector_walk: 'vals' .* and 'q' .* same shape"),
}


@pytest.mark.parametrize("name", list(ARG_ERRORS))
def test_new_op_argument_errors(name):
    call, msg = ARG_ERRORS[name]
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="^" + msg):
        call()


@pytest.mark.parametrize("dev", DEVICES)
def test_op_timing(dev):
    """ops.set_op_timing: while on, each dispatched op adds a call and its time (host clock on the
    CPU, events around it on CUDA) to op_times(); nothing is counted while off; reset clears."""
    need_device(dev, "rms_norm")
    rng = rng_for("op-timing", dev)
    x = to_dev(rng.standard_normal((8, 64)).astype(np.float32), dev)
    w = to_dev(np.ones(64, np.float32), dev)
    was = ops.op_timing()
    ops.op_times(reset=True)
    try:
        ops.set_op_timing(False)
        ops.rms_norm(x, w, 1e-6)
        assert ops.op_times() == []
        ops.set_op_timing(True)
        assert ops.op_timing()
        for _ in range(3):
            ops.rms_norm(x, w, 1e-6)
        ops.add(x, x)
        with pytest.raises(dflash2_rt.InvalidArgumentError):  # refused before it runs: not counted
            ops.rms_norm(x, to_dev(np.ones(63, np.float32), dev), 1e-6)
        ops.set_op_timing(False)
        ops.rms_norm(x, w, 1e-6)
        rows = {(r["op"], r["device"]): r for r in ops.op_times()}
        assert set(rows) == {("rms_norm", dev), ("add", dev)}
        assert rows[("rms_norm", dev)]["calls"] == 3 and rows[("add", dev)]["calls"] == 1
        assert all(r["seconds"] > 0 for r in rows.values())
        assert ops.op_times(reset=True) and ops.op_times() == []
    finally:
        ops.set_op_timing(was)
        ops.op_times(reset=True)
