// The DFlash drafter's configuration (DFlash 2 `DFlash2DraftModel` / DFlash 1
// `DFlashDraftModel`), parsed from its config.json and checked against the target.
#pragma once
#include <cstdint>
#include <vector>

#include "dflash2/json.h"
#include "model/glm_config.h"

namespace dflash2::model {

struct DraftConfig {
  bool v2 = true;  // DFlash2DraftModel (convs + selector) vs DFlashDraftModel
  int64_t hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 128;
  int64_t vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  int64_t block_size = 0, mask_token_id = 0;
  std::vector<int64_t> target_layer_ids;
  int64_t num_target_layers = 0;
  std::vector<int64_t> window;  // per layer: sliding window (0 = full attention)
  bool causal = false;          // causal inside the block
  int64_t conv_group_size = 16, selector_rank = 256, selector_top_k = 16;

  // Parses and checks the drafter against the target (hidden size, vocabulary, mask id,
  // target_layer_ids, num_target_layers); Config errors name the file and the field.
  static DraftConfig from_config(const Config& cfg, const GlmConfig& target);
};

}  // namespace dflash2::model
