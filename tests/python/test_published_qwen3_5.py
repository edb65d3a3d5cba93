"""The published Qwen/Qwen3.5-0.8B layout at full size (random weights, bfloat16, the VLM checkpoint
layout: model_type qwen3_5, text_config, model.language_model.*, vision tower present):
dev/mixlens_dev/published_layout.py builds it once under build/published/ (~1.8 GB, a few minutes;
later runs reuse it). mixlens loads it through the CLI and matches transformers' logits; the GDN
values have the published widths (16 heads of 128).

Memory: mixlens and transformers each hold the model widened to float32 (~3.6 GB); they run one
after the other, never at the same time."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mixlens_dev.common import rel_rms
from mixlens_dev.cli import REPO, run_values

# Token ids, not text: the Qwen tokenizer is not available offline. Spread over the vocabulary
# (including ids past 151k, the part a Qwen3-sized table would not have).
PROMPT = [9707, 11, 1879, 0, 248000, 151643, 42, 77, 12345, 200001, 3, 248319]


@pytest.fixture(scope="module")
def layout_dir():
    from mixlens_dev import published_layout as mpl

    return mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")


def test_layout_is_the_published_one(layout_dir):
    import json

    from safetensors import safe_open

    cfg = json.loads((layout_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    t = cfg["text_config"]
    assert (t["vocab_size"], t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]) == (248320, 1024, 3584, 24)
    assert [i for i, k in enumerate(t["layer_types"]) if k == "full_attention"] == [3, 7, 11, 15, 19, 23]
    assert t["rope_parameters"]["mrope_section"] == [11, 11, 10] and t["rope_parameters"]["rope_theta"] == 1e7
    with safe_open(str(layout_dir / "model.safetensors"), "np") as f:
        names = set(f.keys())
        emb = f.get_slice("model.language_model.embed_tokens.weight")
        assert emb.get_shape() == [248320, 1024] and emb.get_dtype() == "BF16"
    assert "lm_head.weight" not in names  # tied
    assert any(n.startswith("model.visual.") for n in names)


def test_logits_match_transformers_float32(tmp_path, layout_dir):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    got = run_values(layout_dir, PROMPT, ["logits"], tmp_path / "logits.safetensors")["logits"]
    assert got.shape == (1, len(PROMPT), 248320)

    # Same bf16-rounded weights on both sides, computed in float32 by transformers.
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(str(layout_dir), dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([PROMPT])).logits.numpy()
    del ref
    gc.collect()
    err = rel_rms(got, want)
    print(f"logits rel RMS vs transformers: {err:.2e}")  # shown with pytest -s
    assert err <= 1e-4, err
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()


def test_gdn_value_shapes_on_a_three_token_prompt(tmp_path, layout_dir):
    paths = ["layers.0.linear_attn.attention_queries", "layers.0.linear_attn.states", "layers.3.self_attn.attention_output"]
    got = run_values(layout_dir, PROMPT[:3], paths, tmp_path / "values.safetensors")
    assert got["layers.0.linear_attn.attention_queries"].shape == (1, 3, 16, 128)
    assert got["layers.0.linear_attn.states"].shape == (1, 3, 16, 128, 128)
    assert all(np.isfinite(v).all() for v in got.values())
