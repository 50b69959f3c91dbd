// The tensor-core GEMMs' scale-factor layouts, checked on the CPU: the CuTe layouts that the
// CUTLASS kernels are built with (cpp/src/backend/cuda/cutlass/*_config.cuh) against the
// plain offsets of cpp/src/backend/cuda/layout.h that our quantization kernels write and
// the checkpoints store. Host code only (no kernel runs), so it runs in every build that has
// CUDA and CUTLASS, GPU or not; a wrong layout here would scale the wrong blocks on a GPU.
#include <cstdint>
#include <cstdio>

#include "backend/cuda/cutlass/fp8_config.cuh"
#include "backend/cuda/cutlass/nvfp4_config.cuh"
#include "backend/cuda/layout.h"
#include "testing.h"

namespace L = dflash2::cuda::layout;
using dflash2::cuda::tc::Fp8GroupedKMajorScaleConfig;
using dflash2::cuda::tc::Fp8ScaleConfig;
using dflash2::cuda::tc::Nvfp4SfConfig;

TEST(fp8_activation_scales_are_mn_major_per_row) {
  int bad = 0, cases = 0;
  for (int Mp : {4, 8, 132, 256})
    for (int K : {16, 128, 208, 384}) {
      const int N = 132;
      const auto sfa = Fp8ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(Mp, N, K, 1));
      for (int m = 0; m < Mp; ++m)
        for (int k = 0; k < K; ++k) {
          const int64_t got = sfa(m, k, 0), want = L::fp8_act_scale_offset(m, k / 128, Mp);
          bad += got != want;
          ++cases;
        }
      // the buffer quant.cu fills holds exactly the scales the kernel reads
      CHECK(int64_t(cute::cosize(cute::filter_zeros(sfa))) == int64_t(Mp) * ((K + 127) / 128));
    }
  std::printf("  %d (m, k) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

TEST(fp8_weight_scales_are_the_checkpoints_row_major_blocks) {
  int bad = 0, cases = 0;
  for (int N : {4, 128, 132, 300})
    for (int K : {16, 128, 208, 384}) {
      const int Mp = 8, nbk = (K + 127) / 128;
      const auto sfb = Fp8ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(Mp, N, K, 1));
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) {
          const int64_t got = sfb(n, k, 0), want = L::fp8_weight_scale_offset(n / 128, k / 128, nbk);
          bad += got != want;
          ++cases;
        }
      CHECK(int64_t(cute::cosize(cute::filter_zeros(sfb))) == int64_t((N + 127) / 128) * nbk);
    }
  std::printf("  %d (n, k) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

TEST(fp8_grouped_blackwell_activation_scales_are_k_major) {
  // a group of M_g rows starting at r0 reads its scales at sfa + r0 * nbk through this layout
  int bad = 0, cases = 0;
  for (int M : {1, 3, 4, 130})
    for (int K : {16, 128, 208, 384}) {
      const int N = 132, nbk = (K + 127) / 128;
      const auto sfa = Fp8GroupedKMajorScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(M, N, K, 1));
      for (int m = 0; m < M; ++m)
        for (int k = 0; k < K; ++k) {
          const int64_t got = sfa(m, k, 0), want = L::fp8_act_scale_offset_kmajor(m, k / 128, nbk);
          bad += got != want;
          ++cases;
        }
      CHECK(int64_t(cute::cosize(cute::filter_zeros(sfa))) == int64_t(M) * nbk);
      // the weights' scales stay the checkpoint's row-major blocks
      const auto sfb = Fp8GroupedKMajorScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(M, N, K, 1));
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; k += 16) {
          const int64_t got = sfb(n, k, 0), want = L::fp8_weight_scale_offset(n / 128, k / 128, nbk);
          bad += got != want;
          ++cases;
        }
    }
  std::printf("  %d (m or n, k) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

TEST(nvfp4_scales_are_swizzled_128x4_atoms) {
  int bad = 0, cases = 0;
  for (int R : {1, 4, 100, 128, 130, 300})
    for (int K : {32, 64, 96, 160, 512}) {
      const int N = 132;
      const auto sfa = Nvfp4SfConfig::tile_atom_to_shape_SFA(cute::make_shape(R, N, K, 1));
      const auto sfb = Nvfp4SfConfig::tile_atom_to_shape_SFB(cute::make_shape(N, R, K, 1));
      const int64_t cols = L::nvfp4_sf_cols(K), buf = L::nvfp4_sf_rows(R) * cols;
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < K; ++k) {
          const int64_t want = L::nvfp4_sf_offset(r, k / 16, cols);
          bad += int64_t(sfa(r, k, 0)) != want;
          bad += int64_t(sfb(r, k, 0)) != want;  // B (the weight) takes the same layout over its N rows
          bad += want < 0 || want >= buf;
          cases += 2;
        }
      CHECK(int64_t(cute::cosize(cute::filter_zeros(sfa))) <= buf);
    }
  std::printf("  %d (row, k) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

TEST_MAIN()
