// The tensor-core GEMMs' scale-factor layouts, checked on the CPU: the CuTe layouts that the
// CUTLASS kernels are built with (cpp/src/backend/cuda/cutlass/*_config.cuh) against the
// plain offsets of cpp/src/backend/cuda/layout.h that our quantization kernels write and
// the checkpoints store. Also the wgmma operand layout, descriptors and accumulator fragment
// of gemm_dq.cu's Hopper form against CuTe's GMMA definitions (and, in the emulated build,
// the emulator's reading of those descriptors). Host code only (no kernel runs), so it runs
// in every build that has CUDA and CUTLASS, GPU or not; a wrong layout here would scale the
// wrong blocks, or multiply the wrong elements, on a GPU.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

#include <cute/atom/mma_traits_sm90_gmma.hpp>

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

// The byte offset at which CuTe's canonical K-major 128-byte-swizzle layout of a 128 x 64
// BF16 tile puts element (r, k): the address of that element of a tensor over a 1024-byte
// aligned buffer (the swizzle applies to the address bits, not to the layout's integer).
int64_t k_sw128_byte(int r, int k) {
  using namespace cute;
  alignas(1024) static bfloat16_t buf[128 * 64];
  static const auto t =
      make_tensor(make_smem_ptr(buf), tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, Shape<_128, _64>{}));
  return reinterpret_cast<const char*>(raw_pointer_cast(&t(r, k))) - reinterpret_cast<const char*>(buf);
}

// gemm_dq.cu's wgmma form stores its operand tiles (64 or 128 rows x 64 BF16) with
// layout::wg_sw128_offset: that must be CuTe's canonical K-major 128-byte-swizzle layout, the
// one CUTLASS's Hopper GEMMs describe to wgmma with the same descriptor fields.
TEST(wgmma_operand_tiles_are_cutes_k_sw128_layout) {
  int bad = 0, cases = 0;
  for (int r = 0; r < 128; ++r)
    for (int k = 0; k < 64; ++k) {
      const int64_t want = k_sw128_byte(r, k), got = L::wg_sw128_offset(r, k / 8) + 2 * (k % 8);
      bad += got != want;
      ++cases;
    }
  std::printf("  %d (row, k) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

// Every descriptor field but the start address against make_gmma_desc's for the k16 slices of
// such a tile (CuTe's host build has no shared addresses: it says so on stdout and uses 0).
TEST(wgmma_descriptors_are_cutes) {
  using namespace cute;
  alignas(1024) static bfloat16_t buf[64 * 64];
  const auto sl = tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, Shape<_64, _64>{});
  const auto t = make_tensor(make_smem_ptr(buf), sl);
  std::fflush(stdout);
  const int saved = dup(1), null = open("/dev/null", O_WRONLY);
  if (null >= 0) dup2(null, 1);
  const GmmaDescriptor d = GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(t, Shape<_64, _16>{}, make_coord(0, 0)));
  const uint64_t cute_desc = d.desc_;
  std::fflush(stdout);
  if (saved >= 0) dup2(saved, 1);
  if (null >= 0) close(null);
  if (saved >= 0) close(saved);
  const uint64_t addr_bits = 0x3FFFull;
  CHECK((L::wg_desc_k_sw128(0) & ~addr_bits) == (cute_desc & ~addr_bits));
  // the start address: bits 4..17 of the shared address
  CHECK((L::wg_desc_k_sw128(0x12340u) & addr_bits) == 0x1234u);
  CHECK((L::wg_desc_k_sw128(0x40000u + 0x400u + 32u) & addr_bits) == 0x42u);
  std::printf("  ours 0x%016llx, CuTe's 0x%016llx (start address aside)\n",
              (unsigned long long)L::wg_desc_k_sw128(0), (unsigned long long)cute_desc);
}

// The accumulator registers of wgmma m64n128k16 (F32) against CuTe's CLayout_64x128
// ((thread, value) -> m + 64 n).
TEST(wgmma_accumulator_fragment_is_cutes) {
  using namespace cute;
  const auto cl = GMMA::CLayout_64x128{};
  int bad = 0, cases = 0;
  for (int t = 0; t < 128; ++t)
    for (int v = 0; v < 64; ++v) {
      const int idx = int(cl(t, v)), m = idx % 64, n = idx / 64;
      bad += m != L::wg_acc_row(t, v) || n != L::wg_acc_col(t, v);
      ++cases;
    }
  std::printf("  %d (thread, register) checked, %d misplaced\n", cases, bad);
  CHECK(bad == 0);
}

#if defined(DFLASH2_CUDA_EMULATED)
namespace emu {
uint32_t wgmma_operand_addr(uint64_t desc, int row, int k, const char** why);
}
// The emulator reads a descriptor as the PTX ISA describes it; with ours it must land every
// element of each k16 slice where CuTe's layout puts it (so the emulated runs of the wgmma
// kernel multiply what the tensor cores would).
TEST(emulated_wgmma_reads_the_cute_layout) {
  int bad = 0, cases = 0;
  for (uint32_t base : {0u, 1024u, 0x8000u, 0x1c400u})
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t desc = L::wg_desc_k_sw128(base + 32u * ks);
      for (int r = 0; r < 128; ++r)
        for (int k = 0; k < 16; ++k) {
          const char* why = nullptr;
          const uint32_t got = emu::wgmma_operand_addr(desc, r, k, &why);
          bad += why != nullptr || got != base + uint32_t(k_sw128_byte(r, 16 * ks + k));
          ++cases;
        }
    }
  std::printf("  %d (row, k) checked, %d misread\n", cases, bad);
  CHECK(bad == 0);
}
#endif

TEST_MAIN()
