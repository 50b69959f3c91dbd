#include "model/dflash_drafter.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dflash2/error.h"

namespace dflash2::model {

using ops::Weight;

namespace {
float at(const Tensor& t, int64_t i) {
  return load_as_f32(static_cast<const char*>(t.data()) + i * int64_t(t.itemsize()), t.dtype());
}
}  // namespace

struct DFlashDrafter::Layer {
  Weight q, k, v, o, gate, up, down;
  Tensor q_norm, k_norm, in_norm, post_norm;
  std::vector<float> att_base, mlp_base;  // [2 sides][2 taps][H]
  Weight att_proj, mlp_proj;              // [4G, H]
};

DFlashDrafter::~DFlashDrafter() = default;

std::unique_ptr<DFlashDrafter> DFlashDrafter::load(const Checkpoint& ck, const GlmConfig& tgt, const Tensor& embed,
                                                   const ops::Weight& lm_head, int64_t max_seq_len, int64_t max_batch) {
  DFLASH2_CHECK(ck.has_config(), ErrorKind::Config, "drafter checkpoint ", ck.path(), ": config.json is missing");
  std::unique_ptr<DFlashDrafter> d(new DFlashDrafter());
  d->cfg_ = DraftConfig::from_config(ck.config(), tgt);
  const DraftConfig& c = d->cfg_;
  d->ckpt_ = std::make_shared<Checkpoint>(ck);
  const Checkpoint& k = *d->ckpt_;
  d->embed_ = embed;
  d->lm_head_ = lm_head;
  const int64_t H = c.hidden_size, hd = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads, I = c.intermediate_size;
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
  d->fc_ = lin("fc", H, int64_t(c.target_layer_ids.size()) * H);
  d->hidden_norm_ = vec("hidden_norm.weight", H);
  d->norm_ = vec("norm.weight", H);
  const int64_t G = H / c.conv_group_size;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto L = std::make_unique<Layer>();
    const std::string p = "layers." + std::to_string(l);
    L->q = lin(p + ".self_attn.q_proj", nh * hd, H);
    L->k = lin(p + ".self_attn.k_proj", kvh * hd, H);
    L->v = lin(p + ".self_attn.v_proj", kvh * hd, H);
    L->o = lin(p + ".self_attn.o_proj", H, nh * hd);
    L->q_norm = vec(p + ".self_attn.q_norm.weight", hd);
    L->k_norm = vec(p + ".self_attn.k_norm.weight", hd);
    L->in_norm = vec(p + ".input_layernorm.weight", H);
    L->post_norm = vec(p + ".post_attention_layernorm.weight", H);
    L->gate = lin(p + ".mlp.gate_proj", I, H);
    L->up = lin(p + ".mlp.up_proj", I, H);
    L->down = lin(p + ".mlp.down_proj", H, I);
    if (c.v2) {
      for (const char* which : {"attention_conv", "mlp_conv"}) {
        Tensor b = vec(p + "." + which + ".base_kernel", 4 * H);
        std::vector<float> base;
        if (b.defined()) {
          Tensor bc = b.contiguous();
          for (int64_t i = 0; i < 4 * H; ++i) base.push_back(at(bc, i));
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
  if (c.v2) {
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
  d->kvdim_ = kvh * hd;
  d->max_seq_len_ = max_seq_len;
  d->num_blocks_ = (max_seq_len + d->kv_block_ - 1) / d->kv_block_ * max_batch;
  d->kv_ = Tensor::zeros(DType::F32, {c.num_layers, d->num_blocks_, d->kv_block_, 2 * d->kvdim_});
  d->kv_base_ = d->kv_.data_as<float>();
  for (int64_t b = d->num_blocks_ - 1; b >= 0; --b) d->free_.push_back(int32_t(b));
  return d;
}

void DFlashDrafter::ensure(DraftStream& s, int64_t len) {
  DFLASH2_CHECK_ARG(len <= max_seq_len_, "draft context of ", len, " tokens exceeds max_seq_len ", max_seq_len_);
  while (int64_t(s.blocks.size()) * kv_block_ < len) {
    DFLASH2_CHECK(!free_.empty(), ErrorKind::OutOfMemory, "draft KV cache is full");
    s.blocks.push_back(free_.back());
    free_.pop_back();
  }
}

void DFlashDrafter::rollback(DraftStream& s, int64_t length) {
  DFLASH2_CHECK_ARG(length >= 0 && length <= s.length, "draft rollback to ", length, " but the context has ", s.length);
  const int64_t keep = (length + kv_block_ - 1) / kv_block_;
  while (int64_t(s.blocks.size()) > keep) {
    free_.push_back(s.blocks.back());
    s.blocks.pop_back();
  }
  s.length = length;
}

void DFlashDrafter::append_context(DraftStream& s, const std::vector<Tensor>& taps, int64_t n) {
  const DraftConfig& c = cfg_;
  const int64_t H = c.hidden_size, nt = int64_t(c.target_layer_ids.size()), hd = c.head_dim, kvh = c.num_kv_heads;
  DFLASH2_INTERNAL(int64_t(taps.size()) == nt, "append_context: wrong number of taps");
  if (n == 0) return;
  ensure(s, s.length + n);
  Tensor cat = Tensor::empty(DType::F32, {n, nt * H});
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(cat.data_as<float>() + i * nt * H + j * H, taps[size_t(j)].data_as<float>() + i * H, size_t(H) * 4);
  Tensor f = Tensor::empty(DType::F32, {n, H}), ctx = Tensor::empty(DType::F32, {n, H});
  ops::linear(cat, fc_, f);
  ops::rms_norm(f, hidden_norm_, c.rms_norm_eps, ctx);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = int32_t(s.length + i);
  Tensor pt = Tensor::view(pos.data(), DType::I32, {n});
  Tensor kk = Tensor::empty(DType::F32, {n, kvh * hd}), vv = Tensor::empty(DType::F32, {n, kvh * hd});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = *layers_[size_t(l)];
    ops::linear(ctx, L.k, kk);
    ops::linear(ctx, L.v, vv);
    Tensor k3 = kk.reshape({n * kvh, hd});
    ops::rms_norm(k3, L.k_norm, c.rms_norm_eps, k3);
    Tensor kr = kk.reshape({n, kvh, hd});
    ops::rope(kr, pt, c.rope_theta, ops::RopeStyle::NeoX);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = s.length + i;
      float* dst = kv(l, s.blocks[size_t(p / kv_block_)], p % kv_block_);
      std::memcpy(dst, kk.data_as<float>() + i * kvdim_, size_t(kvdim_) * 4);
      std::memcpy(dst + kvdim_, vv.data_as<float>() + i * kvdim_, size_t(kvdim_) * 4);
    }
  }
  s.length += n;
}

// conv(x, base, dyn)[t, c] = sum_{o in {0,1}} (base[side][o][c] + dyn[t, side, o, c / group]) * x[t - o, c],
// with x[t - 1] = 0 at block position 0 (taps never cross a block).
void DFlashDrafter::conv(const Tensor& x, const float* base, const Tensor& dyn, int64_t side, int64_t nseq,
                         Tensor& out) const {
  const int64_t H = cfg_.hidden_size, B = cfg_.block_size, G = H / cfg_.conv_group_size, gs = cfg_.conv_group_size;
  const float* xp = x.data_as<const float>();
  const float* dp = dyn.data_as<const float>();
  float* op = out.data_as<float>();
  const float* b0 = base + (side * 2 + 0) * H;
  const float* b1 = base + (side * 2 + 1) * H;
  for (int64_t s = 0; s < nseq; ++s) {
    for (int64_t t = B - 1; t >= 0; --t) {  // backwards so out may alias x
      const int64_t r = s * B + t;
      const float* d0 = dp + r * 4 * G + (side * 2 + 0) * G;
      const float* d1 = dp + r * 4 * G + (side * 2 + 1) * G;
      for (int64_t ch = 0; ch < H; ++ch) {
        float v = (b0[ch] + d0[ch / gs]) * xp[r * H + ch];
        if (t > 0) v += (b1[ch] + d1[ch / gs]) * xp[(r - 1) * H + ch];
        op[r * H + ch] = v;
      }
    }
  }
}

void DFlashDrafter::draft(const std::vector<DraftStream*>& streams, const std::vector<int32_t>& anchors,
                          float temperature, std::vector<std::mt19937_64*> rngs, std::vector<DraftBlock>& out) {
  const DraftConfig& c = cfg_;
  const int64_t S = int64_t(streams.size()), B = c.block_size, H = c.hidden_size, T = S * B;
  const int64_t nh = c.num_heads, kvh = c.num_kv_heads, hd = c.head_dim, grp = nh / kvh, I = c.intermediate_size;
  const int64_t G = H / c.conv_group_size, V = c.vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(T)), pos(static_cast<size_t>(T));
  for (int64_t s = 0; s < S; ++s) {
    DFLASH2_CHECK_ARG(streams[size_t(s)]->length + B <= max_seq_len_, "draft block would exceed max_seq_len");
    for (int64_t t = 0; t < B; ++t) {
      ids[size_t(s * B + t)] = t == 0 ? anchors[size_t(s)] : int32_t(c.mask_token_id);
      pos[size_t(s * B + t)] = int32_t(streams[size_t(s)]->length + t);
    }
  }
  Tensor idt = Tensor::view(ids.data(), DType::I32, {T}), pt = Tensor::view(pos.data(), DType::I32, {T});
  Tensor x = Tensor::empty(DType::F32, {T, H}), y = Tensor::empty(DType::F32, {T, H});
  Tensor dyn = Tensor::empty(DType::F32, {T, 4 * G});
  Tensor q = Tensor::empty(DType::F32, {T, nh * hd}), kb = Tensor::empty(DType::F32, {T, kvh * hd}),
         vb = Tensor::empty(DType::F32, {T, kvh * hd}), att = Tensor::empty(DType::F32, {T, nh * hd});
  Tensor ob = Tensor::empty(DType::F32, {T, H}), scratch = Tensor::empty(DType::F32, {2 * T * I});
  ops::embedding(embed_, idt, x);
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = *layers_[size_t(l)];
    // attention sublayer
    ops::rms_norm(x, L.in_norm, c.rms_norm_eps, y);
    if (c.v2) {
      ops::linear(y, L.att_proj, dyn);
      conv(y, L.att_base.data(), dyn, 0, S, y);
    }
    ops::linear(y, L.q, q);
    ops::linear(y, L.k, kb);
    ops::linear(y, L.v, vb);
    Tensor q2 = q.reshape({T * nh, hd}), k2 = kb.reshape({T * kvh, hd});
    ops::rms_norm(q2, L.q_norm, c.rms_norm_eps, q2);
    ops::rms_norm(k2, L.k_norm, c.rms_norm_eps, k2);
    Tensor q3 = q.reshape({T, nh, hd}), k3 = kb.reshape({T, kvh, hd});
    ops::rope(q3, pt, c.rope_theta, ops::RopeStyle::NeoX);
    ops::rope(k3, pt, c.rope_theta, ops::RopeStyle::NeoX);
    const int64_t win = c.window[size_t(l)];
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t s = r / B, t = r % B, kh = h / grp;
        const DraftStream& st = *streams[size_t(s)];
        const int64_t i = st.length + t;  // absolute position of this query
        const int64_t c0 = win > 0 ? std::max<int64_t>(0, i - win + 1) : 0;  // keys j with i - window < j
        const int64_t nblk = c.causal ? t + 1 : B;
        const int64_t nctx = st.length - c0;
        std::vector<float> sc(static_cast<size_t>(std::max<int64_t>(nctx, 0) + nblk));
        const float* qv = q.data_as<float>() + (r * nh + h) * hd;
        float mx = -INFINITY;
        int64_t n = 0;
        for (int64_t j = c0; j < st.length; ++j, ++n) {
          const float* kvp = kv(l, st.blocks[size_t(j / kv_block_)], j % kv_block_) + kh * hd;
          float d = 0;
          for (int64_t e = 0; e < hd; ++e) d += qv[e] * kvp[e];
          sc[size_t(n)] = d * scale;
          mx = std::max(mx, sc[size_t(n)]);
        }
        for (int64_t j = 0; j < nblk; ++j, ++n) {
          const float* kp = kb.data_as<float>() + ((s * B + j) * kvh + kh) * hd;
          float d = 0;
          for (int64_t e = 0; e < hd; ++e) d += qv[e] * kp[e];
          sc[size_t(n)] = d * scale;
          mx = std::max(mx, sc[size_t(n)]);
        }
        double sum = 0;
        for (auto& v : sc) {
          v = std::exp(v - mx);
          sum += v;
        }
        float* o = att.data_as<float>() + (r * nh + h) * hd;
        std::fill(o, o + hd, 0.0f);
        n = 0;
        for (int64_t j = c0; j < st.length; ++j, ++n) {
          const float* vp = kv(l, st.blocks[size_t(j / kv_block_)], j % kv_block_) + kvdim_ + kh * hd;
          const float p = float(sc[size_t(n)] / sum);
          for (int64_t e = 0; e < hd; ++e) o[e] += p * vp[e];
        }
        for (int64_t j = 0; j < nblk; ++j, ++n) {
          const float* vp = vb.data_as<float>() + ((s * B + j) * kvh + kh) * hd;
          const float p = float(sc[size_t(n)] / sum);
          for (int64_t e = 0; e < hd; ++e) o[e] += p * vp[e];
        }
      }
    }
    ops::linear(att, L.o, ob);
    if (c.v2) conv(ob, L.att_base.data(), dyn, 1, S, ob);
    for (int64_t i = 0; i < T * H; ++i) x.data_as<float>()[i] += ob.data_as<float>()[i];
    // MLP sublayer
    ops::rms_norm(x, L.post_norm, c.rms_norm_eps, y);
    if (c.v2) {
      ops::linear(y, L.mlp_proj, dyn);
      conv(y, L.mlp_base.data(), dyn, 0, S, y);
    }
    ops::gated_mlp(y, L.gate, L.up, L.down, ob, scratch);
    if (c.v2) conv(ob, L.mlp_base.data(), dyn, 1, S, ob);
    for (int64_t i = 0; i < T * H; ++i) x.data_as<float>()[i] += ob.data_as<float>()[i];
  }
  ops::rms_norm(x, norm_, c.rms_norm_eps, y);
  // logits of block positions 1..B-1 (position i predicts the token at start + i)
  const int64_t R = S * (B - 1);
  Tensor hrows = Tensor::empty(DType::F32, {R, H});
  for (int64_t s = 0; s < S; ++s)
    std::memcpy(hrows.data_as<float>() + s * (B - 1) * H, y.data_as<float>() + (s * B + 1) * H, size_t((B - 1) * H) * 4);
  Tensor logits = Tensor::empty(DType::F32, {R, V});
  ops::linear(hrows, lm_head_, logits);
  out.assign(size_t(S), DraftBlock());
  if (!c.v2 || !use_selector_) {
    for (int64_t s = 0; s < S; ++s)
      for (int64_t t = 0; t < B - 1; ++t) {
        const float* lg = logits.data_as<float>() + (s * (B - 1) + t) * V;
        out[size_t(s)].tokens.push_back(int32_t(std::max_element(lg, lg + V) - lg));  // first max: lowest id
      }
    return;
  }
  const int64_t K = c.selector_top_k, Rk = c.selector_rank;
  Tensor vals = Tensor::empty(DType::F32, {R, K}), cand = Tensor::empty(DType::I32, {R, K});
  ops::topk(logits, K, vals, cand);
  Tensor g = Tensor::empty(DType::F32, {R, Rk});
  ops::linear(hrows, sel_proj_, g);
  std::vector<float> a(static_cast<size_t>(Rk)), score(static_cast<size_t>(K));
  for (int64_t s = 0; s < S; ++s) {
    DraftBlock& db = out[size_t(s)];
    int32_t pred = anchors[size_t(s)];
    for (int64_t t = 0; t < B - 1; ++t) {
      const int64_t r = s * (B - 1) + t;
      const float* gt = g.data_as<float>() + r * Rk;
      for (int64_t e = 0; e < Rk; ++e) a[size_t(e)] = at(pred_book_, int64_t(pred) * Rk + e) * gt[e];
      const int32_t* cd = cand.data_as<int32_t>() + r * K;
      for (int64_t b = 0; b < K; ++b) {
        float dd = 0;
        for (int64_t e = 0; e < Rk; ++e) dd += a[size_t(e)] * at(succ_book_, int64_t(cd[b]) * Rk + e);
        score[size_t(b)] = vals.data_as<float>()[r * K + b] + dd;
      }
      int64_t choice = 0;
      if (temperature <= 0.0f) {
        for (int64_t b = 1; b < K; ++b)
          if (score[size_t(b)] > score[size_t(choice)]) choice = b;
      } else {
        std::vector<float> qd(static_cast<size_t>(K));
        float mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (int64_t b = 0; b < K; ++b) sum += (qd[size_t(b)] = std::exp((score[size_t(b)] - mx) / temperature));
        for (auto& v : qd) v = float(v / sum);
        const double u = std::uniform_real_distribution<double>(0.0, 1.0)(*rngs[size_t(s)]);
        double cum = 0;
        choice = K - 1;
        for (int64_t b = 0; b < K; ++b) {
          cum += qd[size_t(b)];
          if (u < cum) {
            choice = b;
            break;
          }
        }
        db.q.push_back(qd);
      }
      db.cand.emplace_back(cd, cd + K);
      pred = cd[choice];
      db.tokens.push_back(pred);
    }
  }
}

}  // namespace dflash2::model
