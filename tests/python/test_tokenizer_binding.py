"""The native tokenizer as the Python package exposes it (``model.tokenizer``), against HF
`tokenizers` run live on the committed corpus (tests/fixtures/tokenizer/corpus.jsonl) with the
gpt-neox-20b tokenizer.json. test_tokenizer_live.py checks the committed expectations themselves."""

from __future__ import annotations

import json

import pytest

import mixlens
from mixlens_dev.common import NEOX_TOKENIZER, REPO

CORPUS = REPO / "tests" / "fixtures" / "tokenizer" / "corpus.jsonl"


@pytest.fixture(scope="module")
def texts():
    out = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").split("\n") if line.strip()]
    assert len(out) > 1000
    return out


def test_encode_and_decode_match_hf_tokenizers(text_model_dir, texts):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(NEOX_TOKENIZER))
    tok = mixlens.StandardizedTransformer(str(text_model_dir)).tokenizer
    bad = []
    for text in texts:
        want = hf.encode(text).ids
        got = tok.encode(text)
        if got != want:
            bad.append(f"encode {text!r}: {got} != {want}")
        elif tok.decode(got) != hf.decode(want, skip_special_tokens=False):
            bad.append(f"decode {text!r}")
    assert not bad, f"{len(bad)} of {len(texts)} differ: {bad[:5]}"
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert tok.token_to_id("<|endoftext|>") == hf.token_to_id("<|endoftext|>") == 0
    assert tok.id_to_token(1000) == hf.id_to_token(1000)
