"""The published AntonV/mamba2-130m-hf layout (24 layers, 768 wide, state 128, vocab 50288, tied
embeddings, gpt-neox tokenizer) with random weights (dev/mixlens_dev/published_layout.py, cached under
build/ by its cached_layout()): it loads, tokenizes like HF, and its logits match
transformers on a 16-token prompt."""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, rel_rms

PROMPT = "The little fox ran across the snowy field to find her friends before dark"


@pytest.fixture(scope="module")
def layout_dir():
    from mixlens_dev import published_layout as published_layout_cache

    return published_layout_cache.cached_layout(REPO / "build")


@pytest.fixture(scope="module")
def model(layout_dir):
    return mixlens.StandardizedTransformer(str(layout_dir))


def test_logits_match_transformers(layout_dir, model):
    import tokenizers
    import torch
    from transformers import Mamba2ForCausalLM

    ids = model.tokenizer.encode(PROMPT)
    assert ids == tokenizers.Tokenizer.from_file(str(layout_dir / "tokenizer.json")).encode(PROMPT).ids
    assert 14 <= len(ids) <= 18
    ref = Mamba2ForCausalLM.from_pretrained(str(layout_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits.numpy()
    got = model.run(ids)["logits"]
    assert got.shape == want.shape == (1, len(ids), 50288)
    assert rel_rms(got, want) <= 1e-4
    assert (got[0].argmax(-1) == want[0].argmax(-1)).mean() >= 0.9


def test_value_shapes_on_a_three_token_prompt(model):
    assert model.info["num_layers"] == 24 and model.info["hidden_size"] == 768
    with model.trace([[510, 1652, 30013]]) as tracer:
        mix = model.layers[23].linear_attn
        shapes = {
            "attention_queries": mix.attention_queries.shape,
            "attention_keys": mix.attention_keys.shape,
            "attention_values": mix.attention_values.shape,
            "betas": mix.betas.shape,
            "decays": mix.decays.shape,
            "state_input": mix.state_input,  # None on a fresh prompt
            "states": mix.states.shape,
            "state_output": mix.state_output.shape,
            "attention_head_outputs": mix.attention_head_outputs.shape,
            "attention_output": mix.attention_output.shape,
        }
    assert shapes == {
        "attention_queries": (1, 3, 1, 128),
        "attention_keys": (1, 3, 1, 128),
        "attention_values": (1, 3, 24, 64),
        "betas": (1, 3, 24),
        "decays": (1, 3, 24),
        "state_input": None,
        "states": (1, 3, 24, 128, 64),
        "state_output": (1, 24, 128, 64),
        "attention_head_outputs": (1, 3, 24, 64),
        "attention_output": (1, 3, 768),
    }
    assert tracer.logits.shape == (1, 3, 50288)
    declared = {v["path"]: v["shape"] for v in model.values(1, 3)}
    assert declared["layers.23.linear_attn.state_input"] == (1, 24, 128, 64)
    assert all(declared[f"layers.23.linear_attn.{k}"] == s for k, s in shapes.items() if s is not None)
    assert np.isfinite(tracer.logits).all()
