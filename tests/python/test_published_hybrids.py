"""Published Mamba-2 hybrid and FalconMamba layouts (random weights, bfloat16, made by transformers 5.18
with the configs of dev/mixlens_dev/published_hybrids.py, where each config's source is written down):
tiiuae/Falcon-H1-0.5B-Base at full size, nvidia/Nemotron-H-8B-Base-8K reduced to its first 8
blocks, ibm-ai-platform/Bamba-9B reduced to 2 layers, tiiuae/falcon-mamba-7b reduced to 2 layers,
ibm-granite/granite-4.0-h-350m at full size, an ai21labs/Jamba-tiny-dev class layout (16 layers), Qwen/Qwen3.5-35B-A3B (Qwen3.5-MoE) reduced to 2 layers,
allenai/Olmo-Hybrid-7B reduced to 4 layers, Zyphra/Zamba2-1.2B at full size, moonshotai/Kimi-Linear-48B-A3B
reduced to 2 layers and 16 of its 256 experts (~1B parameters, mostly the two 163840-row tables), LiquidAI/LFM2-350M at full size, google/recurrentgemma-2b reduced to 3 layers, MiniMaxAI/MiniMax-Text-01 widths reduced to 2 layers, 2 experts and a 32000-row vocabulary, NX-AI/xLSTM-7b reduced to 2 blocks. Built once under build/published/ (a few minutes and 1-3 GB each; later
runs reuse them). mixlens loads each, matches transformers' float32 logits (both sides widen the same bf16 weights)
and serves the published value shapes.

The three reduced big layouts (Nemotron-H-8B widths, Bamba-9B widths: ~1.5B parameters each, mostly
the 128k-row embedding tables; falcon-mamba-7b widths: ~0.75B; minutes each on 2 cores) and
granite-4.0-h-350m (32 layers of Mamba-2 / NoPE attention) and the Jamba-tiny-dev class (~306M parameters,
16 experts on 8 layers), Zamba2-1.2B (38 layers, 6 of them with the
shared block and its adapters) run only with MIXLENS_BIG_LAYOUTS=1, to keep
`make test` short; the Falcon-H1-0.5B layout (~1 minute) always runs.

Memory: mixlens and transformers each hold a model in float32 (up to ~6 GB for the Nemotron-H
layout); they run one after the other, never at the same time. The Qwen3.5-MoE layout (2.6B parameters,
2 x 256 experts) peaks at ~20 GB resident (transformers widening it to float32, ~4 minutes on 2 cores);
its logits matched at 2.2e-6 relative RMS when added; the RecurrentGemma-2B layout (3 layers, ~0.9B parameters,
~1 minute once built) at 1.2e-6; the MiniMax-Text-01 layout (2 layers, 2 experts, ~1.5B parameters, built in
bfloat16 without the lightning decay buffers the release does not store; ~1.5 minutes) at 1.1e-6; the xLSTM-7B layout (2 blocks, ~0.8B parameters, ~1 minute to build on 2 cores)
at 1.5e-6."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms

PROMPT = [1, 17, 923, 4051, 12, 7, 30000, 2, 511, 64, 9001, 3]

# name -> (value path, expected shape for the 12-token prompt)
SHAPES = {
    "falcon_h1_0_5b": {
        "layers.0.linear_attn.attention_queries": (1, 12, 1, 128),
        "layers.0.linear_attn.attention_values": (1, 12, 24, 64),
        "layers.0.linear_attn.states": (1, 12, 24, 128, 64),
        "layers.35.self_attn.attention_keys": (1, 12, 2, 64),
        "layers.35.self_attn.attention_output": (1, 12, 1024),
        "layers.35.mlp.output": (1, 12, 1024),
    },
    "nemotron_h_8b_8blocks": {
        "layers.0.linear_attn.attention_keys": (1, 12, 8, 128),
        "layers.0.linear_attn.state_output": (1, 128, 128, 64),
        "layers.7.self_attn.attention_queries": (1, 12, 32, 128),
        "layers.7.self_attn.attention_values": (1, 12, 8, 128),
        "layers.1.mlp.output": (1, 12, 4096),
    },
    "bamba_9b_2layers": {
        "layers.0.linear_attn.attention_values": (1, 12, 128, 64),
        "layers.0.linear_attn.betas": (1, 12, 128),
        "layers.1.self_attn.attention_keys": (1, 12, 8, 128),
        "layers.1.mlp.output": (1, 12, 4096),
    },
    "granite_4_0_h_350m": {
        "layers.0.linear_attn.attention_values": (1, 12, 48, 32),
        "layers.0.linear_attn.states": (1, 12, 48, 128, 32),
        "layers.10.self_attn.attention_queries": (1, 12, 12, 64),
        "layers.10.self_attn.attention_keys": (1, 12, 4, 64),
        "layers.27.self_attn.attention_output": (1, 12, 768),
        "layers.31.mlp.output": (1, 12, 768),
    },
    "falcon_mamba_7b_2layers": {
        "layers.0.linear_attn.attention_queries": (1, 12, 16),
        "layers.0.linear_attn.attention_values": (1, 12, 8192),
        "layers.0.linear_attn.betas": (1, 12, 8192),
        "layers.1.linear_attn.states": (1, 12, 8192, 16),
        "layers.1.linear_attn.attention_output": (1, 12, 4096),
    },
    "jamba_tiny_dev_class": {
        "layers.0.linear_attn.attention_values": (1, 12, 1024),
        "layers.0.linear_attn.attention_keys": (1, 12, 16),
        "layers.3.linear_attn.states": (1, 12, 1024, 16),
        "layers.4.self_attn.attention_queries": (1, 12, 8, 64),
        "layers.12.self_attn.attention_keys": (1, 12, 2, 64),
        "layers.1.mlp.output": (1, 12, 512),
        "layers.15.mlp.output": (1, 12, 512),
    },
    "qwen3_5_moe_35b_a3b_2layers": {
        "layers.0.linear_attn.attention_queries": (1, 12, 32, 128),
        "layers.0.linear_attn.states": (1, 12, 32, 128, 128),
        "layers.0.mlp.output": (1, 12, 2048),
        "layers.1.self_attn.attention_keys": (1, 12, 2, 256),
        "layers.1.self_attn.gate": (1, 12, 4096),
        "layers.1.mlp.output": (1, 12, 2048),
    },
    "olmo_hybrid_7b_4layers": {
        "layers.0.linear_attn.attention_keys": (1, 12, 30, 96),
        "layers.0.linear_attn.states": (1, 12, 30, 96, 192),
        "layers.2.linear_attn.betas": (1, 12, 30),
        "layers.3.self_attn.attention_queries": (1, 12, 30, 128),
        "layers.3.self_attn.attention_output": (1, 12, 3840),
        "layers.3.mlp.output": (1, 12, 3840),
    },
    "kimi_linear_48b_a3b_2layers": {
        "layers.0.linear_attn.decays": (1, 12, 32, 128),
        "layers.0.linear_attn.states": (1, 12, 32, 128, 128),
        "layers.0.mlp.output": (1, 12, 2304),
        "layers.1.self_attn.attention_queries": (1, 12, 32, 192),
        "layers.1.self_attn.attention_values": (1, 12, 32, 128),
        "layers.1.mlp.output": (1, 12, 2304),
    },
    "zamba2_1_2b": {
        "layers.0.linear_attn.attention_values": (1, 12, 64, 64),
        "layers.0.linear_attn.states": (1, 12, 64, 128, 64),
        "layers.5.self_attn.attention_queries": (1, 12, 32, 128),
        "layers.35.self_attn.attention_values": (1, 12, 32, 128),
        "layers.35.mlp.output": (1, 12, 2048),
        "layers.35.linear_attn.attention_output": (1, 12, 2048),
    },
    "rwkv_4_169m_pile": {
        "layers.0.linear_attn.attention_keys": (1, 12, 768),
        "layers.11.linear_attn.state_output": (1, 5 * 768),
        "layers.11.mlp.output": (1, 12, 768),
    },
    "lfm2_350m": {
        "layers.0.linear_attn.attention_keys": (1, 12, 1024),
        "layers.0.linear_attn.states": (1, 12, 1024, 3),
        "layers.15.linear_attn.state_output": (1, 1024, 3),
        "layers.2.self_attn.attention_queries": (1, 12, 16, 64),
        "layers.14.self_attn.attention_keys": (1, 12, 8, 64),
        "layers.15.mlp.output": (1, 12, 1024),
    },
    "recurrent_gemma_2b_3layers": {"layers.0.linear_attn.decays": (1, 12, 2560),
                                   "layers.1.linear_attn.states": (1, 12, 4, 2560),
                                   "layers.2.self_attn.attention_queries": (1, 12, 10, 256),
                                   "layers.2.self_attn.attention_keys": (1, 12, 1, 256)},
    "minimax_text_01_2layers": {"layers.0.linear_attn.attention_keys": (1, 12, 64, 128),
                                "layers.0.linear_attn.decays": (1, 12, 64),
                                "layers.0.linear_attn.states": (1, 12, 64, 128, 128),
                                "layers.0.linear_attn.attention_output": (1, 12, 6144),
                                "layers.1.self_attn.attention_keys": (1, 12, 8, 128),
                                "layers.1.mlp.output": (1, 12, 6144)},
    "xlstm_7b_2blocks": {"layers.0.linear_attn.attention_queries": (1, 12, 2048),
                         "layers.0.linear_attn.betas": (1, 12, 8),
                         "layers.1.linear_attn.state_output": (1, 8 * (256 * 512 + 256 + 1)),
                         "layers.1.mlp.output": (1, 12, 4096)},
}
MODEL_CLASS = {"falcon_h1_0_5b": "FalconH1ForCausalLM", "nemotron_h_8b_8blocks": "NemotronHForCausalLM",
               "bamba_9b_2layers": "BambaForCausalLM", "granite_4_0_h_350m": "GraniteMoeHybridForCausalLM",
               "falcon_mamba_7b_2layers": "FalconMambaForCausalLM",
               "jamba_tiny_dev_class": "JambaForCausalLM",
               "qwen3_5_moe_35b_a3b_2layers": "Qwen3_5MoeForCausalLM", "olmo_hybrid_7b_4layers": "OlmoHybridForCausalLM",
               "zamba2_1_2b": "Zamba2ForCausalLM",
               "rwkv_4_169m_pile": "RwkvForCausalLM",
               "kimi_linear_48b_a3b_2layers": "KimiLinearForCausalLM",
               "lfm2_350m": "Lfm2ForCausalLM",
               "recurrent_gemma_2b_3layers": "RecurrentGemmaForCausalLM",
               "minimax_text_01_2layers": "MiniMaxForCausalLM",
               "xlstm_7b_2blocks": "xLSTMForCausalLM"}


BIG = {"nemotron_h_8b_8blocks", "bamba_9b_2layers", "granite_4_0_h_350m", "falcon_mamba_7b_2layers",
       "jamba_tiny_dev_class", "qwen3_5_moe_35b_a3b_2layers", "olmo_hybrid_7b_4layers", "zamba2_1_2b",
       "rwkv_4_169m_pile",
       "kimi_linear_48b_a3b_2layers",
       "lfm2_350m",
       "recurrent_gemma_2b_3layers",
       "minimax_text_01_2layers", "xlstm_7b_2blocks"}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def layout(request):
    import os

    from mixlens_dev import published_hybrids as mph

    if request.param in BIG and os.environ.get("MIXLENS_BIG_LAYOUTS") != "1":
        pytest.skip("big reduced layout: set MIXLENS_BIG_LAYOUTS=1 to run it")
    return request.param, mph.cached(request.param)


def test_logits_match_transformers_float32_and_shapes_are_published(layout):
    import torch
    import transformers

    name, d = layout
    m = mixlens.StandardizedTransformer(str(d))
    paths = list(SHAPES[name]) + ["logits"]
    run = m.generate([PROMPT], max_new_tokens=1, eos_token_id=-1, saves=paths).run()
    got = {p: np.asarray(run.saved[p][0]) for p in paths}
    del m, run
    gc.collect()
    for p, shape in SHAPES[name].items():
        assert got[p].shape == shape, (p, got[p].shape)
        assert np.isfinite(got[p]).all(), p

    # MiniMax: loaded in float32, so the decay buffers the file lacks are computed in float32, as mixlens does.
    dtype = torch.float32 if name == "minimax_text_01_2layers" else torch.bfloat16
    ref = getattr(transformers, MODEL_CLASS[name]).from_pretrained(str(d), dtype=dtype).float().eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([PROMPT])).logits.float().numpy()
    del ref
    gc.collect()
    err = rel_rms(got["logits"], want)
    print(f"{name}: logits rel RMS vs transformers {err:.2e}")  # shown with pytest -s
    assert err <= 1e-4, err
    assert (got["logits"][0].argmax(-1) == want[0].argmax(-1)).all()
