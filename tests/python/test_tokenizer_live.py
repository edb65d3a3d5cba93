"""Live check of the tokenizer fixtures against the installed HF `tokenizers`.

The C++ tests (tests/cpp/test_tokenizer.cpp) compare mixlens with the expectations committed under
tests/fixtures/tokenizer/expected/. This test re-derives those expectations with whatever
`tokenizers` version is installed and compares them with the committed files, so a change in HF
behaviour (or a stale fixture) fails here instead of silently drifting. It also checks that the
committed tokenizer files are the ones the expectations were made from.

Regenerate the fixtures with: .venv/bin/python scripts/make_tokenizer_fixtures.py
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "tokenizer"


def _load_fixture_module():
    spec = importlib.util.spec_from_file_location("make_tokenizer_fixtures",
                                                  REPO / "scripts" / "make_tokenizer_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_fixture_module()
CORPUS = gen.read_corpus(FIX)
META = json.loads((FIX / "metadata.json").read_text(encoding="utf-8"))


def test_corpus_is_big_and_varied():
    assert len(CORPUS) == META["corpus_strings"]
    assert len(CORPUS) >= 1000
    assert "" in CORPUS
    assert any("<|im_start|>" in s for s in CORPUS)
    assert any("\u200d" in s for s in CORPUS)  # emoji ZWJ sequences


@pytest.mark.parametrize("name", sorted(META["files"]))
def test_tokenizer_files_unchanged(name):
    digest = hashlib.sha256((FIX / name / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == META["files"][name]


@pytest.mark.parametrize("name", gen.TOKENIZER_NAMES)
def test_hf_matches_committed_expectations(name):
    tok = gen.load_hf_tokenizer(name, FIX)
    with open(FIX / "expected" / f"{name}.jsonl", encoding="utf-8") as f:
        expected = [json.loads(line) for line in f]
    assert len(expected) == len(CORPUS)
    bad = []
    for i, (text, want) in enumerate(zip(CORPUS, expected)):
        got = gen.expectation(tok, text)
        if got != want:
            bad.append((i, text, want, got))
    detail = "\n".join(f"line {i} {text!r}\n  committed {w}\n  live      {g}" for i, text, w, g in bad[:5])
    assert not bad, (f"{len(bad)} of {len(CORPUS)} strings differ between the committed fixtures (tokenizers "
                     f"{META['tokenizers_version']}) and the installed tokenizers {tokenizers.__version__}:\n{detail}")


def test_llama_cpp_vectors_hold_for_hf():
    # The llama.cpp vectors are an independent oracle for the same files.
    for vocab, name in [("qwen2", "qwen3"), ("gpt-2", "gpt2")]:
        tok = gen.load_hf_tokenizer(name, FIX)
        inputs = gen.llama_cpp_inputs(FIX / "llama.cpp-vectors" / f"ggml-vocab-{vocab}.gguf.inp")
        lines = (FIX / "llama.cpp-vectors" / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        assert len(inputs) == len(lines)
        for text, line in zip(inputs, lines):
            assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in line.split()], text
