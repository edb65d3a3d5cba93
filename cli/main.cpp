// mixlens command-line tool: a thin front end over the library (flag parsing and printing only).
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <cerrno>
#include <cstring>
#include <unistd.h>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <limits>
#include <map>
#include <new>
#include <stdexcept>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/extract.h"
#include "mixlens/model.h"
#include "mixlens/tools.h"

namespace {

// The help, in pieces: `mixlens --help` prints them all, `mixlens <command> --help` (or `mixlens help
// <command>`) the usage and options of that command.
constexpr const char* kHead = "mixlens: read and write every value of recurrent language models\n\nusage:\n";
constexpr const char* kUseGenerate = R"(  mixlens generate [--model DIR|HUB_ID] [--dtype D] [--deterministic] PROMPT... --max-new-tokens N
                   [--greedy | --temperature T --top-k K --top-p P --seed S]
                   [--save PATH ...] [--out FILE] [--ids]
)";
constexpr const char* kUseRun = R"(  mixlens run      [--model DIR|HUB_ID] [--dtype D] [--deterministic] PROMPT... --save PATH ... --out FILE [--ids]
)";
constexpr const char* kUsePrompts = R"(  (PROMPT... may be replaced or joined by --prompt-file PATH / --ids-file PATH, each repeatable)
)";
constexpr const char* kUseInspect = R"(  mixlens inspect  [--model DIR|HUB_ID] [--dtype D] [--prompt-length T]
)";
constexpr const char* kUseTokenize = R"(  mixlens tokenize [--model DIR|HUB_ID] [--dtype D] TEXT
)";
constexpr const char* kUseExtract = R"(  mixlens extract  [--model DIR|HUB_ID] [--dtype D] [--deterministic] PROMPTS_FILE --values PATH ... --out DIR
                   [--batch-size N] [--positions all|last|mask] [--text-field F] [--mask-field F]
                   [--shard-bytes N] [--max-bytes N] [--hash-prompts]
)";
constexpr const char* kUseConvert = R"(  mixlens convert  [--model DIR|HUB_ID] [--dtype bfloat16|float16] --out DIR
)";
constexpr const char* kUsePlot = R"(  mixlens plot     KIND PROMPT --out FILE.html|FILE.png [--model DIR|HUB_ID] [--dtype D] [--layers 0,2]
)";
constexpr const char* kPlot = R"(plot: draw KIND (logit-lens, state-norm, decay, beta, attention) for PROMPT into --out: interactive
self-contained HTML (plotly, opens offline) or PNG (matplotlib), by the extension. The pictures are drawn
by the Python package (python -m mixlens.plot, with the optional extra: pip install 'mixlens[plot]'),
run with the Python beside this executable, $MIXLENS_PYTHON to choose another; `mixlens plot --help`
prints its options (docs/plots.md).
)";
constexpr const char* kConvert = R"(convert: write DIR, a copy of the checkpoint whose matmul weights (projections, embeddings, lm_head,
experts) are stored in --dtype (default bfloat16; rounded to nearest even, as a load with that dtype
rounds them) and every other tensor in its own dtype, with the folder's config and tokenizer files;
loading DIR with --dtype auto gives bitwise the numbers of loading the source with --dtype, without
converting at each load.
)";
constexpr const char* kOptModel = R"(  --model      checkpoint folder or hub id from the local HuggingFace cache
               (default: $MIXLENS_MODEL, else the model shipped with mixlens)
)";
constexpr const char* kOptSaveOut = R"(  --save PATH  a value path, e.g. layers.3.linear_attn.states or layers.*.linear_attn.state_output;
               layers.1.linear_attn.state@t5 is the state after token 5 (@t-1: the last token);
               PATH@step{k} saves step k alone (0: the prompt, k >= 1: the k-th decode step), e.g.
               layers.0.linear_attn.state@t0@step2 (repeatable; `mixlens inspect` lists them all)
  --out FILE   safetensors file: one tensor per saved path (generate: PATH@step{k}),
               with a JSON "mixlens" metadata entry (model, prompts, token ids)
  --ids        PROMPT is comma-separated token ids instead of text
)";
constexpr const char* kOptDtype = R"(  --dtype D    weights kept and multiplied as float32 (default), bfloat16, float16, int8
               (quantized at load in blocks of 32, as llama.cpp's Q8_0) or auto (the
               checkpoint's dtype); values are float32 whatever the dtype
)";
constexpr const char* kOptDeterministic = R"(  --deterministic  batch-invariant numerics: a prompt's values are bitwise the same alone or
               batched with others, on any thread count (slower prompts; LoadOptions::deterministic)
)";
constexpr const char* kOptPrompts = R"(  --prompt-file PATH   one text prompt: the file's content (less one trailing newline)
  --ids-file PATH      one prompt of token ids: whitespace- or comma-separated, or a JSON list
                       (a JSON list of lists: one prompt per inner list)
  -            as PROMPT or PATH: read that prompt from standard input (once)
  several prompts run as one left-padded batch, in the order given; prompts of any length
  (e.g. 32k tokens) go through files or stdin, which have no argument-list limit
)";
constexpr const char* kOptGenerate = R"(  --max-new-tokens N   tokens to generate per prompt (required, >= 1)
  --greedy             argmax decoding: the default when no sampling flag is given
  --temperature T      sampling temperature (> 0, default 1); any sampling flag turns sampling on
  --top-k K            sample among the K likeliest tokens (0 = all, default)
  --top-p P            sample within the smallest set of probability >= P (in (0, 1], 1 = off, default)
  --seed S             the sampler's seed (default 0): the same seed gives the same tokens
)";
constexpr const char* kOptInspect = R"(  --prompt-length T  the tokens per call that the listed value shapes assume (default 8)
)";
constexpr const char* kExtract = R"(extract: run every prompt of PROMPTS_FILE (.jsonl: one object per line with a "text" field; else
plain text, one prompt per line) and write the values of their real tokens to DIR as sharded
safetensors + index.json (layout: docs/extract.md). A rerun with the same arguments resumes: shards
already written are skipped.
  --values PATH      value paths as for --save (repeatable, or comma-separated)
  --text-field F     the .jsonl field that holds each prompt (default "text")
  --batch-size N     prompts per forward (left-padded batch; default 8)
  --positions P      all (every token, default), last (the last token), or mask (the 0/1 list in
                     each jsonl line's --mask-field F, default "mask")
  --shard-bytes N    data bytes per shard (default 256M; K/M/G suffixes = 2^10/2^20/2^30)
  --max-bytes N      refuse to start when the estimated output is larger (default: no limit)
  --hash-prompts     index.json keeps FNV-1a hashes of the prompts instead of their text
)";

// The help for `command` ("" = every command); empty for an unknown one.
std::string help_text(const std::string& command) {
  const std::string head = kHead;
  if (command.empty())
    return head + kUseGenerate + kUseRun + kUsePrompts + kUseInspect + kUseTokenize + kUseExtract + kUseConvert +
           kUsePlot + "  mixlens --version\n\n" + kOptModel + kOptGenerate + kOptSaveOut + kOptDtype + kOptDeterministic + kOptPrompts + "\n" +
           kExtract + "\n" + kConvert + "\n" + kPlot;
  if (command == "generate")
    return head + kUseGenerate + kUsePrompts + "\n" + kOptModel + kOptGenerate + kOptSaveOut + kOptDtype +
           kOptDeterministic + kOptPrompts;
  if (command == "run")
    return head + kUseRun + kUsePrompts + "\n" + kOptModel + kOptSaveOut + kOptDtype + kOptDeterministic + kOptPrompts;
  if (command == "inspect") return head + kUseInspect + "\n" + kOptModel + kOptInspect + kOptDtype;
  if (command == "tokenize") return head + kUseTokenize + "\n" + kOptModel + kOptDtype;
  if (command == "extract") return head + kUseExtract + "\n" + kOptModel + kOptDtype + kOptDeterministic + "\n" + kExtract;
  if (command == "convert") return head + kUseConvert + "\n" + kOptModel + "\n" + kConvert;
  if (command == "plot") return head + kUsePlot + "\n" + kPlot;
  return {};
}

// One prompt as given: positional text / ids, or a file (stdin for "-") of text or ids.
struct PromptArg {
  enum Kind { text, ids, text_file, ids_file } kind = text;
  std::string value;
};

struct Args {
  std::string command, model;
  std::vector<std::string> positional, saves;
  std::vector<PromptArg> prompts;  // in command-line order
  std::string out;
  mixlens::LoadOptions load;
  int max_new_tokens = -1;
  bool greedy = false, sampling_flag = false, ids = false;
  mixlens::GenerateOptions gen;
  int64_t prompt_length = 8;
  // extract
  std::vector<std::string> values;
  int64_t batch_size = 8;
  std::string positions = "all", text_field = "text", mask_field;
  uint64_t shard_bytes = 256ull << 20, max_bytes = 0;
  bool hash_prompts = false;
  bool dtype_given = false;  // convert: its default is bfloat16, not the load's float32
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "mixlens: %s\n(run `mixlens --help` for usage)\n", msg.c_str());
  std::exit(2);
}

template <class T>
T parse_number(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    T out;
    if constexpr (std::is_same_v<T, float>) {
      out = std::stof(v, &used);
      if (!std::isfinite(out)) throw std::out_of_range(v);  // "nan" / "inf" parse but are never a setting
    } else if constexpr (std::is_same_v<T, uint64_t>) {
      if (v.find('-') != std::string::npos) throw std::out_of_range(v);  // stoull wraps "-1"
      out = std::stoull(v, &used);
    } else {
      // Range-check before narrowing: a silently wrapped id or count is a wrong result.
      const long long wide = std::stoll(v, &used);
      if (wide < std::numeric_limits<T>::min() || wide > std::numeric_limits<T>::max()) throw std::out_of_range(v);
      out = static_cast<T>(wide);
    }
    if (used != v.size()) throw std::invalid_argument(v);
    return out;
  } catch (const std::exception&) {
    usage_error(flag + " expects a number in range, got '" + v + "'");
  }
}

// "4096", "64K", "256M", "2G" (binary multiples).
uint64_t parse_bytes(const std::string& flag, std::string v) {
  uint64_t mult = 1;
  if (!v.empty()) {
    const char c = static_cast<char>(std::toupper(static_cast<unsigned char>(v.back())));
    const int shift = c == 'K' ? 10 : c == 'M' ? 20 : c == 'G' ? 30 : c == 'T' ? 40 : 0;
    if (shift) mult = uint64_t{1} << shift, v.pop_back();
  }
  const uint64_t n = parse_number<uint64_t>(flag, v);
  if (n > std::numeric_limits<uint64_t>::max() / mult) usage_error(flag + " is too large");
  return n * mult;
}

// The flags each command takes: one another command takes is refused, not ignored.
const std::set<std::string>* command_flags(const std::string& command) {
  using S = std::set<std::string>;
  static const S generate = {"--model", "--dtype", "--deterministic", "--save", "--out", "--ids", "--prompt-file", "--ids-file",
                             "--max-new-tokens", "--greedy", "--temperature", "--top-k", "--top-p", "--seed"};
  static const S run = {"--model", "--dtype", "--deterministic", "--save", "--out", "--ids", "--prompt-file", "--ids-file"};
  static const S inspect = {"--model", "--dtype", "--prompt-length"};
  static const S tokenize = {"--model", "--dtype"};
  static const S extract = {"--model", "--dtype", "--deterministic", "--values", "--out", "--batch-size", "--positions", "--text-field",
                            "--mask-field", "--shard-bytes", "--max-bytes", "--hash-prompts"};
  static const S convert = {"--model", "--dtype", "--out"};
  if (command == "generate") return &generate;
  if (command == "run") return &run;
  if (command == "inspect") return &inspect;
  if (command == "tokenize") return &tokenize;
  if (command == "extract") return &extract;
  if (command == "convert") return &convert;
  return nullptr;
}

// The Python side of `mixlens plot`: import the renderer (saying which Python lacks it, and how to get it)
// and run its main on the arguments after "plot".
constexpr const char* kPlotBootstrap = R"(import sys
try:
    from mixlens.plot import main
except ImportError as e:
    sys.exit(f"mixlens: error: `mixlens plot` draws with the Python package (mixlens.plot), which {sys.executable} "
             f"cannot import ({e}): install it there with its plot extra (pip install 'mixlens[plot]') or set "
             "$MIXLENS_PYTHON to a Python that has it")
sys.exit(main(sys.argv[1:]))
)";

// `mixlens plot ...`: replaces this process with the Python renderer (plotting is not reimplemented in C++).
[[noreturn]] void run_plot(int argc, char** argv) {
  const std::string python = mixlens::plot_python();
  std::vector<std::string> args = {python, "-c", kPlotBootstrap};
  for (int i = 2; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::fflush(stdout);
  execvp(python.c_str(), cargs.data());
  std::fprintf(stderr,
               "mixlens: error: `mixlens plot` draws with the Python package (python -m mixlens.plot) and cannot "
               "run the Python '%s' (%s): install Python 3 with mixlens and its plot extra (pip install "
               "'mixlens[plot]') or set $MIXLENS_PYTHON\n",
               python.c_str(), std::strerror(errno));
  std::exit(1);
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) usage_error("no command given");
  a.command = argv[1];
  if (a.command == "--version" || a.command == "-V" || a.command == "version") {
    std::printf("mixlens %s\n", mixlens::version().c_str());
    std::exit(0);
  }
  if (a.command == "--help" || a.command == "-h" || a.command == "help") {
    if (argc > 3) usage_error("help takes one command, e.g. `mixlens help generate`");
    const std::string topic = a.command == "help" && argc > 2 ? argv[2] : "";
    const std::string text = help_text(topic);
    if (text.empty()) usage_error("no help for '" + topic + "': the commands are generate, run, inspect, tokenize, extract, convert, plot");
    std::fputs(text.c_str(), stdout);
    std::exit(0);
  }
  if (a.command == "plot") run_plot(argc, argv);  // its flags are the Python renderer's
  const std::set<std::string>* flags = command_flags(a.command);
  bool only_positional = false;  // after "--": a prompt may start with '-'
  std::string inline_value;       // "--flag=value"
  bool has_inline = false;
  for (int i = 2; i < argc; ++i) {
    std::string f = argv[i];
    has_inline = false;
    if (only_positional || f == "-" || f.size() < 2 || f[0] != '-') {
      if (flags == nullptr) usage_error("unknown command '" + a.command + "'");
      a.positional.push_back(f);
      a.prompts.push_back({PromptArg::text, f});  // kind fixed below once --ids is known
      continue;
    }
    if (f == "--") {
      only_positional = true;
      continue;
    }
    if (const size_t eq = f.find('='); f.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = f.substr(eq + 1);
      f = f.substr(0, eq);
      has_inline = true;
    }
    if (f == "--help" || f == "-h") {
      const std::string text = help_text(a.command);
      if (text.empty()) usage_error("unknown command '" + a.command + "'");
      std::fputs(text.c_str(), stdout);
      std::exit(0);
    }
    if (flags == nullptr) usage_error("unknown command '" + a.command + "'");
    if (f.size() > 2 && f[0] == '-' && f[1] == '-' && !flags->count(f)) {
      if (a.command == "extract" && f == "--save") usage_error("extract takes --values, not --save");
      for (const char* c : {"generate", "run", "inspect", "tokenize", "extract", "convert"})
        if (command_flags(c)->count(f))
          usage_error(a.command + " does not take " + f + " (`mixlens " + a.command + " --help` lists what it takes)");
      usage_error("unknown flag " + f);
    }
    auto value = [&]() -> std::string {
      if (has_inline) {
        has_inline = false;
        return inline_value;
      }
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--model") a.model = value();
    else if (f == "--save") a.saves.push_back(value());
    else if (f == "--out") a.out = value();
    else if (f == "--max-new-tokens") a.max_new_tokens = parse_number<int>(f, value());
    else if (f == "--greedy") a.greedy = true;
    else if (f == "--deterministic") a.load.deterministic = true;
    else if (f == "--temperature") a.gen.temperature = parse_number<float>(f, value()), a.sampling_flag = true;
    else if (f == "--top-k") a.gen.top_k = parse_number<int>(f, value()), a.sampling_flag = true;
    else if (f == "--top-p") a.gen.top_p = parse_number<float>(f, value()), a.sampling_flag = true;
    else if (f == "--seed") a.gen.seed = parse_number<uint64_t>(f, value()), a.sampling_flag = true;
    else if (f == "--prompt-length") a.prompt_length = parse_number<int64_t>(f, value());
    else if (f == "--ids") a.ids = true;
    else if (f == "--dtype") {
      a.load.dtype = value();
      a.dtype_given = true;
      if (a.load.dtype != "float32" && a.load.dtype != "bfloat16" && a.load.dtype != "float16" && a.load.dtype != "int8" &&
          a.load.dtype != "auto")
        usage_error("--dtype must be float32, bfloat16, float16, int8 or auto, not '" + a.load.dtype + "'");
    }
    else if (f == "--prompt-file") a.prompts.push_back({PromptArg::text_file, value()});
    else if (f == "--ids-file") a.prompts.push_back({PromptArg::ids_file, value()});
    else if (f == "--values") {
      std::stringstream ss(value());
      std::string p;
      while (std::getline(ss, p, ','))
        if (!p.empty()) a.values.push_back(p);
    } else if (f == "--batch-size") a.batch_size = parse_number<int64_t>(f, value());
    else if (f == "--positions") a.positions = value();
    else if (f == "--text-field") a.text_field = value();
    else if (f == "--mask-field") a.mask_field = value();
    else if (f == "--shard-bytes") a.shard_bytes = parse_bytes(f, value());
    else if (f == "--max-bytes") a.max_bytes = parse_bytes(f, value());
    else if (f == "--hash-prompts") a.hash_prompts = true;
    else if (f.size() > 1 && f[0] == '-' && f[1] == '-') usage_error("unknown flag " + f);
    else {
      a.positional.push_back(f);
      a.prompts.push_back({PromptArg::text, f});  // kind fixed below once --ids is known
    }
    if (has_inline) usage_error(f + " takes no value (got '" + f + "=" + inline_value + "')");
  }
  for (PromptArg& p : a.prompts)
    if (p.kind == PromptArg::text && a.ids) p.kind = PromptArg::ids;
  return a;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    // "1,,2" is a typo, not two ids: refuse rather than guess.
    if (tok.empty()) usage_error("--ids prompt '" + s + "' has an empty entry (ids are separated by single commas)");
    ids.push_back(parse_number<int32_t>("--ids prompt", tok));
  }
  if (ids.empty()) usage_error("--ids prompt '" + s + "' has no token ids");
  return ids;
}

// The whole content of `path`, or of standard input for "-" (read at most once).
std::string read_source(const std::string& path, const std::string& flag) {
  static bool stdin_used = false;
  std::string out;
  if (path == "-") {
    if (stdin_used) usage_error("standard input ('-') can feed only one prompt");
    stdin_used = true;
    std::ostringstream ss;
    ss << std::cin.rdbuf();
    out = ss.str();
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) usage_error(flag + " '" + path + "' is not a readable file");
    std::ifstream f(path, std::ios::binary);
    if (!f) usage_error(flag + " '" + path + "' cannot be opened");
    std::ostringstream ss;
    ss << f.rdbuf();
    out = ss.str();
  }
  return out;
}

// Token ids of an ids file: a JSON list (of ints, or of lists of ints: several prompts), else ids
// separated by whitespace and/or commas.
std::vector<std::vector<int32_t>> parse_ids_file(const std::string& text, const std::string& where) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) usage_error(where + " has no token ids");
  auto id_of = [&](const nlohmann::json& j) -> int32_t {
    if (!j.is_number_integer()) usage_error(where + ": token ids must be integers, got " + j.dump());
    const auto v = j.get<int64_t>();
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) usage_error(where + ": token id " + j.dump() + " is out of range");
    return static_cast<int32_t>(v);
  };
  std::vector<std::vector<int32_t>> rows;
  if (text[first] == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      usage_error(where + " is not a valid JSON list: " + e.what());
    }
    if (!j.is_array() || j.empty()) usage_error(where + ": expected a non-empty JSON list of token ids");
    if (j[0].is_array()) {
      for (const auto& r : j) {
        if (!r.is_array() || r.empty()) usage_error(where + ": every inner list needs at least one token id");
        std::vector<int32_t> row;
        for (const auto& x : r) row.push_back(id_of(x));
        rows.push_back(std::move(row));
      }
    } else {
      std::vector<int32_t> row;
      for (const auto& x : j) row.push_back(id_of(x));
      rows.push_back(std::move(row));
    }
    return rows;
  }
  std::vector<int32_t> row;
  std::string tok;
  auto flush = [&] {
    if (!tok.empty()) row.push_back(parse_number<int32_t>(where, tok));
    tok.clear();
  };
  for (char c : text) {
    if (c == ',' || std::isspace(static_cast<unsigned char>(c))) flush();
    else tok += c;
  }
  flush();
  rows.push_back(std::move(row));
  return rows;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

std::string human_bytes(uint64_t b) {
  char buf[32];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

std::string clock_str(double s) {
  const long long t = static_cast<long long>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

// What `generate` runs with: the sampling flags, or greedy when none was given.
mixlens::GenerateOptions generate_options(const Args& a) {
  mixlens::GenerateOptions o = a.gen;
  o.max_new_tokens = a.max_new_tokens;
  o.greedy = !a.sampling_flag;
  return o;
}

// Model::load, saying where the path came from when it was $MIXLENS_MODEL (a stale variable would
// otherwise read as if the shipped model were broken).
mixlens::Model load_model(const Args& a, const std::string& path) {
  try {
    return mixlens::Model::load(path, a.load);
  } catch (const mixlens::Error& e) {
    const char* env = std::getenv("MIXLENS_MODEL");
    if (!a.model.empty() || env == nullptr || *env == '\0') throw;
    std::fprintf(stderr, "mixlens: error: %s (the path came from $MIXLENS_MODEL; unset it for the shipped model)\n",
                 e.what());
    std::exit(1);
  }
}

int run_extract(const Args& a, const std::string& model_path) {
  if (a.positional.size() != 1) usage_error("extract takes exactly one PROMPTS_FILE");
  if (a.values.empty()) usage_error("extract needs --values PATH ...");
  if (a.out.empty()) usage_error("extract needs --out DIR");
  const std::string mask_field = a.mask_field.empty() && a.positions == "mask" ? "mask" : a.mask_field;
  if (!mask_field.empty() && a.positions != "mask") usage_error("--mask-field needs --positions mask");
  mixlens::ExtractOptions o;
  o.values = a.values;
  o.batch_size = a.batch_size;
  o.positions = a.positions;
  o.shard_bytes = a.shard_bytes;
  o.max_bytes = a.max_bytes;
  o.store_prompts = !a.hash_prompts;
  try {
    o.check();  // the library's own rule, reported as a usage error (exit 2) before loading
  } catch (const mixlens::InputError& e) {
    usage_error(e.what());
  }
  const auto prompts = mixlens::read_prompts_file(a.positional[0], a.text_field, mask_field);
  mixlens::Model m = load_model(a, model_path);
  const mixlens::ExtractPlan plan = mixlens::plan_extraction(m, prompts, o);
  std::fprintf(stderr, "mixlens: extract %zu prompts, %lld rows, %zu values -> %s in %zu shards (about %s)\n",
               plan.ids.size(), static_cast<long long>(plan.total_rows), plan.values.size(), a.out.c_str(),
               plan.shards.size(), human_bytes(plan.total_bytes).c_str());
  mixlens::ExtractRunOptions run;
  double last = -1;
  run.on_progress = [&](const mixlens::ExtractProgress& p) {
    const bool end = p.shards_done == p.shards_total;  // the last report
    if (!end && p.elapsed_s - last < 0.5) return;  // at most two lines a second
    last = p.elapsed_s;
    const int64_t fresh = p.prompts_done - p.prompts_skipped;  // rate of this run's forwards only
    const double rate = p.elapsed_s > 0 ? static_cast<double>(fresh) / p.elapsed_s : 0;
    const std::string eta = rate > 0 ? clock_str(static_cast<double>(p.prompts_total - p.prompts_done) / rate) : "?";
    std::fprintf(stderr, "\rextract: %lld/%lld prompts  shard %lld/%lld  %s/%s  %.1f prompts/s  ETA %s   ",
                 static_cast<long long>(p.prompts_done), static_cast<long long>(p.prompts_total),
                 static_cast<long long>(p.shards_done), static_cast<long long>(p.shards_total),
                 human_bytes(p.bytes_done).c_str(), human_bytes(p.bytes_total).c_str(), rate, eta.c_str());
    if (end) std::fputc('\n', stderr);
  };
  const auto sum = mixlens::extract(m, plan, a.out, run);
  std::fprintf(stderr, "mixlens: %lld shards written, %lld already complete (resumed); index: %s\n",
               static_cast<long long>(sum.shards_written), static_cast<long long>(sum.shards_skipped),
               (std::filesystem::path(a.out) / "index.json").lexically_normal().c_str());
  return 0;
}

int run_command(const Args& a) {
  const std::string model_path = a.model.empty() ? mixlens::default_model_path() : a.model;
  if (a.command == "extract") return run_extract(a, model_path);
  if (a.command == "convert") {
    if (!a.positional.empty()) usage_error("convert takes no positional arguments (the source is --model)");
    if (a.out.empty()) usage_error("convert needs --out DIR");
    const std::string dtype = a.dtype_given ? a.load.dtype : "bfloat16";
    if (dtype != "bfloat16" && dtype != "float16") usage_error("convert --dtype must be bfloat16 or float16");
    const mixlens::ConvertReport r = mixlens::convert_checkpoint(model_path, a.out, dtype);
    std::printf("wrote %s: %lld matmul weights in %s, %lld other tensors kept; %.1f MB of tensors (was %.1f MB)\n",
                r.out_dir.c_str(), static_cast<long long>(r.converted), dtype.c_str(), static_cast<long long>(r.kept),
                static_cast<double>(r.bytes_after) / 1e6, static_cast<double>(r.bytes_before) / 1e6);
    return 0;
  }
  if (a.command == "inspect") {
    if (!a.positional.empty()) usage_error("inspect takes no positional arguments");
    if (a.prompt_length < 1) usage_error("--prompt-length must be >= 1");
    mixlens::Model m = load_model(a, model_path);
    std::fputs(mixlens::describe_model(m, a.prompt_length).c_str(), stdout);
    return 0;
  }
  if (a.command == "tokenize") {
    if (a.positional.size() != 1) usage_error("tokenize takes exactly one TEXT");
    mixlens::Model m = load_model(a, model_path);
    const auto ids = m.tokenizer().encode(a.positional[0]);
    std::printf("%s\n", join_ids(ids).c_str());
    for (int32_t id : ids) std::printf("%d\t%s\n", id, m.tokenizer().id_to_token(id).c_str());
    return 0;
  }
  if (a.command != "generate" && a.command != "run") usage_error("unknown command '" + a.command + "'");
  if (a.prompts.empty()) usage_error(a.command + " needs a PROMPT (or --prompt-file / --ids-file)");
  if (a.command == "run" && (a.saves.empty() || a.out.empty()))
    usage_error("run needs --save PATH ... and --out FILE");
  if (!a.out.empty() && a.saves.empty()) usage_error("--out needs at least one --save PATH");
  if (a.command == "generate") {
    if (a.max_new_tokens < 1) usage_error("generate needs --max-new-tokens N (N >= 1)");
    if (a.greedy && a.sampling_flag) usage_error("--greedy cannot be combined with sampling flags");
    try {
      generate_options(a).check();  // the library's own rule, reported as a usage error (exit 2) before loading
    } catch (const mixlens::InputError& e) {
      usage_error(e.what());
    }
  }
  // Save keys as every front end takes them (the library's split_step: "@step<k>" names one step).
  mixlens::Trace trace;
  for (const auto& s : a.saves) {
    try {
      const mixlens::StepPath sp = mixlens::split_step(s);
      trace.save(sp.path, sp.steps);
    } catch (const mixlens::InputError& e) {
      usage_error(std::string("--save: ") + e.what());
    }
  }
  mixlens::Model m = load_model(a, model_path);
  if (!a.out.empty()) {
    try {
      mixlens::check_trace_file(a.out, m);  // before the run, not after it
    } catch (const mixlens::InputError& e) {
      usage_error(std::string("--out: ") + e.what());
    }
  }
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> texts;    // per prompt: as given (text, ids string or file name)
  std::vector<bool> is_text;         // echoed before the continuation
  for (const PromptArg& p : a.prompts) {
    switch (p.kind) {
      case PromptArg::text:
      case PromptArg::text_file: {
        std::string t = p.kind == PromptArg::text && p.value != "-" ? p.value
                                                                   : read_source(p.value, p.kind == PromptArg::text ? "PROMPT" : "--prompt-file");
        if (p.kind == PromptArg::text_file || p.value == "-")
          if (!t.empty() && t.back() == '\n') t.pop_back();  // the file's final newline is not prompt text
        if (t.empty()) usage_error("prompt " + (p.value == "-" ? std::string("from standard input") : "'" + p.value + "'") + " is empty");
        prompts.push_back(m.tokenizer().encode(t));
        if (prompts.back().empty()) usage_error("prompt from '" + p.value + "' encodes to no tokens");
        texts.push_back(t);
        is_text.push_back(true);
        break;
      }
      case PromptArg::ids:
        if (p.value != "-") {
          prompts.push_back(parse_ids(p.value));
          texts.push_back(p.value);
          is_text.push_back(false);
          break;
        }
        [[fallthrough]];
      case PromptArg::ids_file: {
        const std::string where = p.value == "-" ? "standard input" : "--ids-file '" + p.value + "'";
        for (auto& row : parse_ids_file(read_source(p.value, "--ids-file"), where)) {
          prompts.push_back(std::move(row));
          texts.push_back(p.value);
          is_text.push_back(false);
        }
        break;
      }
    }
  }

  std::vector<std::vector<int32_t>> generated;
  if (a.command == "run") {
    m.run(prompts, &trace, /*all_logits=*/false);  // a saved `logits` still gets every position
  } else {
    auto res = m.generate(prompts, generate_options(a), &trace);
    generated = res.new_tokens;
    for (size_t r = 0; r < prompts.size(); ++r) {
      if (m.has_tokenizer() && is_text[r])
        std::printf("%s%s\n", texts[r].c_str(), m.tokenizer().decode(res.new_tokens[r]).c_str());
      else
        std::printf("%s\n", join_ids(res.new_tokens[r]).c_str());
    }
  }
  if (!a.out.empty()) {
    const auto names = mixlens::write_trace(a.out, trace, m, texts, prompts, generated, a.command == "generate");
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    std::fprintf(stderr, "mixlens: wrote %zu tensors to %s: %s\n", names.size(), a.out.c_str(), list.c_str());
  } else if (!a.saves.empty()) {
    for (const auto& [k, t] : trace.saved()) std::fprintf(stderr, "%s %s\n", k.c_str(), mixlens::shape_str(t.shape()).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  try {
    return run_command(a);
  } catch (const mixlens::Error& e) {
    std::fprintf(stderr, "mixlens: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mixlens: error: out of memory (an allocation failed); use a smaller batch, prompt or "
                         "fewer --save values\n");
    return 1;
  } catch (const std::length_error& e) {
    std::fprintf(stderr, "mixlens: error: size limit exceeded (%s)\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixlens: internal error: %s\n", e.what());
    return 3;
  }
}
