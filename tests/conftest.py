import os
import sys

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
