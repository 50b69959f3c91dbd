"""The quantizer (python -m dflash2_rt.tools.quantize): codecs against torch and the
independent references in tests/refs.py, error bounds of the round trip, the names /
dtypes / shapes it writes, its metadata files, and the runtime reading the result
(inspect_checkpoint, ops.Weight.load format detection, Weight.dequantize)."""
import json
import os

import numpy as np
import refs
import pytest
import torch

import dflash2_rt
from dflash2_rt import ops
from dflash2_rt.checkpoint import bf16_bits_to_f32, f32_to_bf16_bits, save_safetensors
from dflash2_rt.tools import quantize as Q
from dflash2_rt.tools.make_demo_checkpoint import DEMO_CONFIG, write_demo_checkpoint

import refs

# ---------------------------------------------------------------------------- codecs


def test_fp8_codec_matches_torch_bitwise():
    rng = np.random.default_rng(0)
    finite = Q._FP8_VALUES[np.isfinite(Q._FP8_VALUES)].astype(np.float64)
    pos = np.sort(np.unique(np.abs(finite)))
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties: round half to even
    x = np.concatenate([
        rng.standard_normal(50000) * np.exp(rng.uniform(-14, 6, 50000)),
        finite, mids, -mids, mids + 1e-7 * mids, mids - 1e-7 * mids,
        [0.0, -0.0, 2.0 ** -10, 2.0 ** -9.5, 447.9, 448.0, 449.0, 463.0],
    ]).astype(np.float32)
    mine = Q.f32_to_fp8_e4m3(x)
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = np.flatnonzero(mine != ref)
    assert bad.size == 0, f"{bad.size} codes differ, e.g. x={x[bad[:5]]} mine={mine[bad[:5]]} torch={ref[bad[:5]]}"
    codes = np.arange(256, dtype=np.uint8)
    dec = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    mine_dec = Q.fp8_e4m3_to_f32(codes)
    assert np.array_equal(np.isnan(mine_dec), np.isnan(dec))
    ok = ~np.isnan(dec)
    assert np.array_equal(mine_dec[ok], dec[ok])
    # saturating (no NaN) for large finite inputs
    assert Q.fp8_e4m3_to_f32(Q.f32_to_fp8_e4m3(np.array([1e6, -1e6], np.float32))).tolist() == [448.0, -448.0]


@pytest.mark.parametrize("shape", [(1, 7), (128, 128), (129, 128), (300, 200), (5, 1000)])
def test_fp8_block128_round_trip(shape):
    rng = np.random.default_rng(hash(shape) % 2 ** 32)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))).astype(np.float32)
    w[0, 0] = 0.0
    q, s = Q.quantize_fp8_block128(w)
    n, k = shape
    assert q.dtype == np.uint8 and q.shape == shape
    assert s.dtype == np.float32 and s.shape == (-(-n // 128), -(-k // 128))
    deq = Q.dequantize_fp8_block128(q, s)
    np.testing.assert_array_equal(deq, refs.dequant_fp8_block128(q, s).astype(np.float32))
    # scale = amax / 448 per block, so the largest |w| of each block is exactly +-448
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            np.testing.assert_allclose(s[bi, bj], np.abs(blk).max() / 448.0, rtol=1e-6)
            qb = Q.fp8_e4m3_to_f32(q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128])
            assert np.abs(qb).max() == 448.0
    # within 1/16 relative (3 mantissa bits, round to nearest), 2^-10 * scale for subnormals
    se = np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    bound = np.maximum(np.abs(w) / 16.0, 2.0 ** -10 * se) * (1 + 1e-6)
    assert (np.abs(deq - w) <= bound).all()


@pytest.mark.parametrize("shape", [(2, 16), (7, 64), (33, 208), (128, 4096)])
def test_nvfp4_round_trip(shape):
    rng = np.random.default_rng(hash(shape) % 2 ** 32)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, (shape[0], 1)))).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero block
    p, su8, g = Q.quantize_nvfp4(w)
    n, k = shape
    assert p.dtype == np.uint8 and p.shape == (n, k // 2)
    assert su8.dtype == np.uint8 and su8.shape == (n, k // 16)
    np.testing.assert_allclose(g, np.abs(w).max() / (6 * 448), rtol=1e-6)
    deq = Q.dequantize_nvfp4(p, su8, g)
    np.testing.assert_array_equal(deq, refs.dequant_nvfp4(p, su8, g).astype(np.float32))
    assert (deq[0, :16] == 0).all()
    # within half a step of the E2M1 grid at each value's magnitude (scale = fp8(block) * g)
    s = np.repeat(Q.fp8_e4m3_to_f32(su8).astype(np.float64) * np.float64(g), 16, 1)
    v = np.abs(w) / np.where(s > 0, s, 1.0)
    half = np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0)) * s
    over = np.maximum(v - 6.0, 0.0) * s  # when the block scale rounded down in fp8
    assert (np.abs(deq - w) <= half + over + 1e-6 * np.abs(w) + 1e-30).all()
    # low nibble = even k
    codes = np.empty((n, k), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4
    np.testing.assert_array_equal(Q.E2M1_VALUES[codes] * np.repeat(Q.fp8_e4m3_to_f32(su8), 16, 1) * g, deq)


def test_nvfp4_exact_for_representable_weights_and_rounds_half_to_even():
    g = np.float32(0.01)
    scales = np.array([[1.0, 2.0, 0.5, 448.0]], np.float32)  # representable in E4M3
    grid = Q.E2M1_VALUES[np.arange(64) % 16].reshape(1, 64)
    w = (grid * np.repeat(scales, 16, 1) * g).astype(np.float32)
    w[0, [15, 31, 47, 63]] = 6 * scales[0] * g  # make each block's amax 6 * scale
    p, su8, g2 = Q.quantize_nvfp4(w, global_scale=g)
    np.testing.assert_array_equal(Q.dequantize_nvfp4(p, su8, g2), w)
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5], np.float64)
    assert Q.E2M1_VALUES[Q._e2m1_encode(ties)].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0]


def test_nvfp4_rejects_bad_k():
    with pytest.raises(ValueError, match="divisible by 16"):
        Q.quantize_nvfp4(np.ones((4, 24), np.float32))


# ---------------------------------------------------------------------------- checkpoints

SYN_CONFIG = {"model_type": "glm_moe_dsa", "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
              "hidden_size": 208}


def _bf16(rng, *shape, scale=0.05):
    return (f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32)), "BF16")


def _synthetic(path):
    """Odd shapes (several 128-blocks, K = 208) and an MTP layer (layer 1)."""
    rng = np.random.default_rng(7)
    t = {
        "model.embed_tokens.weight": _bf16(rng, 50, 208),
        "lm_head.weight": _bf16(rng, 50, 208),
        "model.norm.weight": _bf16(rng, 208),
        "model.layers.0.self_attn.q_a_proj.weight": _bf16(rng, 300, 208),
        "model.layers.0.self_attn.indexer.weights_proj.weight": _bf16(rng, 4, 208),
        "model.layers.0.mlp.gate.weight": rng.standard_normal((2, 208)).astype(np.float32),
        "model.layers.0.mlp.gate.e_score_correction_bias": rng.standard_normal(2).astype(np.float32),
        "model.layers.1.eh_proj.weight": _bf16(rng, 208, 416),
        "model.layers.1.mlp.experts.0.gate_proj.weight": _bf16(rng, 48, 208),
        "model.layers.1.enorm.weight": _bf16(rng, 208),
    }
    for e, amp in ((0, 0.05), (1, 0.5)):
        p = f"model.layers.0.mlp.experts.{e}."
        t[p + "gate_proj.weight"] = _bf16(rng, 300, 208, scale=amp)
        t[p + "up_proj.weight"] = _bf16(rng, 300, 208, scale=3 * amp)  # up has the larger amax
        t[p + "down_proj.weight"] = _bf16(rng, 208, 304, scale=amp)
    for m in ("shared_experts", ):
        t[f"model.layers.0.mlp.{m}.gate_proj.weight"] = _bf16(rng, 64, 208)
        t[f"model.layers.0.mlp.{m}.up_proj.weight"] = _bf16(rng, 64, 208)
        t[f"model.layers.0.mlp.{m}.down_proj.weight"] = _bf16(rng, 208, 64)
    os.makedirs(path, exist_ok=True)
    save_safetensors(os.path.join(path, "model.safetensors"), t, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SYN_CONFIG, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"dummy": true}')
    return t


def _src_f32(value):
    if isinstance(value, tuple):
        return bf16_bits_to_f32(value[0])
    return value


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_checkpoint(path, shards=2)
    return path


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("syn"))
    return path, _synthetic(path)


def _is_fp8_target(name):
    return (name.endswith(".weight") and not any(x in name for x in (
        "embed_tokens", "lm_head", "mlp.gate.weight", "weights_proj", "norm")))


def test_fp8_checkpoint(syn, tmp_path):
    src, tensors = syn
    dst = str(tmp_path / "fp8")
    summary = Q.quantize_checkpoint(src, dst, "fp8")
    info = dflash2_rt.inspect_checkpoint(dst)
    ck = dflash2_rt.Checkpoint.open(dst)
    deq = Q.dequantize_checkpoint(dst)
    assert sorted(deq) == sorted(tensors)
    for name, value in tensors.items():
        w = _src_f32(value)
        prefix = name[: -len(".weight")]
        if _is_fp8_target(name) and w.ndim == 2:
            n, k = w.shape
            assert info[name]["dtype"] == "F8_E4M3" and info[name]["shape"] == [n, k]
            si = info[prefix + ".weight_scale_inv"]
            assert si["dtype"] == "F32" and si["shape"] == [-(-n // 128), -(-k // 128)]
            assert prefix in summary["quantized"]
            s = np.repeat(np.repeat(np.from_dlpack(ck.tensor(prefix + ".weight_scale_inv")), 128, 0), 128, 1)[:n, :k]
            assert (np.abs(deq[name] - w) <= np.maximum(np.abs(w) / 16, 2.0 ** -10 * s) * (1 + 1e-6)).all()
            wt = ops.Weight.load(ck, prefix)
            assert wt.format == "fp8-block128" and (wt.out_features, wt.in_features) == (n, k)
            np.testing.assert_array_equal(np.from_dlpack(wt.dequantize()), deq[name])
        else:
            expected_dtype = value[1] if isinstance(value, tuple) else "F32"
            assert info[name]["dtype"] == expected_dtype, name
            np.testing.assert_array_equal(deq[name], w)
            if w.ndim == 2:
                assert prefix in summary["kept"]
                assert ops.Weight.load(ck, prefix).format == "dense"
    # the MTP layer's Linear weights are FP8 too (eh_proj, its experts)
    assert info["model.layers.1.eh_proj.weight"]["dtype"] == "F8_E4M3"
    assert info["model.layers.0.self_attn.q_a_proj.weight_scale_inv"]["shape"] == [3, 2]
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg.pop("quantization_config")
    assert cfg == SYN_CONFIG
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert set(qc["modules_to_not_convert"]) == {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate",
                                                  "model.layers.0.self_attn.indexer.weights_proj"}
    assert not os.path.exists(os.path.join(dst, "hf_quant_config.json"))
    assert open(os.path.join(dst, "tokenizer.json")).read() == '{"dummy": true}'
    assert dflash2_rt.load_config(dst)["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("scope", ["experts", "mlp"])
def test_nvfp4_checkpoint(syn, tmp_path, scope):
    src, tensors = syn
    dst = str(tmp_path / scope)
    summary = Q.quantize_checkpoint(src, dst, "nvfp4", scope)
    info = dflash2_rt.inspect_checkpoint(dst)
    ck = dflash2_rt.Checkpoint.open(dst)
    deq = Q.dequantize_checkpoint(dst)
    assert sorted(deq) == sorted(tensors)

    def quantized(name):
        if name.startswith("model.layers.1."):  # MTP layer stays unquantized
            return False
        if ".mlp.experts." in name:
            return True
        return scope == "mlp" and ".shared_experts." in name

    for name, value in tensors.items():
        w = _src_f32(value)
        prefix = name[: -len(".weight")]
        if name.endswith(".weight") and quantized(name):
            n, k = w.shape
            assert info[name] == {"dtype": "U8", "shape": [n, k // 2], "file": "model.safetensors"}
            assert info[prefix + ".weight_scale"]["dtype"] == "F8_E4M3"
            assert info[prefix + ".weight_scale"]["shape"] == [n, k // 16]
            for s in ("weight_scale_2", "input_scale"):
                assert info[f"{prefix}.{s}"]["dtype"] == "F32" and info[f"{prefix}.{s}"]["shape"] == []
            g = float(np.from_dlpack(ck.tensor(prefix + ".weight_scale_2")))
            bs = torch.from_dlpack(ck.tensor(prefix + ".weight_scale")).float().numpy()
            step = np.repeat(bs, 16, 1) * g  # one E2M1 unit; the widest half-step is 1 unit (4 -> 6)
            assert (np.abs(deq[name] - w) <= step * 1.0 + 1e-6 * np.abs(w)).all()
            wt = ops.Weight.load(ck, prefix)
            assert wt.format == "nvfp4" and (wt.out_features, wt.in_features) == (n, k)
            assert wt.global_scale == np.float32(g)
            assert wt.input_scale == np.float32(Q.DEFAULT_INPUT_AMAX / (6 * 448))
            np.testing.assert_array_equal(np.from_dlpack(wt.dequantize()), deq[name])
            assert prefix in summary["quantized"]
        else:
            expected_dtype = value[1] if isinstance(value, tuple) else "F32"
            assert info[name]["dtype"] == expected_dtype, name
            np.testing.assert_array_equal(deq[name], w)
            if w.ndim == 2:
                assert ops.Weight.load(ck, prefix).format == "dense"
                assert prefix in summary["kept"]
    # gate_proj and up_proj share weight_scale_2 (= the larger amax / 2688)
    for e in (0, 1):
        p = f"model.layers.0.mlp.experts.{e}."
        g_gate = float(np.from_dlpack(ck.tensor(p + "gate_proj.weight_scale_2")))
        g_up = float(np.from_dlpack(ck.tensor(p + "up_proj.weight_scale_2")))
        amax = max(np.abs(_src_f32(tensors[p + "gate_proj.weight"])).max(),
                   np.abs(_src_f32(tensors[p + "up_proj.weight"])).max())
        assert g_gate == g_up
        np.testing.assert_allclose(g_gate, amax / (6 * 448), rtol=1e-6)
    with open(os.path.join(dst, "hf_quant_config.json")) as f:
        hq = json.load(f)
    assert hq["producer"]["name"] == "modelopt"
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    ex = set(hq["quantization"]["exclude_modules"])
    assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_a_proj", "model.layers.0.mlp.gate",
            "model.layers.1.eh_proj", "model.layers.1.mlp.experts.0.gate_proj"} <= ex
    assert ("model.layers.0.mlp.shared_experts.gate_proj" in ex) == (scope == "experts")
    assert "model.layers.0.mlp.experts.0.gate_proj" not in ex
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f) == SYN_CONFIG  # copied unchanged


def test_demo_checkpoint_shards_and_scopes(demo, tmp_path):
    """The sharded BF16 demo checkpoint: output mirrors the source's 2 files by default,
    --shards N gives N files, and every Linear of the GLM layout is classified right."""
    src_info = dflash2_rt.inspect_checkpoint(demo)
    n_src_files = len({v["file"] for v in src_info.values()})
    out = str(tmp_path / "fp8")
    Q.quantize_checkpoint(demo, out, "fp8")
    info = dflash2_rt.inspect_checkpoint(out)
    assert len({v["file"] for v in info.values()}) == n_src_files
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    for name in src_info:
        prefix = name[: -len(".weight")]
        if name.endswith(".weight") and len(src_info[name]["shape"]) == 2:
            want = "F8_E4M3" if _is_fp8_target(name) else src_info[name]["dtype"]
            assert info[name]["dtype"] == want, name
            if want == "F8_E4M3":  # scales in the same file as the weight
                assert info[prefix + ".weight_scale_inv"]["file"] == info[name]["file"]
    # nvfp4, mlp scope, 3 shards
    out3 = str(tmp_path / "nv3")
    Q.quantize_checkpoint(demo, out3, "nvfp4", "mlp", shards=3)
    info3 = dflash2_rt.inspect_checkpoint(out3)
    assert len({v["file"] for v in info3.values()}) == 3
    L = DEMO_CONFIG["num_hidden_layers"]
    assert info3["model.layers.0.mlp.gate_proj.weight"]["dtype"] == "U8"  # dense MLP (layer 0)
    assert info3["model.layers.1.mlp.shared_experts.down_proj.weight"]["dtype"] == "U8"
    assert info3[f"model.layers.{L - 1}.mlp.experts.3.up_proj.weight"]["dtype"] == "U8"
    assert info3["model.layers.1.self_attn.kv_b_proj.weight"]["dtype"] == "BF16"
    assert info3["model.layers.1.mlp.gate.weight"]["dtype"] == "F32"
    for name, v in info3.items():
        if name.endswith(".weight_scale"):
            assert info3[name[: -len("_scale")]]["file"] == v["file"]
    deq = Q.dequantize_checkpoint(out3)
    assert sorted(deq) == sorted(src_info)


def test_cli(demo, tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert Q.main([demo, out, "--format", "nvfp4", "--nvfp4-scope", "experts", "--shards", "1"]) == 0
    assert os.listdir(out).count("model.safetensors") == 1
    assert "nvfp4-experts" in capsys.readouterr().out
    # not into a non-empty directory without --force; --force replaces the old files
    assert Q.main([demo, out, "--format", "fp8"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert Q.main([demo, out, "--format", "fp8", "--force"]) == 0
    assert not os.path.exists(os.path.join(out, "hf_quant_config.json"))
    # a quantized checkpoint is not quantized again
    assert Q.main([out, str(tmp_path / "again"), "--format", "nvfp4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        Q.main([demo, str(tmp_path / "x"), "--format", "int4"])


def test_quantizer_agrees_with_refs_quantizer_in_error():
    """Same inputs, tests/refs.py's independent quantizers: comparable (not identical:
    the rounding of ties and zero blocks may differ) reconstruction errors."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 320)).astype(np.float32)
    e_mine = np.abs(Q.dequantize_fp8_block128(*Q.quantize_fp8_block128(w)) - w).mean()
    e_ref = np.abs(refs.dequant_fp8_block128(*refs.quantize_fp8_block128(w)) - w).mean()
    assert e_mine <= 1.01 * e_ref
    e_mine = np.abs(Q.dequantize_nvfp4(*Q.quantize_nvfp4(w)) - w).mean()
    e_ref = np.abs(refs.dequant_nvfp4(*refs.quantize_nvfp4(w)) - w).mean()
    assert e_mine <= 1.01 * e_ref


# ---------------------------------------------------------------------------- W4A4 activations
def _e2m1_rne(v):
    """Independent reference: nearest of the E2M1 magnitudes, ties to the even code."""
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    a = np.minimum(np.abs(v), 6.0)
    d = np.abs(a[..., None] - mags)
    best = d.min(-1, keepdims=True)
    cand = np.where(np.isclose(d, best, rtol=0, atol=0), np.arange(8), 99)
    # among equally near codes take the even one (two candidates at most)
    lo = cand.min(-1)
    hi = np.where(cand == 99, -1, cand).max(-1)
    code = np.where(lo % 2 == 0, lo, hi)
    return np.sign(v) * mags[code]


def _nvfp4_act_ref(x, input_scale):
    x = np.asarray(x, np.float32)
    m, k = x.shape
    g = np.float32(1.0) / np.float32(input_scale)
    blocks = x.reshape(m, k // 16, 16)
    amax = np.abs(blocks).max(-1).astype(np.float32)
    sf_arg = (g * (amax * np.float32(1.0 / 6.0))).astype(np.float32)
    sf = refs.fp8_e4m3_to_f64(refs.f32_to_fp8_e4m3(np.minimum(sf_arg, 448.0))).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = (np.float32(1.0) / (sf / g)).astype(np.float32)
        scaled = (blocks * inv[..., None]).astype(np.float32)
    q = _e2m1_rne(scaled.astype(np.float64)).astype(np.float32)
    out = (q * sf[..., None]).astype(np.float32) * np.float32(input_scale)
    out = np.where(sf[..., None] == 0, 0.0, out)
    return out.reshape(m, k).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_activation_quantization_matches_reference(seed):
    """The CPU emulation of Blackwell's NVFP4 activation quantization (the W4A4 reference)
    equals an independent numpy implementation bitwise, and linear over it is the W4A4 GEMM."""
    from dflash2_rt import ops
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 20, (7, 1))).astype(np.float32)
    x[0, :16] = 0.0                      # an all-zero block
    x[1, 16:32] = 1e-30                  # a block whose scale underflows to zero
    x[2, :16] = [6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -6, -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25]
    input_scale = float(np.abs(x).max()) / (448 * 6)
    got = np.from_dlpack(ops.nvfp4_quantize_act(x, input_scale)).copy()
    want = _nvfp4_act_ref(x, input_scale)
    np.testing.assert_array_equal(got, want)
    assert (got[0, :16] == 0).all() and (got[1, 16:32] == 0).all()
    # the quantized values are representable: quantizing again changes nothing
    np.testing.assert_array_equal(np.from_dlpack(ops.nvfp4_quantize_act(got, input_scale)), got)
    # relative error per block is bounded by E2M1's half step (1/4 of the value at worst) + the scale's
    err = np.abs(got - x).reshape(7, 6, 16).max(-1)
    amax = np.abs(x).reshape(7, 6, 16).max(-1)
    assert (err <= amax * 0.30 + 1e-30).all()
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="multiple of 16"):
        ops.nvfp4_quantize_act(x[:, :40], input_scale)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="input_scale"):
        ops.nvfp4_quantize_act(x, 0.0)
    nan = x.copy()
    nan[3, 5] = np.nan
    out = np.from_dlpack(ops.nvfp4_quantize_act(nan, input_scale))
    assert np.isnan(out[3, :16]).all() and np.isfinite(out[3, 16:]).all()


def test_nvfp4_activation_quantization_on_cuda_is_the_cpus():
    """The CUDA kernel behind linear_nvfp4's activations (quant.cu) against the CPU's, bitwise,
    including zero, underflowing, tie and non-finite blocks."""
    from conftest import cuda_or_skip
    from dflash2_rt import ops
    cuda_or_skip()
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 160)) * rng.uniform(0.01, 20, (9, 1))).astype(np.float32)
    x[0, :16] = 0.0
    x[1, 16:32] = 1e-30
    x[2, :16] = [6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -6, -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25]
    x[3, 40] = np.nan
    input_scale = float(np.nanmax(np.abs(x))) / (448 * 6)
    want = np.from_dlpack(ops.nvfp4_quantize_act(x, input_scale)).copy()
    got = np.from_dlpack(ops.nvfp4_quantize_act(dflash2_rt.from_dlpack(x).to("cuda:0"), input_scale).to("cpu"))
    np.testing.assert_array_equal(got, want)
