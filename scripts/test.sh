#!/usr/bin/env bash
# The project's test command (the README's second command runs it through .ci/run):
# the C++ tests through ctest (a standalone CMake build), then pytest against the
# installed package. Needs `pip install .` and requirements-test.txt first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DFLASH2_JOBS:-2}
cuda=${DFLASH2_CUDA:-AUTO}

# With a GPU: the ctest build is a CUDA build (the CUTLASS GEMMs included). Without one, and
# with the CUDA toolkit's headers present, it is the CPU emulation of the CUDA backend
# (cpp/emu, DFLASH2_CUDA_EMULATE): `pip install .` has already compiled every .cu file with
# nvcc, and the emulated build runs the same kernels' code on the CPU, so the CUDA tests
# (C++ and, through the emulated Python module, the GPU cases of pytest) run here too.
# DFLASH2_CUDA_EMULATE=ON / OFF overrides the choice.
have_gpu=0
if nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi
emulate=OFF
if [ "$have_gpu" = 0 ] && [ "$cuda" != OFF ] && { command -v nvcc >/dev/null 2>&1 || [ -e /usr/local/cuda/include/cuda_runtime.h ]; }; then
  emulate=ON
fi
emulate=${DFLASH2_CUDA_EMULATE:-$emulate}

if [ "$emulate" = ON ]; then
  tree=build/ctest-emu
  cmake -S . -B "$tree" -G Ninja -DDFLASH2_CUDA=OFF -DDFLASH2_CUDA_EMULATE=ON -DDFLASH2_BUILD_TESTS=ON \
    -DDFLASH2_BUILD_BENCH=OFF -DDFLASH2_BUILD_PYTHON=ON -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" \
    > build-ctest-configure.log 2>&1 || { cat build-ctest-configure.log; exit 1; }
else
  # Without a GPU the C++ tests cannot run the CUTLASS GEMMs, and `pip install .` has just
  # compiled them (the heaviest translation units: minutes each): the ctest build leaves them
  # out (test_cutlass_layout still checks their scale layouts, from CUTLASS's headers).
  cutlass_kernels=ON
  if [ "$have_gpu" = 0 ]; then cutlass_kernels=OFF; fi
  cutlass_kernels=${DFLASH2_CUTLASS_KERNELS:-$cutlass_kernels}
  tree=build/ctest
  cmake -S . -B "$tree" -G Ninja -DDFLASH2_CUDA="$cuda" -DDFLASH2_BUILD_TESTS=ON -DDFLASH2_BUILD_PYTHON=OFF \
    -DDFLASH2_CUTLASS_KERNELS="$cutlass_kernels" > build-ctest-configure.log 2>&1 \
    || { cat build-ctest-configure.log; exit 1; }
fi
cmake --build "$tree" -j "$jobs"
if [ "$emulate" = ON ]; then
  # the emulator's memcheck (guard pages; README, "The CUDA backend") for every emulated run:
  # a kernel reaching past its buffers fails its launch, so the test fails
  export EMU_MEMCHECK="${EMU_MEMCHECK:-1}"
fi
ctest --test-dir "$tree" --output-on-failure

# pytest exits 5 when it collects no test: that fails here too (set -e).
python -m pytest -q -ra tests

if [ "$emulate" = ON ]; then
  # The emulator runs a kernel on one core: the emulated op and engine cases run in $jobs
  # pytest workers (pytest-xdist, requirements-test.txt), each case in one of them.
  par=()
  if [ "$jobs" -gt 1 ] && python -c "import xdist" >/dev/null 2>&1; then par=(-n "$jobs"); fi
  # The GPU cases of pytest against the emulated module (tests/conftest.py puts python/ first
  # when DFLASH2_RT_CORE_DIR is set): every op's CUDA rows, and the end-to-end engine cases
  # that fit CI's 40 minutes (see README, "Tests": the CPU emulation of the CUDA backend).
  # Left out (run them by hand, e.g. DFLASH2_EMU_ENGINE_TESTS="mtp or real_dimension"): the
  # engine's MTP, real-dimension, prefill-numerics and sampling-distribution cases (2-30
  # minutes each in the emulator).
  op_cases="cuda"
  DFLASH2_RT_CORE_DIR="$PWD/$tree" python -m pytest -q -ra -p no:cacheprovider ${par[@]+"${par[@]}"} \
    tests/test_ops.py tests/test_sampling.py tests/test_quantize.py tests/test_tensor.py tests/test_kv_fp8.py \
    -k "${DFLASH2_EMU_OP_TESTS:-$op_cases}"
  # The tensor-core GEMMs again as Blackwell (EMU_SM=100): the NVFP4 W4A4 paths and the FP8
  # kernels' other scale layout (CUTLASS's kernels are host references in the emulator,
  # cpp/emu/cutlass_ref.cpp; what runs is our code around them).
  EMU_SM=100 DFLASH2_RT_CORE_DIR="$PWD/$tree" python -m pytest -q -ra -p no:cacheprovider tests/test_ops.py \
    -k "cuda and (linear_bf16 or linear_fp8 or linear_nvfp4 or moe_experts or dq_wgmma)"
  # 4 emulated GPUs, so tensor parallelism runs over the emulator's NCCL (cpp/emu/nccl_emu.cpp)
  engine_cases="test_logits_equal_cpu or nvfp4-experts or greedy_and_batch or seeded_sampling_equal or dflash2_pair"
  engine_cases="$engine_cases or bad_devices or decode_gemm_on_cuda or tensor_parallel or cuda_graphs_equal_eager"
  engine_cases="$engine_cases or dflash_paths or stop_tokens or failed_captures or decode_gemm_expert_parallel"
  engine_cases="$engine_cases or one_shot_all_reduce or pdl_graphs or dq_wgmma_fault or exact_tc_on_cuda"
  engine_cases="$engine_cases or op_timing_on_cuda or wide_vocab_sampling or (kv_cache_bf16_on_cuda and lora128) or (kv_cache_fp8_on_cuda and lora128)"
  engine_cases="$engine_cases or attention_tc_fault or interleaved_prefill or prefix_cache_on_cuda or logprobs_on_cuda or conversation_prefix_on_cuda"
  engine_cases="$engine_cases or penalties_on_cuda or structured_output_on_cuda"
  EMU_DEVICES=4 DFLASH2_RT_CORE_DIR="$PWD/$tree" python -m pytest -q -ra -p no:cacheprovider ${par[@]+"${par[@]}"} \
    tests/test_cuda_engine.py -k "${DFLASH2_EMU_ENGINE_TESTS:-$engine_cases}"
fi
