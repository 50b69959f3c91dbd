"""Checkpoint I/O: agreement with the `safetensors` library, zero-copy tensors, every
corruption raising CheckpointError with a message that names the file, the tensor or
field, and what was expected / found; the numpy writer; the `inspect` CLI."""
from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt import CheckpointError, ConfigError, DFlash2Error, _core
from dflash2_rt.checkpoint import (
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    inspect_checkpoint,
    load_config,
    save_safetensors,
    save_sharded,
)

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ST_NAME = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
}


def raw_bytes(t) -> bytes:
    """The bytes of a contiguous dflash2_rt.Tensor (any dtype, numpy or not)."""
    return ctypes.string_at(t.data_ptr, t.nbytes)


def torch_bytes(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_sharded_torch(directory, tensors: dict, shards: int) -> dict:
    """Sharded checkpoint written by safetensors.torch.save_file + an HF-style index."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return weight_map


def glm_like_tensors(dtype, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(dtype),
        "lm_head.weight": torch.randn(64, 16, generator=g).to(dtype),
        "model.norm.weight": torch.randn(16, generator=g).to(dtype),
    }
    for layer in range(3):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = torch.randn(16, generator=g).to(dtype)
        out[p + "self_attn.q_a_proj.weight"] = torch.randn(8, 16, generator=g).to(dtype)
        out[p + "self_attn.kv_b_proj.weight"] = torch.randn(2, 3, 5, generator=g).to(dtype)
        out[p + "mlp.experts.0.down_proj.weight"] = torch.randn(16, 7, generator=g).to(dtype)
    out["scalar"] = torch.tensor(1.5).to(dtype)
    out["empty"] = torch.zeros(0, 4).to(dtype)
    return out


def library_view(directory_or_file) -> dict:
    """{name: (dtype, shape, file basename, bytes)} as the safetensors library reads it."""
    files = ([directory_or_file] if os.path.isfile(directory_or_file) else
             sorted(os.path.join(directory_or_file, f) for f in os.listdir(directory_or_file)
                    if f.endswith(".safetensors")))
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                t = f.get_tensor(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()), os.path.basename(path), torch_bytes(t))
    return out


# ---------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shards", [1, 3])
def test_inspect_agrees_with_safetensors_library(tmp_path, dtype, shards):
    tensors = glm_like_tensors(dtype)
    write_sharded_torch(tmp_path, tensors, shards)
    ref = library_view(str(tmp_path))
    got = inspect_checkpoint(tmp_path)  # PathLike accepted
    assert list(got) == sorted(ref)  # insertion order sorted by name
    for name, (dt, shape, fname, _) in ref.items():
        assert got[name] == {"dtype": dt, "shape": shape, "file": fname}
    ck = _core.Checkpoint.open(str(tmp_path))
    assert ck.names() == sorted(ref) and len(ck) == len(ref)
    assert sorted(os.path.basename(f) for f in ck.files()) == sorted({v[2] for v in ref.values()})
    assert ck.total_bytes == sum(len(v[3]) for v in ref.values())
    for name, (dt, shape, fname, data) in ref.items():
        t = ck.tensor(name)
        assert t.dtype == dt and list(t.shape) == shape
        assert raw_bytes(t) == data
        x = torch.from_dlpack(t)
        assert x.dtype == dtype and list(x.shape) == shape
        assert torch_bytes(x) == torch_bytes(tensors[name])


def test_all_dtypes_single_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "f8": torch.randn(4, 6, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 255, (9,), generator=g).to(torch.uint8),
        "i32": torch.randint(-1000, 1000, (3, 3), generator=g).int(),
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=g),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    got = inspect_checkpoint(path)
    ref = library_view(str(path))
    assert {n: (v["dtype"], v["shape"]) for n, v in got.items()} == {n: (r[0], r[1]) for n, r in ref.items()}
    ck = _core.Checkpoint.open(str(path))
    for name, t in tensors.items():
        assert got[name]["dtype"] == ST_NAME[t.dtype]
        assert raw_bytes(ck.tensor(name)) == torch_bytes(t)
        assert torch_bytes(torch.from_dlpack(ck.tensor(name))) == torch_bytes(t)
    np.testing.assert_array_equal(ck.tensor("f32").numpy(), tensors["f32"].numpy())
    np.testing.assert_array_equal(ck.tensor("i64").numpy(), tensors["i64"].numpy())


def test_directory_without_index_and_parse_bytes(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.ones(3, dtype=torch.bfloat16)}, str(tmp_path / "two.safetensors"))
    got = inspect_checkpoint(str(tmp_path))
    assert got == {"a": {"dtype": "F32", "shape": [2], "file": "one.safetensors"},
                   "b": {"dtype": "BF16", "shape": [3], "file": "two.safetensors"}}
    data = (tmp_path / "two.safetensors").read_bytes()
    assert _core.parse_safetensors_bytes(data) == {"b": {"dtype": "BF16", "shape": [3]}}
    assert _core.parse_safetensors_bytes(bytearray(data), "x") == {"b": {"dtype": "BF16", "shape": [3]}}


def test_zero_copy_and_lifetime(tmp_path):
    t0 = torch.arange(1000, dtype=torch.float32)
    save_file({"w": t0}, str(tmp_path / "m.safetensors"))
    ck = _core.Checkpoint.open(str(tmp_path / "m.safetensors"))
    a, b = ck.tensor("w"), ck.tensor("w")
    assert a.data_ptr == b.data_ptr  # both views of the same mapping
    x = torch.from_dlpack(a)
    assert x.data_ptr() == a.data_ptr
    info = ck.info("w")
    assert info["data_offsets"] == (0, 4000) and info["nbytes"] == 4000 and info["path"].endswith("m.safetensors")
    del ck, a, b
    gc.collect()
    assert torch.equal(x, t0)  # the view keeps the file mapped
    # Writing into a view changes a private copy only: the file is untouched.
    x[0] = -1.0
    again = _core.Checkpoint.open(str(tmp_path / "m.safetensors"))
    assert torch.from_dlpack(again.tensor("w"))[0].item() == 0.0


def test_config_and_has(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    ck = _core.Checkpoint.open(str(tmp_path))
    assert ck.config() is None
    cfg = {"hidden_size": 64, "rms_norm_eps": 1e-5, "eos_token_id": [1, 2], "rope_parameters": {"rope_theta": 8e6},
           "tie_word_embeddings": False, "x": None, "name": "caf\u00e9"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ck = _core.Checkpoint.open(str(tmp_path))
    assert ck.config() == cfg
    assert load_config(tmp_path) == cfg and load_config(tmp_path / "config.json") == cfg
    assert ck.has("a") and "a" in ck and not ck.has("b")
    # a single file picks up config.json beside it
    assert _core.Checkpoint.open(str(tmp_path / "model.safetensors")).config() == cfg


def test_missing_tensor_suggests_close_names(tmp_path):
    save_file({"model.layers.0.mlp.up_proj.weight": torch.ones(1), "model.layers.0.mlp.down_proj.weight": torch.ones(1),
               "lm_head.weight": torch.ones(1)}, str(tmp_path / "m.safetensors"))
    ck = _core.Checkpoint.open(str(tmp_path))
    with pytest.raises(CheckpointError) as e:
        ck.info("model.layers.0.mlp.up_proj.weights")
    msg = str(e.value)
    assert "'model.layers.0.mlp.up_proj.weights'" in msg and str(tmp_path) in msg
    assert "did you mean 'model.layers.0.mlp.up_proj.weight'" in msg
    with pytest.raises(CheckpointError, match="has no tensor 'zzz'"):
        ck.tensor("zzz")


# ---------------------------------------------------------------------------- corruptions


def st_image(header, data: bytes = b"", length=None) -> bytes:
    h = header if isinstance(header, (bytes, str)) else json.dumps(header)
    h = h.encode() if isinstance(h, str) else h
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (id, image bytes, substrings the message must contain besides the file name)
CORRUPTIONS = [
    ("short", b"\x01\x02\x03", ["too short", "3 bytes"]),
    ("header_len_beyond_file", st_image({"w": entry()}, b"\0" * 8, length=10_000),
     ["header length 10000", "file size 77"]),
    ("header_len_huge", st_image("{}", b"", length=2**64 - 1), ["header length 18446744073709551615", "file size 10"]),
    ("malformed_json", st_image('{"w": {"dtype": "F32",', b""), ["safetensors header", "malformed JSON at byte 22"]),
    ("json_trailing_garbage", st_image('{} {}', b""), ["malformed JSON at byte 3", "after the JSON value"]),
    ("not_object", st_image("[1, 2]"), ["header must be a JSON object", "found array"]),
    ("entry_not_object", st_image({"w": [1]}), ["tensor 'w'", "expected an object", "found array"]),
    ("missing_dtype", st_image({"w": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     ["tensor 'w'", "missing field 'dtype'"]),
    ("missing_shape", st_image({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8),
     ["tensor 'w'", "missing field 'shape'"]),
    ("missing_offsets", st_image({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
     ["tensor 'w'", "missing field 'data_offsets'"]),
    ("dtype_wrong_type", st_image({"w": entry(dtype=4)}, b"\0" * 8),
     ["tensor 'w'", "field 'dtype': expected a string, found integer"]),
    ("shape_wrong_type", st_image({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8),
     ["tensor 'w'", "field 'shape': expected an array of non-negative integers", "found string"]),
    ("offsets_wrong_type", st_image({"w": {"dtype": "F32", "shape": [2], "data_offsets": "0:8"}}, b"\0" * 8),
     ["tensor 'w'", "field 'data_offsets': expected [begin, end]", '"0:8"']),
    ("unknown_dtype", st_image({"w": entry(dtype="F64", offsets=(0, 16))}, b"\0" * 16),
     ["tensor 'w'", "unsupported dtype 'F64'", "supported: F32 F16 BF16 F8_E4M3 U8 I32 I64"]),
    ("negative_dim", st_image({"w": entry(shape=(2, -3))}, b"\0" * 8), ["tensor 'w'", "negative dimension -3"]),
    ("shape_overflow", st_image({"w": entry(shape=(2**40, 2**40))}, b"\0" * 8),
     ["tensor 'w'", "[1099511627776, 1099511627776]", "more elements than fit in 64 bits"]),
    ("begin_after_end", st_image({"w": entry(shape=(0,), offsets=(8, 0))}, b"\0" * 8),
     ["tensor 'w'", "data_offsets [8, 0] have begin > end"]),
    ("end_beyond_data", st_image({"w": entry(shape=(4,), offsets=(0, 16))}, b"\0" * 8),
     ["tensor 'w'", "data_offsets [0, 16]", "end beyond the data region of 8 bytes"]),
    ("size_mismatch", st_image({"w": entry(dtype="BF16", shape=(3, 2), offsets=(0, 8))}, b"\0" * 12),
     ["tensor 'w'", "BF16 [3, 2] needs 12 bytes", "data_offsets [0, 8] hold 8"]),
    ("overlap", st_image({"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}, b"\0" * 12),
     ["tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [4, 12]) overlap"]),
    ("metadata_not_strings", st_image({"__metadata__": {"format": 1}}), ["'__metadata__' entry 'format'", "expected a string"]),
    ("duplicate_names", st_image('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                 '"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', b"\0\0"),
     ["duplicate object key 'w'"]),
]


@pytest.mark.parametrize("case_id,image,expect", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_file_raises_checkpoint_error(tmp_path, case_id, image, expect):
    path = tmp_path / f"bad_{case_id}.safetensors"
    path.write_bytes(image)
    for opener in (inspect_checkpoint, lambda p: _core.Checkpoint.open(str(p))):
        with pytest.raises(CheckpointError) as e:
            opener(path)
        assert isinstance(e.value, ValueError) and isinstance(e.value, DFlash2Error)
        msg = str(e.value)
        assert str(path) in msg, msg
        for s in expect:
            assert s in msg, f"{msg!r} lacks {s!r}"
    # the in-memory parser says the same, naming what it was given
    with pytest.raises(CheckpointError) as e:
        _core.parse_safetensors_bytes(image, "mem.safetensors")
    assert "mem.safetensors" in str(e.value)
    for s in expect:
        assert s in str(e.value)


def test_truncated_real_file(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.zeros(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-50])
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(path)
    msg = str(e.value)
    assert str(path) in msg and "end beyond the data region" in msg and "truncated" in msg
    assert "'a'" in msg or "'b'" in msg


def test_open_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="contains no model.safetensors.index.json and no \\*.safetensors"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path / "empty.safetensors")
    assert "empty.safetensors" in str(e.value) and "empty (0 bytes)" in str(e.value)
    (tmp_path / "dir.safetensors").mkdir()  # a directory is opened as a checkpoint directory
    with pytest.raises(CheckpointError, match="dir.safetensors' contains no model.safetensors.index.json"):
        _core.Checkpoint.open(str(tmp_path / "dir.safetensors"))
    os.chmod(tmp_path / "empty.safetensors", 0)
    if os.access(tmp_path / "empty.safetensors", os.R_OK):  # root reads anything
        return
    with pytest.raises(CheckpointError, match="Permission denied"):
        inspect_checkpoint(tmp_path / "empty.safetensors")


def test_index_errors(tmp_path):
    write_sharded_torch(tmp_path, {"x": torch.ones(2), "y": torch.ones(3), "z": torch.ones(4)}, 2)
    index = tmp_path / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    assert inspect_checkpoint(tmp_path)["z"]["file"] == wm["z"]

    def write_index(weight_map):
        index.write_text(json.dumps({"weight_map": weight_map}))

    write_index({**wm, "y": "model-00009-of-00009.safetensors"})
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    assert "model-00009-of-00009.safetensors" in str(e.value) and "does not exist" in str(e.value)
    assert "'y'" in str(e.value) and str(index) in str(e.value)

    wrong = wm["x"] if wm["y"] != wm["x"] else wm["z"]
    write_index({**wm, "y": wrong})
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    assert f"maps tensor 'y' to '{wrong}', which does not contain it" in str(e.value)

    write_index({**wm, "ghost": wm["x"]})
    with pytest.raises(CheckpointError, match="maps tensor 'ghost'"):
        inspect_checkpoint(tmp_path)

    # a tensor stored in two shards
    save_file({"x": torch.ones(2), "dup": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"dup": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    write_index({"x": "a.safetensors", "dup": "b.safetensors"})
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    assert "'dup' is present in two files" in str(e.value)
    assert "a.safetensors" in str(e.value) and "b.safetensors" in str(e.value)

    index.write_text('{"weight_map": {"x": "a.safetensors",}')
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    assert str(index) in str(e.value) and "malformed JSON at byte" in str(e.value)

    index.write_text('{"weight_map": ["a.safetensors"]}')
    with pytest.raises(CheckpointError, match="field 'weight_map': expected an object, found array"):
        inspect_checkpoint(tmp_path)


def test_duplicate_across_files_without_index(tmp_path):
    save_file({"w": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    msg = str(e.value)
    assert "'w' is present in two files" in msg and "a.safetensors" in msg and "b.safetensors" in msg


def test_bad_config_is_config_error(tmp_path):
    save_file({"w": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    cfg = tmp_path / "config.json"
    cfg.write_text('{"hidden_size": 64,, "x": 1}')
    with pytest.raises(ConfigError) as e:
        inspect_checkpoint(tmp_path)
    assert isinstance(e.value, ValueError)
    assert str(cfg) in str(e.value) and "malformed JSON at byte 19" in str(e.value)
    cfg.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object at the top level, found array"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "none.json")


def test_parse_json_binding():
    assert _core._parse_json('{"a": [1, 2.5, "\\u00e9\\ud83d\\ude00", null, true]}') == {
        "a": [1, 2.5, "\u00e9\U0001F600", None, True]}
    assert _core._parse_json(b"[18446744073709551616]") == [1.8446744073709552e19]
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="malformed JSON at byte 4: trailing comma"):
        _core._parse_json("[1, ]")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="nesting deeper than 64"):
        _core._parse_json("[" * 100000)


# ---------------------------------------------------------------------------- writer


def test_bf16_bits_match_torch():
    vals = np.array([0.0, -0.0, 1.0, -2.5, 3.14159, 1e-40, 65504.0, 3.3895314e38, 3.4028235e38, np.inf, -np.inf,
                     1.00390625, 1.01171875, 1.0078125 + 2**-9], dtype=np.float32)
    rng = np.random.default_rng(0)
    vals = np.concatenate([vals, rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000)])
    vals = vals.astype(np.float32)
    bits = f32_to_bf16_bits(vals)
    ref = torch.from_numpy(vals).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, ref)
    np.testing.assert_array_equal(bf16_bits_to_f32(bits), torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16).float().numpy())
    nan_bits = f32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(bf16_bits_to_f32(nan_bits)).all()
    assert f32_to_bf16_bits(np.zeros((2, 3), np.float32)).shape == (2, 3)


def test_numpy_writer_is_readable_by_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    tensors = {
        "f32": f32,
        "f16": rng.standard_normal(7).astype(np.float16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "i64": np.array([-(2**40), 5], dtype=np.int64),
        "u8": np.arange(5, dtype=np.uint8),
        "bf16": (f32_to_bf16_bits(f32), "BF16"),
        "f8": (np.array([0x38, 0x40, 0xC8], dtype=np.uint8), "F8_E4M3"),
        "big_endian": np.arange(4, dtype=">f4"),
        "scalar": np.float32(2.0),
        "empty": np.zeros((0, 3), np.float32),
    }
    path = tmp_path / "w.safetensors"
    save_safetensors(path, tensors, metadata={"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
        assert torch.equal(f.get_tensor("f32"), torch.from_numpy(f32))
        assert torch.equal(f.get_tensor("bf16"), torch.from_numpy(f32).bfloat16())
        assert f.get_tensor("f8").dtype == torch.float8_e4m3fn
        assert f.get_tensor("f8").float().tolist() == [1.0, 2.0, -4.0]
        assert f.get_tensor("big_endian").tolist() == [0.0, 1.0, 2.0, 3.0]
        assert f.get_tensor("i64").tolist() == [-(2**40), 5]
        assert f.get_tensor("scalar").shape == () and f.get_tensor("empty").shape == (0, 3)
    got = inspect_checkpoint(path)
    assert got["bf16"] == {"dtype": "BF16", "shape": [3, 5], "file": "w.safetensors"}
    assert got["f8"]["dtype"] == "F8_E4M3" and got["scalar"]["shape"] == []
    with pytest.raises(ValueError, match="unsupported numpy dtype float64"):
        save_safetensors(tmp_path / "x.safetensors", {"x": np.zeros(2)})
    with pytest.raises(ValueError, match="BF16 must be given as a uint16 array"):
        save_safetensors(tmp_path / "x.safetensors", {"x": (np.zeros(2, np.float32), "BF16")})
    with pytest.raises(ValueError, match="reserved"):
        save_safetensors(tmp_path / "x.safetensors", {"__metadata__": np.zeros(2, np.float32)})


def test_save_sharded(tmp_path):
    tensors = {f"t{i:02d}": np.full((10,), i, np.float32) for i in range(10)}  # 40 bytes each
    paths = save_sharded(tmp_path, tensors, max_shard_bytes=100)
    assert [os.path.basename(p) for p in paths] == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 400
    assert index["weight_map"]["t00"] == "model-00001-of-00005.safetensors"
    assert index["weight_map"]["t09"] == "model-00005-of-00005.safetensors"
    got = inspect_checkpoint(tmp_path)
    assert {n: v["file"] for n, v in got.items()} == index["weight_map"]
    ref = library_view(str(tmp_path))
    ck = _core.Checkpoint.open(str(tmp_path))
    for n in tensors:
        assert raw_bytes(ck.tensor(n)) == ref[n][3] == tensors[n].tobytes()


def test_demo_checkpoint_tool(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "dflash2_rt.tools.make_demo_checkpoint", str(out), "--shards", "3"],
                       capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert r.returncode == 0, r.stderr
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert shards == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    got = inspect_checkpoint(out)
    ref = library_view(str(out))
    assert {n: (v["dtype"], v["shape"], v["file"]) for n, v in got.items()} == {n: r[:3] for n, r in ref.items()}
    assert {v["dtype"] for v in got.values()} == {"BF16", "F32"}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got
    cfg = _core.Checkpoint.open(str(out)).config()
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["hidden_size"] == got["model.embed_tokens.weight"]["shape"][1]
    # deterministic
    out2 = tmp_path / "demo2"
    subprocess.run([sys.executable, "-m", "dflash2_rt.tools.make_demo_checkpoint", str(out2), "--shards", "3"],
                   check=True, capture_output=True, timeout=120, env=subprocess_env())
    for s in shards:
        assert (out / s).read_bytes() == (out2 / s).read_bytes()


# ---------------------------------------------------------------------------- CLI


def subprocess_env() -> dict:
    """The environment for `python -m dflash2_rt...`: this dflash2_rt on PYTHONPATH."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(dflash2_rt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash2_rt", *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


def test_cli_inspect(tmp_path):
    write_sharded_torch(tmp_path, {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
                                   "model.norm.weight": torch.zeros(4, dtype=torch.float32),
                                   "lm_head.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}, 2)
    r = run_cli("inspect", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "dtype", "shape", "file"]
    rows = [ln.split(None, 3) for ln in lines[1:4]]
    assert [row[0] for row in rows] == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert "[8, 4]" in lines[2] and "model-0000" in lines[2]
    text = r.stdout
    assert "tensors:    3" in text
    assert "files:      2" in text
    assert "parameters: 68 (68)" in text
    assert "bytes:      144 (144 B)" in text  # 2*32*2 + 4*4
    assert "BF16:     128" in text and "F32:      16" in text
    r = run_cli("inspect", "--summary", str(tmp_path))
    assert r.returncode == 0 and "name" not in r.stdout.splitlines()[0] and "tensors:    3" in r.stdout
    r = run_cli("inspect", "--json", str(tmp_path))
    data = json.loads(r.stdout)
    assert data["tensors"] == inspect_checkpoint(tmp_path) and data["totals"]["parameters"] == 68


def test_cli_errors_and_info(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(st_image({"w": entry(shape=(4,), offsets=(0, 16))}, b"\0" * 8))
    r = run_cli("inspect", str(bad))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tensor 'w'" in err[0] and str(bad) in err[0]
    r = run_cli("inspect", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "does not exist" in r.stderr
    r = run_cli("info")
    assert r.returncode == 0 and "version:" in r.stdout and "backends:" in r.stdout
    r = run_cli()
    assert r.returncode == 2  # argparse: a subcommand is required
