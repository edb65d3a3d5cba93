#include "io/hub.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <system_error>
#include <vector>

#include "mixlens/errors.h"

namespace fs = std::filesystem;

namespace mixlens::io {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

fs::path expand_home(const std::string& p) {
  if (p == "~" || p.rfind("~/", 0) == 0) {
    const std::string home = env("HOME");
    if (!home.empty()) return fs::path(home) / p.substr(p.size() > 1 ? 2 : 1);
  }
  return fs::path(p);
}

bool repo_part_ok(const std::string& s) {
  if (s.empty() || s.size() > 96 || s.find("..") != std::string::npos || s.find("--") != std::string::npos)
    return false;
  if (s.front() == '-' || s.front() == '.' || s.back() == '-' || s.back() == '.') return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
}

// Branches, tags, "refs/pr/N" or commit hashes; no path tricks since it becomes a file name.
bool revision_ok(const std::string& r) {
  if (r.empty() || r.front() == '/' || r.back() == '/') return false;
  if (fs::path(r).lexically_normal().string() != r) return false;
  for (const auto& part : fs::path(r))
    if (part == ".." || part == ".") return false;
  return std::all_of(r.begin(), r.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.' || c == '/';
  });
}

// huggingface_hub's folder name for a model repo: "owner/name" -> "models--owner--name".
std::string cache_dir_name(const std::string& repo) {
  const auto slash = repo.find('/');
  if (slash == std::string::npos) return "models--" + repo;
  return "models--" + repo.substr(0, slash) + "--" + repo.substr(slash + 1);
}

struct HubId {
  std::string repo;      // "owner/name" or legacy "name"
  std::string revision;  // empty = main
};

bool parse_hub_id(const std::string& s, bool allow_bare, HubId* out) {
  std::string repo = s;
  if (auto at = s.find('@'); at != std::string::npos) {
    out->revision = s.substr(at + 1);
    repo = s.substr(0, at);
    if (!revision_ok(out->revision)) return false;
  }
  const auto slash = repo.find('/');
  if (slash == std::string::npos) {
    if (!allow_bare || !repo_part_ok(repo)) return false;
  } else if (!repo_part_ok(repo.substr(0, slash)) || !repo_part_ok(repo.substr(slash + 1))) {
    return false;
  }
  out->repo = repo;
  return true;
}

std::vector<std::string> snapshot_names(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_directory(ec)) out.push_back(it->path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(0, s.find_first_not_of(ws));
  const auto last = s.find_last_not_of(ws);
  s.erase(last == std::string::npos ? 0 : last + 1);
  return s;
}

}  // namespace

namespace {
fs::path resolve_in_cache(const HubId& id, const fs::path& cache);
}  // namespace

fs::path hub_cache_dir() {
  for (const char* var : {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"})
    if (std::string v = env(var); !v.empty()) return expand_home(v);
  if (std::string v = env("HF_HOME"); !v.empty()) return expand_home(v) / "hub";
  if (std::string v = env("XDG_CACHE_HOME"); !v.empty()) return expand_home(v) / "huggingface" / "hub";
  if (std::string v = env("HOME"); !v.empty()) return fs::path(v) / ".cache" / "huggingface" / "hub";
  return {};
}

bool looks_like_hub_id(const std::string& s) {
  HubId id;
  return parse_hub_id(s, /*allow_bare=*/false, &id);
}

fs::path resolve_model(const std::string& arg) {
  std::error_code ec;
  if (arg.empty()) throw CheckpointError("model folder '' does not exist (empty model argument)");
  const fs::path as_path(arg);
  if (fs::is_directory(as_path, ec)) return as_path;
  if (fs::exists(as_path, ec))
    throw CheckpointError("model path '" + arg +
                          "' is a file; pass the folder holding config.json and the *.safetensors files");

  HubId id;
  const fs::path cache = hub_cache_dir();
  if (!parse_hub_id(arg, /*allow_bare=*/false, &id)) {
    // A bare "gpt2"-style legacy id counts only if the cache really has it; otherwise it is a
    // mistyped folder and the folder message is the helpful one.
    if (!parse_hub_id(arg, /*allow_bare=*/true, &id) || cache.empty() ||
        !fs::is_directory(cache / cache_dir_name(id.repo), ec))
      throw CheckpointError("model folder '" + arg + "' does not exist");
  }
  // "models/mamba-x" is both a relative folder and an owner/name hub id: when it is neither, say so
  // for both readings (a mistyped folder otherwise reads as an unknown hub id only).
  if (cache.empty() || !fs::is_directory(cache / cache_dir_name(id.repo), ec))
    throw CheckpointError("model folder '" + arg + "' does not exist (no directory " +
                          fs::absolute(as_path, ec).lexically_normal().string() + "), and as a hub id '" + id.repo +
                          "' is not in the local HuggingFace cache (looked in " +
                          (cache.empty() ? std::string("<no cache: HOME unset>") : (cache / cache_dir_name(id.repo)).string()) +
                          "); download it with huggingface-cli or pass a folder (mixlens never downloads)");
  return resolve_in_cache(id, cache);
}

fs::path resolve_hub_id(const std::string& hub_id, const fs::path& cache_dir) {
  HubId id;
  if (!parse_hub_id(hub_id, /*allow_bare=*/true, &id))
    throw CheckpointError("'" + hub_id + "' is not a hub id of the form 'owner/name' (optionally '@revision')");
  return resolve_in_cache(id, cache_dir.empty() ? hub_cache_dir() : cache_dir);
}

namespace {

fs::path resolve_in_cache(const HubId& id, const fs::path& cache) {
  std::error_code ec;
  const std::string dir_name = cache_dir_name(id.repo);
  const fs::path repo_dir = cache / dir_name;
  const std::string id_text = "hub id '" + id.repo + "'";
  if (cache.empty() || !fs::is_directory(repo_dir, ec))
    throw CheckpointError(id_text + " is not in the local HuggingFace cache (looked in " +
                          (cache.empty() ? std::string("<no cache: HOME unset>") : repo_dir.string()) +
                          "); download it with huggingface-cli or pass a folder");

  const fs::path snaps = repo_dir / "snapshots";
  const std::string rev = id.revision.empty() ? "main" : id.revision;
  const fs::path ref_file = repo_dir / "refs" / rev;
  std::string commit;
  if (fs::is_regular_file(ref_file, ec)) {
    // A ref holds one commit name (40 hex digits); read a bounded prefix, never a whole huge file.
    std::ifstream f(ref_file, std::ios::binary);
    std::string buf(4096, '\0');
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    buf.resize(static_cast<size_t>(f.gcount()));
    commit = trim(buf);
    if (!revision_ok(commit) || commit.find('/') != std::string::npos)
      throw CheckpointError("HuggingFace cache entry " + repo_dir.string() + ": refs/" + rev +
                            " holds '" + commit + "', not a commit hash");
  } else if (!id.revision.empty() && fs::is_directory(snaps / id.revision, ec)) {
    commit = id.revision;  // a commit hash given directly
  } else {
    const std::vector<std::string> all = snapshot_names(snaps);
    if (id.revision.empty() && all.size() == 1) {
      commit = all[0];
    } else if (all.empty()) {
      throw CheckpointError(id_text + " is in the local HuggingFace cache (" + repo_dir.string() +
                            ") but has no snapshot; download it with huggingface-cli or pass a folder");
    } else {
      std::string list;
      for (const auto& s : all) list += (list.empty() ? "" : ", ") + s;
      throw CheckpointError(id_text + ": revision '" + rev + "' is not in the local HuggingFace cache (" +
                            repo_dir.string() + " has no refs/" + rev + "); cached snapshots: " + list +
                            "; pass " + id.repo + "@<commit>");
    }
  }
  const fs::path snap = snaps / commit;
  if (!fs::is_directory(snap, ec))
    throw CheckpointError(id_text + ": refs/" + rev + " points at commit " + commit + " but " +
                          snap.string() + " is missing (incomplete download?)");
  return snap;
}

}  // namespace

}  // namespace mixlens::io
