// Finding a model given a folder or a HuggingFace hub id, using only the local cache (no network).
#pragma once
#include <filesystem>
#include <string>

namespace mixlens::io {

/// The local HuggingFace hub cache directory, as huggingface_hub computes it: $HF_HUB_CACHE, else
/// $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
/// ~/.cache/huggingface/hub (a leading "~/" in the variables is expanded). Empty if none applies.
std::filesystem::path hub_cache_dir();

/// True for "owner/name" or "owner/name@revision" with HF's allowed characters
/// (letters, digits, '-', '_', '.'; no "..").
bool looks_like_hub_id(const std::string& s);

/// Resolves a model argument to a folder:
///  - an existing directory is returned as is;
///  - "owner/name[@revision]" (or a bare legacy "name" present in the cache) is looked up in the
///    cache as models--owner--name/snapshots/<commit>, where <commit> is read from
///    refs/<revision or main>, or is the revision itself when it is a commit hash that has a
///    snapshot; when refs/main is missing and exactly one snapshot exists, that one is used.
/// Throws CheckpointError: "model folder 'X' does not exist", "model path 'X' is a file, ...",
/// "hub id 'a/b' is not in the local HuggingFace cache (looked in <dir>); download it with
/// huggingface-cli or pass a folder", and for a cache entry whose refs point to a missing snapshot,
/// an unknown revision, or several snapshots with no refs/main.
std::filesystem::path resolve_model(const std::string& path_or_hub_id);

/// Resolves "owner/name[@revision]" (or a bare legacy "name") in the cache `cache_dir` (empty:
/// hub_cache_dir()), as resolve_model does for hub ids, never treating the argument as a folder.
/// The snapshot is always a folder inside `cache_dir`: a refs file holding an absolute path, "..",
/// or anything but a commit name is refused (CheckpointError). Also CheckpointError for an id that
/// is not "owner/name".
std::filesystem::path resolve_hub_id(const std::string& hub_id, const std::filesystem::path& cache_dir = {});

}  // namespace mixlens::io
