#include "model/dflash_drafter.h"

#include <algorithm>
#include <cmath>

#include "dflash2/error.h"

namespace dflash2::model {

using ops::Weight;

// The per-call workspace (an Arena planned at load for the largest append / draft).
struct DFlashDrafter::Bufs {
  Tensor f, ctx, kk, vv;                                                   // append_context
  Tensor x, y, dyn, q, kb, vb, att, ob, scratch, hrows, logits, vals, g;  // draft
};

struct DFlashDrafter::Layer {
  Weight q, k, v, o, gate, up, down;
  Tensor q_norm, k_norm, in_norm, post_norm;
  Tensor att_base, mlp_base;  // F32 [2 sides, 2 taps, H]
  Weight att_proj, mlp_proj;              // [4G, H]
};

DFlashDrafter::~DFlashDrafter() = default;

bool DFlashDrafter::split_ok(const DraftConfig& c, int64_t n, std::string* why) {
  auto no = [&](const std::string& w) {
    if (why) *why = w;
    return false;
  };
  if (n <= 1) return true;
  const int64_t nh = c.num_heads, kvh = c.num_kv_heads, ns = n;
  if (nh % ns) return no("num_attention_heads = " + std::to_string(nh) + " is not divisible by " + std::to_string(ns));
  if (c.intermediate_size % ns)
    return no("intermediate_size = " + std::to_string(c.intermediate_size) + " is not divisible by " + std::to_string(ns));
  if (kvh < 1 || nh % kvh) return no("num_key_value_heads = " + std::to_string(kvh) + " does not divide the heads");
  // each rank's query heads read whole key / value heads: kvh / n of them, or (n > kvh) one
  // shared head, when a rank's heads all fall in one head's group
  if (kvh % ns && (nh / kvh) % (nh / ns))
    return no("the " + std::to_string(nh / ns) + " query heads of a rank would span key / value heads (" +
              std::to_string(kvh) + " of them)");
  return true;
}

std::unique_ptr<DFlashDrafter> DFlashDrafter::load(const Checkpoint& ck, const GlmConfig& tgt, const Tensor& embed,
                                                   const ops::Weight& lm_head, int64_t max_context_tokens,
                                                   int64_t max_seqs, int64_t tp_rank, int64_t tp_size) {
  DFLASH2_CHECK(ck.has_config(), ErrorKind::Config, "drafter checkpoint ", ck.path(), ": config.json is missing");
  std::unique_ptr<DFlashDrafter> d(new DFlashDrafter());
  d->cfg_ = DraftConfig::from_config(ck.config(), tgt);
  const DraftConfig& c = d->cfg_;
  d->ckpt_ = std::make_shared<Checkpoint>(ck);
  const Checkpoint& k = *d->ckpt_;
  d->embed_ = embed;
  d->lm_head_ = lm_head;
  const int64_t H = c.hidden_size, hd = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads, I = c.intermediate_size;
  DFLASH2_INTERNAL(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "drafter rank ", tp_rank, " of ", tp_size);
  std::string why;
  DFLASH2_CHECK(split_ok(c, tp_size, &why), ErrorKind::Config, "drafter checkpoint ", k.path(), " cannot be split across ",
                tp_size, " ranks: ", why);
  // this rank's share (tensor parallelism; everything at one rank)
  const int64_t n = tp_size, r = tp_rank, nhl = nh / n, h0 = r * nhl, group = nh / kvh;
  const int64_t kvhl = kvh % n == 0 ? kvh / n : 1, kv0 = kvh % n == 0 ? r * kvhl : h0 / group, Il = I / n;
  d->rank_ = r;
  d->size_ = n;
  d->nh_ = nhl;
  d->kvh_ = kvhl;
  d->inter_ = Il;
  auto rows_of = [&](const Weight& w, int64_t b, int64_t e) { return w.data.defined() && n > 1 ? w.rows(b, e) : w; };
  auto cols_of = [&](const Weight& w, int64_t b, int64_t e) { return w.data.defined() && n > 1 ? w.cols(b, e) : w; };
  std::vector<std::string> missing;
  auto lin = [&](const std::string& p, int64_t o, int64_t i) {
    if (!k.has(p + ".weight")) {
      missing.push_back(p + ".weight");
      return Weight();
    }
    return Weight::load(k, p, o, i);
  };
  auto vec = [&](const std::string& n, int64_t len) {
    if (!k.has(n)) {
      missing.push_back(n);
      return Tensor();
    }
    Tensor t = k.tensor(n);
    DFLASH2_CHECK(t.numel() == len && dtype_is_float(t.dtype()) && t.dtype() != DType::F8_E4M3, ErrorKind::Checkpoint,
                  "drafter checkpoint ", k.path(), ": tensor '", n, "' should hold ", len, " floats, found ", t.describe());
    return t;
  };
  if (r == 0) {  // the context features are rank 0's (append_context broadcasts them)
    d->fc_ = lin("fc", H, int64_t(c.target_layer_ids.size()) * H);
    d->hidden_norm_ = vec("hidden_norm.weight", H);
  }
  d->norm_ = vec("norm.weight", H);
  const int64_t G = H / c.conv_group_size;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto L = std::make_unique<Layer>();
    const std::string p = "layers." + std::to_string(l);
    L->q = rows_of(lin(p + ".self_attn.q_proj", nh * hd, H), h0 * hd, (h0 + nhl) * hd);
    L->k = rows_of(lin(p + ".self_attn.k_proj", kvh * hd, H), kv0 * hd, (kv0 + kvhl) * hd);
    L->v = rows_of(lin(p + ".self_attn.v_proj", kvh * hd, H), kv0 * hd, (kv0 + kvhl) * hd);
    L->o = cols_of(lin(p + ".self_attn.o_proj", H, nh * hd), h0 * hd, (h0 + nhl) * hd);
    L->q_norm = vec(p + ".self_attn.q_norm.weight", hd);
    L->k_norm = vec(p + ".self_attn.k_norm.weight", hd);
    L->in_norm = vec(p + ".input_layernorm.weight", H);
    L->post_norm = vec(p + ".post_attention_layernorm.weight", H);
    L->gate = rows_of(lin(p + ".mlp.gate_proj", I, H), r * Il, (r + 1) * Il);
    L->up = rows_of(lin(p + ".mlp.up_proj", I, H), r * Il, (r + 1) * Il);
    L->down = cols_of(lin(p + ".mlp.down_proj", H, I), r * Il, (r + 1) * Il);
    if (c.v2) {
      for (const char* which : {"attention_conv", "mlp_conv"}) {
        Tensor b = vec(p + "." + which + ".base_kernel", 4 * H);
        Tensor base;
        if (b.defined()) {
          base = Tensor::empty(DType::F32, {2, 2, H});
          ops::copy(b.contiguous().reshape({2, 2, H}), base);
        }
        Weight pr = lin(p + "." + which + ".kernel_projection", 4 * G, H);
        if (std::string(which) == "attention_conv") {
          L->att_base = base;
          L->att_proj = pr;
        } else {
          L->mlp_base = base;
          L->mlp_proj = pr;
        }
      }
    }
    d->layers_.push_back(std::move(L));
  }
  if (c.v2 && r == 0) {  // the selector walks on rank 0
    d->sel_proj_ = lin("candidate_selector.hidden_projection", c.selector_rank, H);
    for (const char* n : {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}) {
      if (!k.has(n)) {
        missing.push_back(n);
        continue;
      }
      Tensor t = k.tensor(n);
      DFLASH2_CHECK(t.ndim() == 2 && t.shape(0) == c.vocab_size && t.shape(1) == c.selector_rank &&
                        (t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16) && t.is_contiguous(),
                    ErrorKind::Checkpoint, "drafter checkpoint ", k.path(), ": '", n, "' should be [", c.vocab_size, ", ",
                    c.selector_rank, "], found ", t.describe());
      (std::string(n).find("predecessor") != std::string::npos ? d->pred_book_ : d->succ_book_) = t;
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 12; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 12) list += ", ... (" + std::to_string(missing.size() - 12) + " more)";
    fail(ErrorKind::Checkpoint, "drafter checkpoint ", k.path(), ": ", missing.size(), " required tensor",
         missing.size() > 1 ? "s are" : " is", " missing: ", list,
         c.v2 ? " (a DFlash2DraftModel needs its convs and candidate selector)" : "");
  }
  d->use_selector_ = c.v2;
  d->head_here_ = lm_head.data.defined();  // split: none (the workspace then holds no block logits)
  d->max_ctx_ = max_context_tokens;
  d->max_seqs_ = max_seqs;
  Arena plan = Arena::planner();
  d->alloc_append(plan, max_context_tokens);
  plan.reset();
  d->alloc_draft(plan, max_seqs);
  d->ws_ = std::make_unique<Arena>(plan.high_water());
  // rows s*B + 1 + t (t < B-1) of a drafted batch: the positions that predict tokens
  const int64_t B = c.block_size;
  std::vector<int32_t> rows(static_cast<size_t>(max_seqs * (B - 1)));
  for (int64_t s = 0; s < max_seqs; ++s)
    for (int64_t t = 0; t < B - 1; ++t) rows[size_t(s * (B - 1) + t)] = int32_t(s * B + 1 + t);
  d->logit_rows_ = Tensor::empty(DType::I32, {max_seqs * (B - 1)});
  d->logit_rows_.copy_from(Tensor::view(rows.data(), DType::I32, {max_seqs * (B - 1)}));
  return d;
}

std::vector<Weight*> DFlashDrafter::own_weights() {
  std::vector<Weight*> w{&fc_, &sel_proj_};
  for (auto& L : layers_)
    for (Weight* x : {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down, &L->att_proj, &L->mlp_proj}) w.push_back(x);
  return w;
}

std::vector<const Weight*> DFlashDrafter::own_weights() const {
  std::vector<const Weight*> out;
  for (Weight* w : const_cast<DFlashDrafter*>(this)->own_weights()) out.push_back(w);
  return out;
}

bool DFlashDrafter::any_weight(bool (*is)(const Weight&)) const {
  for (const Weight* w : own_weights())
    if (w->data.defined() && is(*w)) return true;
  return false;
}

size_t DFlashDrafter::device_bytes() const {
  size_t n = ws_->capacity();
  auto T = [&](const Tensor& t) { n += t.defined() ? t.nbytes() : 0; };
  for (const Weight* w : own_weights()) n += w->data.defined() ? w->bytes() : 0;
  T(hidden_norm_);
  T(norm_);
  for (const auto& L : layers_)
    for (const Tensor* t : {&L->q_norm, &L->k_norm, &L->in_norm, &L->post_norm, &L->att_base, &L->mlp_base}) T(*t);
  T(pred_book_);
  T(succ_book_);
  T(logit_rows_);
  return n;
}

namespace {
// A dense LM head that is the embedding table itself (tied word embeddings).
bool head_is_embedding(const Weight& head, const Tensor& embed) {
  return head.format == ops::WeightFormat::Dense && head.data.defined() && embed.defined() &&
         head.data.data() == embed.data() && head.data.dtype() == embed.dtype() && head.data.shape() == embed.shape() &&
         head.data.strides() == embed.strides();
}
}  // namespace

size_t DFlashDrafter::vocab_bytes() const {
  if (size_ > 1) return 0;  // split: the target's own vocabulary shards
  size_t n = embed_.defined() ? embed_.nbytes() : 0;
  if (!head_is_embedding(lm_head_, embed_)) n += lm_head_.data.defined() ? lm_head_.bytes() : 0;
  return n;
}

void DFlashDrafter::drop_head() {
  DFLASH2_CHECK_ARG(device_.is_cpu(), "DFlashDrafter::drop_head: call it before to_device");
  if (!head_here_) return;
  lm_head_ = Weight();
  head_here_ = false;
  // the workspace planned again without the block's logits
  Arena plan = Arena::planner();
  alloc_append(plan, max_ctx_);
  plan.reset();
  alloc_draft(plan, max_seqs_);
  ws_ = std::make_unique<Arena>(plan.high_water());
}

void DFlashDrafter::to_device(Device dev, const Tensor& embed, const Weight& lm_head) {
  DFLASH2_CHECK_ARG(device_.is_cpu(), "DFlashDrafter::to_device: already on ", device_.str());
  if (size_ > 1) {  // split: this rank's vocabulary shard of the target's embedding, already there
    DFLASH2_CHECK_ARG(!head_here_ && embed.defined() && !lm_head.data.defined() && embed.device() == dev &&
                          embed.shape() == embed_.shape(),
                      "DFlashDrafter::to_device: a split drafter reads the target's embedding shard on ", dev.str(),
                      " and has no LM head (drop_head)");
  }
  DFLASH2_CHECK_ARG(size_ > 1 || head_here_ || !embed.defined(), "DFlashDrafter::to_device: without its LM head (drop_head) the "
                    "drafter copies its own embedding");
  DFLASH2_CHECK_ARG(size_ > 1 || embed.defined() == lm_head.data.defined(), "DFlashDrafter::to_device: give both "
                    "the embedding and the LM head on ", dev.str(), ", or neither (the drafter copies its own)");
  if (size_ > 1) {
    embed_ = embed;
  } else if (embed.defined()) {
    DFLASH2_CHECK_ARG(embed.device() == dev && lm_head.data.device() == dev, "DFlashDrafter::to_device: the embedding (",
                      embed.describe(), ") and the LM head must already be on ", dev.str());
    DFLASH2_CHECK_ARG(embed.shape() == embed_.shape() && lm_head.out_features == lm_head_.out_features &&
                          lm_head.in_features == lm_head_.in_features,
                      "DFlashDrafter::to_device: the device embedding / LM head must be the full ones");
    embed_ = embed;
    lm_head_ = lm_head;
  } else {  // full copies of its own (a tied head shares the embedding's)
    const bool tied = head_is_embedding(lm_head_, embed_);
    embed_ = embed_.to(dev);
    if (head_here_ && tied) {  // (after drop_head the head runs elsewhere: nothing to copy)
      lm_head_.data = embed_;
    } else if (head_here_) {
      lm_head_ = lm_head_.to(dev);
    }
  }
  auto T = [&](Tensor& t) {
    if (t.defined()) t = t.to(dev);
  };
  for (Weight* w : own_weights())
    if (w->data.defined()) *w = w->to(dev);
  T(hidden_norm_);
  T(norm_);
  for (auto& L : layers_)
    for (Tensor* t : {&L->q_norm, &L->k_norm, &L->in_norm, &L->post_norm, &L->att_base, &L->mlp_base}) T(*t);
  T(pred_book_);
  T(succ_book_);
  T(logit_rows_);
  ws_ = std::make_unique<Arena>(ws_->capacity(), dev);
  device_ = dev;
  set_gemm(gemm_);  // NVFP4: prepare the scales where they now live
}

void DFlashDrafter::set_gemm(ops::GemmNumerics g) {
  gemm_ = g;
  if (g != ops::GemmNumerics::NVFP4 || !device_.is_cuda()) return;
  for (Weight* w : own_weights()) ops::prepare_nvfp4_scales(*w);  // undefined / not W4A4: nothing
  if (head_here_) ops::prepare_nvfp4_scales(lm_head_);
}

DFlashDrafter::Bufs DFlashDrafter::alloc_append(Arena& a, int64_t n) const {
  const DraftConfig& c = cfg_;
  Bufs b;
  b.f = a.alloc(DType::F32, {n, c.hidden_size});
  b.ctx = a.alloc(DType::F32, {n, c.hidden_size});
  b.kk = a.alloc(DType::F32, {n, kvh_, c.head_dim});
  b.vv = a.alloc(DType::F32, {n, kvh_ * c.head_dim});
  return b;
}

DFlashDrafter::Bufs DFlashDrafter::alloc_draft(Arena& a, int64_t S) const {
  const DraftConfig& c = cfg_;
  const int64_t B = c.block_size, T = S * B, H = c.hidden_size, R = S * (B - 1);
  const int64_t G = H / c.conv_group_size, nh = nh_, kvh = kvh_, hd = c.head_dim;
  Bufs b;
  b.x = a.alloc(DType::F32, {T, H});
  b.y = a.alloc(DType::F32, {T, H});
  b.dyn = a.alloc(DType::F32, {T, 4 * G});
  b.q = a.alloc(DType::F32, {T, nh, hd});
  b.kb = a.alloc(DType::F32, {T, kvh, hd});
  b.vb = a.alloc(DType::F32, {T, kvh, hd});
  b.att = a.alloc(DType::F32, {T, nh, hd});
  b.ob = a.alloc(DType::F32, {T, H});
  b.scratch = a.alloc(DType::F32, {2 * T * inter_});
  b.hrows = a.alloc(DType::F32, {R, H});
  b.vals = a.alloc(DType::F32, {R, c.v2 ? c.selector_top_k : 1});
  b.g = a.alloc(DType::F32, {R, c.v2 ? c.selector_rank : 1});
  b.logits = a.alloc(DType::F32, {head_here_ ? R : 0, c.vocab_size});  // last: none when the head is elsewhere
  return b;
}

void DFlashDrafter::append_context(const TokenBatch& batch, const Tensor& taps, const std::vector<Tensor>& kv_layers) {
  const DraftConfig& c = cfg_;
  const int64_t n = batch.T, kvd = kv_dim();
  DFLASH2_INTERNAL(n >= 1 && n <= max_ctx_, "append_context of ", n, " tokens (max ", max_ctx_, ")");
  ws_->reset();
  Bufs b = alloc_append(*ws_, n);
  if (rank_ == 0) {
    ops::linear_as(gemm_, taps, fc_, b.f);
    ops::rms_norm(b.f, hidden_norm_, c.rms_norm_eps, b.ctx);
  }
  if (size_ > 1) {  // rank 0's features to every rank (each writes its key / value heads)
    DFLASH2_INTERNAL(comm_ != nullptr, "a split drafter without its communicator");
    comm_->broadcast(b.ctx, 0);
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = *layers_[size_t(l)];
    Tensor k2 = b.kk.reshape({n, kvd});
    ops::linear_as(gemm_, b.ctx, L.k, k2);
    ops::linear_as(gemm_, b.ctx, L.v, b.vv);
    ops::rms_norm(b.kk, L.k_norm, c.rms_norm_eps, b.kk);
    ops::rope(b.kk, batch.paged.pos, c.rope_theta, ops::RopeStyle::NeoX);
    Tensor kc = kv_layers[size_t(l)].slice(1, 0, kvd), vc = kv_layers[size_t(l)].slice(1, kvd, 2 * kvd);
    ops::cache_write_many({&k2, &b.vv}, batch.slots, {&kc, &vc});
  }
}

void DFlashDrafter::draft(const TokenBatch& batch, const std::vector<Tensor>& kv_layers, const Tensor& temperature,
                          const Tensor& rng, DraftOutputs& out) {
  draft_rows(batch, kv_layers);
  draft_head(batch.S, out);
  draft_select(batch, temperature, rng, out);
}

DFlashDrafter::Bufs DFlashDrafter::draft_bufs(int64_t S) {
  DFLASH2_INTERNAL(S >= 1 && S <= max_seqs_, "draft batch of ", S, " sequences (max ", max_seqs_, ")");
  ws_->reset();
  return alloc_draft(*ws_, S);  // the same tensors draft_rows allocated (the arena is deterministic)
}

Tensor DFlashDrafter::head_rows(int64_t S) {
  const int64_t R = S * (cfg_.block_size - 1);
  return draft_bufs(S).hrows.slice(0, 0, R);
}

Tensor DFlashDrafter::head_values(int64_t S) {
  DFLASH2_INTERNAL(head_topk() > 0, "head_values without the selector");
  const int64_t R = S * (cfg_.block_size - 1);
  return draft_bufs(S).vals.slice(0, 0, R);
}

void DFlashDrafter::draft_rows(const TokenBatch& batch, const std::vector<Tensor>& kv_layers) {
  const DraftConfig& c = cfg_;
  const int64_t B = c.block_size, T = batch.T, S = batch.S, H = c.hidden_size, G = H / c.conv_group_size;
  const int64_t R = S * (B - 1);
  DFLASH2_INTERNAL(S >= 1 && S <= max_seqs_ && T == S * B, "draft batch of ", S, " sequences / ", T, " tokens");
  Bufs b = draft_bufs(S);
  Tensor x = b.x.slice(0, 0, T), y = b.y.slice(0, 0, T), dyn = b.dyn.slice(0, 0, T), q = b.q.slice(0, 0, T),
         kb = b.kb.slice(0, 0, T), vb = b.vb.slice(0, 0, T), att = b.att.slice(0, 0, T), ob = b.ob.slice(0, 0, T);
  Tensor scratch = b.scratch.slice(0, 0, 2 * T * inter_);
  if (size_ > 1) {  // this rank's vocabulary shard: its rows, zeros elsewhere; summed over the ranks
    ops::embedding_shard(embed_, batch.tokens, rank_ * embed_.shape(0), x);
    all_reduce(x);
  } else {
    ops::embedding(embed_, batch.tokens, x);
  }
  ops::BlockAttention ba;
  ba.block = B;
  ba.causal = c.causal;
  ba.scale = 1.0f / std::sqrt(float(c.head_dim));
  ba.cache_block_size = batch.paged.block_size;
  ba.tensor_cores = gemm_ != ops::GemmNumerics::Exact;  // draft_gemm: the drafter takes the tensor cores
  const int64_t nh = nh_, kvh = kvh_, hd = c.head_dim;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = *layers_[size_t(l)];
    // attention sublayer
    ops::rms_norm(x, L.in_norm, c.rms_norm_eps, y);
    if (c.v2) {
      ops::linear_as(gemm_, y, L.att_proj, dyn, false, /*decode=*/true);
      ops::dyn_conv(y, L.att_base.select(0, 0), dyn.slice(1, 0, 2 * G), B, y);
    }
    Tensor q2 = q.reshape({T, nh * hd}), k2 = kb.reshape({T, kvh * hd}), v2 = vb.reshape({T, kvh * hd});
    ops::linear_as_many(gemm_, y, {&L.q, &L.k, &L.v}, {&q2, &k2, &v2}, /*decode=*/true);
    ops::rms_norm_many({&q, &kb}, {&L.q_norm, &L.k_norm}, {c.rms_norm_eps, c.rms_norm_eps}, {&q, &kb});
    ops::rope_many({&q, &kb}, batch.paged.pos, c.rope_theta, ops::RopeStyle::NeoX);
    ba.window = c.window[size_t(l)];
    ops::block_attention(q, kb, vb, kv_layers[size_t(l)], batch.ctx_len, batch.paged.block_table, ba, att);
    ops::linear_as(gemm_, att.reshape({T, nh * hd}), L.o, ob, false, /*decode=*/true);
    all_reduce(ob);  // split: the ranks' heads
    if (c.v2) ops::dyn_conv(ob, L.att_base.select(0, 1), dyn.slice(1, 2 * G, 4 * G), B, ob);
    ops::add(x, ob, x);
    // MLP sublayer
    ops::rms_norm(x, L.post_norm, c.rms_norm_eps, y);
    if (c.v2) {
      ops::linear_as(gemm_, y, L.mlp_proj, dyn, false, /*decode=*/true);
      ops::dyn_conv(y, L.mlp_base.select(0, 0), dyn.slice(1, 0, 2 * G), B, y);
    }
    ops::gated_mlp(y, L.gate, L.up, L.down, ob, scratch, gemm_, /*decode=*/true);
    all_reduce(ob);  // split: the ranks' intermediate slices
    if (c.v2) ops::dyn_conv(ob, L.mlp_base.select(0, 1), dyn.slice(1, 2 * G, 4 * G), B, ob);
    ops::add(x, ob, x);
  }
  ops::rms_norm(x, norm_, c.rms_norm_eps, y);
  // the head's rows: block positions 1..B-1 (position i predicts the token at start + i)
  Tensor hrows = b.hrows.slice(0, 0, R);
  ops::gather_rows(y, logit_rows_.slice(0, 0, R), hrows);
  if (head_topk() > 0 && rank_ == 0) {  // the selector's low-rank factors of the same rows (it walks on rank 0)
    Tensor g = b.g.slice(0, 0, R);
    ops::linear_as(gemm_, hrows, sel_proj_, g, false, /*decode=*/true);
  }
}

void DFlashDrafter::all_reduce(Tensor& x) const {
  if (size_ == 1) return;
  DFLASH2_INTERNAL(comm_ != nullptr, "a split drafter without its communicator");
  comm_->all_reduce_sum(x);
}

void DFlashDrafter::draft_head(int64_t S, DraftOutputs& out) {
  DFLASH2_INTERNAL(head_here_, "the drafter's LM head runs elsewhere (tensor parallelism): draft_head on ",
                   device_.str());
  const int64_t R = S * (cfg_.block_size - 1), K = head_topk();
  Bufs b = draft_bufs(S);
  Tensor hrows = b.hrows.slice(0, 0, R), logits = b.logits.slice(0, 0, R);
  ops::linear_as(gemm_, hrows, lm_head_, logits, false, /*decode=*/true);
  if (out.pen.seq.defined()) {
    const auto& p = out.pen;
    ops::apply_penalties(logits, p.row0.slice(0, 0, R), p.draft, p.draft_row.slice(0, 0, R),
                         p.draft_len.slice(0, 0, R), p.seq.slice(0, 0, R), p.params.slice(0, 0, R), p.state, p.bias);
  }
  if (K == 0) {
    Tensor toks = out.tokens.reshape({R});
    return ops::argmax(logits, toks);
  }
  Tensor vals = b.vals.slice(0, 0, R), cand = out.cand.reshape({R, K});
  ops::topk(logits, K, vals, cand);
}

void DFlashDrafter::draft_select(const TokenBatch& batch, const Tensor& temperature, const Tensor& rng,
                                 DraftOutputs& out) {
  const int64_t K = head_topk();
  if (K == 0) return;  // the argmax per position is the draft
  DFLASH2_INTERNAL(rank_ == 0, "the selector walks on rank 0, not ", rank_);
  const int64_t S = batch.S, B = cfg_.block_size, R = S * (B - 1), Rk = cfg_.selector_rank;
  Bufs b = draft_bufs(S);
  Tensor vals = b.vals.slice(0, 0, R), g = b.g.slice(0, 0, R);
  ops::selector_walk(vals.reshape({S, B - 1, K}), out.cand, g.reshape({S, B - 1, Rk}), pred_book_, succ_book_,
                     batch.tokens.reshape({S, B}).select(1, 0), temperature, rng, out.tokens, out.q);
}

}  // namespace dflash2::model
