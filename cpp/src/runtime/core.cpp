#include "runtime/core.h"

#include <algorithm>
#include <cstring>
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
  device = target->options().device;  // rank 0's device
  logits = Tensor::empty(DType::F32, {verify_rows, V}, device);
  flags = Tensor::empty(DType::I32, {verify_rows});
  // the drafter's features live where it runs (the target writes them there directly)
  const Device fdev = drafter ? drafter->device() : Device::cpu();
  if (!taps.empty()) taps_buf = Tensor::empty(DType::F32, {feat_rows, int64_t(taps.size()) * H}, fdev);
  if (want_final) fin = Tensor::empty(DType::F32, {feat_rows, H}, fdev);
  s_temp = Tensor::zeros(DType::F32, {B});
  // flags, accepted, bonus and sampled tokens: views of one host buffer (h_res), which on
  // CUDA is the copy of one device buffer (d_res)
  h_res = Tensor::zeros(DType::I32, {verify_rows + 3 * B});
  flags = h_res.slice(0, 0, verify_rows);
  s_topp = Tensor::zeros(DType::F32, {B});
  s_topk = Tensor::zeros(DType::I32, {B});
  s_rng = Tensor::zeros(DType::I64, {B, 2});
  s_out = h_res.slice(0, verify_rows + 2 * B, verify_rows + 3 * B);
  a_row0 = Tensor::zeros(DType::I32, {B});
  a_draft_row = Tensor::zeros(DType::I32, {B});
  a_draft_len = Tensor::zeros(DType::I32, {B});
  a_accepted = h_res.slice(0, verify_rows, verify_rows + B);
  a_bonus = h_res.slice(0, verify_rows + B, verify_rows + 2 * B);
  no_drafts = Tensor::zeros(DType::I32, {B, 1});
  if (device.is_cuda()) {
    d_res = Tensor::zeros(DType::I32, {verify_rows + 3 * B}, device);
    d_flags = d_res.slice(0, 0, verify_rows);
    d_accepted = d_res.slice(0, verify_rows, verify_rows + B);
    d_bonus = d_res.slice(0, verify_rows + B, verify_rows + 2 * B);
    d_out = d_res.slice(0, verify_rows + 2 * B, verify_rows + 3 * B);
    // packed inputs, fixed offsets (rng first: 8-byte aligned): rng I64 [B, 2], then temp,
    // top-p (F32), top-k, row0, draft_row, draft_len (I32), B each
    const int64_t words = 4 * B + 6 * B;  // in 4-byte words
    d_in = Tensor::zeros(DType::I32, {words}, device);
    h_in.assign(size_t(words) * 4, 0);
    uint8_t* base = static_cast<uint8_t*>(d_in.data());
    auto view = [&](int64_t word, DType dt, const Tensor::Shape& shape) {
      return Tensor::view(base + word * 4, dt, shape, {}, device);
    };
    d_rng = view(0, DType::I64, {B, 2});
    d_temp = view(4 * B, DType::F32, {B});
    d_topp = view(5 * B, DType::F32, {B});
    d_topk = view(6 * B, DType::I32, {B});
    d_row0 = view(7 * B, DType::I32, {B});
    d_draft_row = view(8 * B, DType::I32, {B});
    d_draft_len = view(9 * B, DType::I32, {B});
  }
}

namespace {
// A device buffer of `like`'s shape and dtype (grown when too small), holding a copy of it.
Tensor upload_whole(const Tensor& like, Tensor& buf, Device dev) {
  if (!like.defined()) return Tensor();
  if (like.device() == dev) return like;  // already there (a drafter on the device)
  if (!buf.defined() || buf.dtype() != like.dtype() || buf.numel() < like.numel())
    buf = Tensor::empty(like.dtype(), {std::max<int64_t>(like.numel(), 1)}, dev);
  Tensor d = buf.slice(0, 0, like.numel()).reshape(like.shape());
  if (like.numel() > 0) d.copy_from(like.contiguous());
  return d;
}
}  // namespace

void Core::upload_inputs(int64_t n, bool accept) {
  const int64_t B = s_temp.shape(0);
  uint8_t* h = h_in.data();
  auto put = [&](int64_t word, const Tensor& src, int64_t elem_bytes) {
    std::memcpy(h + word * 4, src.data(), size_t(n * elem_bytes));
  };
  put(0, s_rng, 16);
  put(4 * B, s_temp, 4);
  put(5 * B, s_topp, 4);
  put(6 * B, s_topk, 4);
  if (accept) {
    put(7 * B, a_row0, 4);
    put(8 * B, a_draft_row, 4);
    put(9 * B, a_draft_len, 4);
  }
  d_in.copy_from(Tensor::view(h, DType::I32, {int64_t(h_in.size() / 4)}));  // one copy
}

void Core::download_results() { h_res.copy_from(d_res); }  // one copy (synchronizes)

void Core::check_rows(int64_t rows) {
  if (rows <= 0) return;
  Tensor lg = logits.slice(0, 0, rows);
  if (!device.is_cuda()) {
    Tensor fl = flags.slice(0, 0, rows);
    ops::check_finite(lg, fl);
  } else {
    Tensor dfl = d_flags.slice(0, 0, rows);
    ops::check_finite(lg, dfl);  // comes back with the step's results
  }
}

void Core::sample_rows(int64_t R) {
  if (R <= 0) return;
  Tensor lg = logits.slice(0, 0, R);
  if (!device.is_cuda()) {
    Tensor rng = s_rng.slice(0, 0, R), tok = s_out.slice(0, 0, R);
    ops::sample(lg, sampling_rows(R), rng, tok);
    return;
  }
  upload_inputs(R, false);
  ops::SamplingTensors sp{d_temp.slice(0, 0, R), d_topp.slice(0, 0, R), d_topk.slice(0, 0, R)};
  Tensor rng = d_rng.slice(0, 0, R), tok = d_out.slice(0, 0, R);
  ops::sample(lg, sp, rng, tok);
  download_results();  // the tokens, and the flags of check_rows
}

void Core::argmax_row0() {
  Tensor lg = logits.slice(0, 0, 1);
  if (!device.is_cuda()) {
    Tensor tok = s_out.slice(0, 0, 1);
    ops::argmax(lg, tok);
    return;
  }
  Tensor tok = d_out.slice(0, 0, 1);
  ops::argmax(lg, tok);
  download_results();
}

void Core::accept_rows(int64_t rows, int64_t S, const Tensor& drafts, const Tensor& cand, const Tensor& q) {
  Tensor lg = logits.slice(0, 0, rows);
  if (!device.is_cuda()) {
    Tensor rng = s_rng.slice(0, 0, S), acc = a_accepted.slice(0, 0, S), bon = a_bonus.slice(0, 0, S);
    ops::accept(lg, a_row0.slice(0, 0, S), drafts, a_draft_row.slice(0, 0, S), a_draft_len.slice(0, 0, S), cand, q,
                sampling_rows(S), rng, acc, bon);
    return;
  }
  upload_inputs(S, true);
  ops::SamplingTensors sp{d_temp.slice(0, 0, S), d_topp.slice(0, 0, S), d_topk.slice(0, 0, S)};
  Tensor rng = d_rng.slice(0, 0, S), acc = d_accepted.slice(0, 0, S), bon = d_bonus.slice(0, 0, S);
  Tensor dd = upload_whole(drafts, d_drafts, device);
  Tensor dc = upload_whole(cand, d_cand, device), dq = upload_whole(q, d_q, device);
  ops::accept(lg, d_row0.slice(0, 0, S), dd, d_draft_row.slice(0, 0, S), d_draft_len.slice(0, 0, S), dc, dq, sp, rng,
              acc, bon);
  download_results();  // accepted, bonus, and the flags of check_rows
}

}  // namespace dflash2::runtime
