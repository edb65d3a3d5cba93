"""Native gradients (issue 12) against torch autograd on transformers' pure-torch Qwen3.5, Qwen3-Next,
Qwen3.5-MoE, OLMo-Hybrid and Kimi-Linear (the committed fixtures tests/fixtures/qwen3_5, qwen3_next, qwen3_5_moe,
olmo_hybrid, kimi_linear: Kimi Delta Attention, latent attention, KimiLinearMoE), and LFM2 / LFM2-MoE (issue 25:
tests/fixtures/lfm2, lfm2_moe; the short conv as linear_attn) and MiniMax (issue 25: tests/fixtures/minimax; lightning
attention as linear_attn, its decays and states against the written-out recurrence only, the softmax-routed MoE,
the scaled residuals): every value's gradient (residual
stream, gated DeltaNet values incl. per-token states, gated attention values, MLP / MoE outputs), both
kernel paths (mixlens chunked vs transformers' torch_chunk_gated_delta_rule, mixlens routed to the token
recurrence vs torch_recurrent_gated_delta_rule, both vs an explicit recurrence for the states), a padded
batch, a continuation from a cache, and set_index edits; relative RMS <= 1e-4 in float32.
Reference: tests/python/oracle_grad_qwen.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import mixlens
from mixlens_dev import oracle_grad_qwen as og
from mixlens_dev.common import REPO, rel_rms
from mixlens_dev.grad_common import TOL, call_grads, compare, mixlens_edits, mixlens_grads

FIX = REPO / "tests" / "fixtures"
CASES = ["qwen3_5/hv_eq_hk_chunks", "qwen3_5/hv_2hk", "qwen3_5/padded_batch", "qwen3_5/continuation",
         "qwen3_next/moe_hv_2hk", "qwen3_next/padded_batch", "qwen3_5_moe/moe_hv_2hk", "qwen3_5_moe/padded_batch",
         "olmo_hybrid/hv_2hk_chunks", "olmo_hybrid/padded_batch", "olmo_hybrid/continuation",
         "kimi_linear/kda_mla_moe_chunks", "kimi_linear/padded_batch", "kimi_linear/continuation",
         "lfm2/conv_attn", "lfm2/padded_batch", "lfm2/bias_short_prompt", "lfm2/continuation",
         "lfm2_moe/moe_conv_attn", "lfm2_moe/padded_batch",
         "minimax/lightning_attn", "minimax/padded_batch", "minimax/continuation", "minimax/default_layout"]
CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
           "olmo_hybrid": "OlmoHybridForCausalLM",
           "kimi_linear": "KimiLinearForCausalLM",
           "lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM",
           "minimax": "MiniMaxForCausalLM"}
UNGATED = ("olmo_hybrid", "kimi_linear", "lfm2", "lfm2_moe", "minimax")  # attention without Qwen's output gate
GDN = ("attention_queries", "attention_keys", "attention_values", "betas", "decays", "states",
       "attention_head_outputs", "attention_output")
# LFM2's short conv (C, B, x; the window after every token; C * conv; out_proj).
SHORT_CONV = ("attention_queries", "attention_keys", "attention_values", "states", "attention_head_outputs",
              "attention_output")
# MiniMax's lightning attention (q, k, v; the constant per-head decay; the kv state after every token; o before the
# norm and gate; out_proj): decays and states only in the written-out recurrence (transformers' graph has neither).
LIGHTNING = ("attention_queries", "attention_keys", "attention_values", "decays", "states", "attention_head_outputs",
             "attention_output")
ATTN = ("attention_queries", "attention_keys", "attention_values", "gate", "attention_output")


class Case:
    def __init__(self, name):
        self.family, self.case = name.split("/")
        self.lfm2 = self.family.startswith("lfm2")  # one kernel (the token loop); every window retained
        self.minimax = self.family == "minimax"
        d = FIX / self.family / self.case
        spec = json.loads((d / "case.json").read_text())
        cls = getattr(transformers, CLASSES[self.family])
        self.torch_model = cls.from_pretrained(str(d)).eval()
        self.model = mixlens.StandardizedTransformer(str(d), output="torch")
        self.prompts = spec["prompts"]
        self.cont = spec["feeds"][0] if self.case == "continuation" else None
        cfg = self.torch_model.config
        self.types = ["linear_attention" if t == "conv" else t for t in cfg.layer_types]
        B = len(self.prompts)
        T = len(self.cont[0]) if self.cont else max(map(len, self.prompts))
        rng = np.random.default_rng(sum(map(ord, name)))
        self.targets = torch.as_tensor(rng.integers(0, cfg.vocab_size, size=(B, T)))
        # Real positions only: a left-padded row's padding never reaches its real tokens.
        m = np.ones((B, T), np.float32)
        if not self.cont:
            for r, p in enumerate(self.prompts):
                m[r, : T - len(p)] = 0
        self.mask = torch.as_tensor(m)

    def paths(self):
        out = ["embed_tokens.output", "ln_final.output", "logits"]
        for i, t in enumerate(self.types):
            out += [f"layers.{i}.layer_input", f"layers.{i}.layer_output", f"layers.{i}.mlp.output"]
            if t == "linear_attention":
                out += [f"layers.{i}.linear_attn.{v}" for v in (SHORT_CONV if self.lfm2 else LIGHTNING if self.minimax
                                                               else GDN)]
                if self.cont:
                    out.append(f"layers.{i}.linear_attn.state_input")
            else:
                out += [f"layers.{i}.self_attn.{v}" for v in ATTN if v != "gate" or self.family not in UNGATED]
        return out

    def metric(self, logits):
        lp = torch.log_softmax(logits, -1).gather(-1, self.targets[..., None])[..., 0]
        return (lp * self.mask).sum() + 0.5 * (logits[:, -1, 3] - logits[:, -1, 7]).sum()

    def mixlens_grads(self, edits=None):
        return call_grads(self.model, self.prompts, self.cont, self.paths(), self.metric, edits)

    def torch_grads(self, scan, edits=()):
        return og.run(self.torch_model, self.prompts, self.metric, scan=scan, edits=edits, continuation=self.cont)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return Case(request.param)


@pytest.fixture(params=["default", "recurrent"])
def route(request, case):
    mixlens.route_kernels(case.family, request.param)
    yield request.param
    mixlens.route_kernels(case.family, "default")


def test_every_gradient_matches_torch_autograd(case, route):
    got, tr = case.mixlens_grads()
    # MiniMax takes the token loop on every call over a cache (transformers' too).
    recurrent = route == "recurrent" or case.lfm2 or (case.minimax and case.cont is not None)
    assert tr.calls[-1]["kernel"] == ("recurrent" if recurrent else "chunked")
    scan = "recurrent" if route == "recurrent" else "chunk"
    # LFM2: windows always kept; MiniMax: transformers' graph has no per-token states or decays tensors.
    n_states = 0 if case.lfm2 else (2 if case.minimax else 1) * sum(t == "linear_attention" for t in case.types)
    assert compare(got, case.torch_grads(scan), scan) == len(case.paths()) - n_states
    assert compare(got, case.torch_grads("explicit"), "explicit recurrence") == len(case.paths())
    for p in case.paths():  # the metric's gradient is not vacuous anywhere
        assert np.abs(got[p]).max() > 0, p


def test_gradients_through_edits_match_torch(case, route):
    lin = [i for i, t in enumerate(case.types) if t == "linear_attention"]
    att = [i for i, t in enumerate(case.types) if t != "linear_attention"]
    if case.targets.shape[1] < 4:
        pytest.skip("the edits write tokens 0..3 (lfm2/bias_short_prompt has two)")
    first = "attention_keys" if case.lfm2 or case.minimax else "betas"  # neither has betas
    edits = [dict(path=f"layers.{lin[0]}.linear_attn.{first}", index=2, value=0.0),
             dict(path=f"layers.{lin[-1]}.linear_attn.attention_values", index=1, value=0.25),
             dict(path=f"layers.{lin[0]}.linear_attn.{'attention_queries' if case.lfm2 else 'decays'}", index=0,
                  value=-0.5),
             dict(path=f"layers.{lin[0]}.linear_attn.attention_output", index=3, value=0.0),
             dict(path=f"layers.{att[0]}.self_attn.attention_output", index=1, value=0.1),
             dict(path=f"layers.{lin[-1]}.mlp.output", index=0, value=0.0)]
    if case.cont:
        edits.append(dict(path=f"layers.{lin[-1]}.linear_attn.state_input", index=1, value=0.0))

    got, _ = case.mixlens_grads(mixlens_edits(edits))
    ref = case.torch_grads("explicit", edits)
    compare(got, ref, "edited")
    # A written element is a constant: its own gradient is served, nothing flows through it upstream.
    assert np.all(got[f"layers.{lin[0]}.linear_attn.{first}"][0, 2] != 0)  # row 0 is never padded there
    unedited = case.torch_grads("explicit")
    upstream = "attention_values" if case.lfm2 else "attention_queries"  # reads the written elements
    assert rel_rms(got[f"layers.{lin[0]}.linear_attn.{upstream}"],
                   unedited[f"layers.{lin[0]}.linear_attn.{upstream}"]) > 1e-3


def test_state_output_gradient_is_zero():
    c = Case("qwen3_5/continuation")
    cache = c.model.new_cache(1)
    with c.model.trace(c.prompts, cache=cache):
        pass
    with c.model.trace(c.cont, cache=cache, grad=True) as tr:
        pass
    tr.backward(c.metric(tr.logits), paths=["layers.0.linear_attn.state_output", "layers.0.linear_attn.state_input"])
    assert float(tr.grad("layers.0.linear_attn.state_output").abs().max()) == 0.0
    assert float(tr.grad("layers.0.linear_attn.state_input").abs().max()) > 0.0


@pytest.mark.parametrize("name", ["qwen3_5/continuation", "qwen3_next/moe_hv_2hk",
                                  "kimi_linear/continuation", "kimi_linear/kda_mla_moe_chunks", "lfm2/continuation",
                                  "lfm2_moe/moe_conv_attn", "minimax/continuation", "minimax/default_layout"])
def test_decode_step_gradients_match_torch(name):
    """A one-token call over a cache (the decode kernel, the token recurrence), state_input included."""
    c = Case(name)
    c.cont = [[11] for _ in c.prompts]
    c.targets = c.targets[:, :1]
    c.mask = torch.ones(len(c.prompts), 1)
    got, tr = c.mixlens_grads()
    assert tr.calls[-1]["kernel"] == "recurrent"
    assert any(p.endswith("state_input") for p in c.paths())
    assert compare(got, c.torch_grads("explicit"), "decode step") == len(c.paths())


@pytest.mark.parametrize("name", ["qwen3_5/hv_eq_hk_chunks", "qwen3_5/padded_batch"])
def test_metric_of_a_few_positions_forms_only_their_logits(name):
    """LogProb / LogitDiff declare the positions they read: without `logits` saved the grad forward forms the
    last position's logits only and backward runs the LM head on the metric's rows; the gradients still equal
    torch autograd's of the same metric, and tracer.logits still gives every position's."""
    c = Case(name)
    paths = [p for p in c.paths() if p != "logits"]
    for metric, ref_metric in [
        (mixlens.metrics.LogProb(5), lambda z: torch.log_softmax(z[:, -1], -1)[:, 5].sum()),
        (mixlens.metrics.LogitDiff(3, 7, position=2), lambda z: (z[:, 2, 3] - z[:, 2, 7]).sum()),
    ]:
        with c.model.trace(c.prompts, grad=True) as tr:
            pass
        tr.backward(metric, paths=paths)
        B, V = len(c.prompts), c.model.vocab_size
        assert tr._done()["logits"][0].shape == (B, 1, V) and tr._full_logits is None  # no [B,T,vocab] formed
        got = {p: tr.grad(p).numpy() for p in paths}
        ref = og.run(c.torch_model, c.prompts, ref_metric, scan="explicit")
        compare(got, ref, f"{name} one position", paths=paths)
        assert abs(metric.value(tr.logits.detach().numpy()) - float(ref["metric"])) < 1e-4
        with c.model.trace(c.prompts) as plain:
            pass
        assert rel_rms(tr.logits.detach().numpy(), plain.logits.numpy()) < 1e-6  # formed on demand, every position
