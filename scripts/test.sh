#!/usr/bin/env bash
# The project's test command (the README's second command runs it through .ci/run):
# the C++ tests through ctest (a standalone CMake build), then pytest against the
# installed package. Needs `pip install .` and requirements-test.txt first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DFLASH2_JOBS:-2}
cuda=${DFLASH2_CUDA:-AUTO}

# Without a GPU the C++ tests cannot run the CUTLASS GEMMs, and `pip install .` has just
# compiled them (the heaviest translation units: minutes each): the ctest build leaves them
# out (test_cutlass_layout still checks their scale layouts, from CUTLASS's headers).
cutlass_kernels=ON
if ! nvidia-smi -L >/dev/null 2>&1; then cutlass_kernels=OFF; fi
cutlass_kernels=${DFLASH2_CUTLASS_KERNELS:-$cutlass_kernels}

cmake -S . -B build/ctest -G Ninja -DDFLASH2_CUDA="$cuda" -DDFLASH2_BUILD_TESTS=ON -DDFLASH2_BUILD_PYTHON=OFF \
  -DDFLASH2_CUTLASS_KERNELS="$cutlass_kernels" > build-ctest-configure.log 2>&1 \
  || { cat build-ctest-configure.log; exit 1; }
cmake --build build/ctest -j "$jobs"
ctest --test-dir build/ctest --output-on-failure

# pytest exits 5 when it collects no test: that fails here too (set -e).
python -m pytest -q -ra tests
