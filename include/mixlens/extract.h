// Dataset-scale extraction: run many prompts in left-padded batches and write the chosen values of
// their real tokens to sharded safetensors files with an index.json, resumably. One implementation
// behind `mixlens extract` (CLI), `model.extract(...)` and the Ray workers (Python).
//
// On-disk layout (format "mixlens-extract", version 1), in the output folder:
//   shard-00000.safetensors, shard-00001.safetensors, ...   consecutive prompts, <= shard_bytes each
//   index.json                                                metadata, written atomically
// A shard holding prompts [first, end) has:
//   VALUE          F32 [rows, ...]  per-token values: one row per stored token of its prompts,
//                                   prompt after prompt (left padding never stored)
//   VALUE          F32 [P, ...]     values without a token axis (e.g. state_output): one per prompt
//   prompt_index   I64 [P]          global index of each prompt of the shard
//   offsets        I64 [P+1]        rows of prompt j are offsets[j] .. offsets[j+1]-1
//   positions      I64 [rows]       token index of each row inside its prompt (0 = first token)
//   token_ids      I64 [rows]       the token at that position
// and the safetensors metadata "mixlens_extract" (JSON: fingerprint, shard number, prompt range).
// Which tokens are stored: positions "all" (every token), "last" (the last one) or "mask" (the
// tokens whose per-prompt 0/1 mask entry is 1). Shard boundaries and batches depend only on the
// prompts and the options, so a rerun recomputes the same plan, skips the shards already written
// (each file is written to a .tmp name and renamed when complete) and gives the same files.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "mixlens/model.h"

namespace mixlens {

/// One prompt of an extraction.
struct ExtractPrompt {
  std::string text;           ///< tokenized with the model's tokenizer (add_special_tokens) unless `ids` is given
  std::vector<int32_t> ids;   ///< token ids; when non-empty `text` is only recorded in the index
  std::vector<uint8_t> mask;  ///< positions "mask": one 0/1 entry per token (required there, refused elsewhere)
};

/// Reads a prompts file. `*.jsonl`: one JSON object per line with a string field `text_field` (and,
/// when `mask_field` is non-empty, a 0/1 array field `mask_field`). Any other name: plain text, one
/// prompt per line (UTF-8, "\r\n" accepted; a text_field other than "text" or a mask_field is refused
/// there, as they would be ignored). InputError naming the file and the line for: a missing
/// or unreadable file, an empty file, an empty line, a line that is not JSON / not an object / lacks
/// the field or has it mistyped, a mask entry that is not 0 or 1.
std::vector<ExtractPrompt> read_prompts_file(const std::string& path, const std::string& text_field = "text",
                                             const std::string& mask_field = "");

struct ExtractOptions {
  /// Value paths as `--save` takes them ("layers.*.mixer.betas", "logits"); "*" expands to every
  /// layer that has the value. Per-token state paths (@t) are refused: extract `states` instead.
  std::vector<std::string> values;
  int64_t batch_size = 8;               ///< prompts per forward (left-padded batch), >= 1
  std::string positions = "all";        ///< "all", "last" or "mask"
  uint64_t shard_bytes = 256ull << 20;  ///< target data bytes per shard (a prompt is never split)
  uint64_t max_bytes = 0;               ///< refuse (ResourceError) when the estimate passes it; 0 = no limit
  bool store_prompts = true;            ///< index.json keeps the texts; false: FNV-1a 64 hashes only

  /// InputError for a setting out of range (batch_size < 1, shard_bytes 0, an unknown positions
  /// word); plan_extraction calls it, and callers may before loading anything.
  void check() const;
};

/// Everything decided before any forward runs: tokens, rows per prompt, shard boundaries, size.
struct ExtractPlan {
  struct Value {
    std::string name;  ///< canonical path
    Shape row_shape;   ///< shape of one row (per token) or one prompt's entry (no token axis)
    bool per_token = true;
  };
  struct Shard {
    int64_t first = 0, end = 0;  ///< prompts [first, end)
    int64_t rows = 0;
    uint64_t bytes = 0;  ///< data bytes (tensors, without the header)
  };
  ExtractOptions options;
  std::vector<Value> values;
  std::vector<std::vector<int32_t>> ids;   ///< per prompt
  std::vector<std::vector<uint8_t>> masks; ///< per prompt (positions "mask" only)
  std::vector<std::string> texts;          ///< per prompt as given ("" for id prompts)
  std::vector<int64_t> rows;               ///< stored rows per prompt
  std::vector<Shard> shards;
  uint64_t total_bytes = 0;  ///< sum of shard data bytes (the estimate printed before a run)
  int64_t total_rows = 0;
  std::string fingerprint;   ///< FNV-1a 64 (hex) of the model identity, options, values and tokens
};

/// Tokenizes and validates everything, lays out the shards and estimates the size. Errors:
/// InputError (no prompts, no values, an empty prompt, batch_size < 1, shard_bytes 0, unknown
/// positions, a mask of the wrong length or given without positions "mask"), UnknownValueError (a
/// path the model does not have), UnsupportedError (a @t path, or a value whose shape grows with
/// the sequence beyond its token axis), ResourceError when total_bytes passes max_bytes (the message
/// names both numbers).
ExtractPlan plan_extraction(const Model& model, const std::vector<ExtractPrompt>& prompts,
                            const ExtractOptions& options);

struct ExtractProgress {
  int64_t prompts_done = 0, prompts_total = 0;
  int64_t shards_done = 0, shards_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;
  int64_t prompts_skipped = 0;  ///< prompts of shards found complete (resume), counted in prompts_done
  double elapsed_s = 0;         ///< since extract() started
};

struct ExtractRunOptions {
  /// Write only these shards (Ray workers); nullopt: every shard. An empty list writes none (only
  /// checks the folder and writes the index).
  std::optional<std::vector<int64_t>> only_shards;
  bool write_index = true;  ///< index.json ("complete": true once every shard file exists)
  /// Called after every batch and every skipped shard, on the calling thread; may throw to stop.
  std::function<void(const ExtractProgress&)> on_progress;
  const std::atomic<bool>* cancel = nullptr;  ///< set from another thread: InterruptedError between layers
};

struct ExtractSummary {
  int64_t shards_written = 0, shards_skipped = 0;
  bool complete = false;  ///< every shard of the plan exists
};

/// Runs the plan into folder `out` (created if missing). Shards already written by a run of the
/// same plan (same fingerprint) are skipped. InputError when `out` holds the index of another
/// extraction (another fingerprint) or a listed shard number is out of range; CheckpointError when
/// a file cannot be written; errors of Model::run propagate (the shard being written is left as a
/// .tmp file, ignored and overwritten by the next run).
ExtractSummary extract(const Model& model, const ExtractPlan& plan, const std::string& out,
                       const ExtractRunOptions& run = {});

}  // namespace mixlens
