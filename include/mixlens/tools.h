// Library helpers behind the CLI (kept here so no logic lives only in a front end).
#pragma once
#include <string>
#include <vector>

#include "mixlens/model.h"

namespace mixlens {

/// The mixlens version ("0.1.0"): CMakeLists.txt's project(VERSION), the one source of the version
/// (the Python package's metadata reads it from there too).
std::string version();

/// The model used when none is given: $MIXLENS_MODEL, else the small Mamba-2 shipped in the Python
/// package installed next to this executable (SITE/mixlens.scripts/EXE -> SITE/mixlens/models/
/// mamba2-tinystories for a wheel repaired by auditwheel; PREFIX/bin/EXE -> PREFIX/lib/python3*/
/// {site,dist}-packages/mixlens/models/mamba2-tinystories otherwise), else the repository's
/// models/mamba2-tinystories (development builds).
std::string default_model_path();

/// The Python interpreter `mixlens plot` runs its renderer with (`python -m mixlens.plot`: the pictures are
/// drawn by the Python package's optional plot extra, never in C++): $MIXLENS_PYTHON when set; else
/// python3 (then python) beside this executable (PREFIX/bin of a venv or an install); else, for a wheel
/// repaired by auditwheel (PREFIX/lib/python3.X/site-packages/mixlens.scripts/EXE), PREFIX/bin/python3;
/// else "python3", for the caller to look up on PATH. Only checks that the file exists.
std::string plot_python();

/// The one hub resolver (also behind Model::load and mixlens.hub.resolve): the snapshot folder of
/// "owner/name[@revision]" in the local HuggingFace cache `cache_dir` (empty: $HF_HUB_CACHE,
/// $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub,
/// read now). Never leaves the cache: a refs file holding an absolute path or ".." is refused.
/// CheckpointError naming the id and the place looked in.
std::string resolve_hub_id(const std::string& hub_id, const std::string& cache_dir = "");
/// The cache directory resolve_hub_id uses when given none ("" when HOME is unset).
std::string hub_cache_dir();

/// Human-readable summary: family, layer kinds, every value with its shape for a batch of one
/// prompt of `prompt_length` tokens, and the support() reasons for values a block lacks.
std::string describe_model(const Model& model, int64_t prompt_length);

/// Writes a trace's saved values to a safetensors file: one tensor per saved path (key
/// "PATH@step{k}" when `per_step`, else "PATH"), plus metadata "mixlens" = JSON {model, prompts,
/// prompt_ids, generated_ids}, and the left-padded prompt batch as int64 tensors "input_ids" and
/// "attention_mask" [B,T] (1 = real token), as transformers' tokenizer(padding_side="left") gives
/// them. Returns the names of the tensors written, in file order (the saved paths, then
/// "input_ids" and "attention_mask"). CheckpointError if the file cannot be written; InputError
/// (check_trace_file) if it is one of the model's own checkpoint files.
std::vector<std::string> write_trace(const std::string& file, const Trace& trace, const Model& model,
                 const std::vector<std::string>& prompts, const std::vector<std::vector<int32_t>>& prompt_ids,
                 const std::vector<std::vector<int32_t>>& generated_ids, bool per_step);

/// InputError when `file` is (or would replace) a file the model was loaded from: model.safetensors,
/// its shards and index, config.json, tokenizer.json / tokenizer_config.json, also through a symlink
/// (hub cache snapshots). The CLI checks --out with it before running.
void check_trace_file(const std::string& file, const Model& model);

/// What convert_checkpoint wrote.
struct ConvertReport {
  std::string out_dir;
  int64_t converted = 0;       ///< matmul weights rounded to the target dtype (or copied: already in it)
  int64_t kept = 0;            ///< other tensors, copied byte for byte in their own dtype
  uint64_t bytes_before = 0;   ///< tensor bytes of the source checkpoint
  uint64_t bytes_after = 0;    ///< tensor bytes written
  std::vector<std::string> copied_files;  ///< the other files of the folder (config, tokenizer, ...)
};

/// Writes `out_dir` (created; InputError when it exists and is not empty, or is the source) as a
/// copy of the checkpoint `path_or_hub_id` whose matmul weights (ModelInfo::matmul_weights: the
/// tensors LoadOptions::dtype narrows) are stored in `dtype` ("bfloat16" or "float16"), rounded to
/// nearest even from float32 as a load with that dtype rounds them; every other tensor (norms,
/// A_log, conv weights, biases, ...) is copied in its own dtype, and the folder's other files
/// (config.json, tokenizer files) are copied, so loading `out_dir` with dtype "auto" or `dtype`
/// gives bitwise the numbers of loading the source with `dtype`, without the conversion at each
/// load (issue 27: `mixlens convert`). One model.safetensors, written a tensor at a time. The
/// source is loaded once with `dtype` to learn which tensors are matmul weights. Errors: those of
/// Model::load; InputError for another dtype; CheckpointError when writing fails (a partial output
/// folder is removed).
ConvertReport convert_checkpoint(const std::string& path_or_hub_id, const std::string& out_dir,
                                 const std::string& dtype = "bfloat16");

}  // namespace mixlens
