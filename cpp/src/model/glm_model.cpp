#include "model/glm_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "dflash2/error.h"
#include "ops/kv_fp8.h"

namespace dflash2::model {

using ops::Weight;

// ------------------------------------------------------------------ weights
struct Attn {
  Weight q_a, q_b, kv_a, o;
  Tensor q_a_norm, kv_a_norm;
  Tensor kvb;    // F32 [H*(nope+v), kv_lora], dequantized once
  Tensor wuk_t;  // F32 [heads, kv_lora, nope]: W_UK^T per head (absorbed into the query)
  Tensor wuv;    // F32 [heads, v, kv_lora]: W_UV per head (a view of kvb)
  bool indexer = false;
  Weight iq, ik, iw;
  Tensor ik_norm_w, ik_norm_b;
};

struct Mlp {
  bool moe = false;
  Weight gate, up, down;  // dense MLP or the shared expert
  bool has_shared = false;
  Weight router;          // [E, H]
  Tensor bias;            // F32 [E]: e_score_correction_bias
  ops::ExpertWeights experts;
};

struct Layer {
  Tensor in_norm, post_norm;
  Attn attn;
  Mlp mlp;
};

namespace {

// Collects every missing tensor so one error lists them all.
struct Loader {
  const Checkpoint& ck;
  std::vector<std::string> missing;

  bool has(const std::string& n) const { return ck.has(n); }
  Tensor vec(const std::string& n, int64_t len) {
    if (!ck.has(n)) {
      missing.push_back(n);
      return Tensor();
    }
    Tensor t = ck.tensor(n);
    DFLASH2_CHECK(t.ndim() == 1 && t.shape(0) == len && dtype_is_float(t.dtype()) && t.dtype() != DType::F8_E4M3,
                  ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": tensor '", n, "' should be a float vector [", len,
                  "], found ", t.describe());
    return t;
  }
  Weight lin(const std::string& prefix, int64_t out, int64_t in) {
    if (!ck.has(prefix + ".weight")) {
      missing.push_back(prefix + ".weight");
      return Weight();
    }
    return Weight::load(ck, prefix, out, in);
  }
  Tensor mat(const std::string& n, int64_t rows, int64_t cols) {
    if (!ck.has(n)) {
      missing.push_back(n);
      return Tensor();
    }
    Tensor t = ck.tensor(n);
    DFLASH2_CHECK(t.ndim() == 2 && t.shape(0) == rows && t.shape(1) == cols && dtype_is_float(t.dtype()) &&
                      t.dtype() != DType::F8_E4M3,
                  ErrorKind::Checkpoint, "checkpoint ", ck.path(), ": tensor '", n, "' should be [", rows, ", ", cols,
                  "] (F32/BF16/F16), found ", t.describe());
    return t;
  }
  void finish() const {
    if (missing.empty()) return;
    std::ostringstream os;
    os << "checkpoint " << ck.path() << ": " << missing.size() << " required tensor" << (missing.size() > 1 ? "s are" : " is")
       << " missing: ";
    for (size_t i = 0; i < missing.size() && i < 12; ++i) os << (i ? ", " : "") << missing[i];
    if (missing.size() > 12) os << ", ... (" << missing.size() - 12 << " more)";
    fail(ErrorKind::Checkpoint, os.str());
  }
};

// Tensor parallelism: rank r of n holds attention heads [r nh/n, (r+1) nh/n) (q_b rows, kv_b
// per head, o_proj columns), a 1/n slice of every dense / shared-expert MLP's intermediate
// (gate/up rows, down columns), and of the routed experts either a 1/n slice of every
// expert's intermediate (ep = false) or whole experts [r E/n, (r+1) E/n) (ep = true, expert
// parallelism); everything else (norms, q_a / kv_a, the indexer, the router) is replicated.
void load_layer(Loader& ld, const GlmConfig& c, const std::string& p, bool moe, bool indexer, Layer& L, int64_t r,
                int64_t n, bool ep) {
  const int64_t H = c.hidden_size, nh = c.num_heads, qk = c.qk_head_dim(), nope = c.qk_nope_head_dim,
                v = c.v_head_dim, kvl = c.kv_lora_rank;
  const int64_t nhl = nh / n, h0 = r * nhl;  // this rank's heads
  auto rows = [&](const Weight& w, int64_t b, int64_t e) { return w.data.defined() && n > 1 ? w.rows(b, e) : w; };
  auto cols = [&](const Weight& w, int64_t b, int64_t e) { return w.data.defined() && n > 1 ? w.cols(b, e) : w; };
  L.in_norm = ld.vec(p + ".input_layernorm.weight", H);
  L.post_norm = ld.vec(p + ".post_attention_layernorm.weight", H);
  Attn& a = L.attn;
  const std::string s = p + ".self_attn";
  a.q_a = ld.lin(s + ".q_a_proj", c.q_lora_rank, H);
  a.q_a_norm = ld.vec(s + ".q_a_layernorm.weight", c.q_lora_rank);
  a.q_b = rows(ld.lin(s + ".q_b_proj", nh * qk, c.q_lora_rank), h0 * qk, (h0 + nhl) * qk);
  a.kv_a = ld.lin(s + ".kv_a_proj_with_mqa", c.latent_dim(), H);
  a.kv_a_norm = ld.vec(s + ".kv_a_layernorm.weight", kvl);
  Weight kvb = ld.lin(s + ".kv_b_proj", nh * (nope + v), kvl);
  a.o = cols(ld.lin(s + ".o_proj", H, nh * v), h0 * v, (h0 + nhl) * v);
  if (kvb.data.defined()) {
    // Absorbed MLA: q~_h = W_UK_h^T q_nope_h (kv_lora), out_h = W_UV_h (sum_t p_t c_t).
    Tensor full = kvb.dequantize();
    a.kvb = n > 1 ? full.slice(0, h0 * (nope + v), (h0 + nhl) * (nope + v)).contiguous() : full;
    Tensor per_head = a.kvb.reshape({nhl, nope + v, kvl});
    a.wuk_t = Tensor::empty(DType::F32, {nhl, kvl, nope});
    ops::copy(per_head.slice(1, 0, nope).transpose(1, 2), a.wuk_t);
    a.wuv = per_head.slice(1, nope, nope + v);
  }
  a.indexer = indexer;
  if (indexer) {
    const std::string ix = s + ".indexer";
    a.iq = ld.lin(ix + ".wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank);
    a.ik = ld.lin(ix + ".wk", c.index_head_dim, H);
    a.iw = ld.lin(ix + ".weights_proj", c.index_n_heads, H);
    a.ik_norm_w = ld.vec(ix + ".k_norm.weight", c.index_head_dim);
    a.ik_norm_b = ld.vec(ix + ".k_norm.bias", c.index_head_dim);
  }
  Mlp& m = L.mlp;
  m.moe = moe;
  const std::string mp = p + ".mlp";
  if (!moe) {
    const int64_t Il = c.intermediate_size / n;
    m.gate = rows(ld.lin(mp + ".gate_proj", c.intermediate_size, H), r * Il, (r + 1) * Il);
    m.up = rows(ld.lin(mp + ".up_proj", c.intermediate_size, H), r * Il, (r + 1) * Il);
    m.down = cols(ld.lin(mp + ".down_proj", H, c.intermediate_size), r * Il, (r + 1) * Il);
    return;
  }
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
  Tensor rw = ld.mat(mp + ".gate.weight", E, H);
  if (rw.defined()) m.router = Weight::dense(rw, mp + ".gate.weight");
  Tensor b = ld.vec(mp + ".gate.e_score_correction_bias", E);
  if (b.defined()) {
    m.bias = Tensor::empty(DType::F32, {E});
    ops::copy(b, m.bias);  // stored F32 or BF16
  }
  m.experts.num_global = E;
  if (ep) {  // expert parallelism: this rank's whole experts
    const int64_t El = E / n;
    m.experts.first = r * El;
    for (int64_t e = r * El; e < (r + 1) * El; ++e) {
      const std::string x = mp + ".experts." + std::to_string(e);
      m.experts.gate.push_back(ld.lin(x + ".gate_proj", I, H));
      m.experts.up.push_back(ld.lin(x + ".up_proj", I, H));
      m.experts.down.push_back(ld.lin(x + ".down_proj", H, I));
    }
  } else {  // every expert, this rank's slice of its intermediate
    const int64_t Il = I / n;
    m.experts.first = 0;
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = mp + ".experts." + std::to_string(e);
      m.experts.gate.push_back(rows(ld.lin(x + ".gate_proj", I, H), r * Il, (r + 1) * Il));
      m.experts.up.push_back(rows(ld.lin(x + ".up_proj", I, H), r * Il, (r + 1) * Il));
      m.experts.down.push_back(cols(ld.lin(x + ".down_proj", H, I), r * Il, (r + 1) * Il));
    }
  }
  m.has_shared = c.n_shared_experts > 0;
  if (m.has_shared) {
    const int64_t SI = I * c.n_shared_experts, SIl = SI / n;
    m.gate = rows(ld.lin(mp + ".shared_experts.gate_proj", SI, H), r * SIl, (r + 1) * SIl);
    m.up = rows(ld.lin(mp + ".shared_experts.up_proj", SI, H), r * SIl, (r + 1) * SIl);
    m.down = cols(ld.lin(mp + ".shared_experts.down_proj", H, SI), r * SIl, (r + 1) * SIl);
  }
}


}  // namespace

// ------------------------------------------------------------------ chunk workspace
struct Bufs {
  Tensor h, x, qa, cq, q, kva, c, qt, olat, ocat, ao;
  Tensor qI, kI0, kI, wI, sel, sel_len;
  Tensor mlp_out, scratch, router, rids, rw, moe_ws, nrm, cat, rows;
  Tensor lg_local, lg_all;  // tensor parallelism: this rank's vocabulary slice of the logits, all slices
  Tensor pairs;             // one rank: the rows' (max, id) pairs of ForwardOutputs::argmax_only
};

namespace {
Bufs alloc_bufs(Arena& a, const GlmConfig& c, int64_t T, int64_t tp) {
  const int64_t H = c.hidden_size, nh = c.num_heads / tp, kvl = c.kv_lora_rank;
  Bufs b;
  b.h = a.alloc(DType::F32, {T, H});
  b.x = a.alloc(DType::F32, {T, H});
  b.qa = a.alloc(DType::F32, {T, c.q_lora_rank});
  b.cq = a.alloc(DType::F32, {T, c.q_lora_rank});
  b.q = a.alloc(DType::F32, {T, nh * c.qk_head_dim()});
  b.kva = a.alloc(DType::F32, {T, c.latent_dim()});
  b.c = a.alloc(DType::F32, {T, kvl});
  b.qt = a.alloc(DType::F32, {T, nh, kvl});
  b.olat = a.alloc(DType::F32, {T, nh, kvl});
  b.ocat = a.alloc(DType::F32, {T, nh, c.v_head_dim});
  b.ao = a.alloc(DType::F32, {T, H});
  b.qI = a.alloc(DType::F32, {T, c.index_n_heads, c.index_head_dim});
  b.kI0 = a.alloc(DType::F32, {T, c.index_head_dim});
  b.kI = a.alloc(DType::F32, {T, c.index_head_dim});
  b.wI = a.alloc(DType::F32, {T, c.index_n_heads});
  b.sel = a.alloc(DType::I32, {T, c.index_topk});
  b.sel_len = a.alloc(DType::I32, {T});
  b.mlp_out = a.alloc(DType::F32, {T, H});
  const int64_t F = std::max(c.intermediate_size, c.moe_intermediate_size * std::max<int64_t>(c.n_shared_experts, 1));
  b.scratch = a.alloc(DType::F32, {2 * T * F});
  const int64_t E = std::max<int64_t>(c.n_routed_experts, 1), K = std::max<int64_t>(c.num_experts_per_tok, 1);
  if (tp > 1) {
    b.lg_local = a.alloc(DType::F32, {T, c.vocab_size / tp});
    b.lg_all = a.alloc(DType::F32, {tp, T, c.vocab_size / tp});
  } else {
    b.pairs = a.alloc(DType::F32, {1, T, 2});
  }
  b.router = a.alloc(DType::F32, {T, c.n_routed_experts > 0 ? c.n_routed_experts : 1});
  b.rids = a.alloc(DType::I32, {T, K});
  b.rw = a.alloc(DType::F32, {T, K});
  b.moe_ws = a.alloc(DType::F32, {ops::moe_workspace_floats(T, K, H, std::max<int64_t>(c.moe_intermediate_size, 1), E)});
  b.nrm = a.alloc(DType::F32, {T, H});
  b.cat = a.alloc(DType::F32, {T, 2 * H});
  b.rows = a.alloc(DType::F32, {T, H});
  return b;
}

}  // namespace

// ------------------------------------------------------------------ load
GlmModel::~GlmModel() = default;

std::unique_ptr<GlmModel> GlmModel::load(const Checkpoint& ck, const Options& opt) {
  DFLASH2_CHECK(ck.has_config(), ErrorKind::Config, "checkpoint ", ck.path(), ": config.json is missing");
  std::unique_ptr<GlmModel> m(new GlmModel());
  m->cfg_ = GlmConfig::from_config(ck.config());
  const GlmConfig& c = m->cfg_;
  DFLASH2_CHECK_ARG(opt.max_step_tokens > 0, "engine options: max_step_tokens must be positive");
  const int64_t n = opt.tp_size, r = opt.tp_rank;
  DFLASH2_CHECK_ARG(n >= 1 && r >= 0 && r < n, "tensor parallel rank ", r, " of ", n);
  auto divides = [&](int64_t value, const char* field) {
    DFLASH2_CHECK(value % n == 0, ErrorKind::Config, "tensor_parallel=", n, " does not divide ", field, " = ", value,
                  " of ", ck.path(), " (heads, experts, intermediate sizes and the vocabulary are split across ranks)");
  };
  if (n > 1) {
    divides(c.num_heads, "num_attention_heads");
    divides(c.vocab_size, "vocab_size");
    divides(c.intermediate_size, "intermediate_size");
    if (c.n_routed_experts > 0) {
      if (opt.expert_parallel)
        divides(c.n_routed_experts, "n_routed_experts");
      else
        divides(c.moe_intermediate_size, "moe_intermediate_size");
      divides(c.moe_intermediate_size * c.n_shared_experts, "moe_intermediate_size x n_shared_experts");
    }
  }
  m->opt_ = opt;
  m->ckpt_ = std::make_shared<Checkpoint>(ck);
  Loader ld{*m->ckpt_, {}};
  const int64_t H = c.hidden_size, V = c.vocab_size, Vl = V / n;
  m->embed_ = ld.mat("model.embed_tokens.weight", V, H);
  m->final_norm_ = ld.vec("model.norm.weight", H);
  if (c.tie_word_embeddings && !ld.has("lm_head.weight")) {
    if (m->embed_.defined()) m->lm_head_ = Weight::dense(m->embed_, "model.embed_tokens.weight (tied lm_head)");
  } else {
    m->lm_head_ = ld.lin("lm_head", V, H);
  }
  // vocabulary parallelism: this rank's rows of the embedding and the LM head (the full ones
  // stay available, as mmap'ed views, for the drafter)
  if (m->embed_.defined()) m->embed_local_ = n > 1 ? m->embed_.slice(0, r * Vl, (r + 1) * Vl) : m->embed_;
  if (m->lm_head_.data.defined()) m->lm_head_local_ = n > 1 ? m->lm_head_.rows(r * Vl, (r + 1) * Vl) : m->lm_head_;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto L = std::make_unique<Layer>();
    load_layer(ld, c, "model.layers." + std::to_string(l), c.moe_layer[size_t(l)], c.indexer_full[size_t(l)], *L, r,
               n, opt.expert_parallel);
    m->layers_.push_back(std::move(L));
  }
  if (c.num_mtp_layers > 0) {
    const std::string p = "model.layers." + std::to_string(c.num_layers);
    m->mtp_ = std::make_unique<Layer>();
    bool mtp_moe = ld.has(p + ".mlp.gate.weight");
    bool mtp_indexer = ld.has(p + ".self_attn.indexer.wk.weight");
    load_layer(ld, c, p, mtp_moe, mtp_indexer, *m->mtp_, r, n, opt.expert_parallel);
    m->mtp_enorm_ = ld.vec(p + ".enorm.weight", H);
    m->mtp_hnorm_ = ld.vec(p + ".hnorm.weight", H);
    m->mtp_head_norm_ = ld.vec(p + ".shared_head.norm.weight", H);
    m->mtp_eh_proj_ = ld.lin(p + ".eh_proj", H, 2 * H);
    m->mtp_embed_ = ld.has(p + ".embed_tokens.weight") ? ld.mat(p + ".embed_tokens.weight", V, H) : m->embed_;
    m->mtp_head_ = ld.has(p + ".shared_head.head.weight") ? ld.lin(p + ".shared_head.head", V, H) : m->lm_head_;
    if (m->mtp_embed_.defined()) m->mtp_embed_ = n > 1 ? m->mtp_embed_.slice(0, r * Vl, (r + 1) * Vl) : m->mtp_embed_;
    if (m->mtp_head_.data.defined() && n > 1) m->mtp_head_ = m->mtp_head_.rows(r * Vl, (r + 1) * Vl);
  }
  ld.finish();

  Arena plan = Arena::planner();
  alloc_bufs(plan, c, opt.max_step_tokens, n);
  m->ws_ = std::make_unique<Arena>(plan.high_water());
  return m;
}

// ------------------------------------------------------------------ device placement
void GlmModel::for_each_param(const std::function<void(Tensor&)>& tensor,
                              const std::function<void(Weight&)>& weight) {
  auto T = [&](Tensor& t) {
    if (t.defined()) tensor(t);
  };
  auto W = [&](Weight& w) {
    if (w.data.defined()) weight(w);
  };
  auto layer = [&](Layer& L) {
    T(L.in_norm);
    T(L.post_norm);
    Attn& a = L.attn;
    W(a.q_a);
    W(a.q_b);
    W(a.kv_a);
    W(a.o);
    T(a.q_a_norm);
    T(a.kv_a_norm);
    T(a.kvb);
    T(a.wuk_t);
    W(a.iq);
    W(a.ik);
    W(a.iw);
    T(a.ik_norm_w);
    T(a.ik_norm_b);
    Mlp& m = L.mlp;
    W(m.gate);
    W(m.up);
    W(m.down);
    W(m.router);
    T(m.bias);
    for (auto* v : {&m.experts.gate, &m.experts.up, &m.experts.down})
      for (Weight& w : *v) W(w);
  };
  T(embed_local_);
  W(lm_head_local_);
  T(final_norm_);
  for (auto& L : layers_) layer(*L);
  if (mtp_) {
    layer(*mtp_);
    T(mtp_enorm_);
    T(mtp_hnorm_);
    T(mtp_head_norm_);
    T(mtp_embed_);
    W(mtp_eh_proj_);
    W(mtp_head_);
  }
}

namespace {
// One device copy per stored tensor: names that share storage (a tied LM head, the MTP
// layer's embedding / head when it has none of its own) share the copy.
struct TensorKey {
  const void* data;
  DType dtype;
  std::vector<int64_t> shape, strides;
  bool operator<(const TensorKey& o) const {
    if (data != o.data) return data < o.data;
    if (dtype != o.dtype) return dtype < o.dtype;
    if (shape != o.shape) return shape < o.shape;
    return strides < o.strides;
  }
};
TensorKey key_of(const Tensor& t) { return {t.data(), t.dtype(), t.shape(), t.strides()}; }
}  // namespace

size_t GlmModel::device_bytes() const {
  std::set<TensorKey> seen;
  size_t total = 0;
  auto add = [&](const Tensor& t) {
    if (seen.insert(key_of(t)).second) total += t.nbytes();
  };
  const_cast<GlmModel*>(this)->for_each_param([&](Tensor& t) { add(t); },
                                              [&](Weight& w) {
                                                add(w.data);
                                                if (w.scale.defined()) add(w.scale);
                                                if (w.sf_blocked.defined()) add(w.sf_blocked);
                                              });
  return total + ws_->capacity();
}

void GlmModel::to_device(Device dev, const std::function<void(size_t, size_t)>& progress) {
  DFLASH2_CHECK_ARG(device_.is_cpu(), "GlmModel::to_device: the model is already on ", device_.str());
  if (dev.is_cpu()) return;
  const size_t total = device_bytes() - ws_->capacity();
  size_t done = 0;
  std::map<TensorKey, Tensor> copies;
  auto move = [&](Tensor& t) {
    auto it = copies.find(key_of(t));
    if (it == copies.end()) {
      Tensor d = t.to(dev);
      done += t.nbytes();
      it = copies.emplace(key_of(t), d).first;
      if (progress) progress(done, total);
    }
    t = it->second;
  };
  for_each_param(move, [&](Weight& w) {
    move(w.data);
    if (w.scale.defined()) move(w.scale);
  });
  // the views derived from moved tensors
  const GlmConfig& c = cfg_;
  const int64_t nhl = c.num_heads / opt_.tp_size, nope = c.qk_nope_head_dim, v = c.v_head_dim;
  auto views = [&](Layer& L) {
    if (L.attn.kvb.defined())
      L.attn.wuv = L.attn.kvb.reshape({nhl, nope + v, c.kv_lora_rank}).slice(1, nope, nope + v);
  };
  for (auto& L : layers_) views(*L);
  if (mtp_) views(*mtp_);
  ws_ = std::make_unique<Arena>(ws_->capacity(), dev);
  device_ = dev;
}

bool GlmModel::mtp_has_indexer() const { return mtp_ && mtp_->attn.indexer; }

namespace {
// Whether any projection a prompt chunk runs through ops::linear_as matches `is`.
template <class Pred>
bool any_prefill_weight(const std::vector<std::unique_ptr<Layer>>& layers, Pred is) {
  for (const auto& L : layers) {
    const Attn& a = L->attn;
    if (is(a.q_a) || is(a.q_b) || is(a.kv_a) || is(a.o) || is(L->mlp.gate) || is(L->mlp.up) || is(L->mlp.down))
      return true;
  }
  return false;
}
}  // namespace

ops::GemmNumerics GlmModel::experts_numerics(ops::GemmNumerics g, uint32_t experts_allowed) const {
  auto allowed = [experts_allowed](ops::GemmNumerics n) { return (experts_allowed >> unsigned(n)) & 1u; };
  if (g == ops::GemmNumerics::Exact) return g;
  bool any = false, fp8 = g == ops::GemmNumerics::FP8 && allowed(ops::GemmNumerics::FP8),
       fp4 = g == ops::GemmNumerics::NVFP4 && allowed(ops::GemmNumerics::NVFP4),
       bf16 = allowed(ops::GemmNumerics::BF16);
  for (const auto& L : layers_) {
    if (!L->mlp.moe) continue;
    any = true;
    fp8 = fp8 && ops::moe_experts_fp8_available(device_, L->mlp.experts);
    fp4 = fp4 && ops::moe_experts_nvfp4_available(device_, L->mlp.experts);
    bf16 = bf16 && ops::moe_experts_bf16_available(device_, L->mlp.experts);
  }
  return any && fp8    ? ops::GemmNumerics::FP8
         : any && fp4  ? ops::GemmNumerics::NVFP4
         : any && bf16 ? ops::GemmNumerics::BF16
                       : ops::GemmNumerics::Exact;
}

void GlmModel::set_prefill(ops::GemmNumerics g, uint32_t experts_allowed) {
  opt_.prefill = g;
  experts_prefill_ = experts_numerics(g, experts_allowed);
  experts_fp8_ = experts_prefill_ == ops::GemmNumerics::FP8;
  prepare_w4a4_scales();
}

void GlmModel::set_decode(ops::GemmNumerics g, uint32_t experts_allowed) {
  opt_.decode = g;
  experts_decode_ = experts_numerics(g, experts_allowed);
  prepare_w4a4_scales();
}

void GlmModel::prepare_w4a4_scales() {
  using ops::GemmNumerics;
  const bool w4a4 = opt_.prefill == GemmNumerics::NVFP4 || opt_.decode == GemmNumerics::NVFP4 ||
                    experts_prefill_ == GemmNumerics::NVFP4 || experts_decode_ == GemmNumerics::NVFP4;
  if (!w4a4 || !device_.is_cuda()) return;
  for_each_param([](Tensor&) {}, [](Weight& w) { ops::prepare_nvfp4_scales(w); });
}

bool GlmModel::has_fp8_weights() const {
  return any_prefill_weight(layers_, [](const Weight& w) { return w.format == ops::WeightFormat::FP8Block128; });
}

bool GlmModel::has_nvfp4_weights() const {
  auto w4a4 = [](const Weight& w) { return ops::takes_w4a4(w); };
  if (any_prefill_weight(layers_, w4a4)) return true;
  for (const auto& L : layers_) {  // the routed experts (GLM-5.3-NVFP4 quantizes only those)
    const ops::ExpertWeights& ex = L->mlp.experts;
    if (!L->mlp.moe || ex.gate.empty()) continue;
    bool all = true;
    for (size_t e = 0; e < ex.gate.size() && all; ++e) all = w4a4(ex.gate[e]) && w4a4(ex.up[e]) && w4a4(ex.down[e]);
    if (all) return true;
  }
  return false;
}

// ------------------------------------------------------------------ one decoder layer
void GlmModel::layer_forward(const Layer& L, const Tensor& latent, const Tensor& index_keys, const TokenBatch& tb,
                             Bufs& b, Tensor& h, bool& have_sel, ops::GemmNumerics tc, ops::GemmNumerics ex,
                             bool decode) {
  const GlmConfig& c = cfg_;
  const int64_t T = tb.T, nh = c.num_heads / opt_.tp_size, qk = c.qk_head_dim(), nope = c.qk_nope_head_dim,
                rope = c.qk_rope_head_dim, kvl = c.kv_lora_rank, lat = c.latent_dim();
  const bool tp = opt_.tp_size > 1;
  const Attn& a = L.attn;
  const Tensor& positions = tb.paged.pos;
  // the chunk's projection numerics (Options::prefill / decode: the tensor cores when not Exact)
  auto lin = [tc, decode](const Tensor& x, const ops::Weight& w, Tensor& y, bool acc = false) {
    ops::linear_as(tc, x, w, y, acc, decode);
  };
  // --- MLA projections (q_a_layernorm / kv_a_layernorm use eps 1e-6, as transformers does);
  // the projections of one input together (ops::linear_as_many: on the skinny decode path x
  // is rounded to BF16 once for all of them): q_a, kv_a and the indexer's wk / weights_proj
  // of the normed hidden state, then q_b and the indexer's wq_b of the normed q_a
  ops::rms_norm(h, L.in_norm, c.rms_norm_eps, b.x);
  const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
  Tensor qI2 = a.indexer ? b.qI.reshape({T, nI * dI}) : Tensor();
  std::vector<const ops::Weight*> ws{&a.q_a, &a.kv_a};
  std::vector<Tensor*> ys{&b.qa, &b.kva};
  if (a.indexer) {
    ws.insert(ws.end(), {&a.ik, &a.iw});
    ys.insert(ys.end(), {&b.kI0, &b.wI});
  }
  ops::linear_as_many(tc, b.x, ws, ys, decode);
  // q_a's and the latent's norms in one op (one kernel on CUDA)
  Tensor kv_lat = b.kva.slice(1, 0, kvl);
  ops::rms_norm_many({&b.qa, &kv_lat}, {&a.q_a_norm, &a.kv_a_norm}, {1e-6f, 1e-6f}, {&b.cq, &b.c});  // c = RMS(latent)
  ws.assign({&a.q_b});
  ys.assign({&b.q});
  if (a.indexer) {
    ws.push_back(&a.iq);
    ys.push_back(&qI2);
  }
  ops::linear_as_many(tc, b.cq, ws, ys, decode);
  Tensor q3 = b.q.reshape({T, nh, qk});
  Tensor q_nope = q3.slice(2, 0, nope), q_pe = q3.slice(2, nope, qk);
  Tensor k_pe = b.kva.slice(1, kvl, lat).unsqueeze(1);
  Tensor qI_rope, kI_rope;
  if (a.indexer) {  // the indexer's keys: LayerNorm, then RoPE on their first `rope` dims
    ops::layer_norm(b.kI0, a.ik_norm_w, a.ik_norm_b, 1e-6f, b.kI);
    qI_rope = b.qI.slice(2, 0, rope);
    kI_rope = b.kI.slice(1, 0, rope).unsqueeze(1);
  }
  // RoPE of the queries and keys, then their cache rows, each one op over all of them (one
  // kernel each on CUDA: a decode layer's launches are its cost at small batches)
  std::vector<Tensor*> rot{&q_pe, &k_pe};
  if (a.indexer) rot.insert(rot.end(), {&qI_rope, &kI_rope});
  ops::rope_many(rot, positions, c.rope_theta, ops::RopeStyle::Interleaved);
  Tensor lat_c, lat_pe, k_pe2 = b.kva.slice(1, kvl, lat);
  if (latent.dtype() == DType::U8) {  // FP8 rows (ops/kv_fp8.h): c quantized, then k_pe in BF16
    const int64_t qb = kvfp8::fp8_bytes(kvl);
    lat_c = latent.slice(1, 0, qb);
    lat_pe = Tensor::view(static_cast<uint8_t*>(latent.data()) + qb, DType::BF16, {latent.shape(0), rope},
                          {latent.stride(0) / 2, 1}, latent.device(), latent.owner());
  } else {
    lat_c = latent.slice(1, 0, kvl);
    lat_pe = latent.slice(1, kvl, lat);
  }
  Tensor keys = index_keys;
  std::vector<const Tensor*> rows{&b.c, &k_pe2};
  std::vector<Tensor*> dst{&lat_c, &lat_pe};
  if (a.indexer) {
    rows.push_back(&b.kI);
    dst.push_back(&keys);
  }
  ops::cache_write_many(rows, tb.slots, dst);
  // --- DSA indexer: choose each query's keys (shared layers keep the previous selection)
  if (a.indexer) {
    ops::indexer_topk(b.qI, b.wI, index_keys, tb.paged, c.index_topk, b.sel, b.sel_len);
    have_sel = true;
  }
  // --- absorbed attention over the latent cache
  ops::linear_heads(q_nope, a.wuk_t, b.qt);
  const float scale = 1.0f / std::sqrt(float(qk));
  ops::mla_attention(b.qt, q_pe, latent, tb.paged, b.sel, have_sel ? b.sel_len : Tensor(), scale, b.olat);
  ops::linear_heads(b.olat, a.wuv, b.ocat);
  if (!tp) {
    lin(b.ocat.reshape({T, nh * c.v_head_dim}), a.o, h, /*accumulate=*/true);  // h += o_proj(attn)
  } else {  // this rank's heads' share of o_proj, summed over the ranks
    Tensor part = b.ao.slice(0, 0, T);
    lin(b.ocat.reshape({T, nh * c.v_head_dim}), a.o, part);
    reduce_into(part, h);
  }

  // --- MLP
  ops::rms_norm(h, L.post_norm, c.rms_norm_eps, b.x);
  const Mlp& m = L.mlp;
  if (!m.moe) {
    if (!tp) {  // h += down(...): the down projection's sums added to h as ops::add would
      ops::gated_mlp(b.x, m.gate, m.up, m.down, h, b.scratch, tc, decode, /*accumulate=*/true);
      return;
    }
    ops::gated_mlp(b.x, m.gate, m.up, m.down, b.mlp_out, b.scratch, tc, decode);
  } else {
    Tensor logits = b.router.slice(0, 0, T);
    ops::linear(b.x, m.router, logits);  // exact: routing decisions
    ops::MoeRouting r;
    r.top_k = c.num_experts_per_tok;
    r.n_group = c.n_group;
    r.topk_group = c.topk_group;
    r.norm_topk_prob = c.norm_topk_prob;
    r.routed_scaling_factor = c.routed_scaling_factor;
    ops::moe_route(logits, m.bias, r, b.rids, b.rw);
    // the routed experts on a grouped tensor-core GEMM too (set_prefill / set_decode). One
    // rank: their sum added straight to the residual stream, then the shared expert's output by
    // its down projection, h = (h + routed) + shared (no add kernel; transformers rounds
    // h + (routed + shared): the same up to fp32 rounding). Under TP each rank's routed part
    // plus its shared part, then the all-reduce.
    if (!tp) {
      ops::moe_experts(b.x, b.rids, b.rw, m.experts, h, b.moe_ws, ex, decode, /*accumulate=*/true);
      if (m.has_shared) ops::gated_mlp(b.x, m.gate, m.up, m.down, h, b.scratch, tc, decode, true);
      return;
    }
    ops::moe_experts(b.x, b.rids, b.rw, m.experts, b.mlp_out, b.moe_ws, ex, decode);
    if (m.has_shared) ops::gated_mlp(b.x, m.gate, m.up, m.down, b.mlp_out, b.scratch, tc, decode, true);
  }
  reduce_into(b.mlp_out, h);  // the ranks' intermediate slices / experts
}

void GlmModel::reduce_into(Tensor& part, Tensor& h) {
  if (comm_->all_reduce_sum_add(part, h)) return;
  comm_->all_reduce_sum(part);
  ops::add(h, part, h);
}

// ------------------------------------------------------------------ vocabulary parallelism
void GlmModel::embed(const Tensor& table, const TokenBatch& tb, Tensor& out) {
  if (opt_.tp_size == 1) return ops::embedding(table, tb.tokens, out);
  ops::embedding_shard(table, tb.tokens, opt_.tp_rank * table.shape(0), out);  // rows held here, zeros elsewhere
  comm_->all_reduce_sum(out);
}

void GlmModel::project(const Tensor& rows, const ops::Weight& head, Bufs& b, Tensor& logits) {
  if (opt_.tp_size == 1) return ops::linear(rows, head, logits);
  // each rank computes its vocabulary slice; all-gather, then [rank, row, v] -> [row, rank * Vl + v]
  const int64_t R = rows.shape(0), n = opt_.tp_size, Vl = head.out_features;
  Tensor local = b.lg_local.slice(0, 0, R);
  ops::linear(rows, head, local);
  Tensor all = Tensor::view(b.lg_all.data(), DType::F32, {n, R, Vl}, {}, b.lg_all.device());
  comm_->all_gather(local, all);
  Tensor dst = logits.reshape({R, n, Vl}).transpose(0, 1);
  ops::copy(all, dst);
}

void GlmModel::project_argmax(const Tensor& rows, const ops::Weight& head, Bufs& b, const Tensor& ids,
                              const Tensor& flags, const Tensor& logits) {
  if (opt_.tp_size == 1) {  // one GPU: the logits into `logits`, one pass to (max, id), the merge of one shard
    DFLASH2_INTERNAL(logits.defined() && logits.shape(0) == rows.shape(0) && ids.defined(),
                     "argmax outputs on one rank without a logits buffer or ids");
    const int64_t R = rows.shape(0);
    Tensor lg = logits;
    ops::linear(rows, head, lg);
    Tensor all = b.pairs.slice(1, 0, R);
    Tensor mine = Tensor::view(all.data(), DType::F32, {R, 2}, {}, all.device());
    ops::argmax_shard(lg, 0, mine);
    Tensor i = ids, f = flags;
    ops::argmax_merge(all, i, f);
    return;
  }
  DFLASH2_INTERNAL(comm_ != nullptr, "argmax outputs without a communicator");
  const int64_t R = rows.shape(0), n = opt_.tp_size, Vl = head.out_features;
  DFLASH2_INTERNAL(n * R * Vl >= (n + 1) * R * 2, "a vocabulary shard of ", Vl, " ids holds no argmax pairs");
  Tensor local = b.lg_local.slice(0, 0, R);
  ops::linear(rows, head, local);
  // the pairs in the gathered logits' buffer (N x R x Vl floats, Vl >= 2): all N x R x 2
  // first, then this rank's R x 2
  const Device d = b.lg_all.device();
  Tensor all = Tensor::view(b.lg_all.data(), DType::F32, {n, R, 2}, {}, d);
  Tensor mine = Tensor::view(b.lg_all.data_as<float>() + n * R * 2, DType::F32, {R, 2}, {}, d);
  ops::argmax_shard(local, opt_.tp_rank * Vl, mine);
  comm_->all_gather(mine, all);
  if (ids.defined()) {
    Tensor i = ids, f = flags;
    ops::argmax_merge(all, i, f);
  }
}

void GlmModel::vocab_head(const Tensor& rows, ops::GemmNumerics g, int64_t k, Tensor& local, Tensor& packed,
                          Tensor& gathered, Tensor& vals, Tensor& ids, Tensor& flags) {
  DFLASH2_INTERNAL(opt_.tp_size > 1 && comm_ != nullptr, "a vocabulary-parallel head without tensor parallelism");
  const int64_t R = rows.shape(0), w = k > 0 ? 2 * k : 2, Vl = lm_head_local_.out_features;
  const Device d = local.device();
  DFLASH2_INTERNAL(local.shape(0) == R && local.shape(1) == Vl && packed.shape(0) == R && packed.shape(1) == w &&
                       gathered.shape(0) == opt_.tp_size && gathered.shape(1) == R && gathered.shape(2) == w,
                   "vocabulary-parallel head buffers ", local.describe(), ", ", packed.describe(), ", ",
                   gathered.describe(), " for ", R, " rows, k = ", k);
  ops::linear_as(g, rows, lm_head_local_, local, false, /*decode=*/true);  // the drafter's few rows
  if (k > 0) {  // [values | ids] per row, the ids as I32 bits in the same floats
    Tensor v = packed.slice(1, 0, k);
    Tensor i = Tensor::view(packed.data(), DType::I32, {R, w}, {}, d).slice(1, k, w);
    ops::topk(local, k, v, i);
  } else {
    ops::argmax_shard(local, opt_.tp_rank * Vl, packed);
  }
  comm_->all_gather(packed, gathered);
  if (!ids.defined()) return;
  if (k > 0) {
    const int64_t n = opt_.tp_size;
    Tensor gv = gathered.slice(2, 0, k);
    Tensor gi = Tensor::view(gathered.data(), DType::I32, {n, R, w}, {}, d).slice(2, k, w);
    ops::topk_merge(gv, gi, Vl, vals, ids);
  } else {
    ops::argmax_merge(gathered, ids, flags);
  }
}

void GlmModel::prepare_head(ops::GemmNumerics g) {
  if (g == ops::GemmNumerics::NVFP4 && device_.is_cuda()) ops::prepare_nvfp4_scales(lm_head_local_);
}

// ------------------------------------------------------------------ forward
namespace {
// The chunk workspace cut to T rows (the arena is planned for max_step_tokens).
Bufs chunk_bufs(Arena& ws, const GlmConfig& c, int64_t T, int64_t tp) {
  ws.reset();
  return alloc_bufs(ws, c, T, tp);
}
}  // namespace

void GlmModel::forward(const TokenBatch& tb, const GlmCache& cache, const ForwardOutputs& out) {
  const GlmConfig& c = cfg_;
  const int64_t T = tb.T, H = c.hidden_size;
  DFLASH2_INTERNAL(T >= 1 && T <= opt_.max_step_tokens, "forward chunk of ", T, " tokens (max ", opt_.max_step_tokens,
                   ")");
  Bufs b = chunk_bufs(*ws_, c, T, opt_.tp_size);
  Tensor h = b.h;
  embed(embed_local_, tb, h);
  bool have_sel = false;
  using G = ops::GemmNumerics;
  const G tc = out.exact ? G::Exact : out.prompt ? opt_.prefill : opt_.decode;
  const G ex = out.exact ? G::Exact : out.prompt ? experts_prefill_ : experts_decode_;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    layer_forward(*layers_[size_t(l)], cache.latent[size_t(l)], cache.index[size_t(l)], tb, b, h, have_sel, tc, ex,
                  !out.prompt);
    for (size_t j = 0; j < out.tap_layers.size(); ++j)
      if (out.tap_layers[j] == l) {
        Tensor dst = out.taps.slice(1, int64_t(j) * H, int64_t(j + 1) * H);
        ops::copy(h, dst);
      }
  }
  Tensor nrm = b.nrm;
  ops::rms_norm(h, final_norm_, c.rms_norm_eps, nrm);
  if (out.final_hidden.defined()) {
    Tensor fh = out.final_hidden;
    ops::copy(nrm, fh);
  }
  if (out.argmax_only) {  // tensor parallelism, greedy: no logits gather
    Tensor rows = nrm;
    if (!out.all_logits) {
      rows = b.rows.slice(0, 0, tb.logit_rows.shape(0));
      ops::gather_rows(nrm, tb.logit_rows, rows);
    }
    return project_argmax(rows, lm_head_local_, b, out.argmax, out.argmax_flags, out.logits);
  }
  if (!out.logits.defined()) return;
  Tensor logits = out.logits;
  if (out.all_logits) {
    project(nrm, lm_head_local_, b, logits);
  } else {
    Tensor rows = b.rows.slice(0, 0, tb.logit_rows.shape(0));
    ops::gather_rows(nrm, tb.logit_rows, rows);
    project(rows, lm_head_local_, b, logits);
  }
}

void GlmModel::mtp_forward(const TokenBatch& tb, const Tensor& h_main, const GlmCache& cache, Tensor& logits,
                           Tensor& hidden) {
  DFLASH2_CHECK(mtp_ != nullptr, ErrorKind::Unsupported, "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  const GlmConfig& c = cfg_;
  const int64_t T = tb.T, H = c.hidden_size;
  DFLASH2_INTERNAL(T >= 1 && T <= opt_.max_step_tokens, "mtp chunk of ", T, " tokens");
  Bufs b = chunk_bufs(*ws_, c, T, opt_.tp_size);
  Tensor e = b.ao;  // free until the layer runs
  embed(mtp_embed_, tb, e);
  Tensor cat_e = b.cat.slice(1, 0, H), cat_h = b.cat.slice(1, H, 2 * H);
  ops::rms_norm_many({&e, &h_main}, {&mtp_enorm_, &mtp_hnorm_}, {c.rms_norm_eps, c.rms_norm_eps}, {&cat_e, &cat_h});
  Tensor h = b.h;
  ops::linear(b.cat, mtp_eh_proj_, h);
  bool have_sel = false;
  layer_forward(*mtp_, cache.latent[0], cache.index[0], tb, b, h, have_sel);
  const int64_t R = tb.logit_rows.shape(0);
  if (hidden.defined()) ops::gather_rows(h, tb.logit_rows, hidden);
  Tensor nrm = b.nrm.slice(0, 0, R), rows = b.rows.slice(0, 0, R);
  ops::gather_rows(h, tb.logit_rows, rows);
  ops::rms_norm(rows, mtp_head_norm_, c.rms_norm_eps, nrm);
  project(nrm, mtp_head_, b, logits);
}

}  // namespace dflash2::model
