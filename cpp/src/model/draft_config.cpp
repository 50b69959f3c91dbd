#include "model/draft_config.h"

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

// Sane bounds (far above any real drafter, far below what would allocate gigabytes or
// overflow before the weights are checked against them).
constexpr int64_t kMaxVocab = int64_t(1) << 24;
constexpr int64_t kMaxHidden = int64_t(1) << 16;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxFfn = int64_t(1) << 20;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxHeadDim = int64_t(1) << 14;
constexpr int64_t kMaxBlock = 64;
constexpr int64_t kMaxSelectorRank = int64_t(1) << 16;
constexpr int64_t kMaxSelectorTopK = 4096;
constexpr int64_t kMaxWindow = int64_t(1) << 30;

int64_t in_range(const Config& c, const std::string& field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    bad(c, field, (v < lo && lo == 1 ? "must be positive" : "is out of range") + std::string(": expected [") +
                      std::to_string(lo) + ", " + std::to_string(hi) + "], found " + std::to_string(v));
  return v;
}

double finite_in(const Config& c, const std::string& field, double v, double lo, double hi, bool lo_open) {
  if (!std::isfinite(v) || (lo_open ? !(v > lo) : !(v >= lo)) || !(v <= hi)) {
    std::ostringstream os;
    os << "must be a finite number in " << (lo_open ? "(" : "[") << lo << ", " << hi << "], found " << v;
    bad(c, field, os.str());
  }
  return v;
}

// The default tap layers when a config has none (the published DFlash rule).
std::vector<int64_t> default_taps(int64_t num_target_layers, int64_t num_draft_layers) {
  if (num_draft_layers == 1) return {num_target_layers / 2};
  std::vector<int64_t> ids;
  const double start = 1, end = double(num_target_layers - 3), span = end - start;
  for (int64_t i = 0; i < num_draft_layers; ++i)
    ids.push_back(int64_t(std::lround(start + double(i) * span / double(num_draft_layers - 1))));
  return ids;
}

}  // namespace

// Causality and the sliding window are decided here and nowhere else.
DraftConfig DraftConfig::from_config(const Config& c, const GlmConfig& tgt) {
  DraftConfig d;
  std::vector<std::string> arch = c.has("architectures") ? c.get_string_list("architectures") : std::vector<std::string>{};
  if (std::find(arch.begin(), arch.end(), "DFlash2DraftModel") != arch.end()) d.v2 = true;
  else if (std::find(arch.begin(), arch.end(), "DFlashDraftModel") != arch.end()) d.v2 = false;
  else
    bad(c, "architectures", "expected [\"DFlash2DraftModel\"] or [\"DFlashDraftModel\"], found " +
                                (c.has("architectures") ? c.find("architectures")->dump() : std::string("nothing")));
  Config dc = c.sub("dflash_config");
  auto pick_int = [&](const std::string& k, int64_t def, bool required) -> int64_t {
    if (dc.root().is_object() && dc.has(k)) return dc.get_int(k);
    if (c.has(k)) return c.get_int(k);
    if (required) bad(c, "dflash_config." + k, "is required");
    return def;
  };
  d.hidden_size = c.get_int("hidden_size");
  d.intermediate_size = c.get_int("intermediate_size");
  d.num_layers = c.get_int("num_hidden_layers");
  d.num_heads = c.get_int("num_attention_heads");
  d.num_kv_heads = c.get_int("num_key_value_heads", d.num_heads);
  d.head_dim = c.has("head_dim") && !c.find("head_dim")->is_null() ? c.get_int("head_dim") : 128;
  d.vocab_size = c.get_int("vocab_size");
  d.rms_norm_eps = float(finite_in(c, "rms_norm_eps", c.get_double("rms_norm_eps", 1e-6), 0.0, 1.0, false));
  Config rp = c.sub("rope_parameters");
  d.rope_theta = c.get_double("rope_theta", rp.root().is_object() ? rp.get_double("rope_theta", 10000.0) : 10000.0);
  finite_in(c, "rope_theta", d.rope_theta, 0.0, 1e300, true);
  d.block_size = pick_int("block_size", 0, true);
  d.mask_token_id = pick_int("mask_token_id", 0, true);
  // Every size is bounded before anything is derived from it (tap lists, per-layer tables).
  in_range(c, "hidden_size", d.hidden_size, 1, kMaxHidden);
  in_range(c, "intermediate_size", d.intermediate_size, 1, kMaxFfn);
  in_range(c, "num_hidden_layers", d.num_layers, 1, kMaxLayers);
  in_range(c, "num_attention_heads", d.num_heads, 1, kMaxHeads);
  in_range(c, "num_key_value_heads", d.num_kv_heads, 1, kMaxHeads);
  in_range(c, "head_dim", d.head_dim, 1, kMaxHeadDim);
  in_range(c, "vocab_size", d.vocab_size, 1, kMaxVocab);
  in_range(c, "dflash_config.block_size", d.block_size, 2, kMaxBlock);
  if (dc.root().is_object() && dc.has("target_layer_ids")) d.target_layer_ids = dc.get_int_list("target_layer_ids");
  else if (c.has("target_layer_ids")) d.target_layer_ids = c.get_int_list("target_layer_ids");
  d.num_target_layers = c.get_int("num_target_layers", tgt.num_layers);
  in_range(c, "num_target_layers", d.num_target_layers, 1, kMaxLayers);
  if (d.target_layer_ids.size() > size_t(kMaxLayers))
    bad(c, "dflash_config.target_layer_ids", "has " + std::to_string(d.target_layer_ids.size()) +
                                                 " entries, more than " + std::to_string(kMaxLayers));
  if (d.target_layer_ids.empty()) d.target_layer_ids = default_taps(d.num_target_layers, d.num_layers);
  // causality: dflash_config.causal, else top-level is_causal, else non-causal
  if (dc.root().is_object() && dc.has("causal")) d.causal = dc.get_bool("causal", false);
  else d.causal = c.get_bool("is_causal", false);
  // sliding window: layer_types[i] == "sliding_attention" with use_sliding_window and a window
  d.window.assign(size_t(d.num_layers), 0);
  const bool use_sw = c.get_bool("use_sliding_window", false);
  const Json* swj = c.find("sliding_window");
  const int64_t sw = swj && !swj->is_null() ? in_range(c, "sliding_window", c.get_int("sliding_window"), 0, kMaxWindow) : 0;
  if (c.has("layer_types") && !c.find("layer_types")->is_null()) {
    auto lt = c.get_string_list("layer_types");
    if (int64_t(lt.size()) < d.num_layers) bad(c, "layer_types", "has fewer entries than num_hidden_layers");
    for (int64_t i = 0; i < d.num_layers; ++i) {
      if (lt[i] != "sliding_attention" && lt[i] != "full_attention")
        bad(c, "layer_types", "entry '" + lt[i] + "' is not 'sliding_attention' or 'full_attention'");
      if (lt[i] == "sliding_attention" && use_sw && sw > 0) d.window[size_t(i)] = sw;
    }
  }
  if (d.v2) {
    if (dc.root().is_object()) {
      if (dc.get_int("conv_kernel_size", 2) != 2) bad(c, "dflash_config.conv_kernel_size", "only 2 taps are supported");
      d.conv_group_size = dc.get_int("conv_group_size", 16);
      d.selector_rank = dc.get_int("selector_rank", 256);
      d.selector_top_k = dc.get_int("selector_top_k", 16);
    }
    in_range(c, "dflash_config.conv_group_size", d.conv_group_size, 1, d.hidden_size);
    if (d.hidden_size % d.conv_group_size)
      bad(c, "dflash_config.conv_group_size", "must divide hidden_size " + std::to_string(d.hidden_size));
    in_range(c, "dflash_config.selector_top_k", d.selector_top_k, 1, std::min(d.vocab_size, kMaxSelectorTopK));
    in_range(c, "dflash_config.selector_rank", d.selector_rank, 1, kMaxSelectorRank);
  }
  // --- the drafter must fit the target
  if (d.hidden_size != tgt.hidden_size)
    bad(c, "hidden_size", "the drafter has " + std::to_string(d.hidden_size) + " but the target has " +
                              std::to_string(tgt.hidden_size) + ": this drafter was made for another target");
  if (d.vocab_size != tgt.vocab_size)
    bad(c, "vocab_size", "the drafter has " + std::to_string(d.vocab_size) + " but the target has " +
                             std::to_string(tgt.vocab_size));
  if (d.mask_token_id < 0 || d.mask_token_id >= tgt.vocab_size)
    bad(c, "dflash_config.mask_token_id", std::to_string(d.mask_token_id) + " is outside the target vocabulary [0, " +
                                              std::to_string(tgt.vocab_size) + ")");
  if (d.num_target_layers != tgt.num_layers)
    bad(c, "num_target_layers", "the drafter was trained on a target with " + std::to_string(d.num_target_layers) +
                                    " layers, this target has " + std::to_string(tgt.num_layers));
  for (auto id : d.target_layer_ids)
    if (id < 0 || id >= tgt.num_layers)
      bad(c, "dflash_config.target_layer_ids", "layer id " + std::to_string(id) + " is outside the target's [0, " +
                                                   std::to_string(tgt.num_layers) + ")");
  if (d.block_size < 2) bad(c, "block_size", "must be >= 2, found " + std::to_string(d.block_size));
  if (d.num_heads <= 0 || d.num_kv_heads <= 0 || d.num_heads % d.num_kv_heads)
    bad(c, "num_key_value_heads", "must divide num_attention_heads");
  if (d.head_dim % 2) bad(c, "head_dim", "must be even");
  return d;
}

}  // namespace dflash2::model
