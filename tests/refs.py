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
