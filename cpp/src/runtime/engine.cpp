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
#include "model/glm_model.h"
#include "runtime/sampler.h"

namespace dflash2 {

using model::CacheStream;
using model::GlmModel;

struct Engine::Impl {
  EngineConfig cfg;
  std::unique_ptr<GlmModel> model;
  std::string config_json;
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
  if (cfg.method != "ar")
    DFLASH2_CHECK(cfg.method == "dflash2" || cfg.method == "dflash" || cfg.method == "mtp", ErrorKind::InvalidArgument,
                  "Engine: unknown method '", cfg.method, "' (expected 'ar', 'mtp', 'dflash' or 'dflash2')");
  DFLASH2_CHECK(cfg.method == "ar", ErrorKind::Unsupported, "Engine: method '", cfg.method,
                "' is not implemented yet; only 'ar' (plain autoregressive decoding of the target) runs so far");
  DFLASH2_CHECK(cfg.draft.empty(), ErrorKind::Unsupported, "Engine: drafters are not implemented yet (draft='",
                cfg.draft, "')");
  DFLASH2_CHECK(cfg.device == "cpu", ErrorKind::Unsupported, "Engine: device '", cfg.device,
                "' is not supported for the model yet; the target runs on the CPU backend ('cpu')");
  if (cfg.num_threads > 0) omp_set_num_threads(cfg.num_threads);
  Checkpoint ck = Checkpoint::open(cfg.target);
  GlmModel::Options o;
  o.max_seq_len = cfg.max_seq_len;
  o.max_batch_size = cfg.max_batch_size;
  o.max_step_tokens = cfg.max_step_tokens;
  o.kv_block_size = cfg.kv_block_size;
  impl_->model = GlmModel::load(ck, o);
  impl_->config_json = ck.config().root().dump();
}

Engine::~Engine() = default;

int64_t Engine::vocab_size() const { return impl_->model->config().vocab_size; }
int64_t Engine::hidden_size() const { return impl_->model->config().hidden_size; }
int64_t Engine::num_layers() const { return impl_->model->config().num_layers; }
bool Engine::has_mtp() const { return impl_->model->has_mtp(); }
const EngineConfig& Engine::config() const { return impl_->cfg; }
std::string Engine::model_config_json() const { return impl_->config_json; }

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

std::vector<GenerationResult> Engine::generate(const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& p) {
  GlmModel& m = *impl_->model;
  const auto& mc = m.config();
  const int64_t V = mc.vocab_size;
  DFLASH2_CHECK_ARG(!prompts.empty(), "generate: no prompts given");
  DFLASH2_CHECK_ARG(p.max_new_tokens >= 1, "generate: max_new_tokens must be >= 1, found ", p.max_new_tokens);
  DFLASH2_CHECK_ARG(p.temperature >= 0.0f && std::isfinite(p.temperature), "generate: temperature must be >= 0, found ",
                    p.temperature);
  DFLASH2_CHECK_ARG(p.top_p > 0.0f && p.top_p <= 1.0f, "generate: top_p must be in (0, 1], found ", p.top_p);
  DFLASH2_CHECK_ARG(p.top_k >= 0, "generate: top_k must be >= 0 (0 = off), found ", p.top_k);
  for (size_t i = 0; i < prompts.size(); ++i) {
    DFLASH2_CHECK_ARG(!prompts[i].empty(), "generate: prompt ", i, " is empty");
    DFLASH2_CHECK_ARG(int64_t(prompts[i].size()) < m.options().max_seq_len, "generate: prompt ", i, " has ",
                      prompts[i].size(), " tokens; max_seq_len is ", m.options().max_seq_len,
                      " (the prompt plus at least one generated token must fit)");
    for (size_t j = 0; j < prompts[i].size(); ++j)
      DFLASH2_CHECK_ARG(prompts[i][j] >= 0 && prompts[i][j] < V, "generate: prompt ", i, " token ", j, " = ",
                        prompts[i][j], " is outside the vocabulary [0, ", V, ")");
  }
  std::vector<int32_t> stops;
  if (p.has_stop_tokens) stops = p.stop_token_ids;
  else
    for (auto e : mc.eos_token_ids) stops.push_back(int32_t(e));
  runtime::SamplerParams sp{p.temperature, p.top_p, p.top_k};

  std::vector<GenerationResult> results(prompts.size());
  std::vector<double> probs(static_cast<size_t>(V));
  std::vector<int32_t> order(static_cast<size_t>(V));
  const int64_t wave = m.options().max_batch_size;
  for (size_t w0 = 0; w0 < prompts.size(); w0 += size_t(wave)) {
    const size_t w1 = std::min(prompts.size(), w0 + size_t(wave));
    const size_t n = w1 - w0;
    std::vector<CacheStream> streams(n);
    std::vector<std::mt19937_64> rngs;
    for (size_t i = 0; i < n; ++i) rngs.push_back(runtime::make_rng(p.seed, int64_t(w0 + i)));
    std::vector<bool> done(n, false);
    std::vector<int32_t> next(n);
    try {
      // prefill every prompt of the wave together; last-row logits only
      double t0 = now();
      std::vector<GlmModel::StepSeq> step;
      for (size_t i = 0; i < n; ++i)
        step.push_back({&streams[i], prompts[w0 + i].data(), int64_t(prompts[w0 + i].size())});
      Tensor logits = Tensor::empty(DType::F32, {int64_t(n), V});
      std::vector<Tensor> none;
      Tensor no_final;
      m.forward(step, false, logits, {}, none, no_final);
      double t1 = now();
      auto emit = [&](size_t i, int32_t tok) {
        GenerationResult& r = results[w0 + i];
        r.token_ids.push_back(tok);
        if (std::find(stops.begin(), stops.end(), tok) != stops.end()) {
          r.finish_reason = "stop";
          done[i] = true;
        } else if (int64_t(r.token_ids.size()) >= p.max_new_tokens ||
                   streams[i].length + 1 > m.options().max_seq_len) {
          r.finish_reason = "length";
          done[i] = true;
        }
      };
      for (size_t i = 0; i < n; ++i) {
        results[w0 + i].stats.prompt_tokens = int64_t(prompts[w0 + i].size());
        results[w0 + i].stats.prefill_s = t1 - t0;
        next[i] = runtime::sample(logits.data_as<float>() + int64_t(i) * V, V, sp, rngs[i], probs.data(), order.data());
        emit(i, next[i]);
      }
      // decode in lockstep; finished requests leave the batch
      while (true) {
        std::vector<size_t> active;
        for (size_t i = 0; i < n; ++i)
          if (!done[i]) active.push_back(i);
        if (active.empty()) break;
        double s0 = now();
        step.clear();
        for (size_t i : active) step.push_back({&streams[i], &next[i], 1});
        Tensor lg = Tensor::empty(DType::F32, {int64_t(active.size()), V});
        m.forward(step, false, lg, {}, none, no_final);
        for (size_t k = 0; k < active.size(); ++k) {
          const size_t i = active[k];
          next[i] = runtime::sample(lg.data_as<float>() + int64_t(k) * V, V, sp, rngs[i], probs.data(), order.data());
          emit(i, next[i]);
        }
        double s1 = now();
        for (size_t i : active) {
          results[w0 + i].stats.decode_s += s1 - s0;
          results[w0 + i].stats.steps += 1;
        }
      }
    } catch (...) {
      for (auto& s : streams) m.release(s);
      throw;
    }
    for (auto& s : streams) m.release(s);
  }
  for (auto& r : results) {
    r.stats.generated_tokens = int64_t(r.token_ids.size());
    const double t = r.stats.prefill_s + r.stats.decode_s;
    r.stats.tokens_per_second = t > 0 ? double(r.stats.generated_tokens) / t : 0.0;
  }
  return results;
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
