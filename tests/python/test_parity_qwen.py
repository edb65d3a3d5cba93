"""Live parity of the gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next MoE, Qwen3.5-MoE, OLMo-Hybrid) with transformers 5.18.

Fresh random models built here with scripts/qwen_fixtures.py's builder (seeds distinct from the
committed fixtures), every value at every step (prompt + 7 decode steps, each step through the
DeltaNet and the attention layers) read through the Python API and compared with
tests/python/oracle_qwen.py; 8 greedy tokens; edits to betas, decays, state_input and
attention_keys against transformers running the same modification (the oracle's edits),
teacher-forced with the unedited tokens, on every value.

Tolerance: relative RMS <= 1e-5 per value, 1e-4 on logits (float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev import oracle_qwen as oq
from mixlens_dev.common import REPO, rel_rms
from mixlens_dev.parity import LiveCase, assert_edits_match, assert_saves_match, compare, read_every_value

N_STEPS = 8
PAD = 0
LIN, FULL = "linear_attention", "full_attention"


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

CASES = {
    # HV = HK, a 70-token prompt (two chunks of 64) next to a left-padded 9-token row; partial mRoPE.
    "qwen3_5_hv_eq_hk_chunks_padded": dict(
        family="qwen3_5", seed=26, prompts=[70, 9],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                    linear_num_value_heads=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        edits=[
            dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
            dict(name="decays_x3_s2", path=mix(2, "decays"), step=2, op="scale", factor=3.0),
            dict(name="keys_tok66", path=mix(0, "attention_keys"), step=0, op="set_index", index=66, value=0.7),
        ],
    ),
    # HV = 2*HK (q/k head repetition; keys are served per value head), untied head, padded batch.
    "qwen3_5_hv_2hk_padded": dict(
        family="qwen3_5", seed=42, prompts=[12, 5],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                    linear_num_value_heads=4, tie_word_embeddings=False),
        edits=[
            # Keys are L2-normalised inside the kernel (a scale would change nothing): overwrite one.
            dict(name="keys_set_s1", path=mix(2, "attention_keys"), step=1, op="set_index", index=0, value=0.5),
            dict(name="state_in_head1_s2", path=mix(0, "state_input"), step=2, op="set_index", index=1, value=0.0),
            dict(name="betas_zero_tok3", path=mix(2, "betas"), step=0, op="set_index", index=3, value=0.0),
        ],
    ),
    # Qwen3-Next: MoE blocks (one dense layer), HV = 2*HK, two chunks, left-padded batch.
    "qwen3_next_moe_chunks_padded": dict(
        family="qwen3_next", seed=31, prompts=[67, 20],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                    linear_num_value_heads=4, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                    tie_word_embeddings=False, **MOE),
        edits=[
            dict(name="decays_half", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="state_in_x2_s3", path=mix(2, "state_input"), step=3, op="scale", factor=2.0),
            dict(name="betas_x0p3_s1", path=mix(0, "betas"), step=1, op="scale", factor=0.3),
        ],
    ),
    # Qwen3.5-MoE: the MoE on every layer (top-k always renormalised), HV = 2*HK, two chunks, padded batch.
    "qwen3_5_moe_chunks_padded": dict(
        family="qwen3_5_moe", seed=35, prompts=[67, 20],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                    linear_num_value_heads=4, tie_word_embeddings=False, **dict(MOE, num_experts_per_tok=3)),
        edits=[
            dict(name="decays_half", path=mix(0, "decays"), step=0, op="scale", factor=0.5),
            dict(name="state_in_x2_s3", path=mix(2, "state_input"), step=3, op="scale", factor=2.0),
            dict(name="values_x2_s1", path=mix(2, "attention_values"), step=1, op="scale", factor=2.0),
        ],
    ),
    # OLMo-Hybrid: post-norm attention blocks, plain norms, beta = 2 sigmoid(b), RoPE and attention biases,
    # HV = 2*HK, two chunks, left-padded batch.
    "olmo_hybrid_chunks_padded": dict(
        family="olmo_hybrid", seed=36, prompts=[67, 20],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_num_key_heads=2,
                    linear_num_value_heads=4, attention_bias=True, tie_word_embeddings=False),
        edits=[
            dict(name="betas_half", path=mix(0, "betas"), step=0, op="scale", factor=0.5),
            dict(name="state_in_x2_s3", path=mix(2, "state_input"), step=3, op="scale", factor=2.0),
            dict(name="values_x2_s1", path=mix(2, "attention_values"), step=1, op="scale", factor=2.0),
        ],
    ),
    # OLMo-Hybrid NoPE (rope_theta null, as published), beta = sigmoid(b), the last block attention.
    "olmo_hybrid_nope_padded": dict(
        family="olmo_hybrid", seed=37, prompts=[14, 6],
        config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, FULL], linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_allow_neg_eigval=False,
                    rope_parameters={"rope_type": "default", "rope_theta": None}),
        edits=[
            dict(name="decays_x3_s2", path=mix(0, "decays"), step=2, op="scale", factor=3.0),
            dict(name="keys_tok2", path=mix(0, "attention_keys"), step=0, op="set_index", index=2, value=0.7),
        ],
    ),
}


class Case(LiveCase):
    def __init__(self, name: str, tmp_path):
        from mixlens_dev.fixtures import qwen as qf

        super().__init__(name, CASES[name], tmp_path, lambda spec: qf.build_model(spec["family"], spec), oq.run,
                         qf.check_against_plain_hf, PAD)
        assert {k for s, _, k in self.rec.kernel_log if s == 0} == {"chunked"}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_every_value_every_step_through_the_block(case):
    with case.model.generate(case.prompts, max_new_tokens=N_STEPS, eos_token_id=-1) as tracer:
        got = read_every_value(case.model, tracer)
    n = compare(got, case.ref, case.name)
    assert n >= N_STEPS * case.n_layers * 7
    # Both layer kinds were compared at every step.
    for k in range(N_STEPS):
        assert oq.key(mix(0, "states"), k) in got and oq.key("layers.1.self_attn.attention_keys", k) in got
    assert tracer.tokens == case.ref["tokens"].tolist()  # 8 greedy tokens, as transformers'
    assert [c["kernel"] for c in tracer.calls] == ["chunked"] + ["recurrent"] * (N_STEPS - 1)


def test_pre_registered_saves_match(case):
    assert_saves_match(case, 0)


@pytest.mark.parametrize("how", ["interleaved", "pre_registered"])
def test_edits_match_transformers_with_the_same_modification(case, how):
    assert_edits_match(case, how)


@pytest.mark.parametrize("name", ["short_prompt", "padded_batch"])  # last block: softmax attention / GDN
def test_last_position_logits_after_a_block_that_read_states(name):
    """With logits="last", once a `with` block has read what it wanted (a layer's `states`) the rest of
    the call is unobserved and the last block runs on the last row only (queries, attention, o_proj and
    the MLP): the logits equal the full forward's last row, and a decode step from the cache it left
    equals one from the full forward's cache, bitwise."""
    m = mixlens.StandardizedTransformer(str(REPO / "tests" / "fixtures" / "qwen3_5" / name))
    ids = [[(i * 37 + 5) % 90 + 1 for i in range(40)]]
    full = np.asarray(m.run(ids)["logits"])
    with m.trace(ids, logits="last") as tr:
        assert m.layers[0].linear_attn.states.shape[1] == 40
    last = np.asarray(tr.logits)
    assert last.shape == (1, 1, full.shape[-1])
    assert rel_rms(last[:, 0], full[:, -1]) <= 1e-6
    c_full, c_last = m.new_cache(1), m.new_cache(1)
    m.forward(ids, cache=c_full)
    m.forward(ids, cache=c_last, logits="last")
    np.testing.assert_array_equal(np.asarray(m.forward([[5]], cache=c_full)["logits"]),
                                  np.asarray(m.forward([[5]], cache=c_last)["logits"]))


def test_olmo_hybrid_reads_the_module_names_as_well_as_the_stored_ones(tmp_path):
    """transformers 5.18 saves OLMo-Hybrid with the released checkpoints' names (input_layernorm as
    attention_layer_norm, post_attention_layernorm as feedforward_layer_norm, conv1d split into
    q_conv1d / k_conv1d / v_conv1d, near-equal thirds rather than key / key / value widths) and renames
    them at load; a file with the module names (a state_dict saved as is) gives the same logits, and a
    conv split that does not add up to the conv width is refused by name."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    src = REPO / "tests" / "fixtures" / "olmo_hybrid" / "hv_2hk_chunks"
    stored = load_file(str(src / "model.safetensors"))
    renamed = {}
    for k, v in stored.items():
        k2 = k.replace("attention_layer_norm", "input_layernorm").replace("feedforward_layer_norm",
                                                                           "post_attention_layernorm")
        if k2.endswith("linear_attn.q_conv1d.weight"):
            p = k2[: -len("q_conv1d.weight")]
            renamed[p + "conv1d.weight"] = np.concatenate(
                [stored[k.replace("q_conv1d", n)] for n in ("q_conv1d", "k_conv1d", "v_conv1d")], axis=0)
        elif "_conv1d." not in k2:
            renamed[k2] = v
    assert any("q_conv1d" in k for k in stored) and not any("_conv1d" in k for k in renamed)
    d = tmp_path / "module_names"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    save_file(renamed, str(d / "model.safetensors"))
    ids = json.loads((src / "case.json").read_text())["prompts"]
    want = np.asarray(mixlens.StandardizedTransformer(str(src)).run(ids)["logits"])
    got = np.asarray(mixlens.StandardizedTransformer(str(d)).run(ids)["logits"])
    np.testing.assert_array_equal(got, want)

    short = dict(stored)
    short["model.layers.0.linear_attn.v_conv1d.weight"] = stored["model.layers.0.linear_attn.v_conv1d.weight"][1:]
    save_file(short, str(d / "model.safetensors"))
    with pytest.raises(mixlens.CheckpointError, match=r"q_conv1d / k_conv1d / v_conv1d have \d+ channels together, expected 64"):
        mixlens.StandardizedTransformer(str(d))


def test_olmo_hybrid_without_an_attention_block_is_refused(tmp_path):
    import json
    import shutil

    src = REPO / "tests" / "fixtures" / "olmo_hybrid" / "padded_batch"
    cfg = json.loads((src / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(mixlens.ConfigError, match="at least one 'linear_attention' and one 'full_attention'"):
        mixlens.StandardizedTransformer(str(tmp_path))
