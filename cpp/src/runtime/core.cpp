#include "runtime/core.h"

#include <algorithm>
#include <random>

namespace dflash2::runtime {

uint64_t rng_key(int64_t seed, int64_t index) {
  uint64_t s = seed < 0 ? std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) : uint64_t(seed);
  uint64_t z = s + 0x9e3779b97f4a7c15ull * uint64_t(index + 1);  // splitmix64 of (seed, index)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void Core::allocate_buffers() {
  const auto& mc = target->config();
  const int64_t V = mc.vocab_size, H = mc.hidden_size, B = target->options().max_batch_size;
  const int64_t verify_rows = B * (K + 1);
  const int64_t feat_rows = std::max(target->options().max_step_tokens, verify_rows);
  logits = Tensor::empty(DType::F32, {verify_rows, V});
  flags = Tensor::empty(DType::I32, {verify_rows});
  if (!taps.empty()) taps_buf = Tensor::empty(DType::F32, {feat_rows, int64_t(taps.size()) * H});
  if (want_final) fin = Tensor::empty(DType::F32, {feat_rows, H});
  s_temp = Tensor::zeros(DType::F32, {B});
  s_topp = Tensor::zeros(DType::F32, {B});
  s_topk = Tensor::zeros(DType::I32, {B});
  s_rng = Tensor::zeros(DType::I64, {B, 2});
  s_out = Tensor::zeros(DType::I32, {B});
  a_row0 = Tensor::zeros(DType::I32, {B});
  a_draft_row = Tensor::zeros(DType::I32, {B});
  a_draft_len = Tensor::zeros(DType::I32, {B});
  a_accepted = Tensor::zeros(DType::I32, {B});
  a_bonus = Tensor::zeros(DType::I32, {B});
  no_drafts = Tensor::zeros(DType::I32, {B, 1});
}

const int32_t* Core::nonfinite_rows(int64_t rows) {
  Tensor lg = logits.slice(0, 0, rows), fl = flags.slice(0, 0, rows);
  ops::check_finite(lg, fl);
  return fl.data_as<const int32_t>();
}

}  // namespace dflash2::runtime
