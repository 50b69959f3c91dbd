"""The installed C++ package: find_package(dflash2 CONFIG) + dflash2::dflash2 work for a C++
program (examples/embed), which opens a checkpoint, runs an op and prints the build's backends.

The package is taken from the installed wheel (``dflash2_rt.cmake_prefix()``, i.e.
site-packages/dflash2_rt with lib/cmake/dflash2), or from ``DFLASH2_CMAKE_PREFIX`` (e.g. the
prefix of a standalone ``cmake --install``). Under a CMake development build there is no
installed package and the tests skip, saying so.
"""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

import dflash2_rt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBED_SRC = os.path.join(REPO, "examples", "embed")


def _prefix():
    env = os.environ.get("DFLASH2_CMAKE_PREFIX")
    return (env, True) if env else (dflash2_rt.cmake_prefix(), False)


def _write_safetensors(path, tensors):
    """Writes {name: numpy array} with whichever writer is available."""
    try:
        from dflash2_rt.checkpoint import save_safetensors
    except ImportError:
        save_safetensors = None
    if save_safetensors is not None:
        save_safetensors(path, tensors)
        return
    try:
        from safetensors.numpy import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        save_file(tensors, path)
        return
    # minimal writer: 8-byte header length, JSON header, data
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _build_example(tmp_path_factory, name, exe_name):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip(f"cmake is not installed: cannot build examples/{name} against the C++ package")
    prefix, from_env = _prefix()
    configs = [os.path.join(prefix, d, "cmake", "dflash2", "dflash2Config.cmake") for d in ("lib", "lib64")]
    if not any(os.path.isfile(c) for c in configs):
        if from_env:
            pytest.fail(f"DFLASH2_CMAKE_PREFIX={prefix} has no lib/cmake/dflash2/dflash2Config.cmake")
        pytest.skip(
            f"dflash2_rt is imported from {prefix}, which has no lib/cmake/dflash2: this is a development "
            "build (CMake build tree + DFLASH2_RT_CORE_DIR), not an installed wheel. pip install the package, "
            "or set DFLASH2_CMAKE_PREFIX to a `cmake --install` prefix, to test the C++ package")
    src = os.path.join(REPO, "examples", name)
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        pytest.skip(f"examples/{name} is not beside the tests ({src})")

    build = tmp_path_factory.mktemp(f"{name}-build")
    cfg = [cmake, "-S", src, "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    for cmd in (cfg, [cmake, "--build", str(build), "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    exe = build / exe_name
    assert exe.is_file()
    return str(exe), prefix, from_env


@pytest.fixture(scope="module")
def embed_exe(tmp_path_factory):
    return _build_example(tmp_path_factory, "embed", "dflash2_embed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        "a_hidden": rng.standard_normal((3, 8)).astype(np.float32),
        "b_ids": np.arange(5, dtype=np.int32),
        "c_half": np.array([1.0, -2.0, 3.0, 0.5], dtype=np.float16),
    }
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    _write_safetensors(str(path), tensors)
    return str(path), tensors


def _run(exe, *args):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def _row0(out):
    m = re.search(r"^row 0:(.*)$", out, re.M)
    assert m, out
    return np.array([float(v) for v in m.group(1).split()])


def _expected_row0(x):
    x = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1] if x.ndim else 1)[0]
    return x / np.sqrt(np.mean(x * x) + 1e-6)


def test_embed_opens_checkpoint_and_runs_rms_norm(embed_exe, checkpoint):
    exe, prefix, from_env = embed_exe
    path, tensors = checkpoint
    r = _run(exe, path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^tensors: 3$", out, re.M), out
    total = sum(t.nbytes for t in tensors.values())
    assert re.search(rf"^total bytes: {total}$", out, re.M), out
    # the first floating-point tensor by name, with unit weights
    assert re.search(r"^rms_norm a_hidden F32\[3, 8\] cpu -> \[3, 8\]$", out, re.M), out
    got = _row0(out)
    want = _expected_row0(tensors["a_hidden"])[:4]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ms = float(re.search(r"^row 0 mean square: ([0-9.]+)$", out, re.M).group(1))
    assert abs(ms - 1.0) < 1e-4

    m = re.search(r"^backends: (.*)$", out, re.M)
    assert m, out
    backends = m.group(1).split()
    assert "cpu" in backends
    if not from_env:  # the package and the imported module are the same build
        assert backends == list(dflash2_rt.build_info()["backends"])
    assert re.search(r"^cuda available: (yes|no \(.+\))$", out, re.M), out


def test_embed_named_f16_tensor(embed_exe, checkpoint):
    exe, _, _ = embed_exe
    path, tensors = checkpoint
    r = _run(exe, path, "c_half")
    assert r.returncode == 0, r.stderr
    assert "rms_norm c_half F16[4] cpu -> [1, 4]" in r.stdout
    np.testing.assert_allclose(_row0(r.stdout), _expected_row0(tensors["c_half"]), rtol=1e-5, atol=1e-6)


def test_embed_errors_exit_nonzero(embed_exe, checkpoint, tmp_path):
    exe, _, _ = embed_exe
    path, _ = checkpoint
    missing = str(tmp_path / "missing.safetensors")
    r = _run(exe, missing)
    assert r.returncode != 0
    assert r.stderr.startswith("error (Checkpoint): "), r.stderr
    assert "missing.safetensors" in r.stderr

    r = _run(exe, path, "no_such_tensor")
    assert r.returncode != 0
    assert "no_such_tensor" in r.stderr and r.stderr.startswith("error ("), r.stderr

    r = _run(exe, path, "b_ids")
    assert r.returncode != 0
    assert "not a floating-point tensor" in r.stderr, r.stderr

    truncated = tmp_path / "truncated.safetensors"
    with open(path, "rb") as f:
        truncated.write_bytes(f.read()[:-7])
    r = _run(exe, str(truncated))
    assert r.returncode != 0
    assert r.stderr.startswith("error (Checkpoint): "), r.stderr


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, index_topk=4, index_n_heads=8, index_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    path = tmp_path_factory.mktemp("tiny-target")
    transformers.GlmMoeDsaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def test_generate_example_streams_the_engine_output(tmp_path_factory, tiny_target):
    """examples/generate: Engine + generate + a streaming callback from C++, equal to Python's."""
    exe, _, _ = _build_example(tmp_path_factory, "generate", "dflash2_generate")
    r = _run(exe, "--target", tiny_target, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    streamed = [int(t) for t in re.search(r"^stream:(.*)$", r.stdout, re.M).group(1).split()]
    final = [int(t) for t in re.search(r"^tokens:(.*)$", r.stdout, re.M).group(1).split()]
    assert streamed == final and len(final) == 12
    eng = dflash2_rt.Engine(target=tiny_target, max_seq_len=512, max_batch_size=1)
    assert eng.generate([[3, 1, 4, 1, 5]], max_new_tokens=12, stop_token_ids=[])[0].token_ids == final
    assert "method ar: 12 tokens" in r.stdout
    bad = _run(exe, "--target", tiny_target, "--method", "dflash2", "--prompt-ids", "1")
    assert bad.returncode == 1 and "needs a drafter checkpoint" in bad.stderr
