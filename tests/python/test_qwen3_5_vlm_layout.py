"""The published Qwen3.5 checkpoint layout is the vision-language model (Qwen3_5ForConditionalGeneration):
config.json has model_type "qwen3_5" with the text model (and its token ids) in text_config, and the
weights live under model.language_model.* next to a vision tower (model.visual.*) that mixlens
ignores. A tiny one (tiny text_config and vision_config) is built with transformers and saved with
save_pretrained; mixlens must load it, match transformers' text logits, and stop generation at the
eos_token_id that only text_config carries. Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration, model_type
"qwen3_5_moe") is published the same way and runs the same checks."""

from __future__ import annotations

import json

import pytest

from mixlens_dev.common import rel_rms
from mixlens_dev.cli import cli, run_values

LIN, FULL = "linear_attention", "full_attention"
TEXT = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True},
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
MOE_TEXT = dict({k: v for k, v in TEXT.items() if k != "intermediate_size"}, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, shared_expert_intermediate_size=24)
FAMILIES = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT),
            "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", MOE_TEXT)}
# Vision token ids must lie inside the tiny vocabulary; the prompt never uses them.
TOP = dict(image_token_id=97, video_token_id=98, vision_start_token_id=99, vision_end_token_id=100,
           tie_word_embeddings=True)
PROMPT = [5, 17, 33, 8, 60, 42, 11, 90, 3, 25, 71, 14, 6, 50]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request, tmp_path_factory):
    """(folder, model): a seeded random tiny VLM of the family; its norm weights and GDN A_log/dt_bias
    are perturbed away from their init (zeros/ones) so a loader that skipped them would show."""
    import torch
    import transformers

    cfg_cls, model_cls, text = (getattr(transformers, n) if isinstance(n, str) else n for n in FAMILIES[request.param])
    d = tmp_path_factory.mktemp(request.param + "_vlm")
    torch.manual_seed(7)
    model = model_cls(cfg_cls(text_config=dict(text), vision_config=dict(VISION), **TOP))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and ("norm" in name or "A_log" in name or "dt_bias" in name):
                p.add_(0.3 * torch.randn_like(p))
    model.float().eval().save_pretrained(d)
    return d, model


def test_layout_is_the_vlm_one(vlm):
    from safetensors import safe_open

    d, _ = vlm
    cfg = json.loads((d / "config.json").read_text())
    family = cfg["model_type"]
    assert family in FAMILIES and cfg["text_config"]["model_type"] == family + "_text"
    with safe_open(str(d / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)


def test_text_logits_match_transformers(tmp_path, vlm):
    import torch

    d, model = vlm
    got = run_values(d, PROMPT, ["logits", "layers.1.linear_attn.states"], tmp_path / "v.safetensors")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits.numpy()
    assert got["logits"].shape == want.shape == (1, len(PROMPT), 101)
    assert rel_rms(got["logits"], want) <= 1e-4
    assert got["layers.1.linear_attn.states"].shape == (1, len(PROMPT), 4, 8, 8)


def test_generation_stops_at_the_text_config_eos(tmp_path, vlm):
    """Make the first greedy token the eos id, written only in text_config (as the published
    config does); mixlens must then stop after one token, as transformers does."""
    import shutil

    import torch

    src, model = vlm
    with torch.no_grad():
        first = int(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].argmax())
    d = tmp_path / "eos_model"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.get("eos_token_id") is None  # the premise: no top-level eos to fall back on
    cfg["text_config"]["eos_token_id"] = first
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = first
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))

    ref = type(model).from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == [first]

    r = cli("generate", "--model", d, "--ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 6, "--greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"[{first}]"
