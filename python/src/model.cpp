// Model, Cache, kernel routing: the non-interleaved API (pre-registered saves and edits).
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "interrupt.h"
#include "mixlens/mixing.h"
#include "mixlens/model.h"
#include "mixlens/tools.h"
#include "mixlens/trace.h"

namespace mixlens::py {

using Rows = std::vector<std::vector<int32_t>>;

GenerateOptions make_options(int max_new_tokens, bool greedy, float temperature, int top_k, float top_p,
                             uint64_t seed, std::optional<int32_t> eos_token_id) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.greedy = greedy;
  o.temperature = temperature;
  o.top_k = top_k;
  o.top_p = top_p;
  o.seed = seed;
  o.eos_token_id = eos_token_id;
  return o;
}

Batch prompt_batch(const Model& mo, const Rows& prompts, const std::optional<FloatArray>& embeds,
                   const std::vector<uint8_t>& mask) {
  if (!embeds) return mask.empty() ? Batch::left_padded(prompts, mo.pad_token_id()) : Batch::padded(prompts, mask);
  if (!prompts.empty()) throw InputError("give token ids / text or inputs_embeds, not both");
  return Batch::from_embeddings(from_numpy(*embeds), mask);
}

Batch continuation_batch(const Rows& rows, const std::optional<FloatArray>& embeds) {
  if (embeds) {
    if (!rows.empty()) throw InputError("give token ids / text or inputs_embeds, not both");
    return Batch::from_embeddings(from_numpy(*embeds));
  }
  Batch b = Batch::left_padded(rows, 0);
  if (b.has_padding())
    throw InputError("forward with a cache: every row must have the same number of tokens (got rows of different "
                     "lengths): each row of a cache, a fresh one included, continues its own stream token for "
                     "token. Run prompts of different lengths without a cache (trace / generate left-pad them), "
                     "or give each prompt its own cache (new_cache(1))");
  return b;
}

namespace {

nb::dict info_dict(const Model& m) {
  const ModelInfo& i = m.info();
  nb::dict d;
  d["family"] = i.family;
  d["model_type"] = i.model_type;
  d["path"] = i.path;
  d["num_layers"] = i.num_layers;
  d["hidden_size"] = i.hidden_size;
  d["vocab_size"] = i.vocab_size;
  d["dtype"] = i.dtype;
  d["weight_dtypes"] = nb::cast(i.weight_dtypes);
  d["matmul_weights"] = nb::cast(i.matmul_weights);
  d["deterministic"] = i.deterministic;
  nb::list kinds;
  for (LayerKind k : i.layer_kinds) kinds.append(nb::str(std::string(layer_kind_name(k)).c_str()));
  d["layer_kinds"] = kinds;
  return d;
}

nb::list values_list(const Model& m, int64_t batch, int64_t seq) {
  nb::list out;
  for (const ValueInfo& v : m.values(batch, seq)) {
    nb::dict d;
    d["path"] = v.path;
    d["layer"] = v.site.layer;
    d["shape"] = nb::tuple(nb::cast(v.shape));
    d["writable"] = v.writable;
    d["per_token"] = v.per_token;
    d["meaning"] = v.meaning;
    out.append(d);
  }
  return out;
}

}  // namespace

void init_model(nb::module_& m) {
  m.def("default_model_path", &default_model_path,
        "The model used when none is given: $MIXLENS_MODEL, else the models/mamba2-tinystories shipped in an "
        "installed package next to the running executable's prefix, else the source tree's (mixlens::"
        "default_model_path; mixlens.default_model_path() looks in this package first).");
  m.def("resolve_hub_id", &resolve_hub_id, nb::arg("hub_id"), nb::arg("cache_dir") = "",
        "Snapshot folder of 'owner/name[@revision]' in the local HuggingFace cache (the C++ resolver "
        "Model.load uses; never leaves the cache). CheckpointError when absent.");
  m.def("hub_cache_dir", &hub_cache_dir, "The HuggingFace cache resolve_hub_id uses by default, read now.");
  m.def(
      "convert_checkpoint",
      [](const std::string& path, const std::string& out_dir, const std::string& dtype) {
        ConvertReport r;
        {
          nb::gil_scoped_release release;
          r = convert_checkpoint(path, out_dir, dtype);
        }
        nb::dict d;
        d["out_dir"] = r.out_dir;
        d["converted"] = r.converted;
        d["kept"] = r.kept;
        d["bytes_before"] = r.bytes_before;
        d["bytes_after"] = r.bytes_after;
        d["copied_files"] = nb::cast(r.copied_files);
        return d;
      },
      nb::arg("path"), nb::arg("out_dir"), nb::arg("dtype") = "bfloat16",
      "mixlens::convert_checkpoint: writes out_dir with the matmul weights in dtype; returns a dict "
      "{out_dir, converted, kept, bytes_before, bytes_after, copied_files}.");
  m.def(
      "split_step",
      [](const std::string& key) {
        const StepPath sp = split_step(key);
        return std::make_tuple(sp.path, sp.steps.first, sp.steps.last);
      },
      nb::arg("key"),
      "mixlens::split_step: 'path@step3' -> (path, 3, 3), 'path' -> (path, 0, 2**31 - 1) (every step); the "
      "one parser of the '@step<k>' suffix (InputError when malformed).");
  m.def("route_kernels", &route_kernels, nb::arg("family"), nb::arg("route"),
        "Force the recurrent-mixer algorithm of a family process-wide: 'recurrent', 'chunked' or 'default'.");
  m.def(
      "kernel_route",
      [](const std::string& family) -> std::string {
        switch (kernel_route(family)) {
          case KernelRoute::chunked: return "chunked";
          case KernelRoute::recurrent: return "recurrent";
          default: return "default";
        }
      },
      nb::arg("family"));
  m.def(
      "set_chunk_size", [](Model& model, int64_t chunk) { model.set_chunk_size(chunk); }, nb::arg("model"),
      nb::arg("chunk_size"), "Mamba-2 chunk size override (1 = chunk_per_token); 0 restores config.chunk_size.");

  nb::class_<Cache>(m, "Cache", "Cached recurrent state of a batch (conv windows and SSM states per layer).")
      .def_prop_ro("batch", &Cache::batch)
      .def_prop_ro("seen_tokens", &Cache::seen_tokens)
      .def_prop_ro("steps", &Cache::steps, "forward calls made with this cache (the next call's step index)")
      .def_prop_ro("broken", &Cache::broken,
                   "'' while consistent; else why not (a forward over it stopped midway). A broken cache "
                   "refuses forward and copy (InputError) until restore(snapshot).")
      .def("copy", &Cache::copy, nb::keep_alive<0, 1>(),
           "An independent deep copy (conv windows, recurrent states, KV entries, counters), bitwise.")
      .def("restore", &Cache::restore, nb::arg("snapshot"),
           "Make this cache bitwise equal to `snapshot` (a copy() of a cache of the same model and batch).");

  // Tokenizer::StreamDecoder as is: the Python DecodeStream (mixlens._tokenizer) maps "" to None and
  // checks the ids; the decoder holds the tokenizer's tables, so it outlives the Model.
  nb::class_<Tokenizer::StreamDecoder>(m, "StreamDecoder",
                                       "Incremental decoding (mixlens/tokenizer.h Tokenizer::StreamDecoder).")
      .def("push", nb::overload_cast<const std::vector<int32_t>&>(&Tokenizer::StreamDecoder::push), nb::arg("ids"),
           "One step of `ids`: the text of the ids since the last non-empty return, or '' while it would end in "
           "U+FFFD (a split UTF-8 character held back; HF DecodeStream's rule); an id with no token decodes to "
           "nothing.")
      .def("flush", &Tokenizer::StreamDecoder::flush,
           "What is held back (an incomplete character as U+FFFD); the stream starts over.");

  nb::class_<Model>(m, "Model")
      .def_static(
          "load",
          [](const std::string& path, const std::string& dtype, std::optional<bool> deterministic) {
            nb::gil_scoped_release r;
            LoadOptions o;
            o.dtype = dtype;
            o.deterministic = deterministic;
            return Model::load(path, o);
          },
          nb::arg("path"), nb::arg("dtype") = "float32", nb::arg("deterministic") = nb::none(),
          "Load a checkpoint; dtype: 'float32' (default), 'bfloat16', 'float16' or 'auto' (LoadOptions::dtype); "
          "deterministic: batch-invariant numerics (LoadOptions::deterministic; None: MIXLENS_DETERMINISTIC).")
      .def_prop_ro("info", &info_dict)
      .def("values", &values_list, nb::arg("batch") = 1, nb::arg("seq") = 1)
      .def("support", &Model::support)
      .def_prop_ro("has_tokenizer", &Model::has_tokenizer)
      .def_prop_ro("pad_token_id", &Model::pad_token_id)
      .def_prop_ro("eos_token_id", &Model::eos_token_id)
      .def(
          "encode", [](const Model& mo, const std::string& text, bool special) { return mo.tokenizer().encode(text, special); },
          nb::arg("text"), nb::arg("add_special_tokens") = true)
      .def(
          "decode",
          [](const Model& mo, const std::vector<int32_t>& ids, bool skip) { return mo.tokenizer().decode(ids, skip); },
          nb::arg("ids"), nb::arg("skip_special_tokens") = false)
      .def(
          "stream_decoder",
          [](const Model& mo, bool skip) { return Tokenizer::StreamDecoder(mo.tokenizer(), skip); },
          nb::arg("skip_special_tokens") = false,
          "A Tokenizer::StreamDecoder of this model's tokenizer (TokenizerError without tokenizer.json).")
      .def("token_to_id", [](const Model& mo, const std::string& t) { return mo.tokenizer().token_to_id(t); })
      .def("id_to_token", [](const Model& mo, int32_t id) { return mo.tokenizer().id_to_token(id); })
      .def_prop_ro("tokenizer_vocab_size", [](const Model& mo) { return mo.tokenizer().vocab_size(); })
      .def(
          "mixer_identity",
          [](const Model& mo, int layer, int64_t prompt_seq) {
            const MixerIdentity id = mixer_identity(mo, layer, prompt_seq);
            nb::dict d;
            d["kind"] = id.kind;
            d["prompt_kernel"] = id.prompt_kernel;
            d["step_kernel"] = id.step_kernel;
            d["state_op"] = id.state_op;
            return d;
          },
          nb::arg("layer"), nb::arg("prompt_seq"),
          "mixlens::mixer_identity (mixlens/trace.h): {kind, prompt_kernel, step_kernel, state_op} of a layer's "
          "recurrent mixer.")
      .def("set_chunk_size", &Model::set_chunk_size, nb::arg("chunk_size"))
      .def_prop_rw("prefill_chunk", &Model::prefill_chunk, &Model::set_prefill_chunk,
                   "Chunked prefill length in tokens (0 = off); see Model::set_prefill_chunk.")
      .def(
          "project_on_vocab",
          [](const Model& mo, const FloatArray& hidden) {
            Tensor h = from_numpy(hidden);
            Tensor out;
            {
              nb::gil_scoped_release r;
              out = mo.project_on_vocab(h);
            }
            return to_numpy(std::move(out));
          },
          nb::arg("hidden"), "Model::project_on_vocab: final norm + LM head, [..., D] -> [..., V].")
      .def(
          "head_weight", [](const Model& mo, const std::string& role) { return to_numpy(mo.head_weight(role).clone()); },
          nb::arg("role"), "A copy of the 'embed_tokens', 'ln_final' or 'lm_head' weight.")
      .def("new_cache", &Model::new_cache, nb::arg("batch"), nb::keep_alive<0, 1>())
      .def(
          "run",
          [](const Model& mo, const Rows& prompts, const std::vector<SaveSpec>& saves,
             const std::vector<EditSpec>& edits, const std::optional<FloatArray>& embeds,
             const std::vector<uint8_t>& mask, bool all_logits) {
            Trace trace;
            register_saves(trace, saves);
            register_edits(trace, edits);
            Batch b = prompt_batch(mo, prompts, embeds, mask);
            Tensor logits = run_interruptible<Tensor>(
                [&](const std::atomic<bool>* cancel) { return mo.run(b, &trace, cancel, all_logits); });
            return nb::make_tuple(to_numpy(std::move(logits)), saved_dict(trace));
          },
          nb::arg("prompts"), nb::arg("saves") = std::vector<SaveSpec>{}, nb::arg("edits") = std::vector<EditSpec>{},
          nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{}, nb::arg("all_logits") = true,
          "One forward of token rows (left-padded here, or already padded with a 0/1 left-padding mask) or of "
          "inputs_embeds [B,T,hidden] with an optional 0/1 mask: "
          "(logits [B,T,V] or, all_logits=False, [B,1,V], {'path@step0': array}). Ctrl-C stops it between layers.")
      .def(
          "token_mixing",
          [](const Model& mo, const Rows& prompts, const std::vector<uint8_t>& mask, int layer, std::pair<int64_t, int64_t> rows,
             std::pair<int64_t, int64_t> cols, std::pair<int64_t, int64_t> heads) {
            const Batch b = prompt_batch(mo, prompts, std::nullopt, mask);
            TokenMixing r;
            {
              nb::gil_scoped_release release;
              r = token_mixing(mo, b, {layer, {rows.first, rows.second}, {cols.first, cols.second}, {heads.first, heads.second}});
            }
            return nb::make_tuple(to_numpy(std::move(r.mixing)), to_numpy(std::move(r.skip)), r.skip_meaning);
          },
          nb::arg("prompts"), nb::arg("mask"), nb::arg("layer"), nb::arg("rows"), nb::arg("cols"), nb::arg("heads"),
          "mixlens::token_mixing (include/mixlens/mixing.h): (mixing [B,h,r,c], skip [B,r,h,P], skip meaning); "
          "each range (begin, end) as a Python slice, end 2**63-1 = to the end.")
      .def(
          "state_contributions",
          [](const Model& mo, const Rows& prompts, const std::vector<uint8_t>& mask, int layer, int64_t t,
             std::pair<int64_t, int64_t> cols, std::pair<int64_t, int64_t> heads) {
            const Batch b = prompt_batch(mo, prompts, std::nullopt, mask);
            Tensor r;
            {
              nb::gil_scoped_release release;
              r = state_contributions(mo, b, {layer, {}, {cols.first, cols.second}, {heads.first, heads.second}}, t);
            }
            return to_numpy(std::move(r));
          },
          nb::arg("prompts"), nb::arg("mask"), nb::arg("layer"), nb::arg("t"), nb::arg("cols"), nb::arg("heads"),
          "mixlens::state_contributions: [B,h,c,*state] per source token of the state after token t.")
      .def(
          "generate",
          [](const Model& mo, const Rows& prompts, int max_new_tokens, bool greedy, float temperature, int top_k,
             float top_p, uint64_t seed, std::optional<int32_t> eos, const std::vector<SaveSpec>& saves,
             const std::vector<EditSpec>& edits, const std::optional<FloatArray>& embeds,
             const std::vector<uint8_t>& mask) {
            Trace trace;
            register_saves(trace, saves);
            register_edits(trace, edits);
            Batch b = prompt_batch(mo, prompts, embeds, mask);
            const GenerateOptions o = make_options(max_new_tokens, greedy, temperature, top_k, top_p, seed, eos);
            GenerationResult g = run_interruptible<GenerationResult>(
                [&](const std::atomic<bool>* cancel) { return mo.generate(b, o, &trace, cancel); });
            return nb::make_tuple(g.new_tokens, g.steps, saved_dict(trace));
          },
          nb::arg("prompts"), nb::arg("max_new_tokens"), nb::arg("greedy") = true, nb::arg("temperature") = 1.0f,
          nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("seed") = 0, nb::arg("eos_token_id") = nb::none(),
          nb::arg("saves") = std::vector<SaveSpec>{}, nb::arg("edits") = std::vector<EditSpec>{},
          nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
          "(new tokens per prompt, steps, {'path@step{k}': array}). Ctrl-C stops it between layers.")
      .def(
          "forward",
          [](const Model& mo, const Rows& rows, Cache& cache, const std::vector<SaveSpec>& saves,
             const std::vector<EditSpec>& edits, bool all_logits, const std::optional<FloatArray>& embeds) {
            Trace trace;
            register_saves(trace, saves);
            register_edits(trace, edits);
            Batch b = continuation_batch(rows, embeds);
            Tensor logits = run_interruptible<Tensor>(
                [&](const std::atomic<bool>* cancel) { return mo.forward(b, cache, &trace, all_logits, cancel); });
            return nb::make_tuple(to_numpy(std::move(logits)), saved_dict(trace));
          },
          nb::arg("rows"), nb::arg("cache"), nb::arg("saves") = std::vector<SaveSpec>{},
          nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("all_logits") = true, nb::arg("embeds") = nb::none(),
          "One forward call continuing `cache` (updated in place): (logits, saved). Ctrl-C stops it between "
          "layers (the cache is then unspecified: restore a copy()).");
}

}  // namespace mixlens::py
