// mixlens command-line tool: a thin front end over the library (flag parsing and printing only).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <new>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/tools.h"

namespace {

const char* kUsage = R"(mixlens: read and write every value of recurrent language models

usage:
  mixlens generate [--model DIR|HUB_ID] PROMPT... --max-new-tokens N
                   [--greedy | --temperature T --top-k K --top-p P --seed S]
                   [--save PATH ...] [--out FILE] [--ids]
  mixlens run      [--model DIR|HUB_ID] PROMPT... --save PATH ... --out FILE [--ids]
  mixlens inspect  [--model DIR|HUB_ID] [--prompt-length T]
  mixlens tokenize [--model DIR|HUB_ID] TEXT

  --model      checkpoint folder or hub id from the local HuggingFace cache
               (default: $MIXLENS_MODEL, else the model shipped with mixlens)
  --save PATH  a value path, e.g. layers.3.linear_attn.states or layers.*.linear_attn.state_output;
               layers.1.linear_attn.state@t5 is the state after token 5 (@t-1: the last token)
               (repeatable; `mixlens inspect` lists them all)
  --out FILE   safetensors file: one tensor per saved path (generate: PATH@step{k}),
               with a JSON "mixlens" metadata entry (model, prompts, token ids)
  --ids        PROMPT is comma-separated token ids instead of text
  several PROMPTs run as one left-padded batch
)";

struct Args {
  std::string command, model;
  std::vector<std::string> positional, saves;
  std::string out;
  int max_new_tokens = -1;
  bool greedy = false, sampling_flag = false, ids = false;
  mixlens::GenerateOptions gen;
  int64_t prompt_length = 8;
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

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) usage_error("no command given");
  a.command = argv[1];
  if (a.command == "--help" || a.command == "-h" || a.command == "help") {
    std::fputs(kUsage, stdout);
    std::exit(0);
  }
  for (int i = 2; i < argc; ++i) {
    std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--model") a.model = value();
    else if (f == "--save") a.saves.push_back(value());
    else if (f == "--out") a.out = value();
    else if (f == "--max-new-tokens") a.max_new_tokens = parse_number<int>(f, value());
    else if (f == "--greedy") a.greedy = true;
    else if (f == "--temperature") a.gen.temperature = parse_number<float>(f, value()), a.sampling_flag = true;
    else if (f == "--top-k") a.gen.top_k = parse_number<int>(f, value()), a.sampling_flag = true;
    else if (f == "--top-p") a.gen.top_p = parse_number<float>(f, value()), a.sampling_flag = true;
    else if (f == "--seed") a.gen.seed = parse_number<uint64_t>(f, value()), a.sampling_flag = true;
    else if (f == "--prompt-length") a.prompt_length = parse_number<int64_t>(f, value());
    else if (f == "--ids") a.ids = true;
    else if (f == "--help" || f == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (f.size() > 1 && f[0] == '-' && f[1] == '-') usage_error("unknown flag " + f);
    else a.positional.push_back(f);
  }
  return a;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ','))
    if (!tok.empty()) ids.push_back(parse_number<int32_t>("--ids prompt", tok));
  if (ids.empty()) usage_error("--ids prompt '" + s + "' has no token ids");
  return ids;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

int run_command(const Args& a) {
  const std::string model_path = a.model.empty() ? mixlens::default_model_path() : a.model;
  if (a.command == "inspect") {
    if (!a.positional.empty()) usage_error("inspect takes no positional arguments");
    if (a.prompt_length < 1) usage_error("--prompt-length must be >= 1");
    mixlens::Model m = mixlens::Model::load(model_path);
    std::fputs(mixlens::describe_model(m, a.prompt_length).c_str(), stdout);
    return 0;
  }
  if (a.command == "tokenize") {
    if (a.positional.size() != 1) usage_error("tokenize takes exactly one TEXT");
    mixlens::Model m = mixlens::Model::load(model_path);
    const auto ids = m.tokenizer().encode(a.positional[0]);
    std::printf("%s\n", join_ids(ids).c_str());
    for (int32_t id : ids) std::printf("%d\t%s\n", id, m.tokenizer().id_to_token(id).c_str());
    return 0;
  }
  if (a.command != "generate" && a.command != "run") usage_error("unknown command '" + a.command + "'");
  if (a.positional.empty()) usage_error(a.command + " needs a PROMPT");
  if (a.command == "run" && (a.saves.empty() || a.out.empty()))
    usage_error("run needs --save PATH ... and --out FILE");
  if (!a.out.empty() && a.saves.empty()) usage_error("--out needs at least one --save PATH");
  if (a.command == "generate") {
    if (a.max_new_tokens < 1) usage_error("generate needs --max-new-tokens N (N >= 1)");
    if (a.greedy && a.sampling_flag) usage_error("--greedy cannot be combined with sampling flags");
  }
  mixlens::Model m = mixlens::Model::load(model_path);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : a.positional) prompts.push_back(a.ids ? parse_ids(p) : m.tokenizer().encode(p));
  mixlens::Trace trace;
  for (const auto& s : a.saves) trace.save(s);

  std::vector<std::vector<int32_t>> generated;
  if (a.command == "run") {
    m.run(prompts, &trace);
  } else {
    mixlens::GenerateOptions o = a.gen;
    o.max_new_tokens = a.max_new_tokens;
    o.greedy = !a.sampling_flag;
    auto res = m.generate(prompts, o, &trace);
    generated = res.new_tokens;
    for (size_t r = 0; r < prompts.size(); ++r) {
      if (m.has_tokenizer() && !a.ids)
        std::printf("%s%s\n", a.positional[r].c_str(), m.tokenizer().decode(res.new_tokens[r]).c_str());
      else
        std::printf("%s\n", join_ids(res.new_tokens[r]).c_str());
    }
  }
  if (!a.out.empty()) {
    const auto names = mixlens::write_trace(a.out, trace, m, a.positional, prompts, generated, a.command == "generate");
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
