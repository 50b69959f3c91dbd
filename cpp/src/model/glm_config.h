// GLM-5.x (`glm_moe_dsa`) configuration: parsed from config.json and validated, with the
// derivations transformers applies (indexer_types, mlp_layer_types).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dflash2/json.h"

namespace dflash2::model {

struct GlmConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, intermediate_size = 0, moe_intermediate_size = 0;
  int64_t num_heads = 0, q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0,
          v_head_dim = 0;
  double rope_theta = 10000.0;
  float rms_norm_eps = 1e-6f;
  int64_t index_topk = 0, index_n_heads = 0, index_head_dim = 0;
  std::vector<bool> indexer_full;  // per layer: runs its own indexer ("full") or reuses ("shared")
  std::vector<bool> moe_layer;     // per layer: MoE ("sparse") or dense MLP
  int64_t n_routed_experts = 0, n_shared_experts = 0, num_experts_per_tok = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  int64_t num_mtp_layers = 0;  // num_nextn_predict_layers
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::vector<int64_t> eos_token_ids;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t latent_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // cache entry per token per layer

  // Throws Config errors naming config.json and the field for anything unsupported or
  // inconsistent.
  static GlmConfig from_config(const Config& cfg);
};

}  // namespace dflash2::model
