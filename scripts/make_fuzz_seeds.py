#!/usr/bin/env python3
"""Writes the libFuzzer seed corpora in tests/fuzz/corpus/<target>/ (committed; rerun to refresh).

Seeds are small real inputs plus the hostile shapes issue 11 found: deeply nested JSON, headers
with many entries, huge token ids, long texts. Standard library only.
"""
import json
import shutil
import struct
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fuzz" / "corpus"
FIX = REPO / "tests" / "fixtures"


def st_file(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write(target: str, name: str, content) -> None:
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(content.encode() if isinstance(content, str) else content)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    # safetensors: a real small checkpoint, minimal files, nesting and many entries.
    write("safetensors", "mamba2_short_prompt.safetensors", (FIX / "mamba2/short_prompt/model.safetensors").read_bytes())
    write("safetensors", "one_f32.safetensors",
          st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, struct.pack("<2f", 1.0, 2.0)))
    write("safetensors", "meta_bf16_i64.safetensors",
          st_file({"__metadata__": {"format": "pt"}, "i": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
                   "b": {"dtype": "BF16", "shape": [2, 1], "data_offsets": [8, 12]}}, b"\x01" * 12))
    write("safetensors", "deep_metadata.safetensors", struct.pack("<Q", 402) + b"{\"__metadata__\":" + b"[" * 192 + b"]" * 192 + b"}")
    write("safetensors", "many_entries.safetensors",
          st_file({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(3000)}))
    # config JSON: every family's fixture config, non-finite spellings, nesting, a large file.
    for fam in ("mamba", "mamba2", "qwen3_5", "qwen3_next"):
        case = sorted(p for p in (FIX / fam).iterdir() if (p / "config.json").exists())[0]
        write("json", f"{fam}_config.json", (case / "config.json").read_text())
    write("json", "nonfinite.json", '{"time_step_limit": [0.0, Infinity], "n": NaN, "m": -Infinity, "t": {"a": 1}}')
    write("json", "float_objects.json", '{"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "NaN"}}')
    write("json", "deep.json", '{"x": ' + "[" * 200 + "]" * 200 + "}")
    write("json", "deep_float_objects.json", '{"x": ' + '{"__float__":' * 150 + "1" + "}" * 150 + "}")
    write("json", "bad_ranges.json", json.dumps({"model_type": "mamba2", "chunk_size": 2 ** 32, "eos_token_id": 10 ** 12,
                                                 "num_heads": 2 ** 24, "head_dim": 2 ** 24, "expand": 1e30,
                                                 "rope_parameters": {"rope_theta": -1}, "vocab_size": 97}))
    write("json", "large.json", json.dumps({f"field_{i}": [i, i * 0.5, str(i)] for i in range(4000)}))
    # tokenizer.json: small complete files, nesting, id bombs.
    write("tokenizer_json", "tiny_unk.json", (FIX / "tokenizer/tiny-unk/tokenizer.json").read_text())
    tiny = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3}, "merges": ["a b"]}}
    write("tokenizer_json", "tiny_bytelevel.json", json.dumps(tiny))
    seq = dict(tiny, normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}]},
               pre_tokenizer={"type": "Sequence", "pretokenizers": [
                   {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": False},
                   tiny["pre_tokenizer"]]},
               post_processor={"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "a", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [], "special_tokens": {"a": {"id": "a", "ids": [0], "tokens": ["a"]}}})
    write("tokenizer_json", "sequences_template.json", json.dumps(seq))
    deep = "null"
    for _ in range(60):
        deep = '{"type":"Sequence","normalizers":[' + deep + "]}"
    write("tokenizer_json", "deep_sequence.json", json.dumps(tiny)[:-1] + ', "normalizer": ' + deep + "}")
    write("tokenizer_json", "id_bomb.json", json.dumps(dict(tiny, model=dict(tiny["model"], vocab={"a": 0, "b": 10 ** 8}))))
    medium = dict(tiny, model=dict(tiny["model"], vocab={f"t{i}": i for i in range(3000)}, merges=[]))
    write("tokenizer_json", "medium_vocab.json", json.dumps(medium))
    # BPE encode/decode (first byte: even = encode text, odd = decode little-endian int32 ids).
    lines = [json.loads(l)["text"] for l in (FIX / "tokenizer/corpus.jsonl").read_text(encoding="utf-8").split("\n") if l.strip()]
    for i, text in enumerate(lines[::40]):
        write("bpe", f"text_{i:03d}", b"\x00" + text.encode())
    write("bpe", "long_text", b"\x02" + ("Once upon a time, there was a little robot. " * 250).encode())
    write("bpe", "special_text", b"\x00" + "a<|endoftext|>b \u00e9\u4e2d\U0001F600\r\n".encode())
    write("bpe", "ids", b"\x01" + struct.pack("<8i", 0, 1, 50256, 50257, -1, 2 ** 31 - 1, 198, 220))


if __name__ == "__main__":
    main()
