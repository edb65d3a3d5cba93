"""TransformerLens 4 hook names (docs/transformer_lens.md) through the Python front end: on a shipped
fixture of every family, saves spelled in TL names come back under those names, bit for bit the
canonical values; the interleaved block reads them too; unmapped names raise with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, rel_rms

FIX = REPO / "tests" / "fixtures"

# fixture -> (TL name, canonical path) pairs that must be the same tensor there.
CASES = {
    "mamba/basic": [("hook_embed", "embed_tokens.output"),
                    ("blocks.1.hook_resid_pre", "layers.1.layer_input"),
                    ("blocks.2.hook_resid_post", "layers.2.layer_output"),
                    ("blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"),
                    ("ln_final.hook_out", "ln_final.output"),
                    ("hook_unembed", "logits")],
    "mamba2/short_prompt": [("blocks.0.hook_resid_post", "layers.0.layer_output"),
                            ("blocks.1.mixer.hook_ssm_out", "layers.1.linear_attn.attention_output")],
    "qwen3_5/hv_eq_hk_chunks": [("blocks.0.linear_attn.hook_q", "layers.0.linear_attn.attention_queries"),
                                ("blocks.0.linear_attn.hook_ssm_B", "layers.0.linear_attn.attention_keys"),
                                ("blocks.1.linear_attn.hook_v", "layers.1.linear_attn.attention_values"),
                                ("blocks.1.linear_attn.hook_beta", "layers.1.linear_attn.betas"),
                                ("blocks.3.linear_attn.hook_ssm_decay", "layers.3.linear_attn.decays"),
                                ("blocks.3.linear_attn.hook_ssm_state", "layers.3.linear_attn.states"),
                                ("blocks.3.linear_attn.hook_recurrence_out",
                                 "layers.3.linear_attn.attention_head_outputs"),
                                ("blocks.2.attn.hook_pattern", "layers.2.self_attn.attention_probabilities"),
                                ("blocks.2.hook_attn_out", "layers.2.self_attn.attention_output"),
                                ("blocks.2.hook_mlp_out", "layers.2.mlp.output")],
    "qwen3_next/padded_batch": [("blocks.0.linear_attn.hook_log_decay", "layers.0.linear_attn.decays"),
                                ("blocks.1.attn.hook_out", "layers.1.self_attn.attention_output"),
                                ("blocks.1.hook_resid_post", "layers.1.layer_output")],
    "nemotron_h/padded_batch": [("blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"),
                                ("blocks.1.mixer.hook_out", "layers.1.mlp.output"),
                                ("blocks.2.mixer.hook_pattern", "layers.2.self_attn.attention_probabilities")],
    "bamba/padded_batch": [("blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"),
                           ("blocks.1.attn.hook_out", "layers.1.self_attn.attention_output"),
                           ("hook_embed", "embed_tokens.output")],
    "falcon_h1/no_rms_norm_padded": [("blocks.1.hook_resid_pre", "layers.1.layer_input"),
                                     ("blocks.0.mlp.hook_out", "layers.0.mlp.output")],
    "jamba/moe_edits": [("blocks.0.mixer.hook_ssm_out", "layers.0.linear_attn.attention_output"),
                        ("blocks.1.hook_attn_out", "layers.1.self_attn.attention_output"),
                        ("blocks.0.hook_mlp_out", "layers.0.mlp.output")],
    "zamba2/nope_padded": [("blocks.1.hook_mixer_out", "layers.1.linear_attn.attention_output"),
                           ("blocks.2.hook_resid_post", "layers.2.layer_output")],
}


def load(case):
    d = FIX / case
    prompts = json.loads((d / "case.json").read_text())["prompts"]
    return mixlens.StandardizedTransformer(str(d)), prompts


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_tl_names_are_the_canonical_values(case):
    model, prompts = load(case)
    pairs = CASES[case]
    out = model.run(prompts, saves=[p for pair in pairs for p in pair])
    for tl, canonical in pairs:
        assert tl in out, f"{tl} not returned under its own name: {sorted(out)}"
        got, ref = np.asarray(out[tl]), np.asarray(out[canonical])
        assert got.shape == ref.shape and got.dtype == ref.dtype, tl
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{tl} differs from {canonical}"


def test_wildcard_and_interleaved_read():
    model, prompts = load("qwen3_5/hv_eq_hk_chunks")
    out = model.run(prompts, saves=["blocks.*.hook_resid_post", "layers.*.layer_output"])
    for i in range(model.num_layers):
        assert np.array_equal(out[f"blocks.{i}.hook_resid_post"], out[f"layers.{i}.layer_output"])
    # Attribute access in TL's spelling (model.blocks[i].<component>.<hook>) reads the aliased value.
    with model.trace(prompts, saves=["layers.1.linear_attn.betas", "layers.3.layer_output"]) as tr:
        beta = np.array(model.blocks[1].linear_attn.hook_beta)
        resid = np.array(model.blocks[-1].hook_resid_post)
    assert np.array_equal(beta, tr.saved["layers.1.linear_attn.betas"])
    assert np.array_equal(resid, tr.saved["layers.3.layer_output"])
    with model.trace(prompts):
        with pytest.raises(mixlens.UnknownValueError, match="no mixlens alias"):
            model.blocks[0].linear_attn.hook_beta_logit


# docs/transformer_lens.md's hook_ssm_* table: the names TL 4.3 does not define on a mixer are refused saying so.
SSM_NOT_IN_TL = ([("mamba/basic", f"blocks.0.mixer.{h}", f"has no {h} on Mamba-1") for h in
                  ("hook_ssm_B", "hook_ssm_C", "hook_ssm_decay")] +
                 [("qwen3_5/hv_eq_hk_chunks", "blocks.0.linear_attn.hook_ssm_dt", "no hook_ssm_dt on a gated DeltaNet")] +
                 [("lfm2/conv_attn", f"blocks.0.conv.{h}", f"LFM2 short conv has no {h}") for h in
                  ("hook_ssm_out", "hook_ssm_state", "hook_ssm_write", "hook_ssm_B", "hook_ssm_C", "hook_ssm_decay",
                   "hook_ssm_dt")] +
                 [("rwkv/basic", "blocks.0.time_mix.hook_ssm_state", "RWKV-4 blocks have no mixlens alias"),
                  ("recurrent_gemma/griffin", "blocks.0.mixer.hook_ssm_state", "wraps each layer whole")])


@pytest.mark.parametrize("case,name,part", [
    ("mamba2/short_prompt", "blocks.0.mixer.hook_ssm_state", "states.transpose(-1, -2)"),
    ("mamba/basic", "blocks.0.mixer.hook_ssm_dt", "softplus(hook_ssm_dt)"),
    ("qwen3_5/hv_2hk", "blocks.0.linear_attn.hook_k", "attention_keys[:, :, ::2]"),
    ("falcon_h1/no_rms_norm_padded", "hook_embed", "embedding_multiplier"),
    ("mamba2/short_prompt", "ln_final.hook_normalized", "before the norm's weight"),
    ("zamba2/nope_padded", "blocks.0.hook_mlp_out", "(SSMBlockBridge) have no hook_mlp_out"),
    ("zamba2/nope_padded", "blocks.0.mixer.hook_out", "on the Mamba layers only"),
    ("kimi_linear/padded_batch", "blocks.0.hook_resid_post", "no Kimi-Linear adapter"),
    ("rwkv/basic", "blocks.1.hook_resid_post", "2 * layers.1.layer_output"),  # a block followed by the halving
    ("rwkv/basic", "blocks.0.hook_resid_mid", "layer_input plus"),
    ("lfm2/conv_attn", "blocks.0.conv.hook_in_proj", "B | C | x"),
    ("lfm2/conv_attn", "blocks.1.conv.hook_out", "its components: attn,mlp"),
    ("recurrent_gemma/griffin", "hook_embed", "normalizer"),
    ("recurrent_gemma/griffin", "hook_unembed", "logits_soft_cap"),
] + SSM_NOT_IN_TL)
def test_unmapped_tl_names_say_why(case, name, part):
    model, prompts = load(case)
    with pytest.raises(mixlens.UnknownValueError) as e:
        model.run(prompts, saves=[name])
    assert part in str(e.value)


def test_cli_save_takes_tl_names(tmp_path, text_model_dir):
    from safetensors.numpy import load_file


    def cli(*args):
        exe = Path(sys.executable).parent / "mixlens"
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300)

    out = tmp_path / "values.safetensors"
    paths = ["blocks.1.hook_resid_post", "layers.1.layer_output", "blocks.*.mixer.hook_ssm_out"]
    r = cli("run", "--model", text_model_dir, "Once upon a time", *sum((["--save", p] for p in paths), []),
            "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert np.array_equal(got["blocks.1.hook_resid_post"], got["layers.1.layer_output"])
    assert {"blocks.0.mixer.hook_ssm_out", "blocks.1.mixer.hook_ssm_out"} <= set(got)
    r = cli("run", "--model", text_model_dir, "Once upon a time", "--save", "blocks.0.mixer.hook_ssm_state",
            "--out", tmp_path / "x.safetensors")
    assert r.returncode != 0 and "states.transpose(-1, -2)" in r.stderr, r.stderr


def _hf_module_outputs(case, modules):
    """transformers' own forward of a fixture's first prompt with forward hooks: {name: the module's output (the
    first element of a tuple: TransformerLens 4.3's GeneralizedComponent hooks output[0], base.py), or its input
    for a path ending in ':in' (TL's `.hook_in`)} for `modules` = {name: module path}."""
    import torch
    from transformers import AutoModelForCausalLM

    d = FIX / case
    tm = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    got, handles = {}, []
    for name, path in modules.items():
        mod = tm.get_submodule(path.removesuffix(":in"))
        pick = (lambda inp, out: inp[0]) if path.endswith(":in") else (
            lambda inp, out: out[0] if isinstance(out, tuple) else out)
        hook = (lambda n, f: lambda _m, inp, out: got.__setitem__(n, f(inp, out).detach()))
        handles.append(mod.register_forward_hook(hook(name, pick)))
    prompt = json.loads((d / "case.json").read_text())["prompts"][0]
    with torch.no_grad():
        tm(torch.tensor([prompt]), use_cache=False)
    for h in handles:
        h.remove()
    return {k: v.numpy() for k, v in got.items()}, [prompt]


@pytest.mark.parametrize("case,pairs", [
    # LFM2 (TL's Lfm2ArchitectureAdapter: `conv`, `attn`, `mlp`); conv_attn's blocks: conv, attention, conv.
    ("lfm2/conv_attn", {"blocks.0.conv.hook_out": "model.layers.0.conv",
                        "blocks.0.conv.hook_gated": "model.layers.0.conv.out_proj:in",
                        "blocks.1.attn.hook_out": "model.layers.1.self_attn",
                        "blocks.1.hook_attn_out": "model.layers.1.self_attn",
                        "blocks.2.mlp.hook_out": "model.layers.2.feed_forward",
                        "blocks.2.hook_mlp_out": "model.layers.2.feed_forward"}),
    # RWKV-4 (TL's RwkvArchitectureAdapter: time_mix = attention, channel_mix = feed_forward); rescale_every 2.
    ("rwkv/basic", {"blocks.1.hook_time_mix_out": "rwkv.blocks.1.attention",
                    "blocks.1.time_mix.hook_out": "rwkv.blocks.1.attention",
                    "blocks.2.hook_channel_mix_out": "rwkv.blocks.2.feed_forward",
                    "blocks.1.channel_mix.hook_out": "rwkv.blocks.1.feed_forward",
                    "blocks.0.hook_resid_post": "rwkv.blocks.0",
                    "blocks.2.hook_resid_post": "rwkv.blocks.2"}),
])
def test_tl_4_3_adapters_name_the_module_outputs(case, pairs):
    """TL 4.3's LFM2 and RWKV-4 adapters hook transformers' module outputs: mixlens's values saved under those TL
    names equal them (float32 rounding)."""
    want, prompts = _hf_module_outputs(case, pairs)
    model = mixlens.StandardizedTransformer(str(FIX / case))
    out = model.run(prompts, saves=list(pairs))
    for tl in pairs:
        got = np.asarray(out[tl])
        assert got.shape == want[tl].shape, (tl, got.shape, want[tl].shape)
        assert rel_rms(got, want[tl]) <= 1e-5, (tl, rel_rms(got, want[tl]))


def test_recurrent_gemma_maps_the_residual_stream():
    """TL 4.3's RecurrentGemma adapter is residual-only (the other names: test_unmapped_tl_names_say_why)."""
    model, prompts = load("recurrent_gemma/griffin")
    out = model.run(prompts, saves=["blocks.1.hook_resid_post", "layers.1.layer_output", "ln_final.hook_out"])
    assert np.array_equal(out["blocks.1.hook_resid_post"], out["layers.1.layer_output"])

