"""Native gradients (issue 12) against torch autograd on transformers' pure-torch Mamba-2: every
value's gradient, both kernel paths (chunked and the token recurrence), relative RMS <= 1e-4 in
float32. The reference is tests/python/oracle_grad_mamba2.py (autograd through transformers' own
mamba2_chunk_scan, and through the explicit recurrence for decays / states, which the chunked
algorithm never forms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev import oracle_grad_mamba2 as og
from mixlens_dev.common import SHIPPED_MODEL, build_mamba2, rel_rms
from mixlens_dev.grad_common import TOL, compare, mixlens_edits, mixlens_grads as grads_of


CASES = {
    "g1_chunk5": dict(seed=69, config=dict(num_hidden_layers=2, n_groups=1, chunk_size=5, tie_word_embeddings=True),
                      lens=[17]),
    "g2_clamp": dict(seed=42, config=dict(num_hidden_layers=2, n_groups=2, chunk_size=4, tie_word_embeddings=False,
                                          time_step_limit=(0.02, 0.2)), dt_bias=[-5.0, -2.4, -1.2, 0.6], lens=[11]),
    "padded_batch": dict(seed=44, config=dict(num_hidden_layers=2, n_groups=1, chunk_size=4,
                                              tie_word_embeddings=True), lens=[10, 5]),
}
MIXER = ("attention_queries", "attention_keys", "attention_values", "betas", "decays", "states",
         "attention_head_outputs", "attention_output")


class Case:
    def __init__(self, name, tmp_path):
        from mixlens_dev import fixtures as mf

        spec = CASES[name]
        self.torch_model = build_mamba2(tmp_path, spec["seed"], spec["config"], spec.get("dt_bias"))
        self.prompts = mf.make_prompts(spec["seed"], spec["lens"], self.torch_model.config.vocab_size)
        self.model = mixlens.StandardizedTransformer(str(tmp_path), output="torch")
        self.n_layers = self.torch_model.config.num_hidden_layers
        T = max(spec["lens"])
        rng = np.random.default_rng(spec["seed"])
        V = self.torch_model.config.vocab_size
        self.targets = torch.as_tensor(rng.integers(0, V, size=(len(spec["lens"]), T)))

    def paths(self):
        out = ["embed_tokens.output", "ln_final.output", "logits"]
        for i in range(self.n_layers):
            out += [f"layers.{i}.layer_input", f"layers.{i}.layer_output"]
            out += [f"layers.{i}.linear_attn.{v}" for v in MIXER]
        return out

    def metric(self, logits):
        # every position's target log-prob plus a logit difference at the last position
        lp = torch.log_softmax(logits, -1).gather(-1, self.targets[..., None]).sum()
        return lp + 0.5 * (logits[:, -1, 3] - logits[:, -1, 7]).sum()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(params=["default", "recurrent"])
def route(request):
    mixlens.route_kernels("mamba2", request.param)
    yield request.param
    mixlens.route_kernels("mamba2", "default")


def mixlens_grads(case, edits=None):
    return grads_of(case.model, case.prompts, case.paths(), case.metric, edits)


def test_every_gradient_matches_torch_autograd(case, route):
    got, tr = mixlens_grads(case)
    assert tr.calls[0]["kernel"] == ("recurrent" if route == "recurrent" else "chunked")
    ref_hf = og.run(case.torch_model, case.prompts, case.metric, scan="hf")
    ref_rec = og.run(case.torch_model, case.prompts, case.metric, scan="recurrence")
    n = compare(got, ref_hf, "hf chunk scan")
    assert n == len(case.paths()) - 2 * case.n_layers  # all but decays / states
    assert compare(got, ref_rec, "explicit recurrence") == len(case.paths())
    # The metric's gradient is not vacuous anywhere.
    for p in case.paths():
        assert np.abs(got[p]).max() > 0, p


def test_gradients_through_edits_match_torch(case, route):
    edits = [dict(path="layers.1.linear_attn.betas", index=2, value=0.0),
             dict(path="layers.0.linear_attn.attention_values", index=1, value=0.25),
             dict(path="layers.0.linear_attn.attention_output", index=3, value=0.0)]

    got, _ = mixlens_grads(case, mixlens_edits(edits))
    ref = og.run(case.torch_model, case.prompts, case.metric, scan="recurrence", edits=edits)
    compare(got, ref, "edited")
    # Written elements are constants: nothing flows through them to what computed them.
    assert np.all(got["layers.0.linear_attn.attention_output"][:, 3] != 0)


def test_metric_helpers_and_read_values_get_grad(case):
    tok = 5
    with case.model.trace(case.prompts, grad=True) as tr:
        h = case.model.layers[0].layer_output
        b = case.model.layers[1].linear_attn.betas
    tr.backward(mixlens.metrics.LogProb(tok))
    ref = og.run(case.torch_model, case.prompts,
                 lambda z: torch.log_softmax(z[:, -1], -1)[:, tok].sum(), scan="hf")
    assert rel_rms(b.grad.numpy(), ref["layers.1.linear_attn.betas"]) <= TOL
    assert rel_rms(tr.grad("layers.0.layer_output").numpy(), ref["layers.0.layer_output"]) <= TOL
    assert h.grad is not None
    lp = mixlens.metrics.LogProb(tok)
    assert abs(lp.value(tr.logits.detach().numpy()) - float(ref["metric"])) < 1e-4


def test_a_per_token_state_read_gets_its_gradient_against_autograd(case):
    """state_after(t) read in a grad trace gets dL/dS_t: autograd's gradient of the explicit recurrence's
    state after token t (the states oracle), and token t of the layer's `states` gradient."""
    tok = 5
    with case.model.trace(case.prompts, grad=True) as tr:
        st = case.model.layers[1].linear_attn.state_after(2)
        last = case.model.layers[1].linear_attn.state_after(-1)
    tr.backward(mixlens.metrics.LogProb(tok))
    ref = og.run(case.torch_model, case.prompts,
                 lambda z: torch.log_softmax(z[:, -1], -1)[:, tok].sum(), scan="recurrence")
    states = ref["layers.1.linear_attn.states"]
    assert float(np.abs(states[:, 2]).sum()) > 0
    assert rel_rms(st.grad.numpy(), states[:, 2]) <= TOL
    assert rel_rms(last.grad.numpy(), states[:, -1]) <= TOL
    np.testing.assert_array_equal(tr.grad("layers.1.linear_attn.state@t2").numpy(), st.grad.numpy())


def test_backward_errors(case):
    with case.model.trace(case.prompts) as tr:
        pass
    with pytest.raises(mixlens.InputError, match="grad=True"):
        tr.backward(mixlens.metrics.LogProb(1))
    with case.model.trace(case.prompts, grad=True) as tr:
        pass
    with pytest.raises(mixlens.InputError, match="shape"):
        tr.backward(np.zeros((1, 1, 3), np.float32))
    with pytest.raises(mixlens.UnknownValueError):
        tr.backward(mixlens.metrics.LogProb(1), paths=["layers.0.linear_attn.betaz"])
    tr.backward(mixlens.metrics.LogProb(1), paths=["layers.0.linear_attn.betas"])
    # Inside the block the forward has not finished: the error says when to call it.
    with case.model.trace(case.prompts, grad=True) as tr_open:
        b = case.model.layers[0].linear_attn.betas
        with pytest.raises(mixlens.InputError, match="after the `with` block has ended"):
            tr_open.backward(mixlens.metrics.LogProb(1))
    tr_open.backward(mixlens.metrics.LogProb(1))
    assert b.grad is not None and b.grad.shape == b.shape
    with pytest.raises(mixlens.UnknownValueError, match="no gradient"):
        tr.grad("layers.1.linear_attn.betas")


def test_bfloat16_weights_give_the_gradient_of_the_bf16_rounded_model(tmp_path):
    """dtype="bfloat16" keeps matmul weights narrow; backward widens them, so its gradients equal those of a
    float32 load of the same weights rounded to bf16 (and differ from the float32 model's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = str(SHIPPED_MODEL)
    rounded = tmp_path / "rounded"
    shutil.copytree(src, rounded)
    w = load_file(str(rounded / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).to(torch.float32) if v.dim() >= 2 and "conv1d" not in k else v
               for k, v in w.items()}, str(rounded / "model.safetensors"), metadata={"format": "pt"})

    def grad_of(path, dtype):
        m = mixlens.StandardizedTransformer(str(path), output="torch", dtype=dtype)
        with m.trace("Once upon a time there", grad=True) as tr:
            h = m.layers_output[1]
        tr.backward(mixlens.metrics.LogProb(7))
        return h.grad

    g16 = grad_of(src, "bfloat16")
    assert rel_rms(g16, grad_of(rounded, "float32")) <= 1e-4
    assert rel_rms(g16, grad_of(src, "float32")) > 1e-4


def test_metric_token_ids_are_checked_and_torch_dlogits_are_accepted():
    """LogProb(-1) once silently meant the last vocabulary entry; a torch dlogits tensor was refused; a
    per-token state's missing gradient pointed at backward's paths, which refuse it too."""
    m = mixlens.StandardizedTransformer(str(SHIPPED_MODEL), output="torch")
    V = m.vocab_size
    for bad in (mixlens.metrics.LogProb(-1), mixlens.metrics.LogProb(V), mixlens.metrics.LogitDiff(3, V + 5)):
        with m.trace("Once upon a time", grad=True) as tr:
            m.layers_output[1]
        with pytest.raises(mixlens.InputError, match="not a token id"):
            tr.backward(bad)

    grads = []
    for as_torch in (False, True):
        with m.trace("Once upon a time", grad=True) as tr:
            h = m.layers_output[1]
        d = np.zeros((1, 4, V), np.float32)
        d[0, -1, 7] = 1.0
        tr.backward(torch.from_numpy(d) if as_torch else d)
        grads.append(h.grad)
        with pytest.raises(mixlens.UnknownValueError, match="no gradient of 'layers.1.linear_attn.state@t2'"):
            tr.grad("layers.1.linear_attn.state@t2")  # neither read nor saved nor named
    assert torch.equal(grads[0], grads[1]) and float(grads[0].abs().sum()) > 0
