// The engine: loads the target, runs batched autoregressive generation in lockstep
// (each request with its own length, sampling stream and stopping), and exposes
// step-level sequences for verification and debugging.
#include "dflash2/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "dflash2/error.h"
#include "dflash2/safetensors.h"
#include "model/dflash_drafter.h"
#include "model/glm_model.h"
#include "runtime/sampler.h"

namespace dflash2 {

using model::CacheStream;
using model::GlmModel;

struct Engine::Impl {
  EngineConfig cfg;
  std::unique_ptr<GlmModel> model;
  std::unique_ptr<model::DFlashDrafter> drafter;
  std::string config_json;
  int64_t draft_len = 0;  // draft tokens per verify step (0 for ar)
};

struct Sequence::Impl {
  GlmModel* model;
  CacheStream main, mtp;
  ~Impl() {
    model->release(main);
    if (model->has_mtp()) model->release(mtp, true);
  }
};

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Engine::Engine(const EngineConfig& cfg) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  DFLASH2_CHECK_ARG(!cfg.target.empty(), "Engine: 'target' (a checkpoint directory) is required");
  const std::string& m = cfg.method;
  DFLASH2_CHECK_ARG(m == "ar" || m == "mtp" || m == "dflash" || m == "dflash2", "Engine: unknown method '", m,
                    "' (expected 'ar', 'mtp', 'dflash' or 'dflash2')");
  DFLASH2_CHECK(cfg.device == "cpu", ErrorKind::Unsupported, "Engine: device '", cfg.device,
                "' is not supported for the model yet; the target runs on the CPU backend ('cpu')");
  if (m == "dflash" || m == "dflash2")
    DFLASH2_CHECK_ARG(!cfg.draft.empty(), "Engine: method '", m, "' needs a drafter checkpoint (draft=PATH)");
  if (cfg.num_threads > 0) omp_set_num_threads(cfg.num_threads);
  Checkpoint ck = Checkpoint::open(cfg.target);
  GlmModel::Options o;
  o.max_seq_len = cfg.max_seq_len;
  o.max_batch_size = cfg.max_batch_size;
  o.max_step_tokens = cfg.max_step_tokens;
  o.kv_block_size = cfg.kv_block_size;
  impl_->model = GlmModel::load(ck, o);
  impl_->config_json = ck.config().root().dump();
  if (m == "dflash" || m == "dflash2") {
    Checkpoint dk = Checkpoint::open(cfg.draft);
    impl_->drafter = model::DFlashDrafter::load(dk, impl_->model->config(), impl_->model->embed_tokens(),
                                                impl_->model->lm_head(), cfg.max_seq_len, cfg.max_batch_size);
    const bool v2 = impl_->drafter->config().v2;
    // dflash2 needs a DFlash 2 checkpoint; dflash runs DFlash 1 checkpoints, and DFlash 2
    // ones with their convs but the selector off (argmax per position: an ablation).
    DFLASH2_CHECK(v2 || m == "dflash", ErrorKind::Config, "Engine: method 'dflash2' but the drafter ", cfg.draft,
                  " is a DFlashDraftModel (no convs, no candidate selector): use method='dflash'");
    impl_->drafter->set_use_selector(m == "dflash2");
    impl_->draft_len = impl_->drafter->block_size() - 1;
  } else if (m == "mtp") {
    DFLASH2_CHECK(impl_->model->has_mtp(), ErrorKind::Config, "Engine: method 'mtp' but the target ", cfg.target,
                  " has no MTP layer (num_nextn_predict_layers = 0)");
    DFLASH2_CHECK_ARG(cfg.mtp_draft_tokens >= 1, "Engine: mtp_draft_tokens must be >= 1");
    impl_->draft_len = cfg.mtp_draft_tokens;
  } else {
    DFLASH2_CHECK_ARG(cfg.draft.empty(), "Engine: method 'ar' takes no drafter (draft='", cfg.draft, "')");
  }
}

Engine::~Engine() = default;

int64_t Engine::vocab_size() const { return impl_->model->config().vocab_size; }
int64_t Engine::hidden_size() const { return impl_->model->config().hidden_size; }
int64_t Engine::num_layers() const { return impl_->model->config().num_layers; }
bool Engine::has_mtp() const { return impl_->model->has_mtp(); }
const EngineConfig& Engine::config() const { return impl_->cfg; }
std::string Engine::model_config_json() const { return impl_->config_json; }
int64_t Engine::block_size() const { return impl_->draft_len + 1; }
const std::string& Engine::method() const { return impl_->cfg.method; }

Tensor Engine::logits(const std::vector<int32_t>& tokens) {
  DFLASH2_CHECK_ARG(!tokens.empty(), "logits: the token list is empty");
  auto seq = new_sequence();
  std::vector<Tensor> none;
  return seq->extend(tokens, {}, &none);
}

std::unique_ptr<Sequence> Engine::new_sequence() {
  auto impl = std::make_unique<Sequence::Impl>();
  impl->model = impl_->model.get();
  return std::unique_ptr<Sequence>(new Sequence(std::move(impl)));
}

namespace {

// Everything one request carries through the decode loop.
struct Req {
  size_t idx = 0;
  CacheStream main, mtp;
  model::DraftStream draft;
  int32_t anchor = 0;  // last emitted token: not yet in the target cache
  bool done = false;
  std::mt19937_64 rng;
  std::vector<float> mtp_logits, mtp_hidden;  // MTP: predicts the next block's first token
  std::vector<int32_t> drafted;
  model::DraftBlock block;
  int64_t committed = 0;
  std::vector<int64_t> accepted_at;
};

int32_t argmax_row(const float* x, int64_t V) { return runtime::argmax(x, V); }

// Runs the MTP layer over n positions (next tokens with the main model's final hidden
// states) and keeps what predicts the next position: its logits row and output hidden.
void mtp_extend(GlmModel& m, CacheStream& s, const int32_t* next, const Tensor& h_main, int64_t n,
                std::vector<float>& last_logits, std::vector<float>& last_hidden) {
  const int64_t V = m.config().vocab_size, H = m.config().hidden_size;
  Tensor lg = Tensor::empty(DType::F32, {n, V}), mh = Tensor::empty(DType::F32, {n, H});
  m.mtp_forward(s, next, h_main, n, lg, &mh);
  last_logits.assign(lg.data_as<float>() + (n - 1) * V, lg.data_as<float>() + n * V);
  last_hidden.assign(mh.data_as<float>() + (n - 1) * H, mh.data_as<float>() + n * H);
}

// Greedy chained MTP drafting of k tokens, starting from the layer's last prediction and
// feeding its output hidden state back as the next step's h_main (appends k-1 positions).
std::vector<int32_t> mtp_chain(GlmModel& m, CacheStream& s, const std::vector<float>& logits,
                               std::vector<float> hidden, int64_t k) {
  const int64_t V = m.config().vocab_size, H = m.config().hidden_size;
  std::vector<int32_t> out;
  if (k <= 0) return out;
  std::vector<float> lg = logits;
  out.push_back(argmax_row(lg.data(), V));
  for (int64_t j = 1; j < k; ++j) {
    Tensor hm = Tensor::view(hidden.data(), DType::F32, {1, H});
    mtp_extend(m, s, &out.back(), hm, 1, lg, hidden);
    out.push_back(argmax_row(lg.data(), V));
  }
  return out;
}

}  // namespace

std::vector<GenerationResult> Engine::generate(const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& p, const TokenCallback& on_tokens) {
  GlmModel& m = *impl_->model;
  const auto& mc = m.config();
  const int64_t V = mc.vocab_size, H = mc.hidden_size, max_len = m.options().max_seq_len;
  DFLASH2_CHECK_ARG(!prompts.empty(), "generate: no prompts given");
  DFLASH2_CHECK_ARG(p.max_new_tokens >= 1, "generate: max_new_tokens must be >= 1, found ", p.max_new_tokens);
  DFLASH2_CHECK_ARG(p.temperature >= 0.0f && std::isfinite(p.temperature), "generate: temperature must be >= 0, found ",
                    p.temperature);
  DFLASH2_CHECK_ARG(p.top_p > 0.0f && p.top_p <= 1.0f, "generate: top_p must be in (0, 1], found ", p.top_p);
  DFLASH2_CHECK_ARG(p.top_k >= 0, "generate: top_k must be >= 0 (0 = off), found ", p.top_k);
  for (size_t i = 0; i < prompts.size(); ++i) {
    DFLASH2_CHECK_ARG(!prompts[i].empty(), "generate: prompt ", i, " is empty");
    DFLASH2_CHECK_ARG(int64_t(prompts[i].size()) < max_len, "generate: prompt ", i, " has ", prompts[i].size(),
                      " tokens; max_seq_len is ", max_len, " (the prompt plus at least one generated token must fit)");
    for (size_t j = 0; j < prompts[i].size(); ++j)
      DFLASH2_CHECK_ARG(prompts[i][j] >= 0 && prompts[i][j] < V, "generate: prompt ", i, " token ", j, " = ",
                        prompts[i][j], " is outside the vocabulary [0, ", V, ")");
  }
  std::vector<int32_t> stops;
  if (p.has_stop_tokens) stops = p.stop_token_ids;
  else
    for (auto e : mc.eos_token_ids) stops.push_back(int32_t(e));
  const runtime::SamplerParams sp{p.temperature, p.top_p, p.top_k};
  const bool greedy = p.temperature <= 0.0f;
  const std::string& method = impl_->cfg.method;
  const bool use_drafter = impl_->drafter != nullptr, use_mtp = method == "mtp";
  const int64_t K = impl_->draft_len;
  std::vector<int64_t> taps;
  if (use_drafter) taps = impl_->drafter->config().target_layer_ids;

  std::vector<GenerationResult> results(prompts.size());
  std::vector<double> probs(static_cast<size_t>(V)), probs2(static_cast<size_t>(V));
  std::vector<int32_t> order(static_cast<size_t>(V));
  const int64_t wave = m.options().max_batch_size;
  for (size_t w0 = 0; w0 < prompts.size(); w0 += size_t(wave)) {
    const size_t n = std::min(prompts.size(), w0 + size_t(wave)) - w0;
    std::vector<Req> reqs(n);
    double t_prefill = 0, t_draft = 0, t_verify = 0, t_total0 = now();
    auto release_all = [&]() {
      for (auto& r : reqs) {
        m.release(r.main);
        if (use_mtp) m.release(r.mtp, true);
        if (use_drafter) impl_->drafter->release(r.draft);
      }
    };
    try {
      for (size_t i = 0; i < n; ++i) {
        reqs[i].idx = w0 + i;
        reqs[i].rng = runtime::make_rng(p.seed, int64_t(w0 + i));
        reqs[i].accepted_at.assign(size_t(K), 0);
        results[w0 + i].stats.prompt_tokens = int64_t(prompts[w0 + i].size());
      }
      // Emits accepted tokens in order; a stop token or the length budget ends the request.
      auto emit = [&](Req& r, const std::vector<int32_t>& toks) {
        GenerationResult& res = results[r.idx];
        std::vector<int32_t> sent;
        for (int32_t t : toks) {
          res.token_ids.push_back(t);
          sent.push_back(t);
          if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
            res.finish_reason = "stop";
            r.done = true;
            break;
          }
          if (int64_t(res.token_ids.size()) >= p.max_new_tokens) {
            res.finish_reason = "length";
            r.done = true;
            break;
          }
        }
        if (on_tokens && !sent.empty()) on_tokens(int64_t(r.idx), sent);
      };
      auto after_commit = [&](Req& r) {  // room for the next anchor?
        if (!r.done && r.main.length + 1 > max_len) {
          results[r.idx].finish_reason = "length";
          r.done = true;
        }
      };

      // ---------------- prefill (hidden states for the drafter's taps / the MTP layer)
      {
        double t0 = now();
        std::vector<GlmModel::StepSeq> step;
        int64_t total = 0;
        for (size_t i = 0; i < n; ++i) {
          step.push_back({&reqs[i].main, prompts[w0 + i].data(), int64_t(prompts[w0 + i].size())});
          total += int64_t(prompts[w0 + i].size());
        }
        Tensor logits = Tensor::empty(DType::F32, {int64_t(n), V});
        std::vector<Tensor> hid;
        for (size_t j = 0; j < taps.size(); ++j) hid.push_back(Tensor::empty(DType::F32, {total, H}));
        Tensor fin = use_mtp ? Tensor::empty(DType::F32, {total, H}) : Tensor();
        m.forward(step, false, logits, taps, hid, fin);
        int64_t row = 0;
        for (size_t i = 0; i < n; ++i) {
          Req& r = reqs[i];
          const int64_t np = int64_t(prompts[w0 + i].size());
          r.anchor = runtime::sample(logits.data_as<float>() + int64_t(i) * V, V, sp, r.rng, probs.data(), order.data());
          if (use_drafter) {
            std::vector<Tensor> rows;
            for (auto& h : hid) rows.push_back(h.slice(0, row, row + np));
            impl_->drafter->append_context(r.draft, rows, np);
          }
          if (use_mtp) {
            std::vector<int32_t> nxt(prompts[w0 + i].begin() + 1, prompts[w0 + i].end());
            nxt.push_back(r.anchor);
            mtp_extend(m, r.mtp, nxt.data(), fin.slice(0, row, row + np), np, r.mtp_logits, r.mtp_hidden);
          }
          row += np;
          emit(r, {r.anchor});
          after_commit(r);
        }
        t_prefill = now() - t0;
      }

      // ---------------- draft / verify / accept
      while (true) {
        std::vector<Req*> act;
        for (auto& r : reqs)
          if (!r.done) act.push_back(&r);
        if (act.empty()) break;
        // 1. draft
        double t0 = now();
        for (Req* r : act) {
          r->drafted.clear();
          r->block = model::DraftBlock();
        }
        if (use_drafter) {
          std::vector<model::DraftStream*> ds;
          std::vector<int32_t> anchors;
          std::vector<std::mt19937_64*> rngs;
          std::vector<Req*> who;
          for (Req* r : act)
            if (r->main.length + K + 1 <= max_len) {
              ds.push_back(&r->draft);
              anchors.push_back(r->anchor);
              rngs.push_back(&r->rng);
              who.push_back(r);
            }
          if (!who.empty()) {
            std::vector<model::DraftBlock> blocks;
            impl_->drafter->draft(ds, anchors, greedy ? 0.0f : p.temperature, rngs, blocks);
            for (size_t k = 0; k < who.size(); ++k) {
              who[k]->block = std::move(blocks[k]);
              who[k]->drafted = who[k]->block.tokens;
            }
          }
        } else if (use_mtp) {
          for (Req* r : act) {
            const int64_t kk = std::min<int64_t>(K, max_len - r->main.length - 1);
            r->drafted = mtp_chain(m, r->mtp, r->mtp_logits, r->mtp_hidden, kk);
          }
        }
        t_draft += now() - t0;

        // 2. verify [anchor, d_1..d_k] in one target pass
        t0 = now();
        std::vector<std::vector<int32_t>> vt(act.size());
        std::vector<GlmModel::StepSeq> step;
        int64_t total = 0;
        for (size_t k = 0; k < act.size(); ++k) {
          vt[k].push_back(act[k]->anchor);
          vt[k].insert(vt[k].end(), act[k]->drafted.begin(), act[k]->drafted.end());
          step.push_back({&act[k]->main, vt[k].data(), int64_t(vt[k].size())});
          total += int64_t(vt[k].size());
        }
        Tensor logits = Tensor::empty(DType::F32, {total, V});
        std::vector<Tensor> hid;
        for (size_t j = 0; j < taps.size(); ++j) hid.push_back(Tensor::empty(DType::F32, {total, H}));
        Tensor fin = use_mtp ? Tensor::empty(DType::F32, {total, H}) : Tensor();
        m.forward(step, true, logits, taps, hid, fin);
        t_verify += now() - t0;

        // 3. accept (greedy: longest matching prefix; sampling: lossless rejection sampling)
        int64_t row = 0;
        for (size_t k = 0; k < act.size(); ++k) {
          Req& r = *act[k];
          const int64_t kk = int64_t(r.drafted.size());
          const float* lg = logits.data_as<float>() + row * V;
          int64_t a = 0;
          int32_t bonus = 0;
          if (greedy) {
            while (a < kk && r.drafted[size_t(a)] == argmax_row(lg + a * V, V)) ++a;
            bonus = argmax_row(lg + a * V, V);
          } else {
            bool rejected = false;
            for (; a < kk; ++a) {
              runtime::sampling_probs(lg + a * V, V, sp, probs.data(), order.data());
              const int32_t d = r.drafted[size_t(a)];
              double qd = 1.0;  // one-hot proposal unless the selector recorded q
              const std::vector<int32_t>* cand = nullptr;
              const std::vector<float>* qrow = nullptr;
              if (size_t(a) < r.block.q.size()) {
                cand = &r.block.cand[size_t(a)];
                qrow = &r.block.q[size_t(a)];
                for (size_t b = 0; b < cand->size(); ++b)
                  if ((*cand)[b] == d) {
                    qd = (*qrow)[b];
                    break;
                  }
              }
              const double u = std::uniform_real_distribution<double>(0.0, 1.0)(r.rng);
              if (u * qd < probs[size_t(d)]) continue;
              // rejected: the bonus comes from normalize(max(p - q, 0)) (or p if no mass is left)
              probs2 = probs;
              if (qrow) {
                for (size_t b = 0; b < cand->size(); ++b)
                  probs2[size_t((*cand)[b])] = std::max(0.0, probs2[size_t((*cand)[b])] - double((*qrow)[b]));
              } else {
                probs2[size_t(d)] = std::max(0.0, probs2[size_t(d)] - 1.0);
              }
              double mass = 0;
              for (double v : probs2) mass += v;
              bonus = mass > 0 ? runtime::draw(probs2.data(), V, mass, r.rng) : runtime::draw(probs.data(), V, 1.0, r.rng);
              rejected = true;
              break;
            }
            if (!rejected) bonus = runtime::sample(lg + kk * V, V, sp, r.rng, probs.data(), order.data());
          }
          // 4. commit anchor + a accepted tokens; roll back the rest of the verify pass
          const int64_t L = r.main.length - (kk + 1);
          m.rollback(r.main, L + a + 1);
          if (use_drafter) {
            std::vector<Tensor> rows;
            for (auto& h : hid) rows.push_back(h.slice(0, row, row + a + 1));
            impl_->drafter->append_context(r.draft, rows, a + 1);
          }
          r.committed += a + 1;
          for (int64_t j = 0; j < a && j < K; ++j) r.accepted_at[size_t(j)] += 1;
          results[r.idx].stats.verify_steps += 1;
          std::vector<int32_t> out(r.drafted.begin(), r.drafted.begin() + a);
          out.push_back(bonus);
          emit(r, out);
          r.anchor = bonus;
          if (use_mtp && !r.done) {
            m.rollback(r.mtp, L, true);
            std::vector<int32_t> nxt(r.drafted.begin(), r.drafted.begin() + a);
            nxt.push_back(bonus);
            mtp_extend(m, r.mtp, nxt.data(), fin.slice(0, row, row + a + 1), a + 1, r.mtp_logits, r.mtp_hidden);
          }
          after_commit(r);
          row += kk + 1;
        }
      }
    } catch (...) {
      release_all();
      throw;
    }
    release_all();
    const double t_total = now() - t_total0;
    for (auto& r : reqs) {
      GenerationStats& st = results[r.idx].stats;
      st.prefill_s = t_prefill;
      st.draft_s = t_draft;
      st.verify_s = t_verify;
      st.decode_s = t_total - t_prefill;
      st.host_s = std::max(0.0, t_total - t_prefill - t_draft - t_verify);
      st.steps = st.verify_steps;
      // the first token comes from the prefill; each verify step commits r.committed / steps
      st.acceptance_length = st.verify_steps ? double(r.committed) / double(st.verify_steps) : 1.0;
      st.accepted_per_position.assign(size_t(K), 0.0);
      for (int64_t j = 0; j < K; ++j)
        st.accepted_per_position[size_t(j)] = st.verify_steps ? double(r.accepted_at[size_t(j)]) / double(st.verify_steps) : 0.0;
    }
  }
  for (auto& r : results) {
    r.stats.generated_tokens = int64_t(r.token_ids.size());
    const double t = r.stats.prefill_s + r.stats.decode_s;
    r.stats.tokens_per_second = t > 0 ? double(r.stats.generated_tokens) / t : 0.0;
  }
  return results;
}

Proposal Engine::propose(const std::vector<int32_t>& tokens) {
  GlmModel& m = *impl_->model;
  DFLASH2_CHECK(impl_->cfg.method != "ar", ErrorKind::InvalidArgument,
                "propose: method 'ar' drafts nothing; create the Engine with method 'dflash2', 'dflash' or 'mtp'");
  DFLASH2_CHECK_ARG(!tokens.empty(), "propose: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = m.config().vocab_size, H = m.config().hidden_size;
  DFLASH2_CHECK_ARG(n + impl_->draft_len + 1 <= m.options().max_seq_len, "propose: ", n, " tokens plus a block of ",
                    impl_->draft_len + 1, " exceed max_seq_len ", m.options().max_seq_len);
  Proposal out;
  CacheStream main, mtp;
  model::DraftStream ds;
  try {
    std::vector<int64_t> taps;
    if (impl_->drafter) taps = impl_->drafter->config().target_layer_ids;
    std::vector<Tensor> hid;
    for (size_t j = 0; j < taps.size(); ++j) hid.push_back(Tensor::empty(DType::F32, {n, H}));
    Tensor fin = impl_->drafter ? Tensor() : Tensor::empty(DType::F32, {n, H});
    Tensor logits = Tensor::empty(DType::F32, {1, V});
    std::vector<GlmModel::StepSeq> step{{&main, tokens.data(), n}};
    m.forward(step, false, logits, taps, hid, fin);
    out.anchor = argmax_row(logits.data_as<float>(), V);
    if (impl_->drafter) {
      impl_->drafter->append_context(ds, hid, n);
      std::vector<model::DraftBlock> blocks;
      impl_->drafter->draft({&ds}, {out.anchor}, 0.0f, {nullptr}, blocks);
      out.tokens = blocks[0].tokens;
      out.candidates = blocks[0].cand;
    } else {
      std::vector<int32_t> nxt(tokens.begin() + 1, tokens.end());
      nxt.push_back(out.anchor);
      std::vector<float> lg, hid_last;
      mtp_extend(m, mtp, nxt.data(), fin, n, lg, hid_last);
      out.tokens = mtp_chain(m, mtp, lg, hid_last, impl_->draft_len);
    }
  } catch (...) {
    m.release(main);
    if (m.has_mtp()) m.release(mtp, true);
    if (impl_->drafter) impl_->drafter->release(ds);
    throw;
  }
  m.release(main);
  if (m.has_mtp()) m.release(mtp, true);
  if (impl_->drafter) impl_->drafter->release(ds);
  return out;
}

// ------------------------------------------------------------------ Sequence
Sequence::Sequence(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sequence::~Sequence() = default;
int64_t Sequence::length() const { return impl_->main.length; }
int64_t Sequence::mtp_length() const { return impl_->mtp.length; }

Tensor Sequence::extend(const std::vector<int32_t>& tokens, const std::vector<int64_t>& hidden_layers,
                        std::vector<Tensor>* hidden, Tensor* final_hidden) {
  GlmModel& m = *impl_->model;
  DFLASH2_CHECK_ARG(!tokens.empty(), "extend: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = m.config().vocab_size, H = m.config().hidden_size;
  Tensor logits = Tensor::empty(DType::F32, {n, V});
  std::vector<Tensor> hs;
  for (size_t j = 0; j < hidden_layers.size(); ++j) hs.push_back(Tensor::empty(DType::F32, {n, H}));
  Tensor fh = final_hidden ? Tensor::empty(DType::F32, {n, H}) : Tensor();
  std::vector<GlmModel::StepSeq> step{{&impl_->main, tokens.data(), n}};
  m.forward(step, true, logits, hidden_layers, hs, fh);
  if (hidden) *hidden = hs;
  if (final_hidden) *final_hidden = fh;
  return logits;
}

void Sequence::rollback(int64_t length) { impl_->model->rollback(impl_->main, length); }
void Sequence::release() {
  impl_->model->release(impl_->main);
  if (impl_->model->has_mtp()) impl_->model->release(impl_->mtp, true);
}

Tensor Sequence::mtp_extend(const std::vector<int32_t>& next_tokens, const Tensor& hidden_main) {
  GlmModel& m = *impl_->model;
  DFLASH2_CHECK_ARG(!next_tokens.empty(), "mtp_extend: the token list is empty");
  const int64_t n = int64_t(next_tokens.size());
  Tensor logits = Tensor::empty(DType::F32, {n, m.config().vocab_size});
  Tensor hm = hidden_main.contiguous();
  m.mtp_forward(impl_->mtp, next_tokens.data(), hm, n, logits);
  return logits;
}

void Sequence::mtp_rollback(int64_t length) { impl_->model->rollback(impl_->mtp, length, true); }

}  // namespace dflash2
