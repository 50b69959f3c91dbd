"""Backend-parity harness (in the style of llama.cpp's test-backend-ops).

Every op runs on every backend (cpu always; cuda where the build has it and a GPU is
present) on random shapes including odd sizes, and is compared with a plain float64
numpy/torch reference (tests/refs.py) by normalized mean squared error with a per-op
threshold, after checking for NaN/Inf. Outputs are written into a buffer with guard
regions on both sides that must come back untouched. A CUDA op plugs in by adding its
name to CUDA_OPS.
"""
import zlib

import numpy as np
import pytest
import torch

import dflash2_rt
from dflash2_rt import ops

import refs
from conftest import cuda_or_skip

DEVICES = ["cpu", "cuda"]
CUDA_OPS = {"rms_norm"}
GUARD = 64
SENTINEL = np.float32(-12345.678)

# per-op NMSE thresholds (fp32 results vs float64 references)
TOL = {
    "linear": 1e-11,
    "rms_norm": 1e-12,
    "layer_norm": 1e-12,
    "rope": 1e-12,
    "silu_mul": 1e-12,
    "softmax": 1e-12,
    "embedding": 0.0,
    "gated_mlp": 1e-10,
}


def need_device(dev, op):
    if dev == "cuda":
        cuda_or_skip()
        if op not in CUDA_OPS:
            pytest.skip(f"{op} is not implemented on the CUDA backend yet")


def to_dev(a, dev):
    t = dflash2_rt.from_dlpack(a)
    return t if dev == "cpu" else t.to(dev)


def to_np(t):
    t = t.to("cpu") if t.device != "cpu" else t
    if t.dtype in ("BF16", "F8_E4M3"):
        return torch.from_dlpack(t).float().numpy()
    return np.from_dlpack(t).copy()


class Guarded:
    """An F32 output of `shape` in the middle of a buffer with sentinel guards."""

    def __init__(self, shape, dev):
        self.shape = tuple(shape)
        self.n = int(np.prod(shape))
        host = np.full(self.n + 2 * GUARD, SENTINEL, np.float32)
        self.buf = to_dev(host, dev)
        self.view = self.buf.slice(0, GUARD, GUARD + self.n).reshape(list(self.shape))

    def result(self):
        all_ = to_np(self.buf)
        assert (all_[:GUARD] == SENTINEL).all(), "op wrote before its output"
        assert (all_[GUARD + self.n:] == SENTINEL).all(), "op wrote past its output"
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
LINEAR_SHAPES = [(1, 64, 32), (3, 100, 17), (5, 129, 33), (8, 256, 96), (17, 48, 50), (1, 1000, 7), (4, 8, 1)]
NVFP4_SHAPES = [(1, 64, 32), (3, 160, 17), (7, 256, 40), (9, 48, 5), (1, 2048, 13)]


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
        ops.linear(to_dev(x, dev), w, out=out.view)
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
