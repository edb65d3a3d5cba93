// Shared implementation of the Mamba hybrids (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H on Mamba-2;
// Jamba on Mamba-1): pre-norm residual blocks whose first branch runs the recurrent mixer
// (src/mixers/mamba2_mixer.*, or src/mixers/mamba_mixer.* when the spec's mixer is mamba1),
// softmax attention (src/mixers/attention_mixer.*), both side by side (Falcon-H1, summed), or an MLP
// (Nemotron-H MLP blocks); optionally a second branch pre_ff norm + MLP (Bamba, Falcon-H1), or
// norm + routed experts + the MLP as a shared MLP (Granite), or norm + routed experts in place of the
// MLP (Jamba). The family files (nemotron_h.cpp, bamba.cpp, falcon_h1.cpp, granitemoehybrid.cpp,
// jamba.cpp) read their configs into a Mamba2HybridSpec.
// Cache: conv window + SSM state for mixer layers, a KV cache for attention layers.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/json.h"
#include "io/weights.h"
#include "mixers/attention_mixer.h"
#include "mixers/mamba2_mixer.h"
#include "mixers/mamba_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

/// swiglu: down(up x * silu(gate x)); relu2: down(relu(up x)^2); geglu: down(gelu(gate x) * up x)
/// with the exact (erf) GELU (Zamba2MLP, hidden_act "gelu").
enum class HybridMlp { swiglu, relu2, geglu };
/// The recurrent mixer of the blocks with `mamba` set (one kind per model).
enum class HybridMixer {
  mamba2,  ///< Mamba2Mixer (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H)
  mamba1,  ///< MambaMixer (Jamba: JambaMambaMixer, Mamba-1 with weighted RMS norms on dt_low, B, C;
           ///< Zamba: ZambaMambaMixer, Mamba-1 per Mamba head)
};
/// The MoE's router and experts.
enum class HybridMoeKind {
  nemotron_h,  ///< NemotronHMoE: sigmoid router + e_score_correction_bias, group-limited top-k, relu2
               ///< experts (optional latent projections), one relu2 shared expert inside the MoE
  granite,     ///< GraniteMoeHybridMoE: softmax over the top-k router logits, SwiGLU experts (fused
               ///< gate_up, gate rows first); the block's MLP is the shared MLP, added by the block
  jamba,       ///< JambaSparseMoeBlock: top-k of the softmax over all router logits, weighted by those
               ///< probabilities (not renormalised), SwiGLU experts as Granite's; no MLP beside them
};

/// What one block holds (weights are looked up under the spec's names).
struct HybridBlock {
  bool mamba = false;       ///< the recurrent mixer on the first branch (values linear_attn.*)
  bool attn = false;        ///< softmax attention on the first branch (values self_attn.*)
  bool branch_mlp = false;  ///< Nemotron-H MLP block: the MLP is the first branch (mlp.output)
  bool moe = false;         ///< with branch_mlp: a Nemotron-H MoE block (NemotronHMoE) instead of the MLP;
                            ///< with ff: Granite's routed experts added to the MLP (the shared MLP),
                            ///< Jamba's routed experts instead of the MLP
  bool ff = false;          ///< second residual branch: ff norm + MLP (mlp.output)
  /// Zamba2 hybrid layer: before the Mamba-2 mixer, the shared transformer block `shared_block`
  /// (attention on RMSNorm([h, embeddings]), then pre-ff RMSNorm + MLP, no residual inside) runs
  /// with this depth's adapters; the layer's own linear maps its output into the mixer's input
  /// (h + linear(...) is normed), not into the residual. Values self_attn.* and mlp.output.
  bool shared = false;
  int64_t shared_block = 0;  ///< which of the num_mem_blocks shared blocks
  int64_t shared_depth = 0;  ///< the adapters' index (the how-many-th hybrid layer this is)
  LayerKind kind = LayerKind::mamba2;
};

struct Mamba2HybridSpec {
  std::string family;  ///< route_kernels name and info.family
  std::string pretty;  ///< name in messages ("Nemotron-H")
  int64_t D = 0, V = 0;
  float eps = 1e-5f;   ///< block / final RMSNorm epsilon
  bool tie = false;
  std::vector<HybridBlock> blocks;
  // Weight names: <prefix><embed>, <prefix>layers.<i>.<in_norm> / <ff_norm>, modules under
  // <prefix>layers.<i>.<mamba_mod> / <attn_mod> / <mlp_mod>, <prefix><final_norm>, lm_head.weight.
  std::vector<std::string> prefixes;  ///< tried in order (published and transformers-saved layouts)
  std::string embed, final_norm, in_norm, ff_norm, mamba_mod, attn_mod, mlp_mod;
  std::string moe_mod;    ///< the MoE module when it is not mlp_mod (Granite: block_sparse_moe beside shared_mlp)
  /// The MLP's gate and up projections are one input_linear [2I, D] (gate rows first) and its down
  /// projection is output_linear (GraniteMoeHybridMLP), instead of gate_proj / up_proj / down_proj.
  bool mlp_fused = false;
  // Zamba2's shared blocks: shared_prefixes[b] holds block b's weights (the first layer that runs it:
  // <prefix>layers.<j>.shared_transformer.); the mixer of a shared layer is under mamba_decoder.
  std::vector<std::string> shared_prefixes;
  std::string shared_mamba_mod;   ///< the mixer module of a shared layer (Zamba2: mamba_decoder.mamba)
  std::string shared_in_norm;     ///< its block norm (Zamba2: mamba_decoder.input_layernorm.weight)
  std::string shared_mod = "shared_transformer.";  ///< the block's module in a hybrid layer (Zamba: shared_transf.)
  /// The shared MLP's gate and up are gate_proj / up_proj (ZambaMLP) instead of one gate_up_proj.
  bool shared_mlp_split = false;
  int64_t mlp_lora_rank = 0;      ///< the shared MLP's per-depth gate_up adapters (Zamba2 adapter_rank)

  Mamba2MixerDims mamba;
  HybridMixer mixer = HybridMixer::mamba2;
  MambaMixerDims mamba1;  ///< the Mamba-1 mixer's sizes and options when mixer is mamba1 (Jamba)
  /// The attention blocks' options (GQA, RoPE, biases, Falcon-H1's attention / key multipliers);
  /// D is set by the skeleton.
  AttentionMixerDims attn;
  // MLP
  HybridMlp mlp = HybridMlp::swiglu;
  int64_t I = 0;
  bool mlp_bias = false;
  // MoE. Nemotron-H (NemotronHMoE / NemotronHTopkRouter): sigmoid router + e_score_correction_bias,
  // group-limited top-k, relu2 experts (up/down, optional latent projections), one shared expert.
  // Granite (GraniteMoeHybridMoE): softmax over the top-k logits, SwiGLU experts of width moe_I.
  HybridMoeKind moe_kind = HybridMoeKind::nemotron_h;
  int64_t n_experts = 0, topk = 0, n_group = 1, topk_group = 1, moe_I = 0, shared_I = 0, latent = 0;
  bool norm_topk = true;
  float routed_scaling = 1.0f;
  // Falcon-H1 µP multipliers (1 elsewhere), applied where transformers applies them.
  float embedding_multiplier = 1.0f, lm_head_multiplier = 1.0f;
  float mlp_gate_multiplier = 1.0f, mlp_down_multiplier = 1.0f;
  // Granite µP (GraniteMoeHybridDecoderLayer): every branch's output * residual_multiplier before it
  // is added (the served attention_output / mlp.output include it: what the block adds; the mixer's
  // factor is folded into mamba.out_multiplier and attn.out_multiplier by make_mamba2_hybrid). GraniteMoeHybridModel scales
  // inputs_embeds by embedding_multiplier too (Falcon-H1: looked-up ids only).
  float residual_multiplier = 1.0f;
  bool embedding_multiplier_on_embeds = false;
};

/// One block's weights (shapes as loaded by make_mamba2_hybrid; optional tensors undefined).
struct HybridMlpWeights {
  Tensor gate, up, down;        ///< gate [I, D] (swiglu only), up [I, D], down [D, I]
  Tensor gate_b, up_b, down_b;  ///< optional biases
  /// Optional LoRA adapter on gate and up (Zamba2MLP gate_up_proj_adapter_list, one per depth):
  /// lora_a [r, D]; lora_gate / lora_up [I, r] (the rows of its fused [2I, r] up projection).
  Tensor lora_a, lora_gate, lora_up;
};
/// One depth of a Zamba2 shared transformer block: the block's tensors shared (the same storage at
/// every depth), this depth's adapters and linear its own.
struct SharedBlockWeights {
  Tensor in_norm;   ///< [2D] RMSNorm of the concatenated [h, embeddings]
  Tensor ff_norm;   ///< [D] pre_ff_layernorm
  Tensor linear;    ///< [D, D] the layer's linear into the mixer input
  std::string prefix;  ///< where the block's tensors were read (the first layer running it, or its own)
};
struct HybridMoeWeights {
  Tensor router, bias;           ///< [E, D], [E] e_score_correction_bias (Nemotron-H only)
  std::vector<Tensor> up, down;  ///< per expert [I, in], [in, I] (in = latent or D)
  std::vector<Tensor> gate;      ///< Granite: per expert [I, D] (views into the fused gate_up tensor)
  Tensor shared_up, shared_down; ///< [Is, D], [D, Is]
  Tensor fc1, fc1_b, fc2, fc2_b; ///< optional latent projections [latent, D], [D, latent]
};
struct HybridBlockWeights {
  SharedBlockWeights shared;
  Tensor in_norm, ff_norm;
  Mamba2MixerWeights mamba;
  MambaMixerWeights mamba1;  ///< Jamba's Mamba-1 blocks
  AttentionMixerWeights attn;
  HybridMlpWeights mlp;
  HybridMoeWeights moe;
};

/// The MoE's routing of `rows` tokens x [rows, D]: NemotronHMoE (fp32 sigmoid router, group_limited_topk
/// (models/common.h) per token) or GraniteMoeHybridTopKRouter (fp32 logits, top-k, softmax over the k chosen logits).
/// The forward and the backward (src/grad/mamba2_hybrid_grad.cpp) share it: identical routing.
struct HybridMoeRouting {
  std::vector<float> scores;    ///< [rows, E] sigmoid(router x) (Nemotron-H) or the router logits (Granite)
  std::vector<int64_t> chosen;  ///< [rows, topk] expert ids, best first
  std::vector<float> total;     ///< [rows] sum of the chosen experts' scores (Nemotron-H)
  /// [rows, topk] routing weights: score / (total + 1e-20) when norm_topk, * routed_scaling (Nemotron-H);
  /// softmax over the chosen logits (Granite).
  std::vector<float> weights;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> routed;  ///< per expert: (row, k), rows ascending
  /// Routing weight of row r's k-th expert.
  float weight(int64_t r, int64_t k) const { return weights[static_cast<size_t>(r * topk + k)]; }
  int64_t topk = 0;
};
HybridMoeRouting hybrid_moe_route(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows);
/// The experts' input [rows, latent] = fc1(x) with latent projections; undefined without (the experts read x).
Tensor hybrid_moe_input(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows);
/// Rows `toks[j].first` of x [*, in] gathered into [toks.size(), in] (one expert's tokens).
Tensor gather_routed_rows(const float* x, int64_t in, const std::vector<std::pair<int64_t, int64_t>>& toks);
/// The MoE forward: x [rows, D] -> [rows, D]. NemotronHMoE: routed relu2 experts, fc2, + the shared
/// expert; Granite: the routed SwiGLU experts only (the block adds its shared MLP).
Tensor hybrid_moe(const Mamba2HybridSpec& s, const HybridMoeWeights& m, const float* x, int64_t rows);
/// One expert e on its gathered rows xs [rows, in]: relu2 (Nemotron-H) or SwiGLU (Granite).
Tensor hybrid_expert(const Mamba2HybridSpec& s, const HybridMoeWeights& m, int64_t e, const float* xs, int64_t rows);
/// A block's second branch on its normed input x [rows, D] -> [rows, D]: the MLP, plus the routed
/// experts when b.moe (Granite: the MLP is the shared MLP), * residual_multiplier: mlp.output.
Tensor ff_branch(const Mamba2HybridSpec& s, const HybridBlockWeights& w, const HybridBlock& b, const float* x, int64_t rows);
/// The block MLP: swiglu down(up x * silu(gate x * gate_mult)) * down_mult, relu2 down(relu(up x)^2), or
/// geglu down(gelu(gate x) * up x) (gate / up plus the depth's adapter when lora_a is set);
/// x [rows, D] -> [rows, D].
Tensor hybrid_mlp(const Mamba2HybridSpec& s, const HybridMlpWeights& m, const float* x, int64_t rows);
/// The looked-up (or given) embeddings times embedding_multiplier, before embed_tokens.output is served.
Tensor hybrid_embeddings(const Mamba2HybridSpec& s, const Tensor& embed, const Batch& in);
/// SwiGLU MLP with explicit weights (Granite experts): down(up x * silu(gate x)), x [rows, in].
Tensor swiglu_mlp(const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w, const float* x, int64_t rows,
                  int64_t in, int64_t I);
/// relu2 MLP with explicit weights (experts, shared expert): down(relu(up x)^2), x [rows, in].
Tensor relu2_mlp(const Tensor& up_w, const Tensor& down_w, const float* x, int64_t rows, int64_t in, int64_t I);

/// What the backward (src/grad/mamba2_hybrid_grad.cpp) reads of a loaded hybrid (all owned by the model).
struct Mamba2HybridParts : BackwardParts {
  const Mamba2HybridSpec* spec = nullptr;
  const Mamba2Mixer* mixer = nullptr;
  const MambaMixer* mixer1 = nullptr;  ///< HybridMixer::mamba1
  const AttentionMixer* attn = nullptr;
  const Tensor* norm_f = nullptr;
  const Tensor* lm_head = nullptr;
  const Tensor* embed = nullptr;  ///< [V, D] token embeddings: the backward re-forms the embeddings the blocks read
  const std::vector<HybridBlockWeights>* blocks = nullptr;
};

/// The sizes every Mamba-2 hybrid config spells alike (Bamba, Falcon-H1, Granite 4.0-H; Nemotron-H
/// names its eps layer_norm_epsilon): hidden_size, vocab_size into s.D / s.V, rms_norm_eps (absent:
/// `default_eps`, the family config's default) into s.eps, tie_word_embeddings into s.tie. Returns
/// num_hidden_layers. ConfigError naming the field when a size is not positive or eps is not a
/// finite number > 0.
int64_t read_hybrid_sizes(const io::Config& cfg, Mamba2HybridSpec& s, double default_eps);
/// The weight names of the hybrids laid out as BambaDecoderLayer (Bamba, Falcon-H1, Jamba):
/// model.embed_tokens, model.layers.{i}.input_layernorm / pre_ff_layernorm / mamba / self_attn /
/// feed_forward, model.final_layernorm.
void use_feed_forward_layout(Mamba2HybridSpec& s);
/// UnsupportedError naming s.pretty unless hidden_act (absent: silu) is silu / swish, the activation
/// of every hybrid's conv and MLP gate.
void require_silu(const io::Config& cfg, const Mamba2HybridSpec& s);

/// The Mamba-1 mixer's sizes as JambaConfig and ZambaConfig spell them into s.mamba1 (s.mixer =
/// mamba1): intermediate mamba_expand * hidden_size, mamba_d_state, mamba_d_conv, mamba_dt_rank
/// ("auto" = ceil(hidden / 16)), mamba_conv_bias, mamba_proj_bias. ConfigError naming a size that is
/// not positive.
void read_hybrid_mamba1(const io::Config& cfg, Mamba2HybridSpec& s);
/// Zamba / Zamba2's sizes (read_hybrid_sizes, rms_norm_eps default 1e-5; tie_word_embeddings default
/// true) and layer list: layers_block_type (layer_types is its attribute_map alias; "mamba" (legacy) /
/// "linear_attention" or "hybrid", as many as num_hidden_layers) into `types`, its name into `field`.
/// Returns false when the list is absent.
bool read_zamba_layers(const io::Config& cfg, Mamba2HybridSpec& s, std::vector<std::string>& types, std::string& field);
/// Zamba / Zamba2's layer list `types` (read from `field`): "mamba" (legacy) / "linear_attention" is
/// a Mamba layer of kind `mamba_kind`, "hybrid" a Mamba layer after a shared block; the depth-th
/// hybrid layer runs block depth % n_mem, whose weights the first layer running it holds
/// (<prefix>layers.<i>.<s.shared_mod>, added to s.shared_prefixes). ConfigError naming any other entry.
void read_shared_layers(const io::Config& cfg, Mamba2HybridSpec& s, const std::vector<std::string>& types,
                        const std::string& field, int64_t n_mem, LayerKind mamba_kind);

std::unique_ptr<FamilyModel> make_mamba2_hybrid(const Mamba2HybridSpec& spec, const io::Config& cfg,
                                                const io::WeightStore& weights);

}  // namespace mixlens::detail
