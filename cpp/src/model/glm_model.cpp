#include "model/glm_model.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "dflash2/error.h"

namespace dflash2::model {

using ops::Weight;

// ------------------------------------------------------------------ paged cache
PagedCache::PagedCache(int64_t n_layers, int64_t latent_dim, const std::vector<bool>& has_index, int64_t index_dim,
                       int64_t block_size, int64_t num_blocks)
    : latent_dim_(latent_dim), index_dim_(index_dim), block_size_(block_size), num_blocks_(num_blocks) {
  int64_t slots = 0;
  index_slot_.assign(size_t(n_layers), -1);
  for (int64_t l = 0; l < n_layers; ++l)
    if (has_index[size_t(l)]) index_slot_[size_t(l)] = slots++;
  latent_ = Tensor::zeros(DType::F32, {n_layers, num_blocks, block_size, latent_dim});
  latent_base_ = latent_.data_as<float>();
  if (slots) {
    index_ = Tensor::zeros(DType::F32, {slots, num_blocks, block_size, index_dim});
    index_base_ = index_.data_as<float>();
  }
  free_.reserve(size_t(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
}

int32_t PagedCache::alloc_block() {
  if (free_.empty())
    fail(ErrorKind::OutOfMemory, "KV cache is full: all ", num_blocks_, " blocks of ", block_size_,
         " tokens are in use (raise max_batch_size or max_seq_len)");
  int32_t b = free_.back();
  free_.pop_back();
  return b;
}

// ------------------------------------------------------------------ weights
struct Attn {
  Weight q_a, q_b, kv_a, o;
  Tensor q_a_norm, kv_a_norm;
  Tensor kvb;                      // F32 [H*(nope+v), kv_lora], dequantized once
  std::vector<Weight> wuk_t, wuv;  // per head: W_UK^T [kv_lora, nope], W_UV [v, kv_lora]
  std::vector<Tensor> wuk_t_owner;
  bool indexer = false;
  Weight iq, ik, iw;
  Tensor ik_norm_w, ik_norm_b;
};

struct Mlp {
  bool moe = false;
  Weight gate, up, down;  // dense MLP or the shared expert
  bool has_shared = false;
  Weight router;          // [E, H]
  std::vector<float> bias;
  std::vector<Weight> eg, eu, ed;
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

void load_layer(Loader& ld, const GlmConfig& c, const std::string& p, bool moe, bool indexer, Layer& L) {
  const int64_t H = c.hidden_size, nh = c.num_heads, qk = c.qk_head_dim(), nope = c.qk_nope_head_dim,
                v = c.v_head_dim, kvl = c.kv_lora_rank;
  L.in_norm = ld.vec(p + ".input_layernorm.weight", H);
  L.post_norm = ld.vec(p + ".post_attention_layernorm.weight", H);
  Attn& a = L.attn;
  const std::string s = p + ".self_attn";
  a.q_a = ld.lin(s + ".q_a_proj", c.q_lora_rank, H);
  a.q_a_norm = ld.vec(s + ".q_a_layernorm.weight", c.q_lora_rank);
  a.q_b = ld.lin(s + ".q_b_proj", nh * qk, c.q_lora_rank);
  a.kv_a = ld.lin(s + ".kv_a_proj_with_mqa", c.latent_dim(), H);
  a.kv_a_norm = ld.vec(s + ".kv_a_layernorm.weight", kvl);
  Weight kvb = ld.lin(s + ".kv_b_proj", nh * (nope + v), kvl);
  a.o = ld.lin(s + ".o_proj", H, nh * v);
  if (kvb.data.defined()) {
    // Absorbed MLA: q~_h = W_UK_h^T q_nope_h (kv_lora), out_h = W_UV_h (sum_t p_t c_t).
    a.kvb = kvb.dequantize();
    const float* W = a.kvb.data_as<const float>();
    for (int64_t h = 0; h < nh; ++h) {
      Tensor t = Tensor::empty(DType::F32, {kvl, nope});
      float* o = t.data_as<float>();
      for (int64_t d = 0; d < nope; ++d)
        for (int64_t cc = 0; cc < kvl; ++cc) o[cc * nope + d] = W[(h * (nope + v) + d) * kvl + cc];
      a.wuk_t.push_back(Weight::dense(t, s + ".kv_b_proj[W_UK^T head " + std::to_string(h) + "]"));
      a.wuk_t_owner.push_back(t);
      a.wuv.push_back(Weight::dense(a.kvb.slice(0, h * (nope + v) + nope, (h + 1) * (nope + v)),
                                    s + ".kv_b_proj[W_UV head " + std::to_string(h) + "]"));
    }
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
    m.gate = ld.lin(mp + ".gate_proj", c.intermediate_size, H);
    m.up = ld.lin(mp + ".up_proj", c.intermediate_size, H);
    m.down = ld.lin(mp + ".down_proj", H, c.intermediate_size);
    return;
  }
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
  Tensor r = ld.mat(mp + ".gate.weight", E, H);
  if (r.defined()) m.router = Weight::dense(r, mp + ".gate.weight");
  Tensor b = ld.vec(mp + ".gate.e_score_correction_bias", E);
  if (b.defined()) {
    m.bias.resize(size_t(E));
    for (int64_t e = 0; e < E; ++e)
      m.bias[size_t(e)] = load_as_f32(static_cast<const char*>(b.data()) + e * int64_t(b.itemsize()), b.dtype());
  }
  for (int64_t e = 0; e < E; ++e) {
    const std::string ep = mp + ".experts." + std::to_string(e);
    m.eg.push_back(ld.lin(ep + ".gate_proj", I, H));
    m.eu.push_back(ld.lin(ep + ".up_proj", I, H));
    m.ed.push_back(ld.lin(ep + ".down_proj", H, I));
  }
  m.has_shared = c.n_shared_experts > 0;
  if (m.has_shared) {
    const int64_t SI = I * c.n_shared_experts;
    m.gate = ld.lin(mp + ".shared_experts.gate_proj", SI, H);
    m.up = ld.lin(mp + ".shared_experts.up_proj", SI, H);
    m.down = ld.lin(mp + ".shared_experts.down_proj", H, SI);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// better(a, b): a ranks before b (larger value, ties to the lower index)
struct Ranked {
  const float* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] != v[b] ? v[a] > v[b] : a < b; }
};

}  // namespace

// ------------------------------------------------------------------ step workspace
struct Bufs {
  Tensor h, x, qa, cq, q, kva, c, qt, olat, ocat, ao;
  Tensor qI, kI0, kI, wI, sel;
  Tensor mlp_out, scratch, router, xe, ye, slot_out, shared_out, nrm, cat, rows;
  Tensor sc, isc, tv, ti;
};

struct GlmModel::Step {
  int64_t T = 0;
  std::vector<CacheStream*> stream;  // per token
  std::vector<int32_t> pos;          // per token
  Tensor positions;                  // I32 [T] over pos
  std::vector<int64_t> sel_count;    // per token: -1 = every causal key
  Bufs b;
};

static Bufs alloc_bufs(Arena& a, const GlmConfig& c, int64_t T, int64_t max_seq, int64_t max_rows, int nth) {
  const int64_t H = c.hidden_size, nh = c.num_heads, kvl = c.kv_lora_rank;
  Bufs b;
  b.h = a.alloc(DType::F32, {T, H});
  b.x = a.alloc(DType::F32, {T, H});
  b.qa = a.alloc(DType::F32, {T, c.q_lora_rank});
  b.cq = a.alloc(DType::F32, {T, c.q_lora_rank});
  b.q = a.alloc(DType::F32, {T, nh * c.qk_head_dim()});
  b.kva = a.alloc(DType::F32, {T, c.latent_dim()});
  b.c = a.alloc(DType::F32, {T, kvl});
  b.qt = a.alloc(DType::F32, {T, nh * kvl});
  b.olat = a.alloc(DType::F32, {T, nh * kvl});
  b.ocat = a.alloc(DType::F32, {T, nh * c.v_head_dim});
  b.ao = a.alloc(DType::F32, {T, H});
  b.qI = a.alloc(DType::F32, {T, c.index_n_heads * c.index_head_dim});
  b.kI0 = a.alloc(DType::F32, {T, c.index_head_dim});
  b.kI = a.alloc(DType::F32, {T, c.index_head_dim});
  b.wI = a.alloc(DType::F32, {T, c.index_n_heads});
  b.sel = a.alloc(DType::I32, {T, c.index_topk});
  b.mlp_out = a.alloc(DType::F32, {T, H});
  const int64_t F = std::max(c.intermediate_size, c.moe_intermediate_size * std::max<int64_t>(c.n_shared_experts, 1));
  b.scratch = a.alloc(DType::F32, {2 * T * F});
  const int64_t E = std::max<int64_t>(c.n_routed_experts, 1), K = std::max<int64_t>(c.num_experts_per_tok, 1);
  b.router = a.alloc(DType::F32, {T, E});
  b.xe = a.alloc(DType::F32, {T, H});
  b.ye = a.alloc(DType::F32, {T, H});
  b.slot_out = a.alloc(DType::F32, {T * K, H});
  b.shared_out = a.alloc(DType::F32, {T, H});
  b.nrm = a.alloc(DType::F32, {T, H});
  b.cat = a.alloc(DType::F32, {T, 2 * H});
  b.rows = a.alloc(DType::F32, {std::max<int64_t>(max_rows, 1), H});
  b.sc = a.alloc(DType::F32, {nth, max_seq});
  b.isc = a.alloc(DType::F32, {nth, max_seq});
  b.tv = a.alloc(DType::F32, {nth, c.index_topk});
  b.ti = a.alloc(DType::I32, {nth, c.index_topk});
  return b;
}

// ------------------------------------------------------------------ load
GlmModel::~GlmModel() = default;

std::unique_ptr<GlmModel> GlmModel::load(const Checkpoint& ck, const Options& opt) {
  DFLASH2_CHECK(ck.has_config(), ErrorKind::Config, "checkpoint ", ck.path(), ": config.json is missing");
  std::unique_ptr<GlmModel> m(new GlmModel());
  m->cfg_ = GlmConfig::from_config(ck.config());
  const GlmConfig& c = m->cfg_;
  DFLASH2_CHECK_ARG(opt.max_seq_len > 0 && opt.max_batch_size > 0 && opt.max_step_tokens > 0 && opt.kv_block_size > 0,
                    "engine options: max_seq_len, max_batch_size, max_step_tokens and kv_block_size must be positive");
  DFLASH2_CHECK_ARG(opt.max_seq_len <= c.max_position_embeddings, "max_seq_len ", opt.max_seq_len,
                    " exceeds the model's max_position_embeddings ", c.max_position_embeddings);
  m->opt_ = opt;
  m->ckpt_ = std::make_shared<Checkpoint>(ck);
  Loader ld{*m->ckpt_, {}};
  const int64_t H = c.hidden_size, V = c.vocab_size;
  m->embed_ = ld.mat("model.embed_tokens.weight", V, H);
  m->final_norm_ = ld.vec("model.norm.weight", H);
  if (c.tie_word_embeddings && !ld.has("lm_head.weight")) {
    if (m->embed_.defined()) m->lm_head_ = Weight::dense(m->embed_, "model.embed_tokens.weight (tied lm_head)");
  } else {
    m->lm_head_ = ld.lin("lm_head", V, H);
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto L = std::make_unique<Layer>();
    load_layer(ld, c, "model.layers." + std::to_string(l), c.moe_layer[size_t(l)], c.indexer_full[size_t(l)], *L);
    m->layers_.push_back(std::move(L));
  }
  if (c.num_mtp_layers > 0) {
    const std::string p = "model.layers." + std::to_string(c.num_layers);
    m->mtp_ = std::make_unique<Layer>();
    bool mtp_moe = ld.has(p + ".mlp.gate.weight");
    bool mtp_indexer = ld.has(p + ".self_attn.indexer.wk.weight");
    load_layer(ld, c, p, mtp_moe, mtp_indexer, *m->mtp_);
    m->mtp_enorm_ = ld.vec(p + ".enorm.weight", H);
    m->mtp_hnorm_ = ld.vec(p + ".hnorm.weight", H);
    m->mtp_head_norm_ = ld.vec(p + ".shared_head.norm.weight", H);
    m->mtp_eh_proj_ = ld.lin(p + ".eh_proj", H, 2 * H);
    m->mtp_embed_ = ld.has(p + ".embed_tokens.weight") ? ld.mat(p + ".embed_tokens.weight", V, H) : m->embed_;
    m->mtp_head_ = ld.has(p + ".shared_head.head.weight") ? ld.lin(p + ".shared_head.head", V, H) : m->lm_head_;
    DFLASH2_CHECK(mtp_indexer || m->opt_.max_seq_len <= c.index_topk, ErrorKind::Checkpoint, "checkpoint ", ck.path(),
                  ": the MTP layer '", p, "' has no indexer tensors, which is only supported while max_seq_len <= index_topk");
  }
  ld.finish();

  const int64_t blocks_per_seq = (opt.max_seq_len + opt.kv_block_size - 1) / opt.kv_block_size;
  const int64_t nblocks = blocks_per_seq * opt.max_batch_size;
  m->cache_ = PagedCache(c.num_layers, c.latent_dim(), c.indexer_full, c.index_head_dim, opt.kv_block_size, nblocks);
  if (m->mtp_)
    m->mtp_cache_ = PagedCache(1, c.latent_dim(), {m->mtp_->attn.indexer}, c.index_head_dim, opt.kv_block_size, nblocks);
  // Per-thread scratch is sized for this many threads and the parallel regions that use it
  // never run wider (the calling thread's OpenMP setting may differ from the loader's,
  // e.g. after torch.set_num_threads or from a streaming thread).
  m->nthreads_ = std::max({1, omp_get_max_threads(), omp_get_num_procs()});
  m->last_rows_ = Tensor::empty(DType::F32, {opt.max_batch_size, H});
  m->plan_workspace();
  return m;
}

void GlmModel::plan_workspace() {
  Arena plan = Arena::planner();
  alloc_bufs(plan, cfg_, opt_.max_step_tokens, opt_.max_seq_len, opt_.max_batch_size, nthreads_);
  ws_ = std::make_unique<Arena>(plan.high_water());
}

// ------------------------------------------------------------------ cache streams
void GlmModel::ensure_capacity(CacheStream& s, int64_t new_len, PagedCache& cache) {
  DFLASH2_CHECK_ARG(new_len <= opt_.max_seq_len, "sequence length ", new_len, " would exceed max_seq_len ",
                    opt_.max_seq_len);
  const int64_t need = (new_len + cache.block_size() - 1) / cache.block_size();
  while (int64_t(s.blocks.size()) < need) s.blocks.push_back(cache.alloc_block());
}

void GlmModel::rollback(CacheStream& s, int64_t length, bool mtp) {
  DFLASH2_CHECK_ARG(length >= 0 && length <= s.length, "rollback to length ", length, " but the sequence has ",
                    s.length, " tokens");
  PagedCache& cache = mtp ? mtp_cache_ : cache_;
  const int64_t keep = (length + cache.block_size() - 1) / cache.block_size();
  while (int64_t(s.blocks.size()) > keep) {
    cache.free_block(s.blocks.back());
    s.blocks.pop_back();
  }
  s.length = length;
}

// ------------------------------------------------------------------ one decoder layer
void GlmModel::layer_forward(const Layer& L, int64_t cl, PagedCache& cache, Step& st, Tensor& h) {
  const GlmConfig& c = cfg_;
  Bufs& b = st.b;
  const int64_t T = st.T, nh = c.num_heads, qk = c.qk_head_dim(), nope = c.qk_nope_head_dim,
                rope = c.qk_rope_head_dim, kvl = c.kv_lora_rank, lat = c.latent_dim(), v = c.v_head_dim;
  const int64_t bs = cache.block_size();
  const Attn& a = L.attn;
  // --- MLA projections (q_a_layernorm / kv_a_layernorm use eps 1e-6, as transformers does)
  ops::rms_norm(h, L.in_norm, c.rms_norm_eps, b.x);
  ops::linear(b.x, a.q_a, b.qa);
  ops::rms_norm(b.qa, a.q_a_norm, 1e-6f, b.cq);
  ops::linear(b.cq, a.q_b, b.q);
  Tensor q_rope = Tensor::view(b.q.data_as<float>() + nope, DType::F32, {T, nh, rope}, {nh * qk, qk, 1});
  ops::rope(q_rope, st.positions, c.rope_theta, ops::RopeStyle::Interleaved);
  ops::linear(b.x, a.kv_a, b.kva);
  ops::rms_norm(b.kva.slice(1, 0, kvl), a.kv_a_norm, 1e-6f, b.c);  // c = RMS(latent)
  Tensor k_pe = Tensor::view(b.kva.data_as<float>() + kvl, DType::F32, {T, 1, rope}, {lat, rope, 1});
  ops::rope(k_pe, st.positions, c.rope_theta, ops::RopeStyle::Interleaved);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t p = st.pos[size_t(i)];
    float* dst = cache.latent(cl, st.stream[size_t(i)]->blocks[size_t(p / bs)], p % bs);
    std::memcpy(dst, b.c.data_as<float>() + i * kvl, size_t(kvl) * 4);
    std::memcpy(dst + kvl, b.kva.data_as<float>() + i * lat + kvl, size_t(rope) * 4);
  }
  // --- DSA indexer: choose each query's keys (shared layers keep the previous selection)
  const int64_t topk = c.index_topk;
  if (a.indexer) {
    const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
    ops::linear(b.cq, a.iq, b.qI);
    Tensor qI_rope = Tensor::view(b.qI.data(), DType::F32, {T, nI, rope}, {nI * dI, dI, 1});
    ops::rope(qI_rope, st.positions, c.rope_theta, ops::RopeStyle::Interleaved);
    ops::linear(b.x, a.ik, b.kI0);
    ops::layer_norm(b.kI0, a.ik_norm_w, a.ik_norm_b, 1e-6f, b.kI);
    Tensor kI_rope = Tensor::view(b.kI.data(), DType::F32, {T, 1, rope}, {dI, rope, 1});
    ops::rope(kI_rope, st.positions, c.rope_theta, ops::RopeStyle::Interleaved);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t p = st.pos[size_t(i)];
      std::memcpy(cache.index_key(cl, st.stream[size_t(i)]->blocks[size_t(p / bs)], p % bs),
                  b.kI.data_as<float>() + i * dI, size_t(dI) * 4);
    }
    ops::linear(b.x, a.iw, b.wI);
    const float wscale = 1.0f / std::sqrt(float(nI)), sscale = 1.0f / std::sqrt(float(dI));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads_)
    for (int64_t i = 0; i < T; ++i) {
      const int64_t p = st.pos[size_t(i)];
      if (p + 1 <= topk) {
        st.sel_count[size_t(i)] = -1;
        continue;
      }
      const int tid = omp_get_thread_num();
      float* sc = b.isc.data_as<float>() + tid * b.isc.shape(1);
      const float* qrow = b.qI.data_as<float>() + i * nI * dI;
      const float* w = b.wI.data_as<float>() + i * nI;
      const CacheStream& s = *st.stream[size_t(i)];
      for (int64_t t = 0; t <= p; ++t) {
        const float* k = cache.index_key(cl, s.blocks[size_t(t / bs)], t % bs);
        float acc = 0;
        for (int64_t hh = 0; hh < nI; ++hh) {
          const float d = dot(qrow + hh * dI, k, dI) * sscale;
          acc += (w[hh] * wscale) * (d > 0 ? d : 0.0f);
        }
        sc[t] = acc;
      }
      Tensor row = Tensor::view(sc, DType::F32, {p + 1});
      Tensor vals = Tensor::view(b.tv.data_as<float>() + tid * topk, DType::F32, {topk});
      Tensor idx = Tensor::view(b.sel.data_as<int32_t>() + i * topk, DType::I32, {topk});
      ops::topk(row, topk, vals, idx);
      std::sort(idx.data_as<int32_t>(), idx.data_as<int32_t>() + topk);  // attend in position order
      st.sel_count[size_t(i)] = topk;
    }
  }
  // --- absorbed attention over the latent cache
  for (int64_t hh = 0; hh < nh; ++hh) {
    Tensor qn = b.q.slice(1, hh * qk, hh * qk + nope);
    Tensor qt = b.qt.slice(1, hh * kvl, (hh + 1) * kvl);
    ops::linear(qn, a.wuk_t[size_t(hh)], qt);
  }
  const float scale = 1.0f / std::sqrt(float(qk));
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(nthreads_)
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t p = st.pos[size_t(i)];
      const int tid = omp_get_thread_num();
      float* sc = b.sc.data_as<float>() + tid * b.sc.shape(1);
      const float* qt = b.qt.data_as<float>() + (i * nh + hh) * kvl;
      const float* qpe = b.q.data_as<float>() + i * nh * qk + hh * qk + nope;
      const CacheStream& s = *st.stream[size_t(i)];
      const int64_t cnt = st.sel_count[size_t(i)];
      const int32_t* sel = b.sel.data_as<int32_t>() + i * topk;
      const int64_t nk = cnt < 0 ? p + 1 : cnt;
      float mx = -INFINITY;
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t t = cnt < 0 ? j : sel[j];
        const float* kv = cache.latent(cl, s.blocks[size_t(t / bs)], t % bs);
        const float sj = (dot(qt, kv, kvl) + dot(qpe, kv + kvl, rope)) * scale;
        sc[j] = sj;
        mx = std::max(mx, sj);
      }
      double sum = 0;
      for (int64_t j = 0; j < nk; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
      }
      const float inv = float(1.0 / sum);
      float* out = b.olat.data_as<float>() + (i * nh + hh) * kvl;
      std::fill(out, out + kvl, 0.0f);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t t = cnt < 0 ? j : sel[j];
        const float* kv = cache.latent(cl, s.blocks[size_t(t / bs)], t % bs);
        const float pj = sc[j] * inv;
        for (int64_t d = 0; d < kvl; ++d) out[d] += pj * kv[d];
      }
    }
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    Tensor ol = b.olat.slice(1, hh * kvl, (hh + 1) * kvl);
    Tensor oc = b.ocat.slice(1, hh * v, (hh + 1) * v);
    ops::linear(ol, a.wuv[size_t(hh)], oc);
  }
  ops::linear(b.ocat, a.o, h, /*accumulate=*/true);  // h += o_proj(attn)

  // --- MLP
  ops::rms_norm(h, L.post_norm, c.rms_norm_eps, b.x);
  const Mlp& m = L.mlp;
  const int64_t Hd = c.hidden_size;
  if (!m.moe) {
    ops::gated_mlp(b.x, m.gate, m.up, m.down, b.mlp_out, b.scratch);
  } else {
    const int64_t E = c.n_routed_experts, K = c.num_experts_per_tok, G = c.n_group, per = E / G;
    Tensor logits = b.router.slice(0, 0, T);
    ops::linear(b.x, m.router, logits);
    std::vector<int32_t> chosen(static_cast<size_t>(T * K));
    std::vector<float> weight(static_cast<size_t>(T * K));
    std::vector<float> s(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t i = 0; i < T; ++i) {
      const float* lg = logits.data_as<float>() + i * E;
      for (int64_t e = 0; e < E; ++e) {
        s[size_t(e)] = 1.0f / (1.0f + std::exp(-lg[e]));
        choice[size_t(e)] = s[size_t(e)] + m.bias[size_t(e)];
      }
      if (G > 1) {  // group-limited routing: keep the topk_group groups with the best top-2 sums
        std::vector<float> gs(static_cast<size_t>(G));
        for (int64_t g = 0; g < G; ++g) {
          std::vector<float> v2(choice.begin() + g * per, choice.begin() + (g + 1) * per);
          std::partial_sort(v2.begin(), v2.begin() + std::min<int64_t>(2, per), v2.end(), std::greater<float>());
          gs[size_t(g)] = per >= 2 ? v2[0] + v2[1] : v2[0];
        }
        std::vector<int32_t> go(static_cast<size_t>(G));
        for (int64_t g = 0; g < G; ++g) go[size_t(g)] = int32_t(g);
        std::sort(go.begin(), go.end(), Ranked{gs.data()});
        std::vector<bool> keep(size_t(G), false);
        for (int64_t g = 0; g < c.topk_group; ++g) keep[size_t(go[size_t(g)])] = true;
        for (int64_t e = 0; e < E; ++e)
          if (!keep[size_t(e / per)]) choice[size_t(e)] = -INFINITY;
      }
      for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), Ranked{choice.data()});
      std::sort(order.begin(), order.begin() + K);  // sum in expert order, as transformers does
      float denom = 0;
      for (int64_t j = 0; j < K; ++j) denom += s[size_t(order[size_t(j)])];
      denom += 1e-20f;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = order[size_t(j)];
        chosen[size_t(i * K + j)] = e;
        weight[size_t(i * K + j)] =
            (c.norm_topk_prob ? s[size_t(e)] / denom : s[size_t(e)]) * c.routed_scaling_factor;
      }
    }
    // run each expert once on the tokens routed to it
    std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));
    for (int64_t i = 0; i < T * K; ++i) slots[size_t(chosen[size_t(i)])].push_back(i);
    for (int64_t e = 0; e < E; ++e) {
      const auto& sl = slots[size_t(e)];
      if (sl.empty()) continue;
      const int64_t n = int64_t(sl.size());
      Tensor xe = b.xe.slice(0, 0, n), ye = b.ye.slice(0, 0, n);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(xe.data_as<float>() + r * Hd, b.x.data_as<float>() + (sl[size_t(r)] / K) * Hd, size_t(Hd) * 4);
      ops::gated_mlp(xe, m.eg[size_t(e)], m.eu[size_t(e)], m.ed[size_t(e)], ye, b.scratch);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(b.slot_out.data_as<float>() + sl[size_t(r)] * Hd, ye.data_as<float>() + r * Hd, size_t(Hd) * 4);
    }
    if (m.has_shared) ops::gated_mlp(b.x, m.gate, m.up, m.down, b.shared_out, b.scratch);
    for (int64_t i = 0; i < T; ++i) {
      float* out = b.mlp_out.data_as<float>() + i * Hd;
      std::fill(out, out + Hd, 0.0f);
      for (int64_t j = 0; j < K; ++j) {
        const float w = weight[size_t(i * K + j)];
        const float* y = b.slot_out.data_as<float>() + (i * K + j) * Hd;
        for (int64_t d = 0; d < Hd; ++d) out[d] += y[d] * w;
      }
      if (m.has_shared) {
        const float* sh = b.shared_out.data_as<float>() + i * Hd;
        for (int64_t d = 0; d < Hd; ++d) out[d] += sh[d];
      }
    }
  }
  float* hp = h.data_as<float>();
  const float* mo = b.mlp_out.data_as<float>();
  for (int64_t i = 0; i < T * Hd; ++i) hp[i] += mo[i];
}

// ------------------------------------------------------------------ forward
void GlmModel::forward(const std::vector<StepSeq>& seqs, bool all_logits, Tensor& logits,
                       const std::vector<int64_t>& hidden_layers, std::vector<Tensor>& hidden, Tensor& final_hidden) {
  const GlmConfig& c = cfg_;
  const int64_t H = c.hidden_size;
  int64_t total = 0;
  DFLASH2_CHECK_ARG(int64_t(seqs.size()) <= opt_.max_batch_size, "batch of ", seqs.size(),
                    " sequences exceeds max_batch_size ", opt_.max_batch_size);
  for (const auto& s : seqs) {
    DFLASH2_CHECK_ARG(s.n >= 1, "forward: every sequence needs at least one new token");
    for (int64_t j = 0; j < s.n; ++j)
      DFLASH2_CHECK_ARG(s.tokens[j] >= 0 && s.tokens[j] < c.vocab_size, "token id ", s.tokens[j], " at position ", j,
                        " is outside the vocabulary [0, ", c.vocab_size, ")");
    DFLASH2_CHECK_ARG(s.stream->length + s.n <= opt_.max_seq_len, "sequence of ", s.stream->length + s.n,
                      " tokens exceeds max_seq_len ", opt_.max_seq_len);
    total += s.n;
  }
  const int64_t rows = all_logits ? total : int64_t(seqs.size());
  DFLASH2_CHECK_ARG(logits.defined() && logits.dtype() == DType::F32 && logits.ndim() == 2 &&
                        logits.shape(0) == rows && logits.shape(1) == c.vocab_size && logits.stride(1) == 1,
                    "forward: logits must be F32 [", rows, ", ", c.vocab_size, "], found ", logits.describe());
  DFLASH2_CHECK_ARG(hidden.size() == hidden_layers.size(), "forward: one hidden output per requested layer");
  for (size_t j = 0; j < hidden_layers.size(); ++j) {
    DFLASH2_CHECK_ARG(hidden_layers[j] >= 0 && hidden_layers[j] < c.num_layers, "hidden layer id ", hidden_layers[j],
                      " is outside [0, ", c.num_layers, ")");
    DFLASH2_CHECK_ARG(hidden[j].defined() && hidden[j].dtype() == DType::F32 && hidden[j].is_contiguous() &&
                          hidden[j].shape() == Tensor::Shape({total, H}),
                      "forward: hidden output must be F32 [", total, ", ", H, "]");
  }
  if (final_hidden.defined())
    DFLASH2_CHECK_ARG(final_hidden.dtype() == DType::F32 && final_hidden.is_contiguous() &&
                          final_hidden.shape() == Tensor::Shape({total, H}),
                      "forward: final_hidden must be F32 [", total, ", ", H, "]");
  // Split the flattened tokens into chunks of at most max_step_tokens (chunked prefill);
  // a sequence may continue into the next chunk, which then sees its earlier tokens in the cache.
  std::vector<Piece> chunk;
  int64_t in_chunk = 0, row0 = 0;
  auto flush = [&]() {
    if (chunk.empty()) return;
    run_chunk(chunk, all_logits, logits, hidden_layers, hidden, row0, final_hidden);
    row0 += in_chunk;
    chunk.clear();
    in_chunk = 0;
  };
  for (size_t si = 0; si < seqs.size(); ++si) {
    const StepSeq& s = seqs[si];
    for (int64_t off = 0; off < s.n;) {
      const int64_t take = std::min(s.n - off, opt_.max_step_tokens - in_chunk);
      chunk.push_back({{s.stream, s.tokens + off, take}, int64_t(si), off + take == s.n});
      in_chunk += take;
      off += take;
      if (in_chunk == opt_.max_step_tokens) flush();
    }
  }
  flush();
  if (!all_logits) {
    Tensor lr = last_rows_.slice(0, 0, rows);
    ops::linear(lr, lm_head_, logits);
  }
}

void GlmModel::run_chunk(const std::vector<Piece>& pieces, bool all_logits, Tensor& logits,
                         const std::vector<int64_t>& hidden_layers, std::vector<Tensor>& hidden, int64_t row0,
                         Tensor& final_hidden) {
  const GlmConfig& c = cfg_;
  const int64_t H = c.hidden_size;
  Step st;
  std::vector<int32_t> ids;
  for (const auto& pc : pieces) {
    const StepSeq& s = pc.s;
    ensure_capacity(*s.stream, s.stream->length + s.n, cache_);
    for (int64_t j = 0; j < s.n; ++j) {
      st.stream.push_back(s.stream);
      st.pos.push_back(int32_t(s.stream->length + j));
      ids.push_back(s.tokens[j]);
    }
  }
  st.T = int64_t(st.pos.size());
  st.positions = Tensor::view(st.pos.data(), DType::I32, {st.T});
  st.sel_count.assign(size_t(st.T), -1);
  ws_->reset();
  st.b = alloc_bufs(*ws_, c, st.T, opt_.max_seq_len, opt_.max_batch_size, nthreads_);
  Tensor h = st.b.h;
  Tensor idt = Tensor::view(ids.data(), DType::I32, {st.T});
  ops::embedding(embed_, idt, h);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    layer_forward(*layers_[size_t(l)], l, cache_, st, h);
    for (size_t j = 0; j < hidden_layers.size(); ++j)
      if (hidden_layers[j] == l) std::memcpy(hidden[j].data_as<float>() + row0 * H, h.data(), size_t(st.T * H) * 4);
  }
  for (const auto& pc : pieces) pc.s.stream->length += pc.s.n;
  Tensor nrm = st.b.nrm;
  ops::rms_norm(h, final_norm_, c.rms_norm_eps, nrm);
  if (final_hidden.defined()) std::memcpy(final_hidden.data_as<float>() + row0 * H, nrm.data(), size_t(st.T * H) * 4);
  if (all_logits) {
    Tensor out = logits.slice(0, row0, row0 + st.T);
    ops::linear(nrm, lm_head_, out);
    return;
  }
  int64_t t = 0;
  for (const auto& pc : pieces) {  // keep the normed last row of each finished sequence
    t += pc.s.n;
    if (pc.last)
      std::memcpy(last_rows_.data_as<float>() + pc.seq * H, nrm.data_as<float>() + (t - 1) * H, size_t(H) * 4);
  }
}

void GlmModel::mtp_forward(CacheStream& stream, const int32_t* next_tokens, const Tensor& h_main, int64_t n,
                           Tensor& logits, Tensor* mtp_hidden) {
  DFLASH2_CHECK(mtp_ != nullptr, ErrorKind::Unsupported, "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  const GlmConfig& c = cfg_;
  const int64_t H = c.hidden_size;
  DFLASH2_CHECK_ARG(h_main.dtype() == DType::F32 && h_main.is_contiguous() && h_main.shape() == Tensor::Shape({n, H}),
                    "mtp: hidden_main must be F32 [", n, ", ", H, "], found ", h_main.describe());
  DFLASH2_CHECK_ARG(logits.dtype() == DType::F32 && logits.ndim() == 2 && logits.shape(0) == n &&
                        logits.shape(1) == c.vocab_size && logits.stride(1) == 1,
                    "mtp: logits must be F32 [", n, ", ", c.vocab_size, "]");
  if (mtp_hidden)
    DFLASH2_CHECK_ARG(mtp_hidden->dtype() == DType::F32 && mtp_hidden->is_contiguous() &&
                          mtp_hidden->shape() == Tensor::Shape({n, H}),
                      "mtp: mtp_hidden must be F32 [", n, ", ", H, "]");
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(next_tokens[j] >= 0 && next_tokens[j] < c.vocab_size, "token id ", next_tokens[j],
                      " is outside the vocabulary [0, ", c.vocab_size, ")");
  for (int64_t off = 0; off < n; off += opt_.max_step_tokens) {
    const int64_t T = std::min(opt_.max_step_tokens, n - off);
    ensure_capacity(stream, stream.length + T, mtp_cache_);
    Step st;
    for (int64_t j = 0; j < T; ++j) {
      st.stream.push_back(&stream);
      st.pos.push_back(int32_t(stream.length + j));
    }
    st.T = T;
    st.positions = Tensor::view(st.pos.data(), DType::I32, {T});
    st.sel_count.assign(size_t(T), -1);
    ws_->reset();
    st.b = alloc_bufs(*ws_, c, T, opt_.max_seq_len, opt_.max_batch_size, nthreads_);
    Tensor e = st.b.ao;  // free until the layer runs
    Tensor ids = Tensor::view(const_cast<int32_t*>(next_tokens + off), DType::I32, {T});
    ops::embedding(mtp_embed_, ids, e);
    Tensor cat = st.b.cat;
    Tensor cat_e = cat.slice(1, 0, H), cat_h = cat.slice(1, H, 2 * H);
    ops::rms_norm(e, mtp_enorm_, c.rms_norm_eps, cat_e);
    ops::rms_norm(h_main.slice(0, off, off + T), mtp_hnorm_, c.rms_norm_eps, cat_h);
    Tensor h = st.b.h;
    ops::linear(cat, mtp_eh_proj_, h);
    layer_forward(*mtp_, 0, mtp_cache_, st, h);
    stream.length += T;
    if (mtp_hidden) std::memcpy(mtp_hidden->data_as<float>() + off * H, h.data(), size_t(T * H) * 4);
    Tensor nrm = st.b.nrm;
    ops::rms_norm(h, mtp_head_norm_, c.rms_norm_eps, nrm);
    Tensor out = logits.slice(0, off, off + T);
    ops::linear(nrm, mtp_head_, out);
  }
}

}  // namespace dflash2::model
