// BPE merging of one pre-tokenized word: HF models/bpe/model.rs (merge_word, tokenize_with_cache)
// and word.rs (merge_all), without dropout.
#include <queue>

#include "tokenizer/tokenizer_impl.h"

namespace mixlens::tok {

namespace {

// HF keeps words shorter than 256 bytes in its cache; longer ones are rare and costly to key.
constexpr size_t kMaxCachedWordBytes = 256;
// Beyond this many entries the cache is dropped and refilled, bounding memory on huge inputs.
constexpr size_t kMaxCacheEntries = 1u << 17;

struct Symbol {
  int32_t id;
  int32_t prev, next;  // linked list over live symbols; -1 at the ends
  bool alive;
};

struct Merge {
  uint32_t rank;
  size_t pos;
  int32_t new_id;
};

// Lowest rank first, then leftmost: HF's heap order.
struct MergeAfter {
  bool operator()(const Merge& a, const Merge& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

}  // namespace

void Bpe::merge_word(std::string_view w, std::vector<int32_t>& out) const {
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t id) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back({id, n - 1, -1, true});
  };

  // Characters -> initial symbols (HF merge_word), with unk / byte-fallback handling.
  int32_t pending_unk = -1;  // unk id waiting to be emitted (fused with following unknowns)
  std::string key;
  size_t i = 0;
  while (i < w.size()) {
    size_t len = 1;
    utf8_decode(w, i, &len);
    const bool is_first = i == 0, is_last = i + len >= w.size();
    key.clear();
    if (!is_first) key += continuing_subword_prefix;
    key.append(w.data() + i, len);
    if (is_last) key += end_of_word_suffix;
    auto it = vocab.find(key);
    if (it != vocab.end()) {
      if (pending_unk >= 0) {
        add(pending_unk);
        pending_unk = -1;
      }
      add(it->second);
    } else {
      bool done = false;
      if (byte_fallback) {
        // HF: every byte of the (prefixed) character must have a <0xXX> token, else unk.
        bool all = true;
        for (char c : key) all = all && byte_fallback_ids[static_cast<unsigned char>(c)] >= 0;
        if (all) {
          for (char c : key) add(byte_fallback_ids[static_cast<unsigned char>(c)]);
          done = true;
        }
      }
      if (!done && unk_id) {
        if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
        if (!(pending_unk >= 0 && fuse_unk)) pending_unk = *unk_id;
      }
      // No unk token: HF silently drops the character.
    }
    i += len;
  }
  if (pending_unk >= 0) add(pending_unk);

  if (sym.size() > 1) {
    std::priority_queue<Merge, std::vector<Merge>, MergeAfter> queue;
    for (size_t p = 0; p + 1 < sym.size(); ++p) {
      auto m = merges.find(pair_key(sym[p].id, sym[p + 1].id));
      if (m != merges.end()) queue.push({m->second.first, p, m->second.second});
    }
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& cur = sym[top.pos];
      if (!cur.alive || cur.next < 0) continue;
      const auto next_pos = static_cast<size_t>(cur.next);
      const Symbol right = sym[next_pos];
      // A stale entry is applied only if the pair still merges to the same token (HF's check).
      auto m = merges.find(pair_key(cur.id, right.id));
      if (m == merges.end() || m->second.second != top.new_id) continue;

      cur.id = top.new_id;
      cur.next = right.next;
      sym[next_pos].alive = false;
      if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = static_cast<int32_t>(top.pos);

      if (cur.prev >= 0) {
        const auto prev = static_cast<size_t>(cur.prev);
        auto pm = merges.find(pair_key(sym[prev].id, cur.id));
        if (pm != merges.end()) queue.push({pm->second.first, prev, pm->second.second});
      }
      if (cur.next >= 0) {
        auto nm = merges.find(pair_key(cur.id, sym[static_cast<size_t>(cur.next)].id));
        if (nm != merges.end()) queue.push({nm->second.first, top.pos, nm->second.second});
      }
    }
  }
  for (const Symbol& s : sym) {
    if (s.alive) out.push_back(s.id);
  }
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(std::string(word));
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() >= kMaxCachedWordBytes) {
    merge_word(word, out);
    return;
  }
  std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::move(key), std::move(ids));
}

}  // namespace mixlens::tok
