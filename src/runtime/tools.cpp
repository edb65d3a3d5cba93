#include "mixlens/tools.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/hub.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "mixlens/errors.h"

#ifndef MIXLENS_DEFAULT_MODEL_DIR
#define MIXLENS_DEFAULT_MODEL_DIR "models/mamba2-tinystories"
#endif

#ifndef MIXLENS_VERSION
#error "MIXLENS_VERSION must be defined by the build (CMakeLists.txt project VERSION)"
#endif

namespace mixlens {

std::string version() { return MIXLENS_VERSION; }

std::string default_model_path() {
  if (const char* env = std::getenv("MIXLENS_MODEL"); env && *env) return env;
  // Installed from a wheel: the CLI is PREFIX/bin/mixlens and the model ships in the Python package,
  // PREFIX/lib/pythonX.Y/{site,dist}-packages/mixlens/models/ (venv, --user and system layouts).
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // auditwheel moves the CLI into site-packages/mixlens.scripts/ (bin/mixlens is a launcher).
    if (const fs::path m = exe.parent_path().parent_path() / "mixlens" / "models" / "mamba2-tinystories";
        fs::is_regular_file(m / "config.json", ec))
      return m.lexically_normal().string();
    const fs::path prefix = exe.parent_path().parent_path();
    for (const char* lib : {"lib", "lib64"}) {
      std::vector<fs::path> found;
      for (fs::directory_iterator it(prefix / lib, ec), end; !ec && it != end; it.increment(ec))
        if (it->path().filename().string().rfind("python3", 0) == 0)
          for (const char* site : {"site-packages", "dist-packages"}) {
            const fs::path m = it->path() / site / "mixlens" / "models" / "mamba2-tinystories";
            if (fs::is_regular_file(m / "config.json", ec)) found.push_back(m);
          }
      std::sort(found.begin(), found.end());  // deterministic when several Pythons have it
      if (!found.empty()) return found.back().string();
      ec.clear();
    }
  }
  return MIXLENS_DEFAULT_MODEL_DIR;  // the source tree of a development build
}

std::string plot_python() {
  if (const char* env = std::getenv("MIXLENS_PYTHON"); env && *env) return env;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // PREFIX/bin/EXE, or SITE/mixlens.scripts/EXE with SITE = PREFIX/lib/python3.X/site-packages.
    for (const fs::path& bin : {exe.parent_path(), exe.parent_path().parent_path().parent_path().parent_path().parent_path() / "bin"})
      for (const char* name : {"python3", "python"})
        if (fs::exists(bin / name, ec)) return (bin / name).lexically_normal().string();
  }
  return "python3";
}

std::string resolve_hub_id(const std::string& hub_id, const std::string& cache_dir) {
  return io::resolve_hub_id(hub_id, cache_dir).string();
}

std::string hub_cache_dir() { return io::hub_cache_dir().string(); }

std::string describe_model(const Model& model, int64_t prompt_length) {
  const auto& info = model.info();
  std::ostringstream o;
  o << "model:  " << info.path << "\n"
    << "family: " << info.family << " (model_type " << info.model_type << ")\n"
    << "layers: " << info.num_layers << ", hidden " << info.hidden_size << ", vocab " << info.vocab_size << "\n"
    << "layer kinds:";
  for (size_t i = 0; i < info.layer_kinds.size(); ++i) o << " " << i << ":" << layer_kind_name(info.layer_kinds[i]);
  o << "\n\nvalues for one prompt of " << prompt_length << " tokens (B=1, T=" << prompt_length << "):\n";
  for (const auto& v : model.values(1, prompt_length))
    o << "  " << v.path << "  " << shape_str(v.shape) << (v.writable ? "" : "  read-only") << "\n      "
      << v.meaning << "\n";
  o << "\nnot available:\n";
  for (const auto& [name, per_layer] : model.support())
    for (const auto& [layer, reason] : per_layer)
      if (!reason.empty()) {
        o << "  " << name << ": " << reason << "\n";
        break;  // one line per value name; the reason names the block kind
      }
  return o.str();
}

namespace {

// The names a model folder's loader reads: weights (single file or shards), index, config, tokenizer.
bool checkpoint_name(const std::filesystem::path& p) {
  const std::string n = p.filename().string();
  return n == "model.safetensors" || n == "model.safetensors.index.json" || n == "config.json" ||
         n == "tokenizer.json" || n == "tokenizer_config.json" ||
         (n.rfind("model-", 0) == 0 && p.extension() == ".safetensors");
}

// True when writing `file` would replace a file the model was loaded from, through a symlink too (a hub
// cache snapshot links its files to blobs).
bool is_checkpoint_file(const std::filesystem::path& file, const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (checkpoint_name(file) && fs::equivalent(file.parent_path().empty() ? fs::path(".") : file.parent_path(), folder, ec))
    return true;
  if (!fs::exists(file, ec)) return false;
  std::error_code eq;  // a broken link among the folder's files answers false, and the walk goes on
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec))
    if (checkpoint_name(it->path()) && fs::equivalent(it->path(), file, eq)) return true;
  return false;
}

}  // namespace

void check_trace_file(const std::string& file, const Model& model) {
  if (is_checkpoint_file(file, model.info().path))
    throw InputError("'" + file + "' is a file of the loaded checkpoint (" + model.info().path +
                     "): writing the values there would overwrite the model's own weights / config; give another path");
}

std::vector<std::string> write_trace(const std::string& file, const Trace& trace, const Model& model,
                 const std::vector<std::string>& prompts, const std::vector<std::vector<int32_t>>& prompt_ids,
                 const std::vector<std::vector<int32_t>>& generated_ids, bool per_step) {
  check_trace_file(file, model);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [key, t] : trace.saved()) {
    std::string k = key;
    if (!per_step) k = k.substr(0, k.rfind("@step"));
    tensors.emplace_back(k, t);
  }
  nlohmann::json meta;
  meta["model"] = model.info().path;
  meta["family"] = model.info().family;
  meta["prompts"] = prompts;
  meta["prompt_ids"] = prompt_ids;
  meta["generated_ids"] = generated_ids;
  // The prompt batch as the forward saw it (left-padded), so saved [B,T,...] values can be masked.
  const Batch b = Batch::left_padded(prompt_ids, model.pad_token_id());
  io::I64Tensor ids{{b.batch, b.seq}, {b.ids.begin(), b.ids.end()}};
  io::I64Tensor mask{{b.batch, b.seq}, {b.mask.begin(), b.mask.end()}};
  io::write_safetensors(file, tensors, {{"mixlens", meta.dump()}}, {{"input_ids", ids}, {"attention_mask", mask}});
  std::vector<std::string> names;
  for (const auto& [k, t] : tensors) names.push_back(k);
  names.push_back("input_ids");
  names.push_back("attention_mask");
  return names;
}

ConvertReport convert_checkpoint(const std::string& path_or_hub_id, const std::string& out_dir,
                                 const std::string& dtype) {
  namespace fs = std::filesystem;
  if (dtype != "bfloat16" && dtype != "float16")
    throw InputError("convert: dtype '" + dtype + "' is not one of bfloat16, float16" +
                     (dtype == "int8" ? std::string(" (int8 is quantized at load, in seconds: load the source with dtype int8)") : ""));
  const fs::path src = io::resolve_model(path_or_hub_id), dst(out_dir);
  std::error_code ec;
  if (fs::exists(dst, ec) && (fs::equivalent(src, dst, ec) || !fs::is_directory(dst) || !fs::is_empty(dst)))
    throw InputError("convert: the output folder '" + out_dir + "' exists and is not an empty folder (or is the source)");
  std::vector<std::string> matmul;
  {
    const Model m = Model::load(src.string(), LoadOptions{dtype, std::nullopt});
    matmul = m.info().matmul_weights;
  }
  // The weights go through the load's own conversion (get_matmul: same rounding, same range checks),
  // the other tensors byte for byte, each only when the writer reaches it.
  io::WeightStore store = io::WeightStore::open(src);
  store.set_matmul_dtype(dtype);
  ConvertReport r;
  r.out_dir = dst.string();
  std::vector<io::StreamedTensor> tensors;
  for (const std::string& name : store.names()) {
    const io::TensorInfo& info = store.info(name);
    r.bytes_before += info.nbytes;
    if (!std::binary_search(matmul.begin(), matmul.end(), name)) {
      ++r.kept;
      r.bytes_after += info.nbytes;
      tensors.push_back({name, info.dtype, info.shape, [&store, name](uint8_t* out) {
                           const std::span<const uint8_t> b = store.bytes(name);
                           std::copy(b.begin(), b.end(), out);
                           store.release(name);
                         }});
      continue;
    }
    ++r.converted;
    r.bytes_after += static_cast<uint64_t>(shape_numel(info.shape)) * 2;
    tensors.push_back({name, dtype == "bfloat16" ? io::DType::BF16 : io::DType::F16, info.shape,
                       [&store, name, shape = info.shape](uint8_t* out) {
                         const Tensor t = store.get_matmul(name, shape);
                         std::memcpy(out, t.raw(), static_cast<size_t>(t.numel()) * 2);
                       }});
  }
  fs::create_directories(dst, ec);
  if (ec) throw CheckpointError("convert: cannot create '" + out_dir + "': " + ec.message());
  try {
    io::write_safetensors_streamed(dst / "model.safetensors", tensors,
                                   {{"format", "pt"}, {"mixlens_convert", "matmul weights in " + dtype + " from " + src.string()}});
    for (fs::directory_iterator it(src), end; it != end; ++it) {
      const fs::path p = it->path();
      const std::string n = p.filename().string();
      if (p.extension() == ".safetensors" || n == "model.safetensors.index.json" || !fs::is_regular_file(p)) continue;
      fs::copy_file(p, dst / n, fs::copy_options::overwrite_existing);  // follows a hub snapshot's symlinks
      r.copied_files.push_back(n);
    }
  } catch (...) {
    fs::remove_all(dst, ec);
    throw;
  }
  std::sort(r.copied_files.begin(), r.copied_files.end());
  return r;
}

}  // namespace mixlens
