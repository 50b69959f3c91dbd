#include "runtime/core.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "dflash2/engine.h"
#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

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
  // flags, accepted, bonus and sampled tokens (and, for a drafter on the device, its
  // drafts): views of one host buffer (h_res), which on CUDA is pinned memory and the copy
  // of one device buffer (d_res)
  const int64_t draft_words = (B + 1) * K;
  const int64_t res_words = verify_rows + 3 * B + draft_words;
  if (device.is_cuda()) {
    res_pin = PinnedResults(device, res_words);
    h_res = res_pin.host().slice(0, 0, res_words);
  } else {
    h_res = Tensor::zeros(DType::I32, {res_words});
  }
  flags = h_res.slice(0, 0, verify_rows);
  s_topp = Tensor::zeros(DType::F32, {B});
  s_topk = Tensor::zeros(DType::I32, {B});
  s_rng = Tensor::zeros(DType::I64, {B, 2});
  s_out = h_res.slice(0, verify_rows + 2 * B, verify_rows + 3 * B);
  a_row0 = Tensor::zeros(DType::I32, {B});
  pen_seq = Tensor::zeros(DType::I32, {B, 2});
  pen_par = Tensor::zeros(DType::F32, {B, 3});
  a_draft_row = Tensor::zeros(DType::I32, {B});
  a_draft_len = Tensor::zeros(DType::I32, {B});
  a_accepted = h_res.slice(0, verify_rows, verify_rows + B);
  a_bonus = h_res.slice(0, verify_rows + B, verify_rows + 2 * B);
  no_drafts = Tensor::zeros(DType::I32, {B, 1}, device);
  const int tp = target->tp_size();
  // greedy steps' argmax ids (decoder.cpp: argmax_only): under tensor parallelism, and on one GPU
  if ((tp > 1 || device.is_cuda()) && V <= (int64_t(1) << 24) && V / tp >= 3)
    ids = Tensor::zeros(DType::I32, {verify_rows}, device);
  marks = StepMarks(device, 4);
  lp_ids = Tensor::zeros(DType::I32, {verify_rows});
  lp_val = Tensor::zeros(DType::F32, {verify_rows});
  lp_lse = Tensor::zeros(DType::F32, {verify_rows});
  lp_topv = Tensor::zeros(DType::F32, {verify_rows * kMaxLogprobs});
  lp_topi = Tensor::zeros(DType::I32, {verify_rows * kMaxLogprobs});
  if (device.is_cuda()) {
    d_res = Tensor::zeros(DType::I32, {res_words}, device);
    d_flags = d_res.slice(0, 0, verify_rows);
    d_accepted = d_res.slice(0, verify_rows, verify_rows + B);
    d_bonus = d_res.slice(0, verify_rows + B, verify_rows + 2 * B);
    d_out = d_res.slice(0, verify_rows + 2 * B, verify_rows + 3 * B);
    if (K > 0) {
      d_step_drafts = d_res.slice(0, verify_rows + 3 * B, res_words).reshape({B + 1, K});
      h_step_drafts = h_res.slice(0, verify_rows + 3 * B, res_words).reshape({B + 1, K});
    }
    // packed inputs, fixed offsets (rng first: 8-byte aligned): rng I64 [B, 2], then temp,
    // top-p (F32), top-k, row0, draft_row, draft_len (I32), B each, then the penalty rows
    // (pen_seq I32 [B, 2], pen_par F32 [B, 3])
    const int64_t words = 4 * B + 6 * B + 5 * B;  // in 4-byte words
    in_up = StagedUpload(device, words);
    d_rng = in_up.view(0, DType::I64, {B, 2});
    d_temp = in_up.view(4 * B, DType::F32, {B});
    d_topp = in_up.view(5 * B, DType::F32, {B});
    d_topk = in_up.view(6 * B, DType::I32, {B});
    d_row0 = in_up.view(7 * B, DType::I32, {B});
    d_draft_row = in_up.view(8 * B, DType::I32, {B});
    d_draft_len = in_up.view(9 * B, DType::I32, {B});
    d_pen_seq = in_up.view(10 * B, DType::I32, {B, 2});
    d_pen_par = in_up.view(12 * B, DType::F32, {B, 3});
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
  uint8_t* h = reinterpret_cast<uint8_t*>(in_up.begin());
  auto put = [&](int64_t word, const Tensor& src, int64_t elem_bytes) {
    std::memcpy(h + word * 4, src.data(), size_t(n * elem_bytes));
  };
  put(0, s_rng, 16);
  put(4 * B, s_temp, 4);
  put(5 * B, s_topp, 4);
  put(6 * B, s_topk, 4);
  if (accept || pen_rows > 0) {
    put(7 * B, a_row0, 4);
    put(8 * B, a_draft_row, 4);
    put(9 * B, a_draft_len, 4);
  }
  if (pen_rows > 0) {
    put(10 * B, pen_seq, 8);
    put(12 * B, pen_par, 12);
  }
  in_up.send(pen_rows > 0 ? 15 * B : accept ? 10 * B : 7 * B);  // one asynchronous copy
}

void Core::ensure_masks() {
  if (mask_bits.defined()) return;
  const int64_t rows = logits.shape(0), W = mask_words();
  mask_bits = Tensor::zeros(DType::I32, {rows, W});
  mask_rows = Tensor::zeros(DType::I32, {rows});
  if (device.is_cuda()) {
    d_mask_bits = Tensor::zeros(DType::I32, {rows, W}, device);
    d_mask_rows = Tensor::zeros(DType::I32, {rows}, device);
  }
}

namespace {
// The first n mask rows where the logits are (uploaded on CUDA), or undefined when n == 0.
std::pair<Tensor, Tensor> mask_plan(const Core& c, int64_t n) {
  if (n <= 0) return {};
  DFLASH2_INTERNAL(c.mask_bits.defined() && n <= c.mask_bits.shape(0), "mask rows ", n, " without their buffers");
  Tensor r = c.mask_rows.slice(0, 0, n), b = c.mask_bits.slice(0, 0, n);
  if (!c.device.is_cuda()) return {r, b};
  Tensor dr = c.d_mask_rows.slice(0, 0, n), db = c.d_mask_bits.slice(0, 0, n);
  dr.copy_from(r);
  db.copy_from(b);
  return {dr, db};
}
}  // namespace

void Core::ensure_penalties() {
  if (pen_state.defined()) return;
  const int64_t B = s_temp.shape(0), V = logits.shape(1);
  pen_state = Tensor::zeros(DType::I32, {B, V}, device);
  pen_bias = Tensor::zeros(DType::F32, {B, V}, device);
  // a step's committed tokens fit at once
  if (device.is_cuda())
    cnt_up = StagedUpload(device, 2 * B * (K + 2));
  else
    pen_cnt = Tensor::zeros(DType::I32, {2, B * (K + 2)});
}

void Core::reset_penalties(int64_t slot, const std::vector<int32_t>& prompt, const std::vector<int32_t>& stops,
                           const std::vector<std::pair<int32_t, float>>& bias) {
  ensure_penalties();
  const int64_t V = pen_state.shape(1);
  Tensor st = Tensor::zeros(DType::I32, {1, V}), bs = Tensor::zeros(DType::F32, {1, V});
  int32_t* f = st.data_as<int32_t>();
  for (int32_t t : prompt) f[t] |= ops::kPenaltyPrompt;
  for (int32_t t : stops) f[t] |= ops::kPenaltyStop;
  for (const auto& [t, b] : bias) bs.data_as<float>()[t] = b;
  pen_state.slice(0, slot, slot + 1).copy_from(st);
  pen_bias.slice(0, slot, slot + 1).copy_from(bs);
}

void Core::count_penalized(const std::vector<int32_t>& slots, const std::vector<int32_t>& ids) {
  const int64_t n = int64_t(slots.size());
  if (n == 0) return;
  ensure_penalties();
  const int64_t cap = device.is_cuda() ? cnt_up.capacity() / 2 : pen_cnt.shape(1);
  for (int64_t lo = 0; lo < n; lo += cap) {  // in pieces of the buffers' size
    const int64_t m = std::min(cap, n - lo);
    int32_t* h = device.is_cuda() ? cnt_up.begin() : pen_cnt.data_as<int32_t>();
    std::copy(slots.begin() + lo, slots.begin() + lo + m, h);
    std::copy(ids.begin() + lo, ids.begin() + lo + m, h + cap);
    Tensor r, i;
    if (device.is_cuda()) {  // no host wait: the copy and the kernel in stream order
      cnt_up.send(cap + m);
      r = cnt_up.view(0, DType::I32, {m});
      i = cnt_up.view(cap, DType::I32, {m});
    } else {
      r = pen_cnt.select(0, 0).slice(0, 0, m);
      i = pen_cnt.select(0, 1).slice(0, 0, m);
    }
    ops::count_tokens(pen_state, r, i);
  }
}

void Core::download_results(int64_t draft_rows) {
  // one asynchronous copy of the results (and the drafts that came with them), then the wait
  const int64_t head = d_res.numel() - (d_step_drafts.defined() ? d_step_drafts.numel() : 0);
  const int64_t words = head + (d_step_drafts.defined() ? draft_rows * d_step_drafts.shape(1) : 0);
  res_pin.fetch(d_res.data(), size_t(words) * 4);
  res_pin.wait();
}

void Core::check_rows(int64_t rows) {
  if (rows <= 0) return;
  Tensor lg = logits.slice(0, 0, rows);
  // the flags go to the host buffer (CPU) or the device results (they come back with them)
  Tensor fl = device.is_cuda() ? d_flags.slice(0, 0, rows) : flags.slice(0, 0, rows);
  StepRecorder& rec = target->recorder();
  if (rec.recording()) {  // a piece of the step's graph
    std::string key = "check|";
    ForwardGraphs::key_add(key, lg);
    ForwardGraphs::key_add(key, fl);
    rec.add(key, [lg, fl]() mutable { ops::check_finite(lg, fl); });
    return;
  }
  ops::check_finite(lg, fl);
}

void Core::sample_rows(int64_t R) {
  if (R <= 0) return;
  Tensor lg = logits.slice(0, 0, R);
  if (pen_rows > 0) {  // one row per sequence, nothing drafted
    DFLASH2_INTERNAL(pen_rows == R, "penalty rows for ", pen_rows, " sequences, ", R, " sampled");
    for (int64_t r = 0; r < R; ++r) {
      a_row0.data_as<int32_t>()[r] = int32_t(r);
      a_draft_row.data_as<int32_t>()[r] = 0;
      a_draft_len.data_as<int32_t>()[r] = 0;
    }
  }
  if (!device.is_cuda()) {
    if (pen_rows > 0)
      ops::apply_penalties(lg, a_row0.slice(0, 0, R), no_drafts, a_draft_row.slice(0, 0, R),
                           a_draft_len.slice(0, 0, R), pen_seq.slice(0, 0, R), pen_par.slice(0, 0, R), pen_state,
                           pen_bias);
    if (mask_count > 0) {
      auto [mr, mb] = mask_plan(*this, mask_count);
      ops::mask_logits(lg, mr, mb);
    }
    Tensor rng = s_rng.slice(0, 0, R), tok = s_out.slice(0, 0, R);
    ops::sample(lg, sampling_rows(R), rng, tok);
    return;
  }
  upload_inputs(R, false);
  if (pen_rows > 0)
    ops::apply_penalties(lg, d_row0.slice(0, 0, R), no_drafts, d_draft_row.slice(0, 0, R),
                         d_draft_len.slice(0, 0, R), d_pen_seq.slice(0, 0, R), d_pen_par.slice(0, 0, R), pen_state,
                         pen_bias);
  if (mask_count > 0) {
    auto [mr, mb] = mask_plan(*this, mask_count);
    ops::mask_logits(lg, mr, mb);
  }
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

void set_token_logprobs(TokenLogprobs& o, float lp, float lse, const float* top_vals, const int32_t* top_ids,
                        int64_t top) {
  o.logprob = lp;
  o.top_ids.assign(top_ids, top_ids + top);
  o.top_logprobs.resize(size_t(top));
  for (int64_t j = 0; j < top; ++j) o.top_logprobs[size_t(j)] = float(double(top_vals[j]) - double(lse));
}

void Core::logprobs(int64_t lo, int64_t rows, int64_t top) {
  if (rows <= lo) return;
  const Tensor lg = logits.slice(0, lo, rows);
  DFLASH2_INTERNAL(lo >= 0 && top >= 0 && top <= kMaxLogprobs && top <= lg.shape(1), "logprobs: rows ", lo, "..",
                   rows, ", top ", top);
  if (!device.is_cuda()) {
    Tensor ids = lp_ids.slice(0, lo, rows), v = lp_val.slice(0, lo, rows), l = lp_lse.slice(0, lo, rows);
    ops::token_logprobs(lg, ids, v, l);
    if (top > 0) {
      Tensor tv = lp_topv.slice(0, lo * top, rows * top).reshape({rows - lo, top});
      Tensor ti = lp_topi.slice(0, lo * top, rows * top).reshape({rows - lo, top});
      ops::topk(lg, top, tv, ti);
    }
    return;
  }
  if (!d_lp_ids.defined()) {  // on first use
    const int64_t n = lp_ids.shape(0);
    d_lp_ids = Tensor::zeros(DType::I32, {n}, device);
    d_lp_val = Tensor::zeros(DType::F32, {n}, device);
    d_lp_lse = Tensor::zeros(DType::F32, {n}, device);
    d_lp_topv = Tensor::zeros(DType::F32, {n * kMaxLogprobs}, device);
    d_lp_topi = Tensor::zeros(DType::I32, {n * kMaxLogprobs}, device);
  }
  const int64_t n = rows - lo;
  Tensor ids = d_lp_ids.slice(0, lo, rows), v = d_lp_val.slice(0, lo, rows), l = d_lp_lse.slice(0, lo, rows);
  ids.copy_from(lp_ids.slice(0, lo, rows));
  ops::token_logprobs(lg, ids, v, l);
  if (top > 0) {
    Tensor tv = d_lp_topv.slice(0, lo * top, rows * top), ti = d_lp_topi.slice(0, lo * top, rows * top);
    Tensor tv2 = tv.reshape({n, top}), ti2 = ti.reshape({n, top});
    ops::topk(lg, top, tv2, ti2);
    lp_topv.slice(0, lo * top, rows * top).copy_from(tv);
    lp_topi.slice(0, lo * top, rows * top).copy_from(ti);
  }
  lp_val.slice(0, lo, rows).copy_from(v);
  lp_lse.slice(0, lo, rows).copy_from(l);
}

void Core::accept_rows(int64_t rows, int64_t S, const Tensor& drafts, const Tensor& cand, const Tensor& q,
                       const std::function<void(const Drafter::StepAcceptance&)>& in_step, const Tensor& target_ids) {
  Tensor lg = logits.slice(0, 0, rows);
  StepRecorder& rec = target->recorder();
  DFLASH2_INTERNAL(pen_rows == 0 || pen_rows == S, "penalty rows for ", pen_rows, " sequences, ", S, " accepted");
  DFLASH2_INTERNAL(!target_ids.defined() || (!q.defined() && target_ids.shape(0) == rows),
                   "acceptance from argmax ids in a sampled step");
  DFLASH2_INTERNAL(mask_count == 0 || (!rec.recording() && !target_ids.defined()),
                   "a step with token masks is recorded or reads argmax ids");
  auto [mr, mb] = mask_plan(*this, mask_count);
  if (!device.is_cuda()) {
    Tensor rng = s_rng.slice(0, 0, S), acc = a_accepted.slice(0, 0, S), bon = a_bonus.slice(0, 0, S);
    Tensor ps = pen_rows > 0 ? pen_seq.slice(0, 0, S) : Tensor(), pp = pen_par.slice(0, 0, S);
    auto work = [lg, r0 = a_row0.slice(0, 0, S), drafts, dr = a_draft_row.slice(0, 0, S),
                 dl = a_draft_len.slice(0, 0, S), cand, q, sp = sampling_rows(S), rng, acc, bon, target_ids, ps, pp,
                 st = pen_state, bs = pen_bias, mr, mb]() mutable {
      if (ps.defined()) ops::apply_penalties(lg, r0, drafts, dr, dl, ps, pp, st, bs);
      if (mr.defined()) ops::mask_logits(lg, mr, mb);
      if (target_ids.defined())
        ops::accept_greedy(target_ids, r0, drafts, dr, dl, acc, bon);
      else
        ops::accept(lg, r0, drafts, dr, dl, cand, q, sp, rng, acc, bon);
    };
    drafts_host = drafts;
    if (rec.recording()) {  // the last piece of the step: run the queue (the draft, the verify pass, ...)
      rec.add("", work);
      if (in_step)
        in_step({a_row0.slice(0, 0, S), a_draft_row.slice(0, 0, S), a_draft_len.slice(0, 0, S), acc, bon, drafts});
      rec.add("", marks.deferred(3));
      target->flush_step();
    } else {
      work();
      marks.mark(3);
    }
    return;
  }
  upload_inputs(S, true);
  ops::SamplingTensors sp{d_temp.slice(0, 0, S), d_topp.slice(0, 0, S), d_topk.slice(0, 0, S)};
  Tensor rng = d_rng.slice(0, 0, S), acc = d_accepted.slice(0, 0, S), bon = d_bonus.slice(0, 0, S);
  // a device drafter's drafts and ar's no_drafts are read in place; a host drafter's go up
  Tensor dd = upload_whole(drafts, d_drafts, device);
  Tensor dc = upload_whole(cand, d_cand, device), dq = upload_whole(q, d_q, device);
  // drafts the drafter left on this device come back with the results (the host plans the
  // next step from them): the rows the plan refers to, copied beside the results
  int64_t draft_rows = 0;
  drafts_host = drafts;
  if (drafts.device() == device && d_step_drafts.defined()) {
    for (int64_t k = 0; k < S; ++k)
      if (a_draft_len.data_as<const int32_t>()[k] > 0)
        draft_rows = std::max<int64_t>(draft_rows, a_draft_row.data_as<const int32_t>()[k] + 1);
    DFLASH2_INTERNAL(drafts.ndim() == 2 && drafts.is_contiguous() && drafts.shape(1) == d_step_drafts.shape(1) &&
                         draft_rows <= std::min(drafts.shape(0), d_step_drafts.shape(0)),
                     "device drafts ", drafts.describe(), " for ", draft_rows, " rows into ", d_step_drafts.describe());
    drafts_host = h_step_drafts;
  }
  Tensor r0 = d_row0.slice(0, 0, S), drow = d_draft_row.slice(0, 0, S), dlen = d_draft_len.slice(0, 0, S);
  Tensor to = d_step_drafts;
  const int dev_index = device.index;
  Tensor ps = pen_rows > 0 ? d_pen_seq.slice(0, 0, S) : Tensor(), pp = d_pen_par.slice(0, 0, S);
  auto work = [lg, r0, dd, drow, dlen, dc, dq, sp, rng, acc, bon, draft_rows, to, dev_index, target_ids, ps, pp,
               st = pen_state, bs = pen_bias, mr, mb]() mutable {
    if (ps.defined()) ops::apply_penalties(lg, r0, dd, drow, dlen, ps, pp, st, bs);
    if (mr.defined()) ops::mask_logits(lg, mr, mb);
    if (target_ids.defined())
      ops::accept_greedy(target_ids, r0, dd, drow, dlen, acc, bon);
    else
      ops::accept(lg, r0, dd, drow, dlen, dc, dq, sp, rng, acc, bon);
#ifdef DFLASH2_WITH_CUDA
    if (draft_rows > 0) cuda::copy_async(to.data(), dd.data(), size_t(draft_rows * dd.shape(1)) * 4, dev_index);
#else
    (void)draft_rows, (void)to, (void)dev_index;
#endif
  };
  if (rec.recording()) {  // the last piece of the step: run the queue as one graph
    std::string key = "accept|";
    for (const Tensor* t : std::initializer_list<const Tensor*>{&lg, &r0, &dd, &drow, &dlen, &dc, &dq, &sp.temperature,
                                                                &sp.top_p, &sp.top_k, &rng, &acc, &bon, &to, &target_ids,
                                                                &ps, &pp, &pen_state, &pen_bias})
      ForwardGraphs::key_add(key, *t);
    ForwardGraphs::key_add(key, draft_rows);
    rec.add(key, work);
    if (in_step) in_step({r0, drow, dlen, acc, bon, dd});
    rec.add("mark3|", marks.deferred(3));
    target->flush_step();
  } else {
    work();
    marks.mark(3);
  }
  download_results(draft_rows);  // accepted, bonus, drafts, and the flags of check_rows
}

}  // namespace dflash2::runtime
