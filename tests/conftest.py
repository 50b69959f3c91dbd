import os
import sys

# torch (the oracle) and dflash2_rt each bring an OpenMP runtime; with spinning waits the
# two thread pools take the cores from each other and tests run 5-20x slower (measured:
# test_speculative.py 45 s passive, 280 s with a 20k spin, 650 s default). Must be set
# before either library initialises OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

# Development builds (plain CMake) put the extension elsewhere: see python/dflash2_rt/__init__.py.
_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("DFLASH2_RT_CORE_DIR"):
    sys.path.insert(0, os.path.join(os.path.dirname(_here), "python"))


def cuda_or_skip():
    import dflash2_rt

    ok, why = dflash2_rt.cuda_available(with_reason=True)
    if not ok:
        pytest.skip(f"CUDA backend not usable here: {why}")
