"""dflash2_rt: a native inference runtime for GLM-5.3 with DFlash 2 speculative decoding.

The C++/CUDA core lives in the extension ``dflash2_rt._core``; this package is a thin layer
over it. For development builds made with plain CMake, set ``DFLASH2_RT_CORE_DIR`` to the
folder that holds the built ``_core`` module and put ``python/`` on ``PYTHONPATH``.
"""
from __future__ import annotations

import os as _os

# OpenMP (libgomp) threads spin for a long time after each parallel region by default; the
# decode step runs many short regions, and on a busy or shared machine (or beside torch's
# own OpenMP runtime) the long spins steal the cores: measured 5-10x slower steps. A short
# spin before sleeping keeps back-to-back regions fast. Read once when libgomp loads (with
# _core below), so it must be set before; an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "20000")

if _os.environ.get("DFLASH2_RT_CORE_DIR"):
    __path__.append(_os.environ["DFLASH2_RT_CORE_DIR"])  # noqa: F821  (package __path__)

from . import _core  # noqa: E402
from ._core import (  # noqa: E402,F401
    BackendError,
    CheckpointError,
    ConfigError,
    DFlash2Error,
    InternalError,
    InvalidArgumentError,
    NumericalError,
    OutOfMemoryError,
    Checkpoint,
    Tensor,
    UnsupportedError,
    cuda_available,
)
from ._core import ops  # noqa: E402,F401
from .checkpoint import inspect_checkpoint, load_config, save_safetensors, save_sharded  # noqa: E402,F401
from .engine import Engine  # noqa: E402,F401

__version__ = _core.__version__


def build_info() -> dict:
    """What this build contains: version, backends (cpu, cuda + archs), NCCL, CUTLASS,
    compiler, the CPU GEMM implementation and the threading runtime."""
    return dict(_core.build_info())


def cmake_prefix() -> str:
    """The prefix to give CMake (``-DCMAKE_PREFIX_PATH=...``) so that
    ``find_package(dflash2 CONFIG)`` finds the installed C++ package."""
    return _os.path.dirname(_os.path.abspath(__file__))


def from_dlpack(obj) -> Tensor:
    """A zero-copy dflash2_rt.Tensor view of any DLPack producer (numpy, torch, ...)."""
    return _core.from_dlpack(obj)
