#include "runtime/step_plan.h"

#include <cstring>

#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

#include <algorithm>

#include "dflash2/error.h"

namespace dflash2::runtime {

void make_chunks(const std::vector<CacheStream*>& streams, const std::vector<const int32_t*>& tokens,
                 const std::vector<int64_t>& counts, int64_t max_tokens, std::vector<std::vector<Piece>>& chunks) {
  // reuses the capacity of `chunks` (steady state: no allocation)
  size_t used = 0;
  int64_t in_chunk = 0;
  auto cur = [&]() -> std::vector<Piece>& {
    if (used == 0 || in_chunk == 0) {
      if (chunks.size() <= used) chunks.emplace_back();
      chunks[used].clear();
      ++used;
    }
    return chunks[used - 1];
  };
  for (size_t si = 0; si < streams.size(); ++si) {
    for (int64_t off = 0; off < counts[si];) {
      const int64_t take = std::min(counts[si] - off, max_tokens - in_chunk);
      std::vector<Piece>& ch = cur();
      Piece p;
      p.stream = streams[si];
      p.tokens = tokens[si] ? tokens[si] + off : nullptr;
      p.n = take;
      p.seq = int64_t(si);
      p.offset = off;
      p.last = off + take == counts[si];
      ch.push_back(p);
      in_chunk += take;
      off += take;
      if (in_chunk == max_tokens) in_chunk = 0;
    }
  }
  chunks.resize(used);
}

StepPlanner::StepPlanner(int64_t max_tokens, int64_t max_seqs, int64_t max_blocks_per_seq, Device dev)
    : max_tokens_(max_tokens), max_seqs_(max_seqs), max_blocks_(max_blocks_per_seq) {
  tokens_ = Tensor::zeros(DType::I32, {max_tokens}, dev);
  seq_ = Tensor::zeros(DType::I32, {max_tokens}, dev);
  pos_ = Tensor::zeros(DType::I32, {max_tokens}, dev);
  slots_ = Tensor::zeros(DType::I32, {max_tokens}, dev);
  logit_rows_ = Tensor::zeros(DType::I32, {std::max(max_tokens, max_seqs)}, dev);
  block_table_ = Tensor::zeros(DType::I32, {max_seqs, max_blocks_per_seq}, dev);
  ctx_len_ = Tensor::zeros(DType::I32, {max_seqs}, dev);
}

model::TokenBatch StepPlanner::views(int64_t T, int64_t S, int64_t block_size) const {
  model::TokenBatch b;
  b.T = T;
  b.S = S;
  b.tokens = tokens_.slice(0, 0, T);
  b.paged.seq = seq_.slice(0, 0, T);
  b.paged.pos = pos_.slice(0, 0, T);
  b.paged.block_table = block_table_.slice(0, 0, std::max<int64_t>(S, 1));
  b.paged.block_size = block_size;
  return b;
}

void gather_rows_of_pieces(const std::vector<Piece>& chunk, const std::vector<int64_t>& first_row, const Tensor& src,
                           Tensor& idx_buf, std::vector<int32_t>& host, Tensor& dst_buf, Tensor& dst,
                           StagedUpload* idx_up) {
  host.clear();
  for (const Piece& p : chunk)
    for (int64_t j = 0; j < p.n; ++j) host.push_back(int32_t(first_row[size_t(p.seq)] + p.offset + j));
  const int64_t T = int64_t(host.size());
  Tensor ix;
  if (idx_up && idx_up->defined()) {  // pinned staging, one asynchronous copy
    DFLASH2_INTERNAL(T <= idx_up->capacity(), "gather of ", T, " rows, staging for ", idx_up->capacity());
    std::copy(host.begin(), host.end(), idx_up->begin());
    idx_up->send(T);
    ix = idx_up->device_buffer().slice(0, 0, T);
  } else {
    ix = idx_buf.slice(0, 0, T);
    ix.copy_from(Tensor::view(host.data(), DType::I32, {T}));
  }
  dst = dst_buf.slice(0, 0, T);
  ops::gather_rows(src, ix, dst);
}

model::TokenBatch StepPlanner::plan(const std::vector<Piece>& pieces, KvCache& cache, bool all_rows) {
  int64_t T = 0;
  for (const Piece& p : pieces) T += p.n;
  const int64_t S = int64_t(pieces.size());
  DFLASH2_INTERNAL(T <= max_tokens_ && S <= max_seqs_, "plan of ", T, " tokens / ", S, " sequences exceeds ",
                   max_tokens_, " / ", max_seqs_);
  for (const Piece& p : pieces) cache.reserve(*p.stream, p.stream->length + p.n);
  int32_t* tok = tokens_.data_as<int32_t>();
  int32_t* seq = seq_.data_as<int32_t>();
  int32_t* pos = pos_.data_as<int32_t>();
  int32_t* slot = slots_.data_as<int32_t>();
  int32_t* rows = logit_rows_.data_as<int32_t>();
  int32_t* bt = block_table_.data_as<int32_t>();
  int64_t t = 0, r = 0;
  for (int64_t s = 0; s < S; ++s) {
    const Piece& p = pieces[size_t(s)];
    const CacheStream& st = *p.stream;
    DFLASH2_INTERNAL(int64_t(st.blocks.size()) <= max_blocks_, "block table of ", st.blocks.size(), " blocks");
    std::copy(st.blocks.begin(), st.blocks.end(), bt + s * max_blocks_);
    for (int64_t j = 0; j < p.n; ++j, ++t) {
      tok[t] = p.tokens ? p.tokens[j] : 0;
      seq[t] = int32_t(s);
      pos[t] = int32_t(st.length + j);
      slot[t] = int32_t(cache.slot(st, st.length + j));
    }
    if (all_rows)
      for (int64_t j = p.n; j > 0; --j) rows[r++] = int32_t(t - j);
    else if (p.last)
      rows[r++] = int32_t(t - 1);
  }
  model::TokenBatch b = views(T, S, cache.block_size());
  b.slots = slots_.slice(0, 0, T);
  b.logit_rows = logit_rows_.slice(0, 0, r);
  return b;
}

model::TokenBatch StepPlanner::plan_blocks(const std::vector<CacheStream*>& streams, int64_t per_seq,
                                           const KvCache& cache) {
  const int64_t S = int64_t(streams.size()), T = S * per_seq;
  DFLASH2_INTERNAL(T <= max_tokens_ && S <= max_seqs_, "block plan of ", T, " tokens exceeds the planner");
  int32_t* seq = seq_.data_as<int32_t>();
  int32_t* pos = pos_.data_as<int32_t>();
  int32_t* bt = block_table_.data_as<int32_t>();
  int32_t* cl = ctx_len_.data_as<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    const CacheStream& st = *streams[size_t(s)];
    std::copy(st.blocks.begin(), st.blocks.end(), bt + s * max_blocks_);
    cl[s] = int32_t(st.length);
    for (int64_t j = 0; j < per_seq; ++j) {
      seq[s * per_seq + j] = int32_t(s);
      pos[s * per_seq + j] = int32_t(st.length + j);
    }
  }
  model::TokenBatch b = views(T, S, cache.block_size());
  b.ctx_len = ctx_len_.slice(0, 0, S);
  return b;
}

// ------------------------------------------------------------------ PlanUploader
PlanUploader::PlanUploader(Device dev, int64_t words) : up_(dev, words) {}

PlanUploader::~PlanUploader() = default;

int64_t PlanUploader::words_of(const model::TokenBatch& b) {
  int64_t n = 0;
  for (const Tensor* t : {&b.tokens, &b.paged.seq, &b.paged.pos, &b.slots, &b.logit_rows, &b.paged.block_table,
                          &b.ctx_len})
    n += t->defined() ? t->numel() : 0;
  return n;
}

model::TokenBatch PlanUploader::upload(const model::TokenBatch& b) {
  int32_t* h = up_.begin();
  const int64_t capacity = up_.capacity();
  int64_t off = 0;
  auto put = [&](const Tensor& t) -> Tensor {
    if (!t.defined()) return Tensor();
    const int64_t n = t.numel();
    DFLASH2_INTERNAL(t.dtype() == DType::I32 && off + n <= capacity, "plan upload: ", t.describe(), " at ", off,
                     " of ", capacity);
    const Tensor c = t.contiguous();
    if (n > 0) std::memcpy(h + off, c.data(), size_t(n) * 4);
    Tensor v = up_.device_buffer().slice(0, off, off + n).reshape(t.shape());
    off += n;
    return v;
  };
  model::TokenBatch d = b;
  d.tokens = put(b.tokens);
  d.paged.seq = put(b.paged.seq);
  d.paged.pos = put(b.paged.pos);
  d.slots = put(b.slots);
  d.logit_rows = put(b.logit_rows);
  d.paged.block_table = put(b.paged.block_table);
  d.ctx_len = put(b.ctx_len);
  up_.send(off);
  return d;
}

}  // namespace dflash2::runtime
