// The engine: loads the target (and a drafter), then runs batched generation in lockstep:
// plan on the host, run the target / drafter / verifier, commit the accepted tokens.
// Every step buffer is allocated here, once, at load; each request has its own length,
// sampling stream and stopping.
#include "dflash2/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "dflash2/error.h"
#include "dflash2/ops.h"
#include "dflash2/safetensors.h"
#include "model/glm_model.h"
#include "runtime/drafter.h"
#include "runtime/target.h"

namespace dflash2 {

using runtime::CacheStream;
using runtime::Method;

struct Engine::Impl {
  EngineConfig cfg;
  Method method = Method::AR;
  std::string method_str;
  std::unique_ptr<runtime::Target> target;
  std::unique_ptr<runtime::Drafter> drafter;  // null for ar
  std::string config_json;
  int64_t K = 0;  // draft tokens per verify step (0 for ar)
  std::vector<int64_t> taps;
  bool want_final = false;
  // step buffers (allocated once): logits of a verify step or of a prefill chunk's last
  // rows, the drafter's features (taps, final hidden) of a chunk or a verify step, and
  // the non-finite flags of the logits rows.
  Tensor logits, taps_buf, fin, flags;
  // sampling / acceptance plan buffers (one row per sequence of a step), filled on the host
  Tensor s_temp, s_topp, s_topk, s_rng, s_out;
  Tensor a_row0, a_draft_row, a_draft_len, a_accepted, a_bonus, no_drafts;
  // host bookkeeping reused across steps
  std::vector<std::vector<runtime::Piece>> chunks;

  void check_finite(int64_t rows, const char* what, int64_t step, const std::vector<int64_t>* row_owner) {
    Tensor lg = logits.slice(0, 0, rows), fl = flags.slice(0, 0, rows);
    ops::check_finite(lg, fl);
    const int32_t* f = fl.data_as<const int32_t>();
    for (int64_t r = 0; r < rows; ++r)
      if (f[r])
        fail(ErrorKind::Numerical, "non-finite logits (NaN or Inf) from the target in ", what,
             step >= 0 ? " at decode step " + std::to_string(step) : std::string(),
             row_owner ? ", request " + std::to_string((*row_owner)[size_t(r)]) : std::string(), ", logits row ", r,
             ": the checkpoint holds non-finite weights or its activations overflow");
  }
};

struct Sequence::Impl {
  Engine::Impl* e;
  CacheStream main, mtp;
  ~Impl() {
    e->target->cache().release(main);
    if (e->target->model().has_mtp()) e->target->mtp_cache().release(mtp);
  }
};

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The method a drafter checkpoint implies when none is given.
std::string method_of_drafter(const Checkpoint& dk) {
  const Config& c = dk.config();
  if (c.has("architectures")) {
    for (const auto& a : c.get_string_list("architectures")) {
      if (a == "DFlash2DraftModel") return "dflash2";
      if (a == "DFlashDraftModel") return "dflash";
    }
  }
  fail(ErrorKind::Config, dk.path(), ": field 'architectures': expected [\"DFlash2DraftModel\"] or [\"DFlashDraftModel\"] "
       "to infer the method; pass method= explicitly");
}
}  // namespace

Engine::Engine(const EngineConfig& cfg) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.cfg = cfg;
  DFLASH2_CHECK_ARG(!cfg.target.empty(), "Engine: 'target' (a checkpoint directory) is required");
  DFLASH2_CHECK(cfg.device == "cpu", ErrorKind::Unsupported, "Engine: device '", cfg.device,
                "' is not supported for the model yet; the target runs on the CPU backend ('cpu')");
  DFLASH2_CHECK_ARG(cfg.num_threads >= 0 && cfg.num_threads <= ops::cpu_max_threads(), "Engine: num_threads must be in [0, ",
                    ops::cpu_max_threads(), "] (0 = all ", ops::cpu_cores(), " cores), found ", cfg.num_threads);
  DFLASH2_CHECK_ARG(cfg.max_batch_size >= 1 && cfg.max_step_tokens >= 1 && cfg.kv_block_size >= 1 && cfg.max_seq_len >= 0,
                    "Engine: max_batch_size, max_step_tokens and kv_block_size must be >= 1 and max_seq_len >= 0 (0 = "
                    "the model's limit), found ", cfg.max_batch_size, ", ", cfg.max_step_tokens, ", ", cfg.kv_block_size,
                    ", ", cfg.max_seq_len);
  ops::CpuThreadScope threads(cfg.num_threads);
  // the method: given, or implied by the drafter
  std::unique_ptr<Checkpoint> dk;
  if (!cfg.draft.empty()) dk = std::make_unique<Checkpoint>(Checkpoint::open(cfg.draft));
  std::string m = cfg.method;
  if (m.empty()) m = dk ? method_of_drafter(*dk) : "ar";
  I.method = runtime::parse_method(m);
  I.method_str = m;
  I.cfg.method = m;
  if (I.method == Method::DFlash || I.method == Method::DFlash2)
    DFLASH2_CHECK_ARG(dk != nullptr, "Engine: method '", m, "' needs a drafter checkpoint (draft=PATH)");
  else
    DFLASH2_CHECK_ARG(dk == nullptr, "Engine: method '", m, "' takes no drafter (draft='", cfg.draft, "')",
                      I.method == Method::MTP ? ": it drafts with the target's own MTP layer" : "");

  Checkpoint ck = Checkpoint::open(cfg.target);
  model::GlmModel::Options mo;
  mo.max_step_tokens = cfg.max_step_tokens;
  auto model = model::GlmModel::load(ck, mo);
  const model::GlmConfig& mc = model->config();
  const int64_t max_len = cfg.max_seq_len > 0 ? cfg.max_seq_len : std::min<int64_t>(4096, mc.max_position_embeddings);
  DFLASH2_CHECK_ARG(max_len <= mc.max_position_embeddings, "Engine: max_seq_len ", max_len,
                    " exceeds the model's max_position_embeddings ", mc.max_position_embeddings);
  I.cfg.max_seq_len = max_len;
  runtime::Target::Options to;
  to.max_seq_len = max_len;
  to.max_batch_size = cfg.max_batch_size;
  to.max_step_tokens = cfg.max_step_tokens;
  to.kv_block_size = cfg.kv_block_size;
  I.target = std::make_unique<runtime::Target>(std::move(model), to);
  I.config_json = ck.config().root().dump();
  if (I.method == Method::DFlash || I.method == Method::DFlash2) {
    I.drafter = runtime::make_dflash_drafter(*dk, *I.target, I.method);
  } else if (I.method == Method::MTP) {
    I.drafter = runtime::make_mtp_drafter(*I.target, cfg.mtp_draft_tokens);
  }
  if (I.drafter) {
    I.K = I.drafter->draft_len();
    I.taps = I.drafter->tap_layers();
    I.want_final = I.drafter->wants_final_hidden();
  }
  const int64_t V = mc.vocab_size, H = mc.hidden_size, B = cfg.max_batch_size;
  const int64_t verify_rows = B * (I.K + 1);
  const int64_t feat_rows = std::max(cfg.max_step_tokens, verify_rows);
  I.logits = Tensor::empty(DType::F32, {verify_rows, V});
  I.flags = Tensor::empty(DType::I32, {verify_rows});
  if (!I.taps.empty()) I.taps_buf = Tensor::empty(DType::F32, {feat_rows, int64_t(I.taps.size()) * H});
  if (I.want_final) I.fin = Tensor::empty(DType::F32, {feat_rows, H});
  I.s_temp = Tensor::zeros(DType::F32, {B});
  I.s_topp = Tensor::zeros(DType::F32, {B});
  I.s_topk = Tensor::zeros(DType::I32, {B});
  I.s_rng = Tensor::zeros(DType::I64, {B, 2});
  I.s_out = Tensor::zeros(DType::I32, {B});
  I.a_row0 = Tensor::zeros(DType::I32, {B});
  I.a_draft_row = Tensor::zeros(DType::I32, {B});
  I.a_draft_len = Tensor::zeros(DType::I32, {B});
  I.a_accepted = Tensor::zeros(DType::I32, {B});
  I.a_bonus = Tensor::zeros(DType::I32, {B});
  I.no_drafts = Tensor::zeros(DType::I32, {B, 1});
}

Engine::~Engine() = default;

int64_t Engine::vocab_size() const { return impl_->target->config().vocab_size; }
int64_t Engine::hidden_size() const { return impl_->target->config().hidden_size; }
int64_t Engine::num_layers() const { return impl_->target->config().num_layers; }
bool Engine::has_mtp() const { return impl_->target->model().has_mtp(); }
const EngineConfig& Engine::config() const { return impl_->cfg; }
std::string Engine::model_config_json() const { return impl_->config_json; }
int64_t Engine::block_size() const { return impl_->K + 1; }
const std::string& Engine::method() const { return impl_->method_str; }

Tensor Engine::logits(const std::vector<int32_t>& tokens) {
  DFLASH2_CHECK_ARG(!tokens.empty(), "logits: the token list is empty");
  auto seq = new_sequence();
  std::vector<Tensor> none;
  return seq->extend(tokens, {}, &none);
}

std::unique_ptr<Sequence> Engine::new_sequence() {
  auto impl = std::make_unique<Sequence::Impl>();
  impl->e = impl_.get();
  return std::unique_ptr<Sequence>(new Sequence(std::move(impl)));
}

namespace {

// The Philox key of request `index` of a call with `seed` (< 0: nondeterministic).
uint64_t rng_key(int64_t seed, int64_t index) {
  uint64_t s = seed < 0 ? std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32) : uint64_t(seed);
  uint64_t z = s + 0x9e3779b97f4a7c15ull * uint64_t(index + 1);  // splitmix64 of (seed, index)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Everything one request carries through the decode loop.
struct Req {
  size_t idx = 0;
  int slot = 0;
  const std::vector<int32_t>* prompt = nullptr;
  CacheStream main;
  int32_t anchor = 0;  // last emitted token: not yet in the target cache
  bool done = false;
  uint64_t rng_key = 0, rng_counter = 0;  // the request's random stream (Philox)
  std::vector<int32_t> next;      // the tokens following the positions being committed
  std::vector<int32_t> verify;    // [anchor, drafts...] of the current step
  int64_t committed = 0;
  std::vector<int64_t> accepted_at;
};

}  // namespace

std::vector<GenerationResult> Engine::generate(const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& p, const TokenCallback& on_tokens) {
  Impl& I = *impl_;
  ops::CpuThreadScope threads(I.cfg.num_threads);
  runtime::Target& tgt = *I.target;
  const auto& mc = tgt.config();
  const int64_t V = mc.vocab_size, max_len = tgt.options().max_seq_len, K = I.K;
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
  if (p.has_stop_tokens) {
    stops = p.stop_token_ids;
    for (size_t i = 0; i < stops.size(); ++i)
      DFLASH2_CHECK_ARG(stops[i] >= 0 && stops[i] < V, "generate: stop_token_ids[", i, "] = ", stops[i],
                        " is outside the vocabulary [0, ", V, ")");
  } else {
    for (auto e : mc.eos_token_ids) stops.push_back(int32_t(e));
  }
  const bool greedy = p.temperature <= 0.0f;
  DFLASH2_CHECK_ARG(p.top_k <= INT32_MAX, "generate: top_k must fit 32 bits, found ", p.top_k);
  const ops::SamplingTensors sp_all{I.s_temp, I.s_topp, I.s_topk};
  // Writes row r of the sampling plan for request q, taking `draws` of its stream.
  auto plan_row = [&](int64_t r, Req& q, uint64_t draws) {
    I.s_temp.data_as<float>()[r] = greedy ? 0.0f : p.temperature;
    I.s_topp.data_as<float>()[r] = p.top_p;
    I.s_topk.data_as<int32_t>()[r] = int32_t(p.top_k);
    I.s_rng.data_as<int64_t>()[2 * r] = int64_t(q.rng_key);
    I.s_rng.data_as<int64_t>()[2 * r + 1] = int64_t(q.rng_counter);
    q.rng_counter += draws;
  };
  auto sampling_rows = [&](int64_t n) {
    return ops::SamplingTensors{sp_all.temperature.slice(0, 0, n), sp_all.top_p.slice(0, 0, n),
                                sp_all.top_k.slice(0, 0, n)};
  };
  runtime::Drafter* drafter = I.drafter.get();
  const int64_t step_tokens = tgt.options().max_step_tokens;

  std::vector<GenerationResult> results(prompts.size());
  const int64_t wave = tgt.options().max_batch_size;
  for (size_t w0 = 0; w0 < prompts.size(); w0 += size_t(wave)) {
    const size_t n = std::min(prompts.size(), w0 + size_t(wave)) - w0;
    std::vector<Req> reqs(n);
    double t_prefill = 0, t_draft = 0, t_verify = 0, t_total0 = now();
    auto release_all = [&]() {
      for (auto& r : reqs) {
        tgt.cache().release(r.main);
        if (drafter) drafter->release(r.slot);
      }
    };
    try {
      for (size_t i = 0; i < n; ++i) {
        reqs[i].idx = w0 + i;
        reqs[i].slot = int(i);
        reqs[i].prompt = &prompts[w0 + i];
        reqs[i].rng_key = rng_key(p.seed, int64_t(w0 + i));
        reqs[i].accepted_at.assign(size_t(K), 0);
        results[w0 + i].stats.prompt_tokens = int64_t(prompts[w0 + i].size());
      }
      // Emits accepted tokens in order; a stop token or the length budget ends the request.
      auto emit = [&](Req& r, const int32_t* toks, int64_t count) {
        GenerationResult& res = results[r.idx];
        std::vector<int32_t> sent;
        for (int64_t k = 0; k < count; ++k) {
          const int32_t t = toks[k];
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
      runtime::Features feats{I.taps_buf, I.fin};

      // ---------------- prefill, chunk by chunk; each chunk's features go to the drafter
      {
        const double t0 = now();
        std::vector<CacheStream*> streams;
        std::vector<const int32_t*> toks;
        std::vector<int64_t> counts;
        for (auto& r : reqs) {
          streams.push_back(&r.main);
          toks.push_back(r.prompt->data());
          counts.push_back(int64_t(r.prompt->size()));
        }
        runtime::make_chunks(streams, toks, counts, step_tokens, I.chunks);
        std::vector<runtime::CommitRows> commits;
        for (const auto& ch : I.chunks) {
          int64_t R = 0;
          for (const auto& pc : ch) R += pc.last ? 1 : 0;
          model::ForwardOutputs out;
          out.logits = I.logits.slice(0, 0, R);
          out.tap_layers = I.taps;
          int64_t T = 0;
          for (const auto& pc : ch) T += pc.n;
          if (I.taps_buf.defined()) out.taps = I.taps_buf.slice(0, 0, T);
          if (I.fin.defined()) out.final_hidden = I.fin.slice(0, 0, T);
          tgt.run_chunk(ch, out);
          if (R > 0) I.check_finite(R, "the prefill", -1, nullptr);
          // the first token of every prompt that ends here (one draw each)
          int64_t r = 0;
          for (const auto& pc : ch)
            if (pc.last) plan_row(r++, reqs[size_t(pc.seq)], 1);
          if (R > 0) {
            Tensor lg = I.logits.slice(0, 0, R), rng = I.s_rng.slice(0, 0, R), out = I.s_out.slice(0, 0, R);
            ops::sample(lg, sampling_rows(R), rng, out);
          }
          r = 0;
          for (const auto& pc : ch) {
            if (!pc.last) continue;
            Req& q = reqs[size_t(pc.seq)];
            q.anchor = I.s_out.data_as<const int32_t>()[r++];
            q.next.assign(q.prompt->begin() + 1, q.prompt->end());
            q.next.push_back(q.anchor);
          }
          if (drafter) {
            commits.clear();
            int64_t row = 0;
            for (const auto& pc : ch) {
              const Req& q = reqs[size_t(pc.seq)];
              runtime::CommitRows c;
              c.slot = q.slot;
              c.pos0 = pc.offset;
              c.row0 = row;
              c.n = pc.n;
              c.next = pc.last ? q.next.data() + pc.offset : q.prompt->data() + pc.offset + 1;
              commits.push_back(c);
              row += pc.n;
            }
            drafter->commit(commits, feats);
          }
          for (const auto& pc : ch) {
            if (!pc.last) continue;
            Req& q = reqs[size_t(pc.seq)];
            emit(q, &q.anchor, 1);
            after_commit(q);
          }
        }
        t_prefill = now() - t0;
      }

      // ---------------- draft / verify / accept / commit
      std::vector<Req*> act;
      std::vector<runtime::DraftJob> jobs;
      std::vector<runtime::CommitRows> commits;
      std::vector<int64_t> row_owner;
      std::vector<CacheStream*> streams;
      std::vector<const int32_t*> toks;
      std::vector<int64_t> counts;
      for (int64_t step = 0;; ++step) {
        act.clear();
        for (auto& r : reqs)
          if (!r.done) act.push_back(&r);
        if (act.empty()) break;
        // 1. draft
        double t0 = now();
        const runtime::DraftResult* dr = nullptr;
        if (drafter) {
          jobs.clear();
          for (Req* r : act) {
            runtime::DraftJob j;
            j.slot = r->slot;
            j.anchor = r->anchor;
            j.max_tokens = max_len - r->main.length - 1;
            j.temperature = greedy ? 0.0f : p.temperature;
            j.rng_key = r->rng_key;
            j.rng_counter = &r->rng_counter;
            jobs.push_back(j);
          }
          dr = &drafter->draft(jobs);
        }
        t_draft += now() - t0;

        // 2. verify [anchor, d_1..d_k] in one target pass (chunked if it exceeds max_step_tokens)
        t0 = now();
        streams.clear();
        toks.clear();
        counts.clear();
        row_owner.clear();
        for (size_t k = 0; k < act.size(); ++k) {
          Req& r = *act[k];
          r.verify.assign(1, r.anchor);
          if (dr && dr->len[k] > 0) {
            const int32_t* d = dr->tokens.data_as<const int32_t>() + dr->row[k] * dr->tokens.stride(0);
            r.verify.insert(r.verify.end(), d, d + dr->len[k]);
          }
          streams.push_back(&r.main);
          toks.push_back(r.verify.data());
          counts.push_back(int64_t(r.verify.size()));
          for (size_t j = 0; j < r.verify.size(); ++j) row_owner.push_back(int64_t(r.idx));
        }
        runtime::make_chunks(streams, toks, counts, step_tokens, I.chunks);
        int64_t row0 = 0;
        for (const auto& ch : I.chunks) {
          int64_t T = 0;
          for (const auto& pc : ch) T += pc.n;
          model::ForwardOutputs out;
          out.logits = I.logits.slice(0, row0, row0 + T);
          out.all_logits = true;
          out.tap_layers = I.taps;
          if (I.taps_buf.defined()) out.taps = I.taps_buf.slice(0, row0, row0 + T);
          if (I.fin.defined()) out.final_hidden = I.fin.slice(0, row0, row0 + T);
          tgt.run_chunk(ch, out);
          row0 += T;
        }
        I.check_finite(row0, "a decode step", step, &row_owner);
        t_verify += now() - t0;

        // 3. accept (greedy: longest matching prefix; sampling: lossless rejection sampling)
        const Tensor& drafts = dr ? dr->tokens : I.no_drafts;
        const int64_t S = int64_t(act.size());
        {
          int64_t row = 0;
          for (int64_t k = 0; k < S; ++k) {
            Req& r = *act[size_t(k)];
            const int64_t kk = int64_t(r.verify.size()) - 1;
            I.a_row0.data_as<int32_t>()[k] = int32_t(row);
            I.a_draft_row.data_as<int32_t>()[k] = dr ? int32_t(dr->row[size_t(k)]) : 0;
            I.a_draft_len.data_as<int32_t>()[k] = int32_t(kk);
            plan_row(k, r, uint64_t(drafts.shape(1) + 1));
            row += kk + 1;
          }
          Tensor lg = I.logits.slice(0, 0, row), rng = I.s_rng.slice(0, 0, S);
          Tensor acc = I.a_accepted.slice(0, 0, S), bon = I.a_bonus.slice(0, 0, S);
          const bool with_q = dr && dr->has_q;
          ops::accept(lg, I.a_row0.slice(0, 0, S), drafts, I.a_draft_row.slice(0, 0, S), I.a_draft_len.slice(0, 0, S),
                      with_q ? dr->cand : Tensor(), with_q ? dr->q : Tensor(), sampling_rows(S), rng, acc, bon);
        }
        commits.clear();
        int64_t row = 0;
        for (int64_t k = 0; k < S; ++k) {
          Req& r = *act[size_t(k)];
          const int64_t kk = int64_t(r.verify.size()) - 1;
          const int64_t a = I.a_accepted.data_as<const int32_t>()[k];
          const int32_t bonus = I.a_bonus.data_as<const int32_t>()[k];
          // 4. commit anchor + a accepted tokens; roll back the rest of the verify pass
          const int64_t L = r.main.length - (kk + 1);
          tgt.cache().truncate(r.main, L + a + 1);
          r.committed += a + 1;
          for (int64_t j = 0; j < a && j < K; ++j) r.accepted_at[size_t(j)] += 1;
          results[r.idx].stats.verify_steps += 1;
          r.next.assign(r.verify.begin() + 1, r.verify.begin() + 1 + a);
          r.next.push_back(bonus);
          emit(r, r.next.data(), int64_t(r.next.size()));
          r.anchor = bonus;
          if (drafter && !r.done) {
            runtime::CommitRows c;
            c.slot = r.slot;
            c.pos0 = L;
            c.row0 = row;
            c.n = a + 1;
            c.next = r.next.data();
            commits.push_back(c);
          }
          after_commit(r);
          row += kk + 1;
        }
        if (drafter && !commits.empty()) drafter->commit(commits, feats);
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
  Impl& I = *impl_;
  ops::CpuThreadScope threads(I.cfg.num_threads);
  runtime::Target& tgt = *I.target;
  DFLASH2_CHECK(I.drafter != nullptr, ErrorKind::InvalidArgument,
                "propose: method 'ar' drafts nothing; create the Engine with method 'dflash2', 'dflash' or 'mtp'");
  DFLASH2_CHECK_ARG(!tokens.empty(), "propose: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = tgt.config().vocab_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(tokens[size_t(j)] >= 0 && tokens[size_t(j)] < V, "propose: token ", j, " = ", tokens[size_t(j)],
                      " is outside the vocabulary [0, ", V, ")");
  DFLASH2_CHECK_ARG(n + I.K + 1 <= tgt.options().max_seq_len, "propose: ", n, " tokens plus a block of ", I.K + 1,
                    " exceed max_seq_len ", tgt.options().max_seq_len);
  Proposal out;
  CacheStream main;
  const int slot = 0;
  try {
    std::vector<CacheStream*> streams{&main};
    std::vector<const int32_t*> toks{tokens.data()};
    std::vector<int64_t> counts{n};
    runtime::make_chunks(streams, toks, counts, tgt.options().max_step_tokens, I.chunks);
    std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
    runtime::Features feats{I.taps_buf, I.fin};
    uint64_t unused = 0;
    for (const auto& ch : I.chunks) {
      const auto& pc = ch[0];
      model::ForwardOutputs fo;
      fo.logits = I.logits.slice(0, 0, pc.last ? 1 : 0);
      fo.tap_layers = I.taps;
      if (I.taps_buf.defined()) fo.taps = I.taps_buf.slice(0, 0, pc.n);
      if (I.fin.defined()) fo.final_hidden = I.fin.slice(0, 0, pc.n);
      tgt.run_chunk(ch, fo);
      if (pc.last) {
        Tensor lg = I.logits.slice(0, 0, 1), tok = I.s_out.slice(0, 0, 1);
        ops::argmax(lg, tok);
        out.anchor = I.s_out.data_as<const int32_t>()[0];
        next.push_back(out.anchor);
      }
      runtime::CommitRows c;
      c.slot = slot;
      c.pos0 = pc.offset;
      c.n = pc.n;
      c.next = next.data() + pc.offset;
      I.drafter->commit({c}, feats);
    }
    runtime::DraftJob j;
    j.slot = slot;
    j.anchor = out.anchor;
    j.max_tokens = I.K;
    j.rng_counter = &unused;
    const runtime::DraftResult& dr = I.drafter->draft({j});
    const int32_t* d = dr.tokens.data_as<const int32_t>() + dr.row[0] * dr.tokens.stride(0);
    out.tokens.assign(d, d + dr.len[0]);
    if (dr.cand.defined() && dr.len[0] > 0) {
      const int64_t Kc = dr.cand.shape(2);
      for (int64_t t = 0; t < dr.len[0]; ++t) {
        const int32_t* c = dr.cand.data_as<const int32_t>() + dr.row[0] * dr.cand.stride(0) + t * dr.cand.stride(1);
        out.candidates.emplace_back(c, c + Kc);
      }
    }
  } catch (...) {
    tgt.cache().release(main);
    I.drafter->release(slot);
    throw;
  }
  tgt.cache().release(main);
  I.drafter->release(slot);
  return out;
}

// ------------------------------------------------------------------ Sequence
Sequence::Sequence(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sequence::~Sequence() = default;
int64_t Sequence::length() const { return impl_->main.length; }
int64_t Sequence::mtp_length() const { return impl_->mtp.length; }

Tensor Sequence::extend(const std::vector<int32_t>& tokens, const std::vector<int64_t>& hidden_layers,
                        std::vector<Tensor>* hidden, Tensor* final_hidden) {
  Engine::Impl& I = *impl_->e;
  ops::CpuThreadScope threads(I.cfg.num_threads);
  runtime::Target& tgt = *I.target;
  DFLASH2_CHECK_ARG(!tokens.empty(), "extend: the token list is empty");
  const int64_t n = int64_t(tokens.size()), V = tgt.config().vocab_size, H = tgt.config().hidden_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(tokens[size_t(j)] >= 0 && tokens[size_t(j)] < V, "token id ", tokens[size_t(j)], " at position ",
                      j, " is outside the vocabulary [0, ", V, ")");
  for (auto l : hidden_layers)
    DFLASH2_CHECK_ARG(l >= 0 && l < tgt.config().num_layers, "hidden layer id ", l, " is outside [0, ",
                      tgt.config().num_layers, ")");
  DFLASH2_CHECK_ARG(impl_->main.length + n <= tgt.options().max_seq_len, "sequence of ", impl_->main.length + n,
                    " tokens exceeds max_seq_len ", tgt.options().max_seq_len);
  Tensor logits = Tensor::empty(DType::F32, {n, V});
  const int64_t nl = int64_t(hidden_layers.size());
  Tensor taps = nl ? Tensor::empty(DType::F32, {n, nl * H}) : Tensor();
  Tensor fh = final_hidden ? Tensor::empty(DType::F32, {n, H}) : Tensor();
  std::vector<CacheStream*> streams{&impl_->main};
  std::vector<const int32_t*> toks{tokens.data()};
  std::vector<int64_t> counts{n};
  std::vector<std::vector<runtime::Piece>> chunks;
  runtime::make_chunks(streams, toks, counts, tgt.options().max_step_tokens, chunks);
  int64_t row0 = 0;
  for (const auto& ch : chunks) {
    const int64_t T = ch[0].n;
    model::ForwardOutputs out;
    out.logits = logits.slice(0, row0, row0 + T);
    out.all_logits = true;
    out.tap_layers = hidden_layers;
    if (nl) out.taps = taps.slice(0, row0, row0 + T);
    if (fh.defined()) out.final_hidden = fh.slice(0, row0, row0 + T);
    tgt.run_chunk(ch, out);
    row0 += T;
  }
  if (hidden) {
    hidden->clear();
    for (int64_t j = 0; j < nl; ++j) hidden->push_back(taps.slice(1, j * H, (j + 1) * H).contiguous());
  }
  if (final_hidden) *final_hidden = fh;
  return logits;
}

void Sequence::rollback(int64_t length) { impl_->e->target->cache().truncate(impl_->main, length); }
void Sequence::release() {
  impl_->e->target->cache().release(impl_->main);
  if (impl_->e->target->model().has_mtp()) impl_->e->target->mtp_cache().release(impl_->mtp);
}

Tensor Sequence::mtp_extend(const std::vector<int32_t>& next_tokens, const Tensor& hidden_main) {
  Engine::Impl& I = *impl_->e;
  ops::CpuThreadScope threads(I.cfg.num_threads);
  runtime::Target& tgt = *I.target;
  DFLASH2_CHECK(tgt.model().has_mtp(), ErrorKind::Unsupported,
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)");
  DFLASH2_CHECK_ARG(!next_tokens.empty(), "mtp_extend: the token list is empty");
  const int64_t n = int64_t(next_tokens.size()), V = tgt.config().vocab_size, H = tgt.config().hidden_size;
  for (int64_t j = 0; j < n; ++j)
    DFLASH2_CHECK_ARG(next_tokens[size_t(j)] >= 0 && next_tokens[size_t(j)] < V, "token id ", next_tokens[size_t(j)],
                      " is outside the vocabulary [0, ", V, ")");
  DFLASH2_CHECK_ARG(hidden_main.dtype() == DType::F32 && hidden_main.shape() == Tensor::Shape({n, H}),
                    "mtp: hidden_main must be F32 [", n, ", ", H, "], found ", hidden_main.describe());
  DFLASH2_CHECK_ARG(impl_->mtp.length + n <= tgt.options().max_seq_len, "MTP sequence of ", impl_->mtp.length + n,
                    " tokens exceeds max_seq_len ", tgt.options().max_seq_len);
  Tensor hm = hidden_main.contiguous();
  Tensor logits = Tensor::empty(DType::F32, {n, V});
  // every row's logits: one piece per token so each is a "last" row
  std::vector<runtime::Piece> pieces;
  for (int64_t off = 0; off < n; off += tgt.options().max_step_tokens) {
    const int64_t T = std::min(tgt.options().max_step_tokens, n - off);
    pieces.clear();
    runtime::Piece pc;
    pc.stream = &impl_->mtp;
    pc.tokens = next_tokens.data() + off;
    pc.n = T;
    pc.last = true;
    pieces.push_back(pc);
    Tensor lg = logits.slice(0, off, off + T), none;
    tgt.mtp_chunk(pieces, hm.slice(0, off, off + T), lg, none, /*all_rows=*/true);
  }
  return logits;
}

void Sequence::mtp_rollback(int64_t length) { impl_->e->target->mtp_cache().truncate(impl_->mtp, length); }

}  // namespace dflash2
