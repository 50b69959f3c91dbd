// The C++ request API on the bundled default pair: submit / poll / cancel from several
// threads (continuous batching), outputs equal to a request run alone, cancellation
// freeing the slot, close() with requests in flight, errors for bad requests.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dflash2/dflash2.h"
#include "testing.h"

using namespace dflash2;

namespace {
const std::string kPair = std::string(DFLASH2_SOURCE_DIR) + "/python/dflash2_rt/models/default";

void skip(const char* test, const char* why) { std::printf("  %s: skipped: %s\n", test, why); }

bool have_pair() {
  FILE* f = std::fopen((kPair + "/target/config.json").c_str(), "r");
  if (!f) return false;
  std::fclose(f);
  return true;
}

EngineConfig config(const std::string& method, const std::string& speculation = "fixed") {
  EngineConfig c;
  c.target = kPair + "/target";
  if (method == "dflash2") c.draft = kPair + "/draft";
  c.method = method;
  c.max_batch_size = 3;
  c.max_seq_len = 256;
  c.speculation = speculation;
  return c;
}

std::vector<int32_t> prompt(int i) {
  std::vector<int32_t> p;
  for (int j = 0; j < 5 + (i * 7) % 23; ++j) p.push_back((i * 31 + j * 17) % 4000 + 2);
  return p;
}

std::vector<int32_t> run(Engine& e, RequestId id) {
  std::vector<int32_t> got;
  while (true) {
    auto ups = e.poll({id}, -1.0);
    for (auto& u : ups) {
      got.insert(got.end(), u.new_tokens.begin(), u.new_tokens.end());
      if (u.finished) return got;
    }
  }
}
}  // namespace

TEST(threads_get_their_alone_outputs) {
  if (!have_pair()) return skip("threads", "the bundled default pair is not present");
  for (const char* spec : {"fixed", "adaptive"}) {
    Engine e(config("dflash2", spec));
    SamplingParams p;
    p.max_new_tokens = 16;
    p.has_stop_tokens = true;  // no stop tokens
    std::vector<std::vector<int32_t>> alone;
    for (int i = 0; i < 8; ++i) alone.push_back(e.generate({prompt(i)}, p)[0].token_ids);
    std::vector<std::vector<int32_t>> got(8);
    std::vector<std::thread> ts;
    for (int i = 0; i < 8; ++i)
      ts.emplace_back([&, i] { got[size_t(i)] = run(e, e.submit(prompt(i), p)); });
    for (auto& t : ts) t.join();
    for (int i = 0; i < 8; ++i) CHECK(got[size_t(i)] == alone[size_t(i)]);
    EngineMetrics m = e.metrics();
    CHECK(m.running == 0 && m.queue_length == 0 && m.requests_finished == m.requests_total);
  }
}

TEST(cancel_frees_the_slot_and_close_ends_everything) {
  if (!have_pair()) return skip("cancel", "the bundled default pair is not present");
  EngineConfig c = config("ar");
  c.max_seq_len = 2048;
  Engine e(c);
  SamplingParams p;
  p.max_new_tokens = 1800;
  p.has_stop_tokens = true;
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(e.submit(prompt(i), p));  // fills the 3 slots
  SamplingParams wp = p;
  wp.max_new_tokens = 40;
  const RequestId waiting = e.submit(prompt(3), wp);                     // waits for one
  auto first = e.poll({ids[0]}, -1.0);
  CHECK(!first.empty() && !first[0].new_tokens.empty());
  e.cancel(ids[0]);  // frees a slot: the waiting request is admitted and finishes
  SamplingParams shortp = p;
  shortp.max_new_tokens = 5;
  std::vector<int32_t> w = run(e, waiting);
  CHECK(int64_t(w.size()) == wp.max_new_tokens);
  bool threw = false;
  try {
    e.poll({ids[0]}, 0.0);  // cancelled: forgotten
  } catch (const Error& err) {
    threw = err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(threw);
  e.close();  // ids[1], ids[2] still run: they end as cancelled
  for (RequestId id : {ids[1], ids[2]}) {
    bool finished = false;
    while (!finished)
      for (auto& u : e.poll({id}, -1.0))
        if (u.finished) {
          finished = true;
          CHECK(u.result.finish_reason == "cancelled");
        }
  }
  threw = false;
  try {
    e.submit(prompt(0), shortp);
  } catch (const Error& err) {
    threw = err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(threw);
}

// A poll sleeps until one of *its* requests has news (each poll waits on a variable of its
// own, woken by those requests' tokens or end): a poll over several ids wakes for any of
// them, pollers of different requests are woken by their own, and close() wakes a poll
// waiting without a timeout on a request still running.
TEST(polls_wake_for_their_own_requests) {
  if (!have_pair()) return skip("polls", "the bundled default pair is not present");
  EngineConfig c = config("ar");
  c.max_seq_len = 2048;
  Engine e(c);
  SamplingParams p;
  p.has_stop_tokens = true;
  p.max_new_tokens = 24;
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < 3; ++i) alone.push_back(e.generate({prompt(i)}, p)[0].token_ids);
  const RequestId a = e.submit(prompt(0), p), b = e.submit(prompt(1), p);
  std::vector<int32_t> got_a, got_b, got_c;
  std::thread both([&] {  // one poll over two requests, no timeout, until both end
    std::vector<RequestId> open{a, b};
    while (!open.empty())
      for (auto& u : e.poll(open, -1.0)) {
        (u.id == a ? got_a : got_b).insert((u.id == a ? got_a : got_b).end(), u.new_tokens.begin(),
                                           u.new_tokens.end());
        if (u.finished) open.erase(std::find(open.begin(), open.end(), u.id));
      }
  });
  std::thread one([&] { got_c = run(e, e.submit(prompt(2), p)); });
  both.join();
  one.join();
  CHECK(got_a == alone[0]);
  CHECK(got_b == alone[1]);
  CHECK(got_c == alone[2]);
  // close() while a poll waits (no timeout) on a request that would run for long
  SamplingParams longp = p;
  longp.max_new_tokens = 1800;
  const RequestId l = e.submit(prompt(3), longp);
  std::atomic<bool> ended{false};
  std::string reason;
  std::thread waiter([&] {
    while (!ended)
      for (auto& u : e.poll({l}, -1.0))
        if (u.finished) {
          reason = u.result.finish_reason;
          ended = true;
        }
  });
  e.close();
  waiter.join();
  CHECK(ended && reason == "cancelled");
}

// Chunked prefill between decode steps: while a request decodes, a newcomer's 100-token
// prompt runs 16 tokens a round (prefill_tokens_per_step), so it takes 7 rounds; with 0 it
// runs whole (1 round); the outputs are the requests' alone outputs either way.
TEST(prompts_prefill_between_decode_steps) {
  if (!have_pair()) return skip("prefill rounds", "the bundled default pair is not present");
  std::vector<int32_t> long_prompt;
  for (int j = 0; j < 100; ++j) long_prompt.push_back((j * 37) % 3000 + 2);
  for (int64_t budget : {int64_t(16), int64_t(0)}) {
    EngineConfig c = config("dflash2");
    c.max_step_tokens = 32;
    c.prefill_tokens_per_step = budget;
    c.prefix_caching = false;  // the alone run below would cache the long prompt's blocks
    Engine e(c);
    CHECK(e.config().prefill_tokens_per_step == budget);
    SamplingParams p;
    p.max_new_tokens = 200;
    p.has_stop_tokens = true;
    SamplingParams q = p;
    q.max_new_tokens = 6;
    const std::vector<int32_t> alone_first = e.generate({prompt(1)}, p)[0].token_ids;
    const std::vector<int32_t> alone_long = e.generate({long_prompt}, q)[0].token_ids;
    const RequestId first = e.submit(prompt(1), p);
    std::vector<int32_t> got;
    while (got.empty())
      for (auto& u : e.poll({first}, -1.0)) got.insert(got.end(), u.new_tokens.begin(), u.new_tokens.end());
    const RequestId second = e.submit(long_prompt, q);
    GenerationResult res;
    for (bool done = false; !done;)
      for (auto& u : e.poll({second}, -1.0))
        if (u.finished) {
          done = true;
          res = u.result;
        }
    CHECK(res.token_ids == alone_long);
    CHECK(res.stats.prefill_rounds == (budget ? 7 : 1));
    std::vector<int32_t> rest = run(e, first);
    got.insert(got.end(), rest.begin(), rest.end());
    CHECK(got == alone_first);
    const EngineMetrics m = e.metrics();
    CHECK(m.running == 0 && m.prefilling == 0 && m.cache_pages_used == 0);
  }
  EngineConfig bad = config("ar");
  bad.prefill_tokens_per_step = -2;
  bool threw = false;
  try {
    Engine e(bad);
  } catch (const Error& err) {
    threw = err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(threw);
}

// Automatic prefix caching: a prompt that starts with a prompt that ran takes its full
// blocks (cached_tokens), every output equals the engine's without the cache; with too few
// cache blocks for everything, the least recently used entries are evicted.
TEST(prefix_cache_takes_earlier_prompts_blocks) {
  if (!have_pair()) return skip("prefix cache", "the bundled default pair is not present");
  std::vector<int32_t> system;
  for (int j = 0; j < 70; ++j) system.push_back((j * 41) % 3000 + 2);
  for (const char* method : {"dflash2", "ar"}) {
    EngineConfig c = config(method);
    c.max_seq_len = 128;
    c.max_batch_size = 2;
    EngineConfig off = c;
    off.prefix_caching = false;
    Engine e(c), ref(off);
    CHECK(e.config().prefix_caching && !ref.config().prefix_caching);
    SamplingParams p;
    p.max_new_tokens = 12;
    p.has_stop_tokens = true;
    for (int k = 0; k < 6; ++k) {
      std::vector<int32_t> prompt_k = system;
      for (int j = 0; j <= k; ++j) prompt_k.push_back(7 + j + k);
      GenerationResult got = e.generate({prompt_k}, p)[0], want = ref.generate({prompt_k}, p)[0];
      CHECK(got.token_ids == want.token_ids);
      CHECK(want.stats.cached_tokens == 0);
      CHECK(got.stats.cached_tokens == (k == 0 ? 0 : 64));  // 4 blocks of 16 (the 70th token runs)
    }
    EngineMetrics m = e.metrics();
    CHECK(m.prefix_cache_hit_tokens == 5 * 64 && m.prefix_cache_pages >= 4 && m.cache_pages_used == 0);
    // distinct prompts until the cache must evict: outputs still equal, every page free again
    for (int k = 0; k < 12; ++k) {
      std::vector<int32_t> q;
      for (int j = 0; j < 90; ++j) q.push_back((j * 13 + k * 101) % 3000 + 2);
      CHECK(e.generate({q}, p)[0].token_ids == ref.generate({q}, p)[0].token_ids);
    }
    m = e.metrics();
    CHECK(m.prefix_cache_evictions > 0 && m.cache_pages_used == 0 && m.running == 0);
  }
}

TEST(logprobs_come_with_the_tokens) {
  if (!have_pair()) return skip("logprobs", "the bundled default pair is not present");
  Engine e(config("dflash2"));
  SamplingParams p;
  p.max_new_tokens = 20;
  p.has_stop_tokens = true;
  const std::vector<int32_t> q = prompt(3);
  const GenerationResult plain = e.generate({q}, p)[0];
  CHECK(plain.logprobs.empty());
  p.logprobs = 4;
  const RequestId id = e.submit(q, p);
  std::vector<int32_t> toks;
  std::vector<TokenLogprobs> lps;
  GenerationResult res;
  for (bool done = false; !done;)
    for (auto& u : e.poll({id}, -1.0)) {
      CHECK(u.new_logprobs.size() == u.new_tokens.size());
      toks.insert(toks.end(), u.new_tokens.begin(), u.new_tokens.end());
      lps.insert(lps.end(), u.new_logprobs.begin(), u.new_logprobs.end());
      if (u.finished) {
        res = u.result;
        done = true;
      }
    }
  CHECK(toks == plain.token_ids && res.logprobs.size() == toks.size() && lps.size() == toks.size());
  // against the teacher-forced logits of the same tokens (greedy: each token the most likely)
  std::vector<int32_t> all = q;
  all.insert(all.end(), toks.begin(), toks.end() - 1);
  const Tensor lg = e.logits(all);
  const int64_t V = lg.shape(1);
  for (size_t j = 0; j < toks.size(); ++j) {
    const float* row = lg.data_as<const float>() + (int64_t(q.size()) - 1 + int64_t(j)) * V;
    double m = row[0], s = 0.0;
    for (int64_t i = 0; i < V; ++i) m = std::max(m, double(row[i]));
    for (int64_t i = 0; i < V; ++i) s += std::exp(double(row[i]) - m);
    const double lse = m + std::log(s);
    CHECK(std::fabs(lps[j].logprob - (double(row[toks[j]]) - lse)) < 1e-4);
    CHECK(lps[j].top_ids.size() == 4 && lps[j].top_ids[0] == toks[j] && lps[j].top_logprobs[0] == lps[j].logprob);
    CHECK(std::fabs(lps[j].top_logprobs[3] - (double(row[lps[j].top_ids[3]]) - lse)) < 1e-4);
    CHECK(res.logprobs[j].logprob == lps[j].logprob);
  }
  p.logprobs = kMaxLogprobs + 1;
  bool caught = false;
  try {
    e.submit(q, p);
  } catch (const Error& err) {
    caught = err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(caught);
}

TEST(repetition_control_through_the_cpp_api) {
  if (!have_pair()) return skip("repetition_control", "the bundled default pair is not present");
  Engine spec(config("dflash2")), ar(config("ar"));
  SamplingParams p;
  p.max_new_tokens = 24;
  p.has_stop_tokens = true;  // none
  const std::vector<int32_t> q = prompt(5);
  const GenerationResult plain = spec.generate({q}, p)[0];
  // a forced token: every token, and the drafter drafts under the bias (whole blocks accepted)
  SamplingParams f = p;
  f.logit_bias = {{77, 100.0f}};
  const GenerationResult forced = spec.generate({q}, f)[0];
  CHECK(forced.token_ids == std::vector<int32_t>(24, 77));
  CHECK(forced.stats.acceptance_length > 6.0);
  // penalties: speculative == ar under the same controls, and different from plain
  SamplingParams r = p;
  r.repetition_penalty = 1.3f;
  r.frequency_penalty = 0.4f;
  r.presence_penalty = 0.2f;
  const GenerationResult a = spec.generate({q}, r)[0], b = ar.generate({q}, r)[0];
  CHECK(a.token_ids == b.token_ids && a.token_ids != plain.token_ids);
  // min_tokens: a stop token that plain decoding emits second is held back for 10 tokens
  SamplingParams m = p;
  m.stop_token_ids = {plain.token_ids[1]};
  CHECK(spec.generate({q}, m)[0].token_ids.size() == 2);
  m.min_tokens = 10;
  const GenerationResult late = spec.generate({q}, m)[0];
  CHECK(late.token_ids.size() >= 10 && late.token_ids == ar.generate({q}, m)[0].token_ids);
  for (int64_t j = 0; j < 10; ++j) CHECK(late.token_ids[size_t(j)] != plain.token_ids[1]);
  int caught = 0;
  for (int k = 0; k < 3; ++k) {
    SamplingParams bad = p;
    if (k == 0) bad.presence_penalty = 2.5f;
    if (k == 1) bad.min_tokens = 25;
    if (k == 2) bad.logit_bias = {{-1, 1.0f}};
    try {
      spec.submit(q, bad);
    } catch (const Error& err) {
      caught += err.kind() == ErrorKind::InvalidArgument;
    }
  }
  CHECK(caught == 3);
}

// A C++ TokenConstraint: after token a, tokens t with (5 t + a) % 3 == 0 are banned; done after
// `stop` tokens; records what was committed.
struct ModThree final : TokenConstraint {
  int64_t V, stop;
  int32_t last = 1;
  std::vector<int32_t> seen;
  ModThree(int64_t v, int64_t s) : V(v), stop(s) {}
  static bool banned(int32_t t, int32_t a) { return (5 * int64_t(t) + int64_t(a)) % 3 == 0; }
  void row(int32_t a, uint32_t* out, int64_t words) const {
    std::fill(out, out + words, 0u);
    for (int64_t t = 0; t < V; ++t)
      if (!banned(int32_t(t), a)) out[t >> 5] |= 1u << (t & 31);
  }
  int64_t masks(const int32_t* d, int64_t n, uint32_t* rows, int64_t words) override {
    int32_t a = last;
    row(a, rows, words);
    for (int64_t j = 0; j < n; ++j) {
      if (banned(d[j], a)) return j + 1;
      a = d[j];
      row(a, rows + (j + 1) * words, words);
    }
    return n + 1;
  }
  // greedy drafts: the drafter's where allowed, else the first allowed candidate
  int64_t steers = 0;
  int64_t steer(const int32_t* cand, int64_t n, int64_t C, int32_t* d) override {
    ++steers;
    int32_t a = last;
    for (int64_t j = 0; j < n; ++j) {
      if (banned(d[j], a)) {
        int64_t c = 0;
        while (c < C && banned(cand[j * C + c], a)) ++c;
        if (c == C) return j;
        d[j] = cand[j * C + c];
      }
      a = d[j];
    }
    return n;
  }
  void commit(const int32_t* t, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      if (banned(t[i], last)) throw Error(ErrorKind::Internal, "a banned token was committed");
      last = t[i];
      seen.push_back(t[i]);
    }
  }
  bool done() override { return int64_t(seen.size()) >= stop; }
};

TEST(token_constraint_through_the_cpp_api) {
  if (!have_pair()) return skip("token_constraint", "the bundled default pair is not present");
  Engine spec(config("dflash2")), ar(config("ar"));
  SamplingParams p;
  p.max_new_tokens = 24;
  p.has_stop_tokens = true;  // none
  const std::vector<int32_t> q = prompt(5);
  const GenerationResult plain = spec.generate({q}, p)[0];
  const int64_t V = 4096;
  std::vector<int32_t> outs[2];
  for (int k = 0; k < 2; ++k) {
    SamplingParams c = p;
    auto mf = std::make_shared<ModThree>(V, 1000);
    c.constraint = mf;
    const GenerationResult g = (k == 0 ? spec : ar).generate({q}, c)[0];
    outs[k] = g.token_ids;
    CHECK(mf->seen == g.token_ids && g.finish_reason == "length");
    CHECK((mf->steers > 0) == (k == 0));  // dflash2's selector candidates are steered; ar drafts nothing
    int32_t a = 1;
    for (int32_t t : g.token_ids) {
      CHECK(!ModThree::banned(t, a));
      a = t;
    }
  }
  CHECK(outs[0] == outs[1] && outs[0] != plain.token_ids);
  // done() ends the request ("stop")
  SamplingParams d = p;
  d.constraint = std::make_shared<ModThree>(V, 5);
  const GenerationResult five = spec.generate({q}, d)[0];
  CHECK(five.token_ids.size() == 5 && five.finish_reason == "stop" &&
        std::vector<int32_t>(outs[0].begin(), outs[0].begin() + 5) == five.token_ids);
  // one constraint cannot serve several prompts
  bool caught = false;
  try {
    spec.generate({q, q}, d);
  } catch (const Error& err) {
    caught = err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(caught);
}

TEST(bad_requests_throw_at_submit) {
  if (!have_pair()) return skip("bad_requests", "the bundled default pair is not present");
  Engine e(config("ar"));
  SamplingParams p;
  int caught = 0;
  for (auto bad : {std::vector<int32_t>{}, std::vector<int32_t>{-1}, std::vector<int32_t>{1 << 30}}) {
    try {
      e.submit(bad, p);
    } catch (const Error& err) {
      caught += err.kind() == ErrorKind::InvalidArgument;
    }
  }
  p.top_p = 0.0f;
  try {
    e.submit({1, 2}, p);
  } catch (const Error& err) {
    caught += err.kind() == ErrorKind::InvalidArgument;
  }
  CHECK(caught == 4);
}

TEST_MAIN()
