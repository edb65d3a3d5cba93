"""Native gradients (issue 12) of the Mamba hybrids (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H, Jamba, Zamba2) against torch
autograd on transformers' pure-torch models (mixlens_dev/oracle_grad_hybrids.py): every value's
gradient (residual stream, block values, Mamba-2 mixer values, attention queries / keys / values /
outputs, MLP and MoE outputs), both kernel paths (chunked, and routed to the token recurrence),
relative RMS <= 1e-4 in float32; left-padded batches; set_index edits.

The models are mixlens_dev.fixtures.hybrids' builder with seeds distinct from the committed
fixtures; together they cover the grouped gated norm (Nemotron-H, Falcon-H1), the full-width gated
norm (Bamba), norm-then-gate and no norm (Falcon-H1), every Falcon-H1 µP multiplier, partial RoPE
(Bamba), no positional encoding (Nemotron-H, Granite "nope"), GQA, relu2 MLPs, SwiGLU MLPs, a MoE
block with group-limited routing, a latent projection and a shared expert, and Granite's softmax
top-k routed SwiGLU experts beside its shared MLP with its µP multipliers (embedding, residual,
attention softmax scale, logits scaling), and Jamba's Mamba-1 mixer (weighted RMS norms on dt / B /
C) with its top-k-of-softmax experts in place of the MLP, and Zamba2's shared transformer blocks (concatenated
[h, embeddings] input, per-depth q / k / v and GeGLU gate_up adapters, a block run at two depths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev import oracle_grad_hybrids as og
from mixlens_dev.common import rel_rms
from mixlens_dev.grad_common import TOL, compare, mixlens_edits, mixlens_grads as grads_of

PAD = 0

MIXER = ("attention_queries", "attention_keys", "attention_values", "betas", "decays", "states",
         "attention_head_outputs", "attention_output")
ATTN = ("attention_queries", "attention_keys", "attention_values", "attention_output")

# family, builder config (on mixlens_dev.fixtures.hybrids.BASE), seed, prompt lengths
CASES = {
    "nemotron_h_g2": dict(family="nemotron_h", config={}, seed=71, lens=[19]),
    "nemotron_h_padded": dict(family="nemotron_h", config=dict(hybrid_override_pattern="M-*M", n_groups=1,
                                                               tie_word_embeddings=False), seed=72, lens=[13, 5]),
    "nemotron_h_moe_padded": dict(family="nemotron_h", config=dict(
        hybrid_override_pattern="ME*M", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, moe_latent_size=8,
        routed_scaling_factor=1.5, norm_topk_prob=True), seed=78, lens=[15, 9]),
    "bamba_g2": dict(family="bamba", config={}, seed=73, lens=[21]),
    "bamba_padded": dict(family="bamba", config=dict(mamba_n_groups=1, tie_word_embeddings=False), seed=74,
                         lens=[12, 6]),
    # gated grouped norm (gate first), every µP multiplier
    "falcon_h1_mup": dict(family="falcon_h1", config={}, seed=75, lens=[17]),
    "falcon_h1_no_norm_padded": dict(family="falcon_h1", config=dict(mamba_rms_norm=False, tie_word_embeddings=False),
                                     seed=76, lens=[11, 4]),
    "falcon_h1_norm_before_gate": dict(family="falcon_h1", config=dict(mamba_norm_before_gate=True, mamba_n_groups=1),
                                       seed=77, lens=[10]),
    "granite_rope_moe": dict(family="granitemoehybrid", config={}, seed=79, lens=[17]),
    "granite_nope_dense_padded": dict(family="granitemoehybrid", config=dict(
        position_embedding_type="nope", num_local_experts=0, num_experts_per_tok=0, mamba_n_groups=1,
        layer_types=["attention", "mamba", "mamba"], tie_word_embeddings=False), seed=80, lens=[12, 5]),
    "jamba_moe": dict(family="jamba", config={}, seed=81, lens=[17]),
    "jamba_bias_padded": dict(family="jamba", config=dict(
        num_hidden_layers=3, attn_layer_period=4, attn_layer_offset=2, expert_layer_offset=1, num_experts_per_tok=1,
        mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank=5, tie_word_embeddings=False), seed=82, lens=[12, 5]),
    # Zamba2 as its two fixtures: 2 shared blocks over 3 hybrid layers (block 0 at two depths), RoPE,
    # q / k / v and gate_up adapters; and one untied block per hybrid layer, no RoPE, MLP adapters only.
    "zamba2_shared_lora_padded": dict(family="zamba2", config={}, seed=81, lens=[17, 8]),
    "zamba2_nope_padded": dict(family="zamba2", config=dict(
        use_mem_rope=False, use_shared_attention_adapter=False, num_mem_blocks=1, tie_word_embeddings=False,
        num_hidden_layers=3, layers_block_type=["hybrid", "mamba", "hybrid"]), seed=82, lens=[12, 5]),
}


class Case:
    def __init__(self, name, tmp_path):
        from mixlens_dev.fixtures import hybrids as mh

        spec = CASES[name]
        self.name, self.family = name, spec["family"]
        model = mh.build_model(spec["family"], spec["config"], spec["seed"])
        model.save_pretrained(tmp_path)
        self.torch_model = type(model).from_pretrained(tmp_path).eval()
        self.prompts = mh.prompts_for(spec["lens"], spec["seed"], self.torch_model.config.vocab_size)
        self.model = mixlens.StandardizedTransformer(str(tmp_path), output="torch")
        self.kinds = self.model.info["layer_kinds"]
        T = max(spec["lens"])
        rng = np.random.default_rng(spec["seed"])
        V = self.torch_model.config.vocab_size
        self.targets = torch.as_tensor(rng.integers(0, V, size=(len(spec["lens"]), T)))
        self._refs = {}

    def layer_paths(self, i):
        kind = self.kinds[i]
        out = [f"layers.{i}.layer_input", f"layers.{i}.layer_output"]
        if kind in ("mamba2", "mamba", "hybrid"):
            out += [f"layers.{i}.linear_attn.{v}" for v in MIXER]
        if kind in ("attention", "hybrid"):
            out += [f"layers.{i}.self_attn.{v}" for v in ATTN]
        if kind in ("mlp", "moe", "hybrid") or self.family in ("bamba", "granitemoehybrid", "jamba"):
            out.append(f"layers.{i}.mlp.output")
        return out

    def paths(self):
        out = ["embed_tokens.output", "ln_final.output", "logits"]
        for i in range(len(self.kinds)):
            out += self.layer_paths(i)
        return out

    def metric(self, logits):
        # every position's target log-prob plus a logit difference at the last position
        lp = torch.log_softmax(logits, -1).gather(-1, self.targets[..., None]).sum()
        return lp + 0.5 * (logits[:, -1, 3] - logits[:, -1, 7]).sum()

    def ref(self, scan, edits=()):
        k = (scan, repr(edits))
        if k not in self._refs:
            self._refs[k] = og.run(self.torch_model, self.prompts, self.metric, PAD, scan=scan, edits=edits)
        return self._refs[k]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(params=["default", "recurrent", "chunked"])
def route(request, case):
    if request.param == "chunked" and case.family != "jamba":
        pytest.skip("the default route is the chunked kernel")  # Jamba's default is the token loop
    mixlens.route_kernels(case.family, request.param)
    yield request.param
    mixlens.route_kernels(case.family, "default")


def mixlens_grads(case, edits=None):
    return grads_of(case.model, case.prompts, case.paths(), case.metric, edits)


def test_every_gradient_matches_torch_autograd(case, route):
    got, tr = mixlens_grads(case)
    prompt_kernel = "recurrent" if case.family == "jamba" else "chunked"  # Mamba-1: the token loop
    assert tr.calls[0]["kernel"] == (prompt_kernel if route == "default" else route)
    # Mamba-2 under transformers' own chunk scan has no decays / states tensors (Jamba's oracle keeps them).
    n_mixer = sum(k in ("mamba2", "hybrid") for k in case.kinds)
    ref_hf = case.ref("hf")
    assert compare(got, ref_hf, "hf chunk scan") == len(case.paths()) - 2 * n_mixer  # all but decays / states
    assert compare(got, case.ref("recurrence"), "explicit recurrence") == len(case.paths())
    # The metric's gradient is not vacuous anywhere.
    for p in case.paths():
        assert np.abs(got[p]).max() > 0, p


def edits_for(case):
    """set_index writes on a mixer value, an attention value and a block output of this model."""
    mixer = [i for i, k in enumerate(case.kinds) if k in ("mamba2", "mamba", "hybrid")]
    attn = [i for i, k in enumerate(case.kinds) if k in ("attention", "hybrid")]
    # Zamba2's attention output reaches the residual only through the Mamba-2 mixer, which zeroes
    # padding positions, then RMSNorm and a bias-free GeGLU, whose Jacobian at 0 is 0: write a
    # nonzero constant at a token real in every row, or its gradient is exactly zero.
    zamba = case.family == "zamba2"
    out_tok, zero_out = (max(len(p) for p in case.prompts) - 2, 0.5) if zamba else (4, 0.0)
    return [dict(path=f"layers.{mixer[-1]}.linear_attn.betas", index=2, value=0.0),
            dict(path=f"layers.{mixer[0]}.linear_attn.attention_values", index=1, value=0.25),
            dict(path=f"layers.{attn[0]}.self_attn.attention_values", index=3, value=0.5),
            dict(path=f"layers.{attn[0]}.self_attn.attention_output", index=out_tok, value=zero_out),
            dict(path=f"layers.{mixer[0]}.linear_attn.attention_output", index=0, value=0.1)]


def test_gradients_through_edits_match_torch(case, route):
    edits = edits_for(case)

    got, _ = mixlens_grads(case, mixlens_edits(edits))
    ref = case.ref("recurrence", edits)
    compare(got, ref, "edited")
    # The edits change the gradients (they are taken through the edited forward).
    base = case.ref("recurrence")
    assert rel_rms(ref["embed_tokens.output"], base["embed_tokens.output"]) > 1e-3
    # Written elements are constants: nothing flows through them to what computed them, but their own
    # gradient is served.
    for e in edits:
        if e["path"].endswith("self_attn.attention_output"):
            assert np.all(got[e["path"]][:, e["index"]] != 0)


def test_queries_and_keys_without_saving_other_values(case):
    """backward(paths=...) of attention values only, and a value read in the block gets .grad."""
    attn = [i for i, k in enumerate(case.kinds) if k in ("attention", "hybrid")][0]
    q = f"layers.{attn}.self_attn.attention_queries"
    with case.model.trace(case.prompts, grad=True) as tr:
        keys = case.model.layers[attn].self_attn.attention_keys
    tr.backward(case.metric(tr.logits))
    ref = case.ref("hf")
    assert rel_rms(keys.grad.numpy(), ref[f"layers.{attn}.self_attn.attention_keys"]) <= TOL
    tr.backward(case.metric(tr.logits), paths=[q])
    assert rel_rms(tr.grad(q).numpy(), ref[q]) <= TOL
