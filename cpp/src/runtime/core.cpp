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
  device = target->options().device;  // rank 0's device
  logits = Tensor::empty(DType::F32, {verify_rows, V}, device);
  flags = Tensor::empty(DType::I32, {verify_rows});
  // the drafter's features live where it runs (the target writes them there directly)
  const Device fdev = drafter ? drafter->device() : Device::cpu();
  if (!taps.empty()) taps_buf = Tensor::empty(DType::F32, {feat_rows, int64_t(taps.size()) * H}, fdev);
  if (want_final) fin = Tensor::empty(DType::F32, {feat_rows, H}, fdev);
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
  if (device.is_cuda()) {
    d_flags = Tensor::zeros(DType::I32, {verify_rows}, device);
    d_temp = Tensor::zeros(DType::F32, {B}, device);
    d_topp = Tensor::zeros(DType::F32, {B}, device);
    d_topk = Tensor::zeros(DType::I32, {B}, device);
    d_rng = Tensor::zeros(DType::I64, {B, 2}, device);
    d_out = Tensor::zeros(DType::I32, {B}, device);
    d_row0 = Tensor::zeros(DType::I32, {B}, device);
    d_draft_row = Tensor::zeros(DType::I32, {B}, device);
    d_draft_len = Tensor::zeros(DType::I32, {B}, device);
    d_accepted = Tensor::zeros(DType::I32, {B}, device);
    d_bonus = Tensor::zeros(DType::I32, {B}, device);
  }
}

namespace {
// dst[0 .. n) (a device buffer, dim 0) = src[0 .. n) (host); returns the device slice.
Tensor upload_rows(const Tensor& src, const Tensor& dst, int64_t n) {
  Tensor d = dst.slice(0, 0, n);
  if (n > 0) d.copy_from(src.slice(0, 0, n));
  return d;
}
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

const int32_t* Core::nonfinite_rows(int64_t rows) {
  Tensor lg = logits.slice(0, 0, rows), fl = flags.slice(0, 0, rows);
  if (!device.is_cuda()) {
    ops::check_finite(lg, fl);
  } else if (rows > 0) {
    Tensor dfl = d_flags.slice(0, 0, rows);
    ops::check_finite(lg, dfl);
    fl.copy_from(dfl);  // synchronizes: the step's logits are done
  }
  return fl.data_as<const int32_t>();
}

void Core::sample_rows(int64_t R) {
  if (R <= 0) return;
  Tensor lg = logits.slice(0, 0, R);
  if (!device.is_cuda()) {
    Tensor rng = s_rng.slice(0, 0, R), tok = s_out.slice(0, 0, R);
    ops::sample(lg, sampling_rows(R), rng, tok);
    return;
  }
  ops::SamplingTensors sp{upload_rows(s_temp, d_temp, R), upload_rows(s_topp, d_topp, R),
                          upload_rows(s_topk, d_topk, R)};
  Tensor rng = upload_rows(s_rng, d_rng, R), tok = d_out.slice(0, 0, R);
  ops::sample(lg, sp, rng, tok);
  Tensor host = s_out.slice(0, 0, R);
  host.copy_from(tok);
}

void Core::argmax_row0() {
  Tensor lg = logits.slice(0, 0, 1);
  if (!device.is_cuda()) {
    Tensor tok = s_out.slice(0, 0, 1);
    ops::argmax(lg, tok);
    return;
  }
  Tensor tok = d_out.slice(0, 0, 1), host = s_out.slice(0, 0, 1);
  ops::argmax(lg, tok);
  host.copy_from(tok);
}

void Core::accept_rows(int64_t rows, int64_t S, const Tensor& drafts, const Tensor& cand, const Tensor& q) {
  Tensor lg = logits.slice(0, 0, rows);
  if (!device.is_cuda()) {
    Tensor rng = s_rng.slice(0, 0, S), acc = a_accepted.slice(0, 0, S), bon = a_bonus.slice(0, 0, S);
    ops::accept(lg, a_row0.slice(0, 0, S), drafts, a_draft_row.slice(0, 0, S), a_draft_len.slice(0, 0, S), cand, q,
                sampling_rows(S), rng, acc, bon);
    return;
  }
  ops::SamplingTensors sp{upload_rows(s_temp, d_temp, S), upload_rows(s_topp, d_topp, S),
                          upload_rows(s_topk, d_topk, S)};
  Tensor rng = upload_rows(s_rng, d_rng, S), acc = d_accepted.slice(0, 0, S), bon = d_bonus.slice(0, 0, S);
  Tensor dd = upload_whole(drafts, d_drafts, device);
  Tensor dc = upload_whole(cand, d_cand, device), dq = upload_whole(q, d_q, device);
  ops::accept(lg, upload_rows(a_row0, d_row0, S), dd, upload_rows(a_draft_row, d_draft_row, S),
              upload_rows(a_draft_len, d_draft_len, S), dc, dq, sp, rng, acc, bon);
  Tensor ha = a_accepted.slice(0, 0, S), hb = a_bonus.slice(0, 0, S);
  ha.copy_from(acc);
  hb.copy_from(bon);
}

}  // namespace dflash2::runtime
