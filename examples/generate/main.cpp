// Generates from a prompt with the dflash2 engine: streams tokens as they are committed
// (several per verify step with speculative methods) and prints the stats.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "dflash2/dflash2.h"

int main(int argc, char** argv) {
  dflash2::EngineConfig cfg;
  dflash2::SamplingParams sp;
  std::vector<int32_t> prompt;
  cfg.max_seq_len = 512;
  cfg.max_batch_size = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--target") cfg.target = v;
    else if (k == "--draft") cfg.draft = v;
    else if (k == "--method") cfg.method = v;
    else if (k == "--max-new-tokens") sp.max_new_tokens = std::atoll(v.c_str());
    else if (k == "--temperature") sp.temperature = float(std::atof(v.c_str()));
    else if (k == "--seed") sp.seed = std::atoll(v.c_str());
    else if (k == "--prompt-ids") {
      for (char& c : v)
        if (c == ',') c = ' ';
      std::istringstream is(v);
      int32_t t;
      while (is >> t) prompt.push_back(t);
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  sp.has_stop_tokens = true;  // no stop tokens: generate exactly max_new_tokens
  try {
    dflash2::Engine engine(cfg);
    std::printf("stream:");
    auto results = engine.generate({prompt}, sp, [](int64_t, const std::vector<int32_t>& toks) {
      for (int32_t t : toks) std::printf(" %d", t);
      std::fflush(stdout);
    });
    std::printf("\ntokens:");
    for (int32_t t : results[0].token_ids) std::printf(" %d", t);
    const auto& st = results[0].stats;
    std::printf("\nmethod %s: %lld tokens, acceptance length %.3f over %lld verify steps, %.1f tok/s\n",
                engine.method().c_str(), (long long)st.generated_tokens, st.acceptance_length,
                (long long)st.verify_steps, st.tokens_per_second);
    return 0;
  } catch (const dflash2::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
