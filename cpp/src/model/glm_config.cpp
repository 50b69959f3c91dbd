#include "model/glm_config.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "dflash2/error.h"

namespace dflash2::model {

namespace {
[[noreturn]] void bad(const Config& c, const std::string& field, const std::string& what) {
  fail(ErrorKind::Config, c.path(), ": field '", field, "': ", what);
}

// Sane bounds on the sizes a config may ask for: far above any real GLM-5.x value, far
// below what would make the loader allocate gigabytes (or overflow) before the weights are
// checked against them.
constexpr int64_t kMaxVocab = int64_t(1) << 24;      // GLM-5.x: 154880
constexpr int64_t kMaxHidden = int64_t(1) << 16;     // 6144
constexpr int64_t kMaxLayers = 4096;                 // 78
constexpr int64_t kMaxFfn = int64_t(1) << 20;        // 12288 / 2048 (MoE)
constexpr int64_t kMaxHeads = 4096;                  // 64
constexpr int64_t kMaxRank = int64_t(1) << 16;       // q 2048, kv 512
constexpr int64_t kMaxHeadDim = int64_t(1) << 14;    // 192 / 64 / 256
constexpr int64_t kMaxExperts = int64_t(1) << 16;    // 256
constexpr int64_t kMaxPositions = int64_t(1) << 30;  // 202752
constexpr int64_t kMaxTopk = int64_t(1) << 24;       // 2048

int64_t in_range(const Config& c, const char* field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    bad(c, field, (v < lo && lo == 1 ? "must be positive" : "is out of range") + std::string(": expected [") +
                      std::to_string(lo) + ", " + std::to_string(hi) + "], found " + std::to_string(v));
  return v;
}

double finite_in(const Config& c, const char* field, double v, double lo, double hi, bool lo_open) {
  if (!std::isfinite(v) || (lo_open ? !(v > lo) : !(v >= lo)) || !(v <= hi)) {
    std::ostringstream os;
    os << "must be a finite number in " << (lo_open ? "(" : "[") << lo << ", " << hi << "], found " << v;
    bad(c, field, os.str());
  }
  return v;
}
}  // namespace

GlmConfig GlmConfig::from_config(const Config& c) {
  GlmConfig g;
  const std::string mt = c.get_string("model_type", "");
  if (!mt.empty() && mt != "glm_moe_dsa")
    bad(c, "model_type", "unsupported model type '" + mt +
                             "': this runtime serves glm_moe_dsa (GlmMoeDsaForCausalLM) targets");
  if (mt.empty()) {  // no model_type: accept by architecture
    bool arch_ok = false;
    if (c.has("architectures"))
      for (const auto& a : c.get_string_list("architectures")) arch_ok |= (a == "GlmMoeDsaForCausalLM");
    if (!arch_ok)
      bad(c, "model_type", "unsupported model type '" + mt +
                               "': this runtime serves glm_moe_dsa (GlmMoeDsaForCausalLM) targets");
  }
  g.vocab_size = c.get_int("vocab_size");
  g.hidden_size = c.get_int("hidden_size");
  g.num_layers = c.get_int("num_hidden_layers");
  g.intermediate_size = c.get_int("intermediate_size");
  g.moe_intermediate_size = c.get_int("moe_intermediate_size");
  g.num_heads = c.get_int("num_attention_heads");
  if (!c.has("q_lora_rank") || c.find("q_lora_rank")->is_null())
    bad(c, "q_lora_rank", "null (a direct q_proj) is not supported: GLM-5.x uses a q LoRA");
  g.q_lora_rank = c.get_int("q_lora_rank");
  g.kv_lora_rank = c.get_int("kv_lora_rank");
  g.qk_nope_head_dim = c.get_int("qk_nope_head_dim");
  g.qk_rope_head_dim = c.get_int("qk_rope_head_dim");
  g.v_head_dim = c.get_int("v_head_dim");
  g.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-6));
  g.max_position_embeddings = c.get_int("max_position_embeddings", 1 << 20);
  g.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);

  // Every size is bounded before anything is derived from it (per-layer tables, caches).
  in_range(c, "vocab_size", g.vocab_size, 1, kMaxVocab);
  in_range(c, "hidden_size", g.hidden_size, 1, kMaxHidden);
  in_range(c, "num_hidden_layers", g.num_layers, 1, kMaxLayers);
  in_range(c, "intermediate_size", g.intermediate_size, 1, kMaxFfn);
  in_range(c, "num_attention_heads", g.num_heads, 1, kMaxHeads);
  in_range(c, "q_lora_rank", g.q_lora_rank, 1, kMaxRank);
  in_range(c, "kv_lora_rank", g.kv_lora_rank, 1, kMaxRank);
  in_range(c, "qk_nope_head_dim", g.qk_nope_head_dim, 1, kMaxHeadDim);
  in_range(c, "qk_rope_head_dim", g.qk_rope_head_dim, 1, kMaxHeadDim);
  in_range(c, "v_head_dim", g.v_head_dim, 1, kMaxHeadDim);
  in_range(c, "max_position_embeddings", g.max_position_embeddings, 1, kMaxPositions);
  // moe_intermediate_size may be absent-like (0) on a dense-only model; checked below for MoE
  in_range(c, "moe_intermediate_size", g.moe_intermediate_size, 0, kMaxFfn);
  finite_in(c, "rms_norm_eps", c.get_double("rms_norm_eps", 1e-6), 0.0, 1.0, false);
  if (g.qk_rope_head_dim % 2) bad(c, "qk_rope_head_dim", "must be even, found " + std::to_string(g.qk_rope_head_dim));

  // RoPE: rope_parameters {rope_theta, rope_type} (transformers 5) or a top-level rope_theta.
  Config rp = c.sub("rope_parameters");
  if (rp.root().is_object()) {
    std::string rt = rp.get_string("rope_type", "default");
    if (rt != "default")
      bad(c, "rope_parameters.rope_type", "'" + rt + "' is not supported (GLM-5.x uses plain 'default' RoPE)");
    g.rope_theta = rp.get_double("rope_theta", c.get_double("rope_theta", 10000.0));
  } else {
    if (c.has("rope_scaling") && !c.find("rope_scaling")->is_null())
      bad(c, "rope_scaling", "RoPE scaling is not supported (GLM-5.x uses plain RoPE)");
    g.rope_theta = c.get_double("rope_theta", 10000.0);
  }
  if (!(g.rope_theta > 0) || !std::isfinite(g.rope_theta))
    bad(c, "rope_theta", "must be a finite number > 0, found " + std::to_string(g.rope_theta));
  if (c.get_string("hidden_act", "silu") != "silu") bad(c, "hidden_act", "only 'silu' is supported");
  if (c.get_bool("attention_bias", false)) bad(c, "attention_bias", "true is not supported (GLM-5.x has none)");

  // DSA indexer
  g.index_topk = c.get_int("index_topk", 2048);
  g.index_n_heads = c.get_int("index_n_heads", 32);
  g.index_head_dim = c.get_int("index_head_dim", 128);
  in_range(c, "index_topk", g.index_topk, 1, kMaxTopk);
  in_range(c, "index_n_heads", g.index_n_heads, 1, kMaxHeads);
  in_range(c, "index_head_dim", g.index_head_dim, 1, kMaxHeadDim);
  if (g.index_head_dim < g.qk_rope_head_dim)
    bad(c, "index_head_dim", "must be >= qk_rope_head_dim (" + std::to_string(g.qk_rope_head_dim) + ")");
  g.indexer_full.assign(size_t(g.num_layers), true);
  if (c.has("indexer_types") && !c.find("indexer_types")->is_null()) {
    auto t = c.get_string_list("indexer_types");
    if (int64_t(t.size()) < g.num_layers)
      bad(c, "indexer_types", "has " + std::to_string(t.size()) + " entries, expected num_hidden_layers = " +
                                  std::to_string(g.num_layers));
    for (int64_t i = 0; i < g.num_layers; ++i) {
      if (t[i] != "full" && t[i] != "shared") bad(c, "indexer_types", "entry '" + t[i] + "' is not 'full' or 'shared'");
      g.indexer_full[i] = t[i] == "full";
    }
  } else if (c.has("index_topk_pattern") && !c.find("index_topk_pattern")->is_null()) {
    std::string p = c.get_string("index_topk_pattern");
    if (int64_t(p.size()) < g.num_layers) bad(c, "index_topk_pattern", "is shorter than num_hidden_layers");
    for (int64_t i = 0; i < g.num_layers; ++i) {
      if (p[i] != 'F' && p[i] != 'S') bad(c, "index_topk_pattern", "characters must be 'F' or 'S'");
      g.indexer_full[i] = p[i] == 'F';
    }
  } else {
    int64_t freq = std::max<int64_t>(c.get_int("index_topk_freq", 1), 1);
    int64_t offset = c.get_int("index_skip_topk_offset", 2);
    for (int64_t i = 0; i < g.num_layers; ++i) g.indexer_full[i] = (std::max<int64_t>(i - offset + 1, 0) % freq) == 0;
  }
  if (!g.indexer_full[0]) bad(c, "indexer_types", "layer 0 is 'shared' but no earlier layer computes a selection");

  // MLP types
  g.moe_layer.assign(size_t(g.num_layers), false);
  if (c.has("mlp_layer_types") && !c.find("mlp_layer_types")->is_null()) {
    auto t = c.get_string_list("mlp_layer_types");
    if (int64_t(t.size()) < g.num_layers) bad(c, "mlp_layer_types", "has fewer entries than num_hidden_layers");
    for (int64_t i = 0; i < g.num_layers; ++i) {
      if (t[i] != "dense" && t[i] != "sparse") bad(c, "mlp_layer_types", "entry '" + t[i] + "' is not 'dense' or 'sparse'");
      g.moe_layer[i] = t[i] == "sparse";
    }
  } else {
    int64_t k = c.get_int("first_k_dense_replace", 3);
    for (int64_t i = 0; i < g.num_layers; ++i) g.moe_layer[i] = i >= k;
  }
  bool any_moe = false;
  for (bool b : g.moe_layer) any_moe |= b;
  g.n_routed_experts = c.get_int("n_routed_experts", c.get_int("num_local_experts", 0));
  g.n_shared_experts = c.get_int("n_shared_experts", 0);
  g.num_experts_per_tok = c.get_int("num_experts_per_tok", 0);
  g.n_group = c.get_int("n_group", 1);
  g.topk_group = c.get_int("topk_group", 1);
  g.norm_topk_prob = c.get_bool("norm_topk_prob", true);
  g.routed_scaling_factor =
      float(finite_in(c, "routed_scaling_factor", c.get_double("routed_scaling_factor", 1.0), 0.0, 1e6, true));
  in_range(c, "n_routed_experts", g.n_routed_experts, 0, kMaxExperts);
  in_range(c, "n_shared_experts", g.n_shared_experts, 0, kMaxExperts);
  in_range(c, "num_experts_per_tok", g.num_experts_per_tok, 0, kMaxExperts);
  in_range(c, "n_group", g.n_group, 1, kMaxExperts);
  in_range(c, "topk_group", g.topk_group, 1, kMaxExperts);
  if (c.has("scoring_func") && c.get_string("scoring_func") != "sigmoid")
    bad(c, "scoring_func", "only 'sigmoid' router scoring is supported");
  if (c.has("topk_method") && c.get_string("topk_method") != "noaux_tc")
    bad(c, "topk_method", "only 'noaux_tc' is supported");
  if (any_moe) {
    if (g.n_routed_experts <= 0) bad(c, "n_routed_experts", "must be positive for MoE layers");
    if (g.num_experts_per_tok <= 0 || g.num_experts_per_tok > g.n_routed_experts)
      bad(c, "num_experts_per_tok", "must be in [1, n_routed_experts]");
    if (g.n_group <= 0 || g.n_routed_experts % g.n_group)
      bad(c, "n_group", "must divide n_routed_experts (" + std::to_string(g.n_routed_experts) + ")");
    if (g.topk_group <= 0 || g.topk_group > g.n_group) bad(c, "topk_group", "must be in [1, n_group]");
    if (g.topk_group * (g.n_routed_experts / g.n_group) < g.num_experts_per_tok)
      bad(c, "topk_group", "the selected groups hold fewer experts than num_experts_per_tok");
    if (g.moe_intermediate_size <= 0) bad(c, "moe_intermediate_size", "must be positive");
  }
  g.num_mtp_layers = c.get_int("num_nextn_predict_layers", 0);
  if (g.num_mtp_layers < 0 || g.num_mtp_layers > 1)
    bad(c, "num_nextn_predict_layers", "only 0 or 1 MTP layer is supported, found " + std::to_string(g.num_mtp_layers));
  // eos_token_id: null, an id, or a list of ids, each inside the vocabulary.
  if (const Json* e = c.find("eos_token_id"); e && !e->is_null()) {
    if (e->is_array()) g.eos_token_ids = c.get_int_list("eos_token_id");
    else if (e->is_number()) g.eos_token_ids.push_back(c.get_int("eos_token_id"));
    else {
      std::string found = e->dump();
      if (found.size() > 80) found = found.substr(0, 77) + "...";
      bad(c, "eos_token_id", "expected an integer token id or a list of them, found " + found + " (" +
                                 e->type_name() + ")");
    }
    for (int64_t id : g.eos_token_ids)
      if (id < 0 || id >= g.vocab_size)
        bad(c, "eos_token_id", "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                   std::to_string(g.vocab_size) + ")");
  }
  return g;
}

}  // namespace dflash2::model
