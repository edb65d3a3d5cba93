"""Live parity of MiniMax (lightning attention + GQA softmax attention, Mixtral-style MoE on every block,
scaled residuals) with transformers 5.18.

Fresh random models built with the fixture builder (dev/mixlens_dev/fixtures/minimax.py; seeds distinct
from the committed fixtures): every value at every step (prompt + 7 decode steps, left-padded batch)
read through the Python API against mixlens_dev.oracle_minimax (transformers' modules, hooked) on both
kernel routes; 8 greedy tokens; edits against transformers running the same modification; the per-token
kv state (`state_after(t)`) against transformers' linear cache after a prefix, and a write
(`set_state_after(t, v)`) against transformers continuing from a cache whose kv state was replaced;
what support() says. Gradients: test_grad_qwen.py's minimax rows.

Tolerance (float32 on both sides): relative RMS <= 3e-5 per value, 1e-4 on logits.
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev import oracle_minimax as om
from mixlens_dev.common import rel_rms
from mixlens_dev.fixtures import N_STEPS, mix
from mixlens_dev.parity import LiveCase, assert_edits_match, assert_saves_match, compare, read_every_value

torch = pytest.importorskip("torch")
LIN, FULL = "linear_attention", "full_attention"

CASES = {
    "minimax_padded": dict(
        seed=81, prompts=[13, 6],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], block_size=4, linear_attn_beta_factor=1.2,
                    mlp_alpha_factor=0.9),
        edits=[dict(name="keys_half", path=mix(0, "attention_keys"), step=0, op="scale", factor=0.5),
               dict(name="state_in_x2_s3", path=mix(0, "state_input"), step=3, op="scale", factor=2.0),
               dict(name="values_x2_s1", path=mix(0, "attention_values"), step=1, op="scale", factor=2.0)]),
    "minimax_top1": dict(
        seed=83, prompts=[11],
        config=dict(num_hidden_layers=3, layer_types=[LIN, LIN, FULL], block_size=5, num_experts_per_tok=1),
        # one token's queries: a uniform scale of q is undone by the output RMSNorm over all heads
        edits=[dict(name="queries_tok4", path=mix(0, "attention_queries"), step=0, op="set_index", index=4, value=0.5),
               dict(name="state_in_zero_s2", path=mix(1, "state_input"), step=2, op="scale", factor=0.0)]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    from mixlens_dev.fixtures import minimax as mm

    spec = CASES[request.param]
    return LiveCase(request.param, spec, tmp_path_factory.mktemp(request.param), mm.build_model, om.run,
                    om.check_against_plain_hf, mm.PAD)


@pytest.mark.parametrize("route", ["default", "chunked", "recurrent"])
def test_every_value_every_step(case, route):
    mixlens.route_kernels("minimax", route)
    try:
        with case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
            got = read_every_value(case.model, tracer)
    finally:
        mixlens.route_kernels("minimax", "default")
    n = compare(got, case.ref, f"{case.name} {route}")
    assert n >= N_STEPS * case.n_layers * 5
    for k in range(N_STEPS):
        assert om.oq.key(mix(0, "states"), k) in got and om.oq.key(mix(0, "decays"), k) in got
    assert tracer.tokens == case.ref["tokens"].tolist()
    want = ["chunked"] + ["recurrent"] * (N_STEPS - 1) if route == "default" else [route] * N_STEPS
    assert [c["kernel"] for c in tracer.calls] == want


@pytest.mark.parametrize("how", ["saves", "interleaved", "pre_registered"])
def test_saves_and_edits_match_transformers(case, how):
    """Pre-registered saves hold the oracle's values; each edit equals transformers with the same edit."""
    if how == "saves":
        assert_saves_match(case, 0)
    else:
        assert_edits_match(case, how)


def _hf_prefix_state(torch_model, ids):
    """transformers' cache (oracle_minimax.MaskSizedCache) after running `ids` (one row) as a prompt, and layer
    0's kv state in it."""
    cache = om.MaskSizedCache()
    with torch.no_grad():
        torch_model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache, cache.linear_cache[0].clone()


def test_state_after_t_reads_and_writes_match_transformers(case):
    """state_after(t) of layer 0 for every t equals transformers' linear cache after the prompt's first t + 1
    tokens; set_state_after(mid, -1.5 * that) equals transformers continuing the rest of the prompt from a
    cache whose kv state was replaced by the same."""
    prompt = case.prompts[0]
    prefixes = [_hf_prefix_state(case.torch_model, prompt[: t + 1]) for t in range(len(prompt))]
    with case.model.trace([prompt]):
        la = case.model.layers[0].linear_attn
        for t, (_, want) in enumerate(prefixes):
            assert rel_rms(np.array(la.state_after(t), dtype=np.float32), want.numpy()) <= 3e-5, t
    mid = len(prompt) // 2
    with case.model.trace([prompt]) as tr:
        la = case.model.layers[0].linear_attn
        la.set_state_after(mid, la.state_after(mid) * -1.5)
    cache, st = prefixes[mid]
    cache.linear_cache[0].copy_(st * -1.5)
    pos = torch.arange(mid + 1, len(prompt))[None]
    with torch.no_grad():
        out = case.torch_model(input_ids=torch.tensor([prompt[mid + 1:]]), position_ids=pos, past_key_values=cache,
                               use_cache=True)
    assert rel_rms(np.asarray(tr.logits)[:, mid + 1:], out.logits.numpy()) <= 1e-4


def test_a_continuation_equals_the_whole_prompt_where_transformers_stock_cache_does_not(case):
    """The transformers 5.18 bug oracle_minimax works around (its module doc): with layer 0 a lightning
    layer, the stock MiniMaxCache masks a continuation as if nothing were cached. The oracle's
    MaskSizedCache and mixlens both give the whole prompt's logits."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    prompt = case.prompts[0]
    mid = len(prompt) // 2
    pos = torch.arange(mid, len(prompt))[None]
    with torch.no_grad():
        whole = case.torch_model(input_ids=torch.tensor([prompt])).logits[:, mid:].numpy()
        tails = {}
        for name, cache in (("stock", MiniMaxCache()), ("sized", om.MaskSizedCache())):
            case.torch_model(input_ids=torch.tensor([prompt[:mid]]), past_key_values=cache, use_cache=True)
            tails[name] = case.torch_model(input_ids=torch.tensor([prompt[mid:]]), position_ids=pos,
                                           past_key_values=cache, use_cache=True).logits.numpy()
    assert rel_rms(tails["sized"], whole) <= 1e-5
    assert rel_rms(tails["stock"], whole) > 1e-2  # if this fails, transformers fixed it: drop the workaround
    cache = case.model.new_cache(1)
    with case.model.trace([prompt[:mid]], cache=cache):
        pass
    with case.model.trace([prompt[mid:]], cache=cache) as tr:
        pass
    assert rel_rms(np.asarray(tr.logits), whole) <= 1e-4


def test_layer_kinds_and_kernel_identity_name_lightning(case):
    kinds = case.model.info["layer_kinds"]
    assert kinds == ["lightning" if k == LIN else "attention" for k in case.torch_model.config.layer_types]
    ident = case.model._core.mixer_identity(0, 16)
    assert (ident["kind"], ident["state_op"], ident["prompt_kernel"], ident["step_kernel"]) == \
        ("lightning", "lightning_attention", "chunked", "recurrent")


def test_support_says_why(case):
    s = case.model.support()
    assert "lightning" in s["linear_attn.betas"][0]
    assert s["linear_attn.state"][0] is None and s["linear_attn.decays"][0] is None  # available
