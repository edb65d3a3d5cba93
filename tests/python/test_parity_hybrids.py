"""Live parity of the Mamba hybrids (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H, Jamba, Zamba2) with transformers 5.18.

Fresh random models built with mixlens_dev.fixtures.hybrids' builder (seeds distinct from the
committed fixtures), every value at every step (prompt + 7 decode steps, through mixer, attention
and MLP blocks) read through the Python API and compared with mixlens_dev/oracle_hybrids.py;
8 greedy tokens; left-padded batches; chunk sizes smaller than the prompt; n_groups 1 and 2; edits
(betas, decays, state_input, attention_values, a self_attn value) against transformers running the
same modification, teacher-forced with the unedited tokens, on every value.

Tolerance: relative RMS <= 1e-5 per value, 1e-4 on logits (float32 on both sides).
"""

from __future__ import annotations

import pytest

import mixlens
from mixlens_dev import oracle_hybrids as oh
from mixlens_dev.common import rel_rms
from mixlens_dev.parity import ParityCase, assert_edits_match, assert_saves_match, compare, read_every_value

N_STEPS = 8
PAD = 0


def mix(layer, value):
    return f"layers.{layer}.linear_attn.{value}"


def att(layer, value):
    return f"layers.{layer}.self_attn.{value}"


CASES = {
    # n_groups 2 (grouped gated norm), dt clamp at time_step_min, left-padded batch, prompt 23 > chunk 8.
    "nemotron_h_g2_padded": dict(
        family="nemotron_h", seed=41, prompts=[23, 9], config=dict(hybrid_override_pattern="M*-M"),
        edits=[dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
               dict(name="state_in_x2_s2", path=mix(3, "state_input"), step=2, op="scale", factor=2.0),
               dict(name="attn_v_x2_s1", path=att(1, "attention_values"), step=1, op="scale", factor=2.0)]),
    "nemotron_h_g1": dict(
        family="nemotron_h", seed=43, prompts=[14], config=dict(hybrid_override_pattern="M-M*", n_groups=1,
                                                                 chunk_size=4),
        edits=[dict(name="decays_x3", path=mix(2, "decays"), step=0, op="scale", factor=3.0),
               dict(name="values_tok3", path=mix(0, "attention_values"), step=0, op="set_index", index=3,
                    value=0.5)]),
    # MoE blocks (group-limited routing, latent projection, shared expert) in a left-padded batch.
    "nemotron_h_moe_padded": dict(
        family="nemotron_h", seed=59, prompts=[16, 7], config=dict(hybrid_override_pattern="MEM*", n_routed_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                                                               n_group=2, topk_group=1, moe_latent_size=8, routed_scaling_factor=1.5),
        edits=[dict(name="decays_half", path=mix(0, "decays"), step=0, op="scale", factor=0.5)]),
    "bamba_g2_padded": dict(
        family="bamba", seed=46, prompts=[19, 7], config=dict(mamba_chunk_size=4),
        edits=[dict(name="decays_half_s1", path=mix(0, "decays"), step=1, op="scale", factor=0.5),
               dict(name="attn_out_x2_s3", path=att(1, "attention_output"), step=3, op="scale", factor=2.0),
               dict(name="betas_zero_tok2", path=mix(2, "betas"), step=0, op="set_index", index=2, value=0.0)]),
    "bamba_g1": dict(
        family="bamba", seed=48, prompts=[12], config=dict(mamba_n_groups=1, attn_layer_indices=[0],
                                                           tie_word_embeddings=False),
        edits=[dict(name="state_in_head2_s2", path=mix(1, "state_input"), step=2, op="set_index", index=2,
                    value=0.0)]),
    # Every µP multiplier away from 1, mamba_d_ssm != expand * hidden, n_groups 2, left-padded batch,
    # mamba_rms_norm off: a decode step's attention_head_outputs carry silu(z), a prompt's do not.
    "falcon_h1_mup_padded": dict(
        family="falcon_h1", seed=49, prompts=[18, 6], config=dict(mamba_rms_norm=False),
        edits=[dict(name="betas_x0p3", path=mix(0, "betas"), step=0, op="scale", factor=0.3),
               dict(name="attn_v_half_s2", path=att(1, "attention_values"), step=2, op="scale", factor=0.5),
               dict(name="decays_x2_s4", path=mix(1, "decays"), step=4, op="scale", factor=2.0)]),
    # mamba_rms_norm on (norm before gate, n_groups 1). Batch 1: transformers 5.18's
    # FalconH1RMSNormGated drops the token axis on one-token calls, so its batched decode broadcasts
    # [B, D] + [B, 1, D] to [B, B, D] (mixlens computes the per-row result).
    "falcon_h1_norm_before_gate": dict(
        family="falcon_h1", seed=57, prompts=[13], config=dict(mamba_norm_before_gate=True, mamba_n_groups=1,
                                                               tie_word_embeddings=False),
        edits=[dict(name="state_in_x0p5_s1", path=mix(0, "state_input"), step=1, op="scale", factor=0.5)]),
    # Granite 4.0-H: RoPE, routed SwiGLU experts (softmax top-2) + shared MLP, every µP multiplier
    # (embedding, residual, attention softmax scale, logits scaling), left-padded batch, chunk 4.
    "granite_rope_moe_padded": dict(
        family="granitemoehybrid", seed=61, prompts=[18, 7], config=dict(mamba_chunk_size=4),
        edits=[dict(name="decays_half_s1", path=mix(0, "decays"), step=1, op="scale", factor=0.5),
               dict(name="attn_out_x2_s3", path=att(1, "attention_output"), step=3, op="scale", factor=2.0),
               dict(name="betas_zero_tok2", path=mix(2, "betas"), step=0, op="set_index", index=2, value=0.0)]),
    # No positional encoding (the published "nope"), no experts (the shared MLP alone), n_groups 1.
    "granite_nope_dense": dict(
        family="granitemoehybrid", seed=67, prompts=[13, 6], config=dict(
            position_embedding_type="nope", num_local_experts=0, num_experts_per_tok=0, mamba_n_groups=1,
            layer_types=["attention", "mamba", "mamba"], tie_word_embeddings=False),
        edits=[dict(name="state_in_head2_s2", path=mix(1, "state_input"), step=2, op="set_index", index=2, value=0.0),
               dict(name="attn_v_x2_s1", path=att(0, "attention_values"), step=1, op="scale", factor=2.0)]),
    # Jamba: Mamba-1 mixers (weighted RMS norms on dt / B / C) at 0, 2, 3, attention at 1 and 4, softmax
    # top-2 of 4 experts at 0, 2, 4 and the MLP elsewhere, left-padded batch.
    "jamba_moe_padded": dict(
        family="jamba", seed=83, prompts=[18, 7], config={},
        edits=[dict(name="decays_half_s1", path=mix(0, "decays"), step=1, op="scale", factor=0.5),
               dict(name="attn_out_x2_s3", path=att(1, "attention_output"), step=3, op="scale", factor=2.0),
               dict(name="betas_zero_tok2", path=mix(2, "betas"), step=0, op="set_index", index=2, value=0.0)]),
    # Top-1 routing, in_proj / out_proj biases, no conv bias, dt rank 5, untied lm_head.
    "jamba_top1_bias": dict(
        family="jamba", seed=94, prompts=[14], config=dict(
            num_hidden_layers=3, attn_layer_period=4, attn_layer_offset=2, expert_layer_offset=1,
            num_experts_per_tok=1, mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank=5,
            tie_word_embeddings=False),
        edits=[dict(name="state_in_x2_s2", path=mix(1, "state_input"), step=2, op="scale", factor=2.0),
               dict(name="attn_v_x2_s1", path=att(2, "attention_values"), step=1, op="scale", factor=2.0)]),
    # Zamba2: 2 shared blocks over 3 hybrid layers (layers 1 and 4 run block 0), RoPE, q / k / v and
    # MLP adapters per depth, left-padded batch, chunk 4; writes at one depth of a shared block (set,
    # not scaled: the pre-ff RMSNorm undoes a scale of attention_output).
    "zamba2_shared_lora_padded": dict(
        family="zamba2", seed=71, prompts=[17, 8], config=dict(chunk_size=4),
        edits=[dict(name="attn_out_tok2_l4", path=att(4, "attention_output"), step=0, op="set_index", index=2, value=0.5),
               dict(name="attn_v_x2_l1_s2", path=att(1, "attention_values"), step=2, op="scale", factor=2.0),
               dict(name="decays_half_s1", path=mix(3, "decays"), step=1, op="scale", factor=0.5)]),
    # No RoPE, no attention adapters, one shared block, untied, n_groups 1.
    "zamba2_nope_one_block": dict(
        family="zamba2", seed=73, prompts=[14], config=dict(
            use_mem_rope=False, use_shared_attention_adapter=False, num_mem_blocks=1, mamba_ngroups=1,
            tie_word_embeddings=False, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
        edits=[dict(name="attn_v_x2_l3_s1", path=att(3, "attention_values"), step=1, op="scale", factor=2.0),
               dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5)]),
    # Zamba: Mamba-1 layers of 2 Mamba heads, one shared block at layers 1 and 4, GQA, left-padded
    # batch; writes at one depth of the shared block and on one head-split value (B).
    "zamba_shared_padded": dict(
        family="zamba", seed=101, prompts=[17, 8], config={},
        edits=[dict(name="attn_out_tok2_l4", path=att(4, "attention_output"), step=0, op="set_index", index=2, value=0.5),
               dict(name="keys_x2_s2", path=mix(2, "attention_keys"), step=2, op="scale", factor=2.0),
               dict(name="decays_half_s1", path=mix(3, "decays"), step=1, op="scale", factor=0.5)]),
    # 4 Mamba heads, projection biases, no conv bias, dt rank 5, untied; the shared block at 0 and 2.
    "zamba_heads4_bias": dict(
        family="zamba", seed=103, prompts=[14], config=dict(
            n_mamba_heads=4, mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank=5, tie_word_embeddings=False,
            num_hidden_layers=4, layers_block_type=["hybrid", "mamba", "hybrid", "mamba"]),
        edits=[dict(name="attn_v_x2_l2_s1", path=att(2, "attention_values"), step=1, op="scale", factor=2.0),
               dict(name="state_in_x2_s2", path=mix(1, "state_input"), step=2, op="scale", factor=2.0)]),
}


class Case(ParityCase):
    def __init__(self, name, tmp_path):
        from mixlens_dev import fixtures as mf
        from mixlens_dev.fixtures import hybrids as mh

        spec = CASES[name]
        self.name, self.spec = name, spec
        model = mh.build_model(spec["family"], spec["config"], spec["seed"])
        model.save_pretrained(tmp_path)
        self.torch_model = type(model).from_pretrained(tmp_path).eval()
        self.prompts = mh.prompts_for(spec["prompts"], spec["seed"], self.torch_model.config.vocab_size)
        self.ref, rec = oh.run(self.torch_model, self.prompts, PAD, N_STEPS)
        mh.check_against_plain_hf(self.torch_model, self.prompts, self.ref)
        self.mixer_layers = mh.mixer_layers(self.torch_model)
        oh.check_invariants(self.ref, self.mixer_layers, N_STEPS)
        assert mf.greedy_margin(self.ref) > 1e-2, f"{name}: greedy margin too small; pick another seed"
        self.model = mixlens.StandardizedTransformer(str(tmp_path))
        self.path = str(tmp_path)

    def oracle_run(self, edits, feeds):
        return oh.run(self.torch_model, self.prompts, PAD, N_STEPS, edits, feeds=feeds)[0]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_every_value_every_step(case):
    with case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
        got = read_every_value(case.model, tracer)
    n = compare(got, case.ref, case.name)
    assert n >= N_STEPS * len(case.mixer_layers) * 10
    for k in range(N_STEPS):  # mixer and attention values were both compared at every step
        assert oh.key(mix(case.mixer_layers[0], "states"), k) in got
        assert any(oh.key(att(i, "attention_keys"), k) in got for i in range(4))
    assert tracer.tokens == case.ref["tokens"].tolist()
    prompt_kernel = "recurrent" if case.spec["family"] in ("jamba", "zamba") else "chunked"  # Mamba-1: the token loop
    assert [c["kernel"] for c in tracer.calls] == [prompt_kernel] + ["recurrent"] * (N_STEPS - 1)


def test_pre_registered_saves_match(case):
    assert_saves_match(case, case.mixer_layers[0])


@pytest.mark.parametrize("how", ["interleaved", "pre_registered"])
def test_edits_match_transformers_with_the_same_modification(case, how):
    assert_edits_match(case, how)


def _per_layer(entry, n):
    return [None] * n if entry is None else [entry[i] for i in range(n)]


def test_support_and_block_kinds(case):
    """support() per layer; asking a block for what it lacks is an error naming the block's kind."""
    sup = case.model.support()
    n = case.torch_model.config.num_hidden_layers
    lin, sa, mlp = (_per_layer(sup[k], n) for k in ("linear_attn.states", "self_attn.attention_output", "mlp.output"))
    kinds = case.model.info["layer_kinds"]
    for i in range(n):
        assert (lin[i] is None) == (i in case.mixer_layers), (i, lin[i])
        if kinds[i] == "hybrid":  # Falcon-H1: both mixers on every block
            assert lin[i] is None and sa[i] is None and mlp[i] is None
        if kinds[i] == "attention":
            assert sa[i] is None and "is an attention block" in lin[i]
        if kinds[i] in ("mamba2", "mamba"):
            assert f"is a {kinds[i]} block" in sa[i]
        if kinds[i] == "mlp":
            assert mlp[i] is None and "is a mlp block" in lin[i]
        if lin[i] is not None:
            with pytest.raises(mixlens.UnknownValueError, match=f"block {i} is an? {kinds[i]} block"):
                case.model.generate(case.prompts, max_new_tokens=1, saves=[mix(i, "states")]).run()
    expected = {"nemotron_h": {"mamba2", "attention", "mlp"} if "moe" not in kinds else {"mamba2", "attention", "moe"}, "bamba": {"mamba2", "attention"},
                "falcon_h1": {"hybrid"}, "granitemoehybrid": {"mamba2", "attention"},
                "jamba": {"mamba", "attention"},
                "zamba2": {"mamba2", "hybrid"},
                "zamba": {"mamba", "hybrid"}}[case.spec["family"]]
    assert set(kinds) == expected


def test_chunk_size_smaller_than_prompt_agrees_with_recurrent_kernel(case):
    """The chunked kernel (config chunk size < prompt) and the token loop give the same values."""
    paths = [mix(case.mixer_layers[0], v) for v in ("states", "attention_head_outputs", "attention_output")]
    runs = []
    for route in ("chunked", "recurrent"):
        mixlens.route_kernels(case.spec["family"], route)
        try:
            runs.append(case.model.generate(case.prompts, max_new_tokens=2, eos_token_id=-1, saves=paths).run())
        finally:
            mixlens.route_kernels(case.spec["family"], "default")
    for p in paths:
        assert rel_rms(runs[0].saved[p][0], runs[1].saved[p][0]) <= 1e-5, p


def test_granite_inputs_embeds_are_multiplied_as_transformers_does(case):
    """GraniteMoeHybridModel scales inputs_embeds by embedding_multiplier too (Falcon-H1 does not):
    the raw embedding rows given as inputs_embeds reproduce the ids' logits, on both sides."""
    if case.spec["family"] != "granitemoehybrid":
        pytest.skip("Granite only")
    import numpy as np
    import torch

    ids = case.prompts[0]
    raw = case.torch_model.model.embed_tokens(torch.tensor([ids])).detach()
    with torch.no_grad():
        want = case.torch_model(inputs_embeds=raw).logits.numpy()
    got = case.model.run(inputs_embeds=raw.numpy())["logits"]
    assert rel_rms(got, want) <= 1e-5
    np.testing.assert_allclose(got, case.model.run([ids])["logits"], rtol=0, atol=1e-5)


def test_zamba2_shared_block_values_are_per_depth(case):
    """A shared block is addressed per depth: a write at its last depth leaves every value of the
    earlier depths of the same block bitwise unchanged and moves its own; a write at the first depth
    is not re-applied at the later one (the later depth's attention output is not zeroed)."""
    if case.spec["family"] not in ("zamba2", "zamba"):
        pytest.skip("Zamba2 / Zamba only")
    import numpy as np

    kinds = case.model.info["layer_kinds"]
    hybrid = [i for i, k in enumerate(kinds) if k == "hybrid"]
    first, last = hybrid[0], hybrid[-1]
    sites = [att(i, v) for i in (first, last) for v in ("attention_queries", "attention_values", "attention_output")]
    sites += [f"layers.{i}.mlp.output" for i in (first, last)]

    def run(edit_path):
        edits = {f"{edit_path}@step0": lambda v: v * 0.0} if edit_path else {}
        return case.model.generate(case.prompts, max_new_tokens=1, eos_token_id=-1, saves=sites, edits=edits).run().saved

    base, late, early = run(None), run(att(last, "attention_output")), run(att(first, "attention_output"))
    for v in ("attention_queries", "attention_values", "attention_output"):
        assert np.array_equal(late[att(first, v)][0], base[att(first, v)][0]), v
    assert np.array_equal(late[f"layers.{first}.mlp.output"][0], base[f"layers.{first}.mlp.output"][0])
    assert not np.array_equal(late[f"layers.{last}.mlp.output"][0], base[f"layers.{last}.mlp.output"][0])
    assert not np.any(np.asarray(early[att(first, "attention_output")][0]))
    assert np.any(np.asarray(early[att(last, "attention_output")][0]))



@pytest.mark.parametrize("route", ["recurrent", "chunked"])
def test_zamba_embeddings_gradient_matches_torch_autograd(case, route):
    """tr.backward on Zamba vs torch autograd of transformers' model: the embeddings' gradient (it
    flows back through every per-head mixer, the shared block at each depth and the concatenated
    embeddings it reads) of a random weighting of every position's logits, on both kernel routes.
    The per-value gradients are checked against finite differences (tests/cpp/test_grad_hybrids.cpp)."""
    if case.spec["family"] != "zamba":
        pytest.skip("Zamba only")
    import numpy as np
    import torch

    ids = [case.prompts[0]]
    W = np.random.default_rng(5).standard_normal((1, len(ids[0]), case.torch_model.config.vocab_size)).astype(np.float32)
    mixlens.route_kernels("zamba", route)
    try:
        with case.model.trace(ids, saves=["embed_tokens.output"], grad=True) as tr:
            pass
        tr.backward(W)
    finally:
        mixlens.route_kernels("zamba", "default")
    emb = case.torch_model.model.embed_tokens(torch.tensor(ids)).detach().requires_grad_(True)
    (case.torch_model(inputs_embeds=emb).logits * torch.from_numpy(W)).sum().backward()
    assert rel_rms(np.asarray(tr.grad("embed_tokens.output")), emb.grad.numpy()) <= 1e-4


def test_zamba_hybrid_layers_name_their_mamba1_mixer():
    """Kernel identity: a Zamba layer that runs the shared block still runs the Mamba-1 scan (a hybrid
    layer kind meant Mamba-2 for Falcon-H1 and Zamba2)."""
    from mixlens_dev.common import REPO

    m = mixlens.StandardizedTransformer(str(REPO / "tests/fixtures/zamba/shared_edits"))
    kinds = [m.info["layer_kinds"][i] for i in range(m.info["num_layers"])]
    assert "hybrid" in kinds
    assert {m.layers[i].linear_attn.kind for i in range(len(kinds))} == {"selective_scan"}
