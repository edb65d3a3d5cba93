// Reading config.json safely: the range validation every family's config passes before any factory
// runs (build_family), the checks the factories share, and the readers of fields several families
// spell alike (one place to fix a default for all of them).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "io/json.h"
#include "mixers/attention_mixer.h"
#include "mixers/mamba2_mixer.h"

namespace mixlens::detail {

/// "config.json (<path>)" for messages.
std::string where(const io::Config& cfg);
/// ConfigError naming the first field that is not in [1, kMaxConfigDim].
void require_positive(const io::Config& cfg, std::initializer_list<std::pair<const char*, int64_t>> fields);

// ---- Config range validation (every family; run by build_family before any factory) ------------
/// Largest value of any one size field (hidden_size, vocab_size, heads, head dims, state sizes...).
/// Real checkpoints stay under 2^18; the bound makes every product of two sizes fit int64 exactly.
inline constexpr int64_t kMaxConfigDim = int64_t{1} << 24;
/// Largest product of sizes that becomes one tensor (matches the safetensors / Tensor numel limit).
inline constexpr int64_t kMaxConfigNumel = int64_t{1} << 40;
/// Largest SSD / scan chunk length: the chunked kernels hold [chunk, chunk] blocks per head (cost
/// and memory grow with its square: 16384 took 89 s and 3.2 GB for 4 tokens). Published models use
/// 64-256.
inline constexpr int64_t kMaxChunkSize = 2048;

/// Validates the ranges of config.json (and its text_config / rope_parameters) before a family reads
/// it, so no family computes with a wrapped, absurd or non-finite number. ConfigError naming the field:
///  - size fields (hidden_size, vocab_size, *_size, *_dim, *_heads, *_layers, n_groups, ...): an
///    integer in [0, kMaxConfigDim] ("field 'X' = V is out of range: a size must be in [0, 16777216]");
///  - chunk sizes (chunk_size, *_chunk_size): an integer in [1, kMaxChunkSize];
///  - rope_theta, *eps* fields, expand / *_expand: finite and > 0; partial_rotary_factor in (0, 1];
///    time_step_* floats finite and >= 0;
///  - products of sizes that the families allocate (num_heads * head_dim, expand * hidden_size,
///    vocab_size * hidden_size, chunk_size^2 * num_heads, ...) at most kMaxConfigNumel, computed
///    without overflow;
///  - token ids (bos / eos / pad_token_id; an int or a list of ints; null allowed): in [0, vocab_size).
void validate_config(const io::Config& cfg);
/// An overflow-checked product of sizes; ConfigError naming `what` when it exceeds `limit`.
int64_t checked_size_product(const io::Config& cfg, const std::string& what, std::initializer_list<int64_t> factors,
                             int64_t limit = kMaxConfigNumel);

// ---- Shared readers ----------------------------------------------------------------------------
/// time_step_limit ([min, max]) into dims.dt_lo / dt_hi; absent: the default (0, inf), no clamp.
/// `nullable` (BambaConfig, FalconH1Config: an Optional field): null is that default too; otherwise
/// (Mamba2Config, whose strict field takes only a list) null is a ConfigError, as transformers
/// refuses it. ConfigError for a list that is not [min, max] with 0 <= min <= max.
void read_time_step_limit(const io::Config& cfg, Mamba2MixerDims& dims, bool nullable = true);
/// A Mamba-1 dt rank field (MambaConfig time_step_rank, JambaConfig mamba_dt_rank): an integer, or
/// "auto" (also when absent) = ceil(hidden / 16). ConfigError naming the field for anything else.
int64_t read_dt_rank(const io::Config& cfg, const char* field, int64_t hidden);
/// RoPE theta and partial factor from rope_parameters (transformers 5) or the older top-level
/// fields; UnsupportedError for any rope_type other than "default".
void read_rope(const io::Config& cfg, double default_partial, double& theta, double& partial);
/// RoPE over every channel of the head (d.rot = d.hd) at read_rope's theta, whatever partial factor
/// the config names (MiniMaxRotaryEmbedding rotates the whole head).
void read_full_rope(const io::Config& cfg, AttentionMixerDims& d);
/// The attention heads every hybrid config spells alike into d.H / d.Hkv / d.hd:
/// num_attention_heads, num_key_value_heads (absent or null: num_attention_heads), head_dim (absent:
/// hidden / num_attention_heads). ConfigError naming the field when one is not positive, or when
/// hidden is not divisible by the heads and head_dim is not given.
void read_attention_heads(const io::Config& cfg, int64_t hidden, AttentionMixerDims& d);
/// A hybrid's per-layer type list: the first of `names` present and not null (a field and its
/// attribute_map alias) into `types`, its name into `field` (names' first when none is). Returns false
/// when none is there; ConfigError when the list's length is not `layers` (num_hidden_layers).
bool read_layer_types(const io::Config& cfg, std::initializer_list<const char*> names, int64_t layers,
                      std::vector<std::string>& types, std::string& field);
/// How a family spells the Mamba-2 size fields (read_mamba2_dims): per field the names tried in
/// order (the first present and not null is read; a later name is an older spelling) and the
/// default when none is. The defaults are BambaConfig / FalconH1Config's mamba_* fields.
struct Mamba2Spelling {
  std::vector<std::string> heads{"mamba_n_heads"}, head_dim{"mamba_d_head"}, state{"mamba_d_state"},
      groups{"mamba_n_groups"}, conv{"mamba_d_conv"}, chunk{"mamba_chunk_size"};
  int64_t heads_default = 128, state_default = 256, groups_default = 1, conv_default = 4, chunk_default = 256;
  /// The width E. false: int(mamba_expand * D), or mamba_d_ssm first when `d_ssm` (FalconH1Mixer);
  /// head_dim absent, null or "auto" is then width / heads. true (NemotronHConfig): heads * head_dim,
  /// head_dim defaulting to head_dim_default.
  bool width_from_heads = false;
  bool d_ssm = false;
  int64_t head_dim_default = 64;
};

/// The Mamba-2 mixer dims a hybrid's config spells as `names` says, and `eps`; ConfigError naming
/// the field for a head count that is not positive (the other sizes are checked by the mixer).
/// The gated norm, the biases, the dt clamp and any multipliers stay with the family (they differ
/// between families).
void read_mamba2_dims(const io::Config& cfg, int64_t D, float eps, const Mamba2Spelling& names, Mamba2MixerDims& d);
/// The mamba_* spelling (BambaConfig, FalconH1Config): mamba_n_heads, the width (mamba_d_ssm when
/// `d_ssm` is set and the field given, else int(mamba_expand * D)), mamba_d_head (absent, null or
/// "auto": width / heads), mamba_d_state, mamba_n_groups, mamba_d_conv, mamba_chunk_size.
void read_mamba2_dims(const io::Config& cfg, int64_t D, float eps, bool d_ssm, Mamba2MixerDims& d);

}  // namespace mixlens::detail
