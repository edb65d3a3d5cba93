#!/usr/bin/env python3
"""Build the tokenizer fixtures under tests/fixtures/tokenizer/ from shared/data and HF `tokenizers`.

What it writes (all committed, so a clone without shared/ can run the C++ tests):
  <name>/tokenizer.json + README.md   the tokenizers under test (gpt2's is built here from
                                      vocab.json + merges.txt with HF tokenizers)
  tiny-unk/tokenizer.json             a hand-made BPE using unk, byte_fallback, ##-prefix, </w>
  <variant>/overlay.json              variants built in memory from a base tokenizer.json:
                                      qwen3.5-variant (qwen3 + the Qwen3.5 split regex),
                                      gpt2-flags / gpt2-split / gpt2-regex (gpt2 + added-token
                                      flags, templates, Split behaviors, regex syntax; see each
                                      overlay's description)
  llama.cpp-vectors/                  llama.cpp test vectors (copied)
  corpus.jsonl                        one {"text": ...} per line, >= 1000 varied strings
  expected/<name>.jsonl               per corpus line: HF ids, decode, decode(skip_special)
  metadata.json                       versions and hashes the expectations were made with

Usage: .venv/bin/python scripts/make_tokenizer_fixtures.py [--shared /work/shared]
The corpus is deterministic (fixed seeds); rerunning with the same tokenizers version gives
byte-identical files. tests/python/test_tokenizer_live.py re-derives the expectations with
whatever tokenizers is installed and compares, so a behaviour change in HF is caught.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "tokenizer"

# Tokenizers under test: fixture directory name -> how to load it (see load_hf_tokenizer).
TOKENIZER_NAMES = ["gpt-neox-20b", "qwen3", "qwen3.5-variant", "gpt2", "gpt2-flags", "gpt2-split",
                   "gpt2-regex", "tiny-unk"]
VARIANTS = ["qwen3.5-variant", "gpt2-flags", "gpt2-split", "gpt2-regex"]

# Model-math.md §8.2: Qwen3.5's split regex (adds \p{M} to letter runs, removes it from the
# punctuation class). The real Qwen3.5 tokenizer.json was not obtainable offline.
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# Loading (shared with tests/python/test_tokenizer_live.py, which imports this module)
# --------------------------------------------------------------------------------------------

def apply_overlay(base: dict, overlay: dict) -> dict:
    """The overlay rules (the C++ test applies the same): replace top-level keys, set model keys,
    append added tokens."""
    for k, v in overlay.get("replace", {}).items():
        base[k] = v
    for k, v in overlay.get("model", {}).items():
        base["model"][k] = v
    base["added_tokens"] = base.get("added_tokens", []) + overlay.get("append_added_tokens", [])
    return base


def variant_json_text(name: str, fix: Path = FIX) -> str:
    overlay = json.loads((fix / name / "overlay.json").read_text(encoding="utf-8"))
    base = json.loads((fix / overlay["base"] / "tokenizer.json").read_text(encoding="utf-8"))
    return json.dumps(apply_overlay(base, overlay), ensure_ascii=False)


def load_hf_tokenizer(name: str, fix: Path = FIX):
    from tokenizers import Tokenizer
    if name in VARIANTS:
        return Tokenizer.from_str(variant_json_text(name, fix))
    return Tokenizer.from_file(str(fix / name / "tokenizer.json"))


def read_corpus(fix: Path = FIX) -> list[str]:
    with open(fix / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def expectation(tok, text: str) -> dict:
    ids = tok.encode(text).ids
    return {
        "ids": ids,
        "decoded": tok.decode(ids, skip_special_tokens=False),
        "decoded_skip": tok.decode(ids, skip_special_tokens=True),
    }


# --------------------------------------------------------------------------------------------
# Tokenizer files
# --------------------------------------------------------------------------------------------

def copy_tokenizers(shared: Path) -> None:
    src = shared / "data" / "tokenizers"
    for name in ["gpt-neox-20b", "qwen3"]:
        (FIX / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name / "tokenizer.json", FIX / name / "tokenizer.json")
        readme = (src / name / "README.md").read_text(encoding="utf-8")
        readme += ("\n\nCopied unchanged into mixlens tests/fixtures/tokenizer/" + name +
                   "/ by scripts/make_tokenizer_fixtures.py from shared/data/tokenizers/" + name + ".\n")
        (FIX / name / "README.md").write_text(readme, encoding="utf-8")

    vec_dst = FIX / "llama.cpp-vectors"
    vec_dst.mkdir(parents=True, exist_ok=True)
    for f in ["README.md", "ggml-vocab-gpt-2.gguf.inp", "ggml-vocab-gpt-2.gguf.out",
              "ggml-vocab-qwen2.gguf.inp", "ggml-vocab-qwen2.gguf.out"]:
        shutil.copyfile(src / "llama.cpp-vectors" / f, vec_dst / f)

    build_gpt2(src / "gpt2")
    write_variants()
    write_tiny_unk()


def build_gpt2(src: Path) -> None:
    """GPT-2's published tokenizer.json layout, built from OpenAI's vocab.json + merges.txt."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    bpe = models.BPE.from_file(str(src / "vocab.json"), str(src / "merges.txt"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # openai-community/gpt2 marks <|endoftext|> (already id 50256 in vocab.json) as special.
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    dst = FIX / "gpt2"
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"), pretty=False)
    readme = (src / "README.md").read_text(encoding="utf-8")
    readme += (
        "\n\n## tokenizer.json in this folder\n\n"
        "Built by scripts/make_tokenizer_fixtures.py (`build_gpt2`) with HF tokenizers "
        f"{__import__('tokenizers').__version__} from the vocab.json (sha256 "
        f"{sha256(src / 'vocab.json')}) and merges.txt (sha256 {sha256(src / 'merges.txt')}) above:\n"
        "BPE (no unk), pre_tokenizer ByteLevel(add_prefix_space=false, use_regex=true), post_processor\n"
        "ByteLevel(trim_offsets=false), decoder ByteLevel, `<|endoftext|>` (id 50256) added as a special\n"
        "token — the same layout as openai-community/gpt2's tokenizer.json. vocab.json/merges.txt are not\n"
        "copied; their content is inside tokenizer.json.\n")
    (dst / "README.md").write_text(readme, encoding="utf-8")


def write_tiny_unk() -> None:
    """A hand-made non-byte-level BPE: unk_token + fuse_unk, byte_fallback for some bytes,
    continuing_subword_prefix / end_of_word_suffix, no decoder, BertProcessing."""
    letters = "abcde"
    vocab = {"<unk>": 0, "[CLS]": 1, "[SEP]": 2}
    for c in letters:
        for tok in (c, "##" + c, c + "</w>", "##" + c + "</w>"):
            vocab[tok] = len(vocab)
    # Some bytes only (incl. those of "##" and "</w>", which fallback also spells): the rest become <unk>.
    for b in list(range(0x41, 0x5B)) + [0x23, 0x2F, 0x3C, 0x3E, 0x77, 0xC3, 0xA9, 0xE2]:
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = []
    for a, b in [("a", "##b"), ("##a", "##b"), ("c", "##d"), ("ab", "##c"), ("##d", "##e</w>"), ("e", "##e</w>")]:
        merged = a + b[2:]
        if merged not in vocab:
            vocab[merged] = len(vocab)
        merges.append([a, b])
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
            {"id": 1, "content": "[CLS]", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
            {"id": 2, "content": "[SEP]", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": False},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 2], "cls": ["[CLS]", 1]},
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": "##",
                  "end_of_word_suffix": "</w>", "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    dst = FIX / "tiny-unk"
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(tok, indent=1) + "\n", encoding="utf-8")
    (dst / "README.md").write_text(
        "# tiny-unk (test construct)\n\nA hand-made BPE tokenizer.json written by scripts/make_tokenizer_fixtures.py\n"
        "(`write_tiny_unk`): unk_token with fuse_unk, byte_fallback for a few bytes only, continuing_subword_prefix\n"
        "`##` and end_of_word_suffix `</w>`, a whitespace Split with behavior Removed, BertProcessing and no\n"
        "decoder. It pins HF's handling of the BPE options the real byte-level tokenizers do not use.\n",
        encoding="utf-8")


def write_variants() -> None:
    def write(name: str, overlay: dict, readme: str) -> None:
        dst = FIX / name
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "overlay.json").write_text(json.dumps(overlay, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (dst / "README.md").write_text(readme, encoding="utf-8")

    write("qwen3.5-variant", {
        "base": "qwen3",
        "description": "qwen3 with the Qwen3.5 split regex (model-math.md section 8.2)",
        "replace": {"pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN35_REGEX}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ]}},
    }, "# Qwen3.5-style tokenizer variant (test construct, not a published tokenizer)\n\n"
       "The real Qwen3.5 tokenizer.json (248k vocab) could not be obtained offline. This variant is\n"
       "`../qwen3/tokenizer.json` with its `pre_tokenizer` replaced as `overlay.json` says: the Qwen3.5\n"
       "split regex from shared/spec/model-math.md §8.2 (combining marks `\\p{M}` join letter runs and\n"
       "leave the punctuation class). Tests build the variant in memory (C++: `Tokenizer::from_json`,\n"
       "Python: `Tokenizer.from_str`), so no second 11 MB file is committed. It checks that mixlens takes\n"
       "the split regex from the file, including `\\p{M}`; ids are qwen3 ids, not Qwen3.5 ids.\n"
       "Overlay rules: replace the top-level keys in `replace`, set the `model` keys, append\n"
       "`append_added_tokens` to `added_tokens`.\n")

    eot = "<|endoftext|>"
    tok = lambda i, c, **kw: {"id": i, "content": c, "single_word": kw.get("single_word", False),
                              "lstrip": kw.get("lstrip", False), "rstrip": kw.get("rstrip", False),
                              "normalized": kw.get("normalized", False), "special": kw.get("special", False)}
    write("gpt2-flags", {
        "base": "gpt2",
        "description": "added-token flags (lstrip, rstrip, single_word, normalized), ids taken from the vocab "
                       "when the content is there, NFC, add_prefix_space, TemplateProcessing with BOS+EOS",
        "replace": {
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": eot, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                          {"SpecialToken": {"id": eot, "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {eot: {"id": eot, "ids": [50256], "tokens": [eot]}}},
        },
        "append_added_tokens": [
            tok(50257, "<mask>", lstrip=True, special=True),
            tok(50258, "[NEW]", rstrip=True),
            tok(50259, "wordy", single_word=True, normalized=True),
            tok(50260, "cafe\u0301", normalized=True),
            tok(50261, "<sw>", single_word=True, lstrip=True, rstrip=True, special=True),
            tok(31373, "hello"),
            tok(50262, eot + eot),
            tok(50263, "ab", normalized=True),
            tok(50264, "abc"),
            tok(50265, " \t ", normalized=True),
        ],
    }, "# gpt2-flags (test construct)\n\ngpt2 plus the added tokens, normalizer, pre-tokenizer and template\n"
       "listed in overlay.json, to pin HF's added-token flag handling. Expected ids come from HF tokenizers.\n")

    write("gpt2-split", {
        "base": "gpt2",
        "description": "Split behaviors (MergedWithPrevious, MergedWithNext, Contiguous+invert, Removed, an "
                       "empty-matching lookahead), String patterns, RobertaProcessing, ignore_merges, no decoder",
        "replace": {
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithPrevious", "invert": False},
                {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "MergedWithNext", "invert": False},
                {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "Contiguous", "invert": True},
                {"type": "Split", "pattern": {"String": "."}, "behavior": "Removed", "invert": False},
                {"type": "Split", "pattern": {"Regex": "(?=[A-Z])"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ]},
            "post_processor": {"type": "RobertaProcessing", "sep": [eot, 50256], "cls": [eot, 50256],
                               "trim_offsets": True, "add_prefix_space": False},
            "decoder": None,
        },
        "model": {"ignore_merges": True},
    }, "# gpt2-split (test construct)\n\ngpt2 with the Split pre-tokenizers, RobertaProcessing, ignore_merges and\n"
       "no decoder listed in overlay.json, to pin HF's behaviour for each. Expected ids come from HF tokenizers.\n")

    write("gpt2-regex", {
        "base": "gpt2",
        "description": "regex syntax whose meaning differs between Oniguruma (HF) and PCRE2: \\w, \\W, \\h, "
                       "\\s inside and outside classes, POSIX classes, \\Q..\\E, case-insensitive groups (single-character "
                       "folds only: Oniguruma also folds one character onto several, e.g. (?i:ss) matches U+1E9E, "
                       "PCRE2 does not)",
        "replace": {
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\W+"}, "behavior": "MergedWithNext", "invert": False},
                {"type": "Split", "pattern": {"Regex": "[\\w]{3}|\\d"}, "behavior": "Isolated", "invert": False},
                {"type": "Split", "pattern": {"Regex": "\\h\\h|[[:punct:]]|\\Q.*\\E"}, "behavior": "Isolated",
                 "invert": False},
                {"type": "Split", "pattern": {"Regex": "(?i:s|k)|[^\\s\\w]"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ]},
        },
    }, "# gpt2-regex (test construct)\n\ngpt2 with Split patterns using regex syntax whose meaning differs between\n"
       "Oniguruma (used by HF) and PCRE2 (used by mixlens), to pin that mixlens translates it. Expected ids come\n"
       "from HF tokenizers.\n")


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|padding|>", "<think>", "</think>",
            "<tool_call>", "<|fim_prefix|>", "<|vision_pad|>"]


def handwritten() -> list[str]:
    s: list[str] = []
    # Whitespace: runs of every length the gpt-neox added tokens cover (1..24) and beyond.
    s += ["", " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", "\n\n\n", "\t\n", " \n", "\n ",
          "\r\n\r\n", " \r\n ", "\t\t\t", " \t \t ", "\u00a0", "\u3000", "\u2003 x", "a\u180eb",
          "a\u200bb", "x\u0085y", "x\u2028y", "x\u2029y", "x\x0by\x0cz", "x\x1cy\x1d", "\x00", "a\x00b",
          "\u00a0\u00a0word", "word\u00a0", "\u202fx\u205fy"]
    # Two spaces before a borderline "space" character: the `\s+(?!\S)` rule splits the spaces
    # differently depending on whether the engine counts that character as \s.
    for c in ["\u180e", "\x1c", "\x1f", "\u0085", "\u200b", "\u2028", "\ufeff", "\u00a0", "\u3000",
              "\u2007", "\u1680", "\x0b"]:
        s += ["x  " + c, "x  " + c + "y", "\t\t" + c + "\n", "!" + c + "!"]
    for n in list(range(1, 31)) + [40, 49, 50, 64, 100]:
        s.append("a" + " " * n + "b")
        s.append(" " * n)
        s.append("\n" + " " * n + "x")
        s.append("x" + " " * n)
    for n in [1, 2, 3, 5, 8]:
        s.append("def f():\n" + "\t" * n + "return 1\n")
        s.append("if x:\n" + "    " * n + "y = 2\r\n")
    s += ["  leading", "trailing  ", "  both  ", " \t mixed \t ", "line1\nline2\n", "line1\r\nline2\r\n",
          "  \n  \n", "a \n b", "a\t\tb", "a \t\n b", "   Hello\n   World", "\n\n\nHello", "Hello\n\n\n"]
    # Digits.
    s += ["0", "7", "12", "123", "1234", "12345", "123456789", "12345678901234567890",
          "3.14159265358979", "1,000,000", "1 000 000", "2024-06-01", "v1.2.3", "0x1F4A9", "1e-10",
          "-42", "+7", "(555) 123-4567", "a1b2c3", "x = 10 ** 9 + 7", "٠١٢٣٤٥٦٧٨٩", "１２３", "१२३",
          "Ⅻ and ⅻ", "x²+y³", "½ ¼ ¾", "3rd 21st", "99 bottles", " 1 2 3 ", "1" * 200]
    # Punctuation runs.
    s += ["!!!", "???", "...", "!?!?", "--", "---", "-->", "<!-- -->", "==>", "!=", "&&||", "@@@",
          "#!/bin/sh", "$$$", "%%", "^^", "~~~", "```python\nprint(1)\n```", "{}[]()", "<>", "/* */",
          "\"quoted\"", "'single'", "`tick`", "a.b.c", "e.g.", "...and", "hello!!!\n\n", "hi?\r\n",
          ".\n", ";\n\n", "**bold**", "__init__", "http://example.com/path?q=1&r=2#frag",
          "user@example.com", "C:\\Windows\\System32", "a/b/c", "¡Hola!", "¿Qué?", "«guillemets»",
          "„Anführung“", "“curly” ‘quotes’", "—em dash—", "…", "•bullet", "§1 ¶2", "©®™"]
    # Contractions, both cases and odd quotes.
    s += ["it's", "IT'S", "It'S", "we'll", "WE'LL", "We'Ll", "they've", "THEY'VE", "I'm", "I'M",
          "you'd", "YOU'D", "don't", "DON'T", "you're", "YOU'RE", "'s", "'S", "'ll", "'LL", "'t",
          "'re", "'ve", "'m", "'d", "''s", "' s", "'sa", "'ss", "'ſ", "'ſt", "'K", "it’s", "it`s",
          "rock 'n' roll", "'tis", "o'clock", "O'Neil's", "y'all'd've", "Hello, y'all!",
          "We'Ve a'lL", "'SS 'LLL 'DD"]
    # Accents: precomposed vs decomposed (NFC matters), combining marks.
    s += ["café", "cafe\u0301", "naïve", "nai\u0308ve", "Ångström", "A\u030angstro\u0308m",
          "résumé", "re\u0301sume\u0301", "ñ", "n\u0303", "Cửa Việt", "Cu\u031b\u0309a Vie\u0323\u0302t",
          "e\u0301\u0301\u0301", "a\u0300\u0301\u0302\u0303\u0304", "\u0301", "\u0301abc", " \u0301",
          "x \u0301 y", "q\u0307\u0323", "\u1e0b\u0323", "d\u0307\u0323", "ǅ ǈ ǋ", "ﬁ ﬂ ﬆ",
          "Ⅸ", "Å", "K", "Ω", "\u2126", "\u212b", "\u0958", "\u0915\u093c", "\u1100\u1161\u11a8",
          "\u1100\u1161", "\uac00\u11a8", "ö̲", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
          "मनुष्य", "हिन्दी", "क्षत्रिय", "ก่อน", "ภาษาไทย", "ខ្មែរ", "עִבְרִית", "السَّلَامُ عَلَيْكُمْ",
          "ٱلْعَرَبِيَّة", "a\u20dd", "1\u20e3", "#\ufe0f\u20e3"]
    # Scripts.
    s += ["你好，世界", "我想在apple工作1314151天～", "日本語のテキスト、カタカナ、ひらがな", "漢字漢字漢字",
          "한국어 텍스트입니다", "안녕하세요 세계", "Привет, мир!", "нещо на Български", "Ελληνικά γράμματα",
          "مرحبا بالعالم", "كتاب 123 كتب", "שלום עולם", "Բարեւ", "ქართული", "አማርኛ", "ᏣᎳᎩ",
          "𝐀𝐁𝐂 𝑎𝑏𝑐 𝟘𝟙𝟚", "𠀀𠀁 𪚥", "ꦗꦮ", "ᚠᚢᚦ", "Ⓐⓑ", "Ｆｕｌｌｗｉｄｔｈ", "ｶﾀｶﾅ"]
    # Emoji, ZWJ sequences, skin tones, flags, keycaps.
    s += ["😀", "😀😀", "👍🏽", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🏴‍☠️", "🇺🇸🇫🇷", "🇯🇵", "🇦",
          "❤️", "❤", "☺️", "✅", "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅",
          " this is 🦙.cpp", "emoji🙂inside", "🙂 🙂  🙂", "🫠🫡🫶", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "👁️‍🗨️", "🧑🏿‍🦱"]
    # Added / special tokens embedded in text.
    for sp in SPECIALS:
        s += [sp, "a" + sp + "b", " " + sp + " ", sp + sp, "x " + sp + "\n", sp + "  " + sp,
              sp[:-1], sp[1:], "<" + sp + ">", sp.upper()]
    s += ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
          "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>",
          "Text<|endoftext|>More text", "<|endoftext|>   <|endoftext|>", "<|endoftext|>\n\n",
          "<|end|>", "<|endoftext|>|>", "<<|endoftext|>", "<|im_start|><|im_end|>", "<|im_start|>    x"]
    # Strings aimed at the added-token flags of the gpt2-flags variant.
    s += ["abcde", "ab abc abcde cde dee", "ababab cdcd ee", "aXbYc", "aé b", "a€b", "a😀b", "xyz", "ABC abc",
          "e", "ee", "de", "[CLS] a [SEP]", "<unk>", "a<unk>b"]
    s += ["<mask>", " <mask>", "x   <mask>  y", "a\t<mask>", "[NEW]   x", "[NEW]\n\ny", "[NEW]",
          "wordy", "a wordy one", "wordys", "swordy", "wordy_", "wordy.", "(wordy)", "éwordy", "wordyé",
          "cafe\u0301", "café au lait", "<sw>", " <sw> ", "a<sw>b", "a <sw> b", "  <sw>  ", "othello",
          "hello Hello HELLO", "ab abc abcd xabcx", " \t x", "a \t b \t c", "<mask><mask>", "<mask>   ",
          "CamelCaseWordsHere", "AB-CD-EF", "deadBEEF cafe 0x1f", "a.*b", "x_y‿z", "strasse STRASSE straße ẞ",
          "Kelvin \u212a k", "ſs", "a\u200db", "a\u200cb", "x²y", "①②", "Ⅷviii", "x-1-y-2", "1a2b3c", "queue aeiou", "a.b..c...", "--a--"]
    # Combining marks after letters, digits, spaces and punctuation (Qwen3.5 \p{M} handling).
    s += ["e\u0300\u0323 q\u0323\u0307", "x\u0338y", "1\u0301 2\u0302", " \u0300x", "!\u0301!",
          "\u0915\u094d\u0937", "नमस्ते दुनिया", "स्वागत है", "தமிழ் மொழி", "ಕನ್ನಡ", "ผู้ใหญ่", "ไม่ได้",
          "עִבְרִית טוֹבָה", "Tiếng Việt có dấu", "Tie\u0302\u0301ng Vie\u0323\u0302t", "a\u0300b\u0301c\u0302",
          "Z\u0336a\u0336l\u0336g\u0336o\u0336", "mañana\u0303", "\u0e01\u0e34\u0e4a", "ज़िंदगी", "فِي ٱلْبَدْءِ"]
    # llama.cpp/transformers integration-style strings.
    s += ["Hello world", " Hello world", "Hello World", " Hello World!", "Hello, world!",
          "w048 7tuijk dsdfhu", "ied 4 ½ months", "Äpfel", "    Hello\n    Hello", "\n =", "' era",
          "The quick brown fox jumps over the lazy dog.", "THE QUICK BROWN FOX", "camelCaseIdentifier",
          "snake_case_identifier", "kebab-case-id", "HTTPServerError", "iPhone15Pro", "x86_64-linux-gnu",
          "printf(\"%d\\n\", x);", "SELECT * FROM t WHERE a='b';", "<div class=\"x\">y</div>",
          "{\"key\": [1, 2, 3]}", "∀x∈ℝ: x²≥0", "E = mc²", "α + β = γ"]
    return s


def random_strings(rng: random.Random, n: int) -> list[str]:
    def chars(lo: int, hi: int) -> list[str]:
        return [chr(c) for c in range(lo, hi + 1)]

    pools = {
        "ascii": [chr(c) for c in range(0x20, 0x7F)],
        "ws": [" ", " ", " ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\x0b"],
        "latin": chars(0xC0, 0x17F),
        "comb": chars(0x300, 0x36F) + ["\u0951", "\u064b", "\u05b4", "\u0e48", "\u20dd", "\u093c"],
        "cjk": chars(0x4E00, 0x4FFF) + chars(0x3040, 0x30FF),
        "hangul": chars(0xAC00, 0xAD00) + chars(0x1100, 0x1112) + chars(0x1161, 0x1175) + chars(0x11A8, 0x11C2),
        "arabic": chars(0x0620, 0x064A) + chars(0x0660, 0x0669),
        "indic": chars(0x0905, 0x0939) + chars(0x093E, 0x094D) + chars(0x0966, 0x096F),
        "emoji": chars(0x1F600, 0x1F64F) + chars(0x1F300, 0x1F320) + ["\u200d", "\ufe0f"] + chars(0x1F3FB, 0x1F3FF)
        + chars(0x1F1E6, 0x1F1FF),
        "digits": list("0123456789") + chars(0xFF10, 0xFF19) + ["²", "½", "Ⅻ"],
        "punct": list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["…", "—", "«", "»", "“", "”", "。", "，"],
        "special": SPECIALS,
        "contraction": ["'s", "'S", "'ll", "'LL", "'ve", "'d", "'M", "'re", "'T"],
    }
    names = list(pools)
    out = []
    for _ in range(n):
        k = rng.randint(1, 4)
        mix = rng.sample(names, k)
        length = rng.choice([1, 2, 3, 5, 8, 13, 30, 60, 120])
        out.append("".join(rng.choice(pools[rng.choice(mix)]) for _ in range(length)))
    return out


def random_codepoints(rng: random.Random, n: int) -> list[str]:
    """Uniform over assigned, non-surrogate, non-private-use code points (Python's Unicode data)."""
    out = []
    while len(out) < n:
        length = rng.choice([1, 2, 4, 8, 16])
        s = []
        while len(s) < length:
            c = rng.choice([rng.randint(0, 0x2FFF), rng.randint(0, 0xFFFF), rng.randint(0, 0x2FFFF)])
            if 0xD800 <= c <= 0xDFFF:
                continue
            if unicodedata.category(chr(c)) in ("Cn", "Co", "Cs"):
                continue
            s.append(chr(c))
        out.append("".join(s))
    return out


def text_lines(shared: Path, rng: random.Random) -> list[str]:
    out = []
    shak = (shared / "data/text/tinyshakespeare/input.txt").read_text(encoding="utf-8")
    lines = shak.split("\n")
    for _ in range(200):
        out.append(lines[rng.randrange(len(lines))])
    for _ in range(40):
        i = rng.randrange(len(lines) - 12)
        out.append("\n".join(lines[i:i + rng.randint(2, 12)]))
    stories = (shared / "data/text/tinystories/tinystories_excerpt_niklas6.txt").read_text(encoding="utf-8")
    slines = [x for x in stories.split("\n")]
    for _ in range(100):
        out.append(slines[rng.randrange(len(slines))])
    for _ in range(20):
        i = rng.randrange(len(stories) - 3000)
        out.append(stories[i:i + rng.randint(200, 3000)])
    out.append((shared / "data/text/tinystories/tinystories_sample_cs336.txt").read_text(encoding="utf-8"))
    return out


def llama_cpp_inputs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    parts = text.split("\n__ggml_vocab_test__\n")
    if parts and parts[-1] == "":
        parts.pop()
    return parts


def build_corpus(shared: Path) -> list[str]:
    rng = random.Random(20240601)
    corpus = handwritten()
    corpus += llama_cpp_inputs(shared / "data/tokenizers/llama.cpp-vectors/ggml-vocab-qwen2.gguf.inp")
    corpus += text_lines(shared, rng)
    corpus += random_strings(rng, 300)
    corpus += random_codepoints(rng, 150)
    # Long inputs exercise the regex on big runs and BPE on long words.
    corpus += ["x" * 5000, " " * 3000, "\n" * 500, "9" * 3000, "ab" * 2000 + " end", "😀" * 500,
               "a\u0301" * 800, "漢" * 1500, "Hello world! " * 300]
    seen = set()
    uniq = []
    for t in corpus:
        if t not in seen:
            seen.add(t)
            uniq.append(t)
    return uniq


# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared",
                    help="the shared/ folder holding data/tokenizers and data/text")
    args = ap.parse_args()
    import tokenizers

    FIX.mkdir(parents=True, exist_ok=True)
    copy_tokenizers(args.shared)
    corpus = build_corpus(args.shared)
    with open(FIX / "corpus.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for t in corpus:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")

    (FIX / "expected").mkdir(exist_ok=True)
    for name in TOKENIZER_NAMES:
        tok = load_hf_tokenizer(name)
        with open(FIX / "expected" / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for t in corpus:
                f.write(json.dumps(expectation(tok, t), ensure_ascii=False) + "\n")

    meta = {
        "tokenizers_version": tokenizers.__version__,
        "python": sys.version.split()[0],
        "unicode_data": unicodedata.unidata_version,
        "corpus_strings": len(corpus),
        "files": {name: sha256(FIX / name / "tokenizer.json") for name in ["gpt-neox-20b", "qwen3", "gpt2", "tiny-unk"]},
        "qwen3.5-variant_regex": QWEN35_REGEX,
    }
    (FIX / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(corpus)} corpus strings and expectations for {', '.join(TOKENIZER_NAMES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
