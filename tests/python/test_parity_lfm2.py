"""Live parity of LFM2 / LFM2-MoE (gated short conv + GQA attention, SwiGLU MLP or sigmoid-routed MoE)
with transformers 5.18.

Fresh random models built with the fixture builder (dev/mixlens_dev/fixtures/lfm2.py; seeds distinct
from the committed fixtures): every value at every step (prompt + 7 decode steps, left-padded batch)
read through the Python API against mixlens_dev.oracle_lfm2 (transformers' modules, hooked); 8 greedy
tokens; edits against transformers running the same modification; the per-token window
(`state_after(t)`) against the explicit recurrence and transformers' conv_states after a prefix, and a
write (`set_state_after(t, v)`) against transformers continuing from a cache whose window was replaced.

Tolerance: relative RMS <= 3e-5 per value, 1e-4 on logits (float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev import oracle_lfm2 as ol
from mixlens_dev.common import rel_rms
from mixlens_dev.parity import LiveCase, assert_edits_match, assert_saves_match, compare, read_every_value

torch = pytest.importorskip("torch")

N_STEPS = 8
PAD = 0
CONV, FULL = "conv", "full_attention"


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


CASES = {
    "lfm2_padded": dict(
        family="lfm2", seed=66, prompts=[14, 6],
        config=dict(num_hidden_layers=3, layer_types=[CONV, FULL, CONV], intermediate_size=48, block_multiple_of=8,
                    conv_L_cache=3),
        edits=[dict(name="keys_half", path=mix(0, "attention_keys"), step=0, op="scale", factor=0.5),
               dict(name="state_in_x2_s3", path=mix(0, "state_input"), step=3, op="scale", factor=2.0),
               dict(name="values_x2_s1", path=mix(0, "attention_values"), step=1, op="scale", factor=2.0)]),
    "lfm2_moe_padded": dict(
        family="lfm2_moe", seed=64, prompts=[12, 7],
        config=dict(num_hidden_layers=3, layer_types=[CONV, FULL, CONV], intermediate_size=40, moe_intermediate_size=16,
                    num_experts=4, num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=1.25,
                    conv_L_cache=4),
        edits=[dict(name="queries_x3", path=mix(0, "attention_queries"), step=0, op="scale", factor=3.0),
               dict(name="state_in_zero_s2", path=mix(0, "state_input"), step=2, op="scale", factor=0.0)]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    from mixlens_dev.fixtures import lfm2 as lf
    from mixlens_dev.fixtures.qwen import check_against_plain_hf

    spec = CASES[request.param]
    return LiveCase(request.param, spec, tmp_path_factory.mktemp(request.param),
                    lambda s: lf.build_model(s["family"], s), ol.run, check_against_plain_hf, PAD)


def test_every_value_every_step(case):
    with case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
        got = read_every_value(case.model, tracer)
    n = compare(got, case.ref, case.name)
    assert n >= N_STEPS * case.n_layers * 5
    for k in range(N_STEPS):
        assert ol.key(mix(0, "states"), k) in got and ol.key("layers.1.self_attn.attention_keys", k) in got
    assert tracer.tokens == case.ref["tokens"].tolist()
    assert [c["kernel"] for c in tracer.calls] == ["recurrent"] * N_STEPS  # the one kernel


def test_pre_registered_saves_match(case):
    assert_saves_match(case, 0)


@pytest.mark.parametrize("how", ["interleaved", "pre_registered"])
def test_edits_match_transformers_with_the_same_modification(case, how):
    assert_edits_match(case, how)


def _hf_prefix_window(torch_model, ids, layer):
    """transformers' conv_states of `layer` after running `ids` ([1, n]) as a prompt."""
    from transformers import DynamicCache

    cache = DynamicCache(config=torch_model.config)
    with torch.no_grad():
        torch_model(input_ids=torch.tensor(ids), past_key_values=cache, use_cache=True)
    return cache, cache.layers[layer].conv_states[0].clone()


def test_state_after_t_is_transformers_window_after_the_prefix(case):
    """state_after(t) for every t equals transformers' conv_states after the prompt's first t + 1 tokens."""
    prompt = case.prompts[0]
    with case.model.trace([prompt]):
        mb = case.model.layers[2].linear_attn
        got = [np.array(mb.state_after(t), dtype=np.float32) for t in range(len(prompt))]
    for t in range(len(prompt)):
        _, want = _hf_prefix_window(case.torch_model, [prompt[: t + 1]], 2)
        assert rel_rms(got[t], want.numpy()) <= 3e-5, t


def test_set_state_after_t_equals_transformers_with_the_window_replaced(case):
    """A write of the window after t (scaled by -1.5) equals transformers run on tokens 0..t, its
    conv_states replaced by the same, then the rest over that cache."""
    prompt = case.prompts[0]
    t = len(prompt) // 2
    with case.model.trace([prompt]) as tr:
        mb = case.model.layers[0].linear_attn
        mb.set_state_after(t, mb.state_after(t) * -1.5)
    logits = tr.logits
    cache, win = _hf_prefix_window(case.torch_model, [prompt[: t + 1]], 0)
    cache.layers[0].conv_states[0].copy_(win * -1.5)
    with torch.no_grad():
        rest = case.torch_model(input_ids=torch.tensor([prompt[t + 1:]]), past_key_values=cache, use_cache=True,
                                position_ids=torch.arange(t + 1, len(prompt))[None]).logits.numpy()
    got = np.asarray(logits)[:, t + 1:]
    assert rel_rms(got, rest) <= 1e-4


def test_support_says_why(case):
    s = case.model.support()
    assert "short_conv" in s["linear_attn.betas"][0] and "no recurrent state" in s["linear_attn.state"][1]
    assert s["linear_attn.state"][0] is None  # available
    with pytest.raises(mixlens.UnsupportedError, match="one kernel"):
        mixlens.route_kernels(case.spec["family"], "chunked")
    # Gradients: tests/python/test_grad_qwen.py (LFM2 rows), tests/cpp/test_grad_lfm2.cpp.
