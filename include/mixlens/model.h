// Model: load a HuggingFace checkpoint folder (or a hub id from the local cache), run prompts
// with a cache, generate, and serve every value of values.md through a Trace.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mixlens/tensor.h"
#include "mixlens/tokenizer.h"
#include "mixlens/trace.h"
#include "mixlens/values.h"

namespace mixlens {

/// A batch of token rows of equal length, left-padded; mask[b*seq+t] is 1 for real tokens.
struct Batch {
  int64_t batch = 0;
  int64_t seq = 0;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  /// Optional inputs_embeds [batch, seq, hidden] (transformers' `inputs_embeds`): when defined the
  /// forward starts from these rows instead of looking `ids` up in the embedding table (`ids` is
  /// then ignored); `embed_tokens.output` serves them. Only a first call or a continuation takes
  /// embeddings; generation feeds the sampled ids from step 1 on.
  Tensor embeds;
  /// Left-pads `rows` (each non-empty) to the longest with `pad_id`. InputError on an empty row.
  static Batch left_padded(const std::vector<std::vector<int32_t>>& rows, int32_t pad_id);
  /// A batch the caller already padded (transformers' `input_ids` with its `attention_mask`): rows of
  /// equal length, `mask` (B*T, 1 = real, 0 = left padding; every row's zeros before its ones, at
  /// least one 1; empty = all ones). The ids at padded positions are kept: their embeddings are what
  /// the padded positions' values show, as in transformers. InputError on ragged rows, a mask of the
  /// wrong size, or one that is not left padding (right padding: tokenize with padding_side="left").
  static Batch padded(const std::vector<std::vector<int32_t>>& rows, std::vector<uint8_t> mask);
  /// A batch of embeddings [B, T, hidden] (copied). `mask` (B*T, 1 = real, 0 = left padding; every
  /// row's zeros before its ones, at least one 1) defaults to all ones. InputError on a bad shape,
  /// a non-finite entry or a mask that is not left padding.
  static Batch from_embeddings(const Tensor& embeds, std::vector<uint8_t> mask = {});
  bool has_padding() const;
};

namespace detail { struct ModelAccess; }  // internal: runs a forward with an extra listener (Session)

/// Recurrent-mixer algorithm selection (values.md "Which kernel runs").
enum class KernelRoute { default_route, chunked, recurrent };
/// Process-wide, per family ("mamba2", "mamba", "qwen3_5", ...), like the reference's routing.
/// `route` is "default", "chunked" or "recurrent" (InputError otherwise). By default a decode
/// step runs the recurrent kernel and a prompt or continuation the chunked one, except Mamba-1
/// ("mamba"), whose prompts run whichever selective scan is faster: the token loop unless the
/// model is too narrow to occupy the threads (both agree within float rounding).
void route_kernels(const std::string& family, const std::string& route);
/// The route set for `family`; InputError for an unknown family (as route_kernels).
KernelRoute kernel_route(const std::string& family);

/// Cached state of a batch: conv windows and recurrent states per layer (plus KV for attention).
class Cache {
 public:
  ~Cache();
  Cache(Cache&&) noexcept;
  Cache& operator=(Cache&&) noexcept;
  int64_t batch() const;
  /// Tokens consumed so far (including left padding of the first call).
  int64_t seen_tokens() const;
  /// Number of forward calls made with this cache (the next call's step index).
  int steps() const;
  /// Empty while the cache is consistent; otherwise why it is not: a forward over it stopped midway
  /// (an exception from a write, NumericError, a stopped or aborted trace, cancellation), leaving
  /// the layers it reached holding tokens that seen_tokens() / steps() do not count. Such a cache
  /// refuses forward() and copy() with InputError until restore(snapshot). Inputs refused before the
  /// forward starts (wrong batch, out-of-vocabulary ids, ...) leave it consistent.
  const std::string& broken() const;

  /// A snapshot: an independent deep copy of everything the next call reads (conv windows,
  /// recurrent states, attention KV entries and key masks, position and step counters), bitwise.
  /// Continuing the copy and continuing this cache give identical results; neither affects the
  /// other. Not while a Session::forward over this cache is running (the worker writes it).
  /// InputError when broken() is not empty.
  Cache copy() const;
  /// Rollback: makes this cache bitwise equal to `snapshot` (a copy() of a cache of the same model
  /// and batch size), which stays unchanged and can be restored again. InputError when the
  /// snapshot belongs to another model or another batch size, or is itself broken(). Clears broken().
  void restore(const Cache& snapshot);

 private:
  friend class Model;
  friend struct detail::ModelAccess;
  Cache();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct GenerateOptions {
  int max_new_tokens = 20;
  bool greedy = true;        ///< argmax; otherwise sample with the settings below
  float temperature = 1.0f;  ///< > 0
  int top_k = 0;             ///< 0 = off
  float top_p = 1.0f;        ///< in (0, 1]; 1 = off
  uint64_t seed = 0;
  /// Stop a row at this id; default: config eos_token_id. -1 disables stopping on EOS; any other id
  /// outside [0, vocab_size) is an InputError.
  std::optional<int32_t> eos_token_id;
  /// InputError naming the first setting out of range (max_new_tokens >= 1; when sampling:
  /// temperature > 0 and finite, top_p in (0, 1], top_k >= 0), or the sampling settings given
  /// with greedy decoding (not defaults: nothing would read them). generate() calls it first.
  void check() const;
};

struct GenerationResult {
  std::vector<std::vector<int32_t>> new_tokens;  ///< per prompt, excluding the prompt
  int steps = 0;                                 ///< forward calls made
};

struct ModelInfo {
  std::string family;       ///< "mamba2"
  std::string model_type;   ///< config.json model_type
  std::string path;         ///< resolved folder
  int num_layers = 0;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  std::vector<LayerKind> layer_kinds;
  std::string dtype = "float32";  ///< LoadOptions::dtype the model was loaded with
  /// The dtypes its matmul weights are kept in, sorted ("bfloat16", "float16", "float32", "int8"): what
  /// "auto" resolved to (several when the checkpoint mixes them).
  std::vector<std::string> weight_dtypes;
  /// The checkpoint tensors read as matmul weights, sorted: those LoadOptions::dtype narrows (every
  /// other tensor stays float32). What convert_checkpoint rounds.
  std::vector<std::string> matmul_weights;
  bool deterministic = false;  ///< LoadOptions::deterministic the model was loaded with
};

class FamilyModel;  // internal

/// Options of Model::load.
struct LoadOptions {
  /// Dtype the matmul weights (projections, embedding, lm_head, experts) are kept in and multiplied
  /// as, always with float32 accumulation: "float32" (default: widened at load, exact parity with
  /// transformers in float32), "bfloat16", "float16", "int8" (quantized at load: ScalarType::int8,
  /// blocks of 32 weights with a float32 scale max|w| / 127, as llama.cpp's Q8_0; products of 1-4
  /// token rows, or all under `deterministic`, also round the activations to int16 per block of 32:
  /// ops::linear), or "auto" (each weight's checkpoint dtype).
  /// Recurrent state, A_log, dt_bias, D, norm and conv weights, gates, decays, activations and
  /// every served value stay float32 whatever this says. InputError for any other string.
  std::string dtype = "float32";
  /// Batch-invariant numerics (issue 23): every matrix product of the forward takes the kernels
  /// whose per-element sum order depends only on the reduction length, so every value of a row is
  /// bitwise the same alone or in any left-padded batch, at any row position, on any thread count
  /// (MIXLENS_NUM_THREADS) and with any prefill chunking, for the layers whose scans are invariant
  /// (README "Batch invariance"). Prompts run slower (bench/results/invariance.md). Default false:
  /// prompts of more than 4 rows then go to BLAS, and a row's values may move by float rounding
  /// with the batch. Unset (std::nullopt): MIXLENS_DETERMINISTIC, "1" or "0" (InputError for any
  /// other value), else false; an explicit true / false wins over the variable.
  std::optional<bool> deterministic;
};

class Model {
 public:
  /// Loads a checkpoint folder, or a hub id ("AntonV/mamba2-130m-hf") found in the local
  /// HuggingFace cache. Errors: CheckpointError (missing folder / file / tensor, bad shapes, a
  /// non-regular file, NaN / inf / |w| >= 2^64 weights), ConfigError (missing or mistyped fields,
  /// and values out of range: see detail::validate_config), UnsupportedError (unknown model_type),
  /// TokenizerError.
  /// `options.dtype`: see LoadOptions (InputError for an unknown dtype, before anything is read).
  static Model load(const std::string& path_or_hub_id, const LoadOptions& options = {});
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;

  const ModelInfo& info() const;
  /// The checkpoint's tokenizer (TokenizerError if the folder has no tokenizer.json).
  const Tokenizer& tokenizer() const;
  bool has_tokenizer() const;
  int32_t pad_token_id() const;
  std::optional<int32_t> eos_token_id() const;

  /// Every value of the model for a call of `batch` rows and `seq` tokens, in forward order.
  std::vector<ValueInfo> values(int64_t batch, int64_t seq) const;
  /// values.md support(): value name ("linear_attn.states") -> per layer: "" when available,
  /// else the reason. Global/block values map under layer -1 / each layer.
  std::map<std::string, std::map<int, std::string>> support() const;

  Cache new_cache(int64_t batch) const;
  /// One forward call over `batch` starting from `cache` (updated in place). Returns logits
  /// [B,T,vocab] when `all_logits`, else [B,1,vocab] for the last position: then the LM head runs
  /// on the last position only (the [B,T,vocab] block is never built) unless the trace saves,
  /// edits or reads `logits`, which still get every position. A long call may run as a chunked
  /// prefill (set_prefill_chunk): same numbers up to float rounding. NumericError when a
  /// value of the call goes NaN / inf (the message names the first one; the cache is then poisoned:
  /// start a new one); ResourceError when the trace's saved values pass their budget.
  /// `cancel` (optional, set from another thread) stops the call between layers with
  /// InterruptedError; the cache is then unspecified (restore a copy() to roll back).
  Tensor forward(const Batch& batch, Cache& cache, Trace* trace = nullptr, bool all_logits = true,
                 const std::atomic<bool>* cancel = nullptr) const;
  /// Fresh cache + forward of left-padded prompts; logits [B,T,vocab] (`all_logits` false: [B,1,vocab],
  /// the last position only, as forward()).
  Tensor run(const std::vector<std::vector<int32_t>>& prompts, Trace* trace = nullptr, bool all_logits = true) const;
  /// Fresh cache + forward of a prepared batch (e.g. Batch::from_embeddings); logits [B,T,vocab]
  /// (`all_logits` false: [B,1,vocab]).
  Tensor run(const Batch& batch, Trace* trace = nullptr, const std::atomic<bool>* cancel = nullptr,
             bool all_logits = true) const;
  /// Step 0 runs the prompts, then up to max_new_tokens-1 single-token decode steps.
  GenerationResult generate(const std::vector<std::vector<int32_t>>& prompts,
                            const GenerateOptions& options, Trace* trace = nullptr) const;
  /// Generation from a prepared first batch (ids or embeddings, left-padded); later steps feed the
  /// generated ids. From Batch::from_embeddings(E) it equals generate(ids) when E = embed(ids).
  /// `cancel` as forward(): checked between layers and between steps (InterruptedError).
  GenerationResult generate(const Batch& prompt, const GenerateOptions& options, Trace* trace = nullptr,
                            const std::atomic<bool>* cancel = nullptr) const;

  /// Chunk length of the chunked kernel: Mamba-2's SSD chunk (values.md chunk_per_token: 1; 0
  /// restores config.chunk_size), Mamba-1's chunked scan (0 restores its default, 64).
  /// InputError outside [0, 2048] (the kernels' cost grows with the chunk's square);
  /// UnsupportedError for a length other than 0 on Qwen3.5 / Qwen3-Next (their chunk is fixed at 64).
  void set_chunk_size(int64_t chunk_size);

  /// Chunked prefill: a call longer than `tokens` runs as consecutive calls of `tokens` tokens
  /// (the last one takes a remainder of 1 too, so no piece is a one-token decode step) carrying the
  /// cache, so its activations are those of one chunk: a 32k-token prompt needs the memory of a
  /// 512-token one beyond the cache (and the logits when all of them are returned). It applies
  /// only when nothing of the call is observed: no listener wants any value of it (no save, edit,
  /// per-token state or interleaved read/write at that step; checked after begin_call) and the
  /// batch has no left padding (a chunk of padding only would have no real token). It changes the
  /// schedule, never the math: logits and cache equal the unchunked call's up to float rounding
  /// at the chunk boundaries (the SSD / scan chunks restart there from the carried state). The
  /// call stays one step (Trace::calls() records it once). 0 turns it off. Default
  /// kDefaultPrefillChunk. InputError when negative.
  void set_prefill_chunk(int64_t tokens);
  int64_t prefill_chunk() const;
  static constexpr int64_t kDefaultPrefillChunk = 512;

  /// nnterp's project_on_vocab (logit lens): the final norm (ln_final, as the forward applies it)
  /// then the LM head, on hidden states [..., hidden_size] -> logits [..., vocab_size], float32.
  /// Equals transformers' lm_head(norm(h)). InputError on a wrong last dimension or non-finite
  /// input; UnsupportedError for a family that has not declared its head.
  Tensor project_on_vocab(const Tensor& hidden) const;
  /// Read access to the weights around the blocks, by nnterp role: "embed_tokens" [V, D],
  /// "ln_final" [D] (the stored RMSNorm weight; Qwen scales by 1 + w), "lm_head" [V, D] (the
  /// embedding itself when tied). The tensor may borrow read-only (memory-mapped) storage.
  Tensor head_weight(const std::string& role) const;

 private:
  friend struct detail::ModelAccess;
  Model();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mixlens
