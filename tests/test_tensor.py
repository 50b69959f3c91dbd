"""Tensors cross the binding without copies (DLPack both ways); devices; build info."""
import numpy as np
import pytest
import torch

import dflash2_rt


def test_numpy_roundtrip_is_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = dflash2_rt.from_dlpack(a)
    assert t.shape == (3, 4) and t.dtype == "F32" and t.device == "cpu"
    assert t.data_ptr == a.ctypes.data
    b = np.from_dlpack(t)
    assert b.ctypes.data == a.ctypes.data
    b[0, 0] = 42
    assert a[0, 0] == 42
    del a, b
    assert np.from_dlpack(t)[0, 0] == 42  # t keeps the numpy buffer alive


def test_strided_views_keep_strides():
    a = np.arange(60, dtype=np.float32).reshape(5, 12)[:, 2:9]
    t = dflash2_rt.from_dlpack(a)
    assert t.strides == (12, 1) and not t.is_contiguous()
    np.testing.assert_array_equal(np.from_dlpack(t.contiguous()), a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32, torch.int64, torch.uint8])
def test_torch_roundtrip(dtype):
    src = torch.arange(24).reshape(2, 3, 4).to(dtype)
    t = dflash2_rt.from_dlpack(src)
    back = torch.from_dlpack(t)
    assert back.dtype == dtype and back.data_ptr() == src.data_ptr()
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))


def test_native_tensor_to_numpy_and_errors():
    t = dflash2_rt.Tensor.zeros("F32", [2, 3])
    n = t.numpy()
    n += 1
    assert np.from_dlpack(t).sum() == 6
    with pytest.raises(ValueError, match="unknown dtype"):
        dflash2_rt.Tensor.empty("F64", [2])
    with pytest.raises(ValueError, match="negative dimension"):
        dflash2_rt.Tensor.empty("F32", [2, -1])
    with pytest.raises(ValueError, match="unknown device"):
        dflash2_rt.Tensor.empty("F32", [2], "tpu")
    with pytest.raises(ValueError, match="out of range"):
        t.slice(1, 0, 4)
    with pytest.raises(ValueError, match="does not hold"):
        t.reshape([4, 2])


def test_cuda_unavailable_is_a_clear_error():
    ok, why = dflash2_rt.cuda_available(with_reason=True)
    if ok:
        pytest.skip("a CUDA device is present")
    assert why
    with pytest.raises((NotImplementedError, RuntimeError)):
        dflash2_rt.Tensor.empty("F32", [4], "cuda")


def test_build_info():
    info = dflash2_rt.build_info()
    assert info["version"] == dflash2_rt.__version__
    assert "cpu" in info["backends"]
    assert info["cpu_isa"] in ("avx2+fma+f16c", "generic")
    assert info["num_threads"] >= 1 and "OpenMP" in info["threading"]
    assert "GEMM" in info["blas"]
    if "cuda" in info["backends"]:
        assert info["cuda_archs"], "a CUDA build lists its archs"
        assert all(a.startswith("sm_") for a in info["cuda_archs"])
    # an emulated CUDA build (cpp/emu) says so
    assert info["cuda_emulated"] in (True, False)
    if info["cuda_emulated"]:
        assert "cuda" in info["backends"]


def test_engine_without_target_is_a_clear_error(monkeypatch, tmp_path):
    # Engine() loads the bundled default pair; where it is missing, say so instead of failing obscurely
    import dflash2_rt.engine
    monkeypatch.setattr(dflash2_rt.engine, "DEFAULT_PAIR_DIR", str(tmp_path / "missing"))
    with pytest.raises(NotImplementedError, match="bundled default model"):
        dflash2_rt.Engine(target=None)
