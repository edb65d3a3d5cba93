// TransformerLens 4 hook names as aliases of mixlens values (docs/transformer_lens.md).
// A TL name maps to a mixlens value only where TL's tensor is that value exactly (same quantity,
// same layout); every other TL name is an UnknownValueError saying why and what to read instead.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace mixlens::detail {

class FamilyModel;

/// Whether `path` is spelled as a TransformerLens hook name: "blocks.{i|*}.…", "hook_…",
/// "embed.…", "unembed.…" or "ln_final.hook_…" (no mixlens path starts that way).
bool is_tl_name(std::string_view path);

/// The canonical mixlens paths ("layers.3.layer_output", ...) that TL name `path` addresses on
/// `model`; "blocks.*.…" gives one per block where the name has an alias (UnknownValueError when no
/// block has one). UnknownValueError for a name TL does not have on this model or whose tensor is not
/// a mixlens value exactly (layout, quantity or multiplier differ), naming the mixlens value to use.
std::vector<std::string> tl_canonical_paths(const FamilyModel& model, const std::string& path);

/// The key a save registered as TL name `path` is stored under for block `layer`: the name as the
/// user spelled it, with a "blocks.*." wildcard replaced by the block ("blocks.3.hook_resid_post").
std::string tl_key(const std::string& path, int layer);

}  // namespace mixlens::detail
