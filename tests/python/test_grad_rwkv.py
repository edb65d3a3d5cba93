"""Native gradients of RWKV-4 (issue 25) against torch autograd on transformers' pure-torch RwkvForCausalLM
(the committed fixtures tests/fixtures/rwkv), run block by block by oracle_rwkv (its WKV loop is
rwkv_linear_attention_cpu's arithmetic, checked against it in test_parity_rwkv): every value's gradient
(residual stream, time-mix values, the per-token states' num | den | max, channel-mix output), a prompt,
a continuation from a cache (state_input included), a decode step, and set_index edits; relative RMS
<= 1e-4 in float32."""

from __future__ import annotations

import numpy as np
import pytest

from mixlens_dev.common import REPO, rel_rms
from mixlens_dev.grad_common import FixtureCase, call_grads, compare, mixlens_edits, split_call_grads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from mixlens_dev import oracle_rwkv as orw  # noqa: E402

FIX = REPO / "tests" / "fixtures" / "rwkv"
MIX = ("attention_keys", "attention_values", "decays", "attention_queries", "states", "attention_head_outputs",
       "attention_output")


class Case(FixtureCase):
    def __init__(self, name, cont=None):
        super().__init__(transformers.RwkvForCausalLM, FIX / name, name, cont)
        cfg = self.torch_model.config
        self.L, self.A = cfg.num_hidden_layers, cfg.attention_hidden_size

    def paths(self):
        return self.block_paths(self.L, MIX)

    def mixlens_grads(self, edits=None):
        got, tr = call_grads(self.model, self.prompts, self.cont, self.paths(), self.metric, edits)
        for i in range(self.L):  # the oracle's states: num | den | max (its shift parts are the ln outputs)
            p = f"layers.{i}.linear_attn.states"
            got[p] = np.ascontiguousarray(got[p][..., : 3 * self.A])
        return got, tr

    def torch_grads(self, edits=()):
        return orw.grads(self.torch_model, self.prompts, self.metric, edits, self.cont)


CASES = [("basic", None), ("batch_eps_tied", None), ("short_prompt", None), ("basic", [[5, 17, 40, 9]]),
         ("batch_eps_tied", [[7], [8]])]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + ("/continuation" if c[1] else ""))
def case(request):
    return Case(*request.param)


def test_every_gradient_matches_torch_autograd(case):
    got, tr = case.mixlens_grads()
    assert tr.calls[-1]["kernel"] == "recurrent"
    assert compare(got, case.torch_grads(), "rwkv", paths=case.paths()) == len(case.paths())
    one = case.targets.shape[1] == 1  # one token: its decay and state feed only the next call (and on a fresh
    for p in case.paths():            # state its key cancels: y = v), so those gradients are 0
        if not (one and p.endswith(("states", "decays", "attention_keys"))):
            assert np.abs(got[p]).max() > 0, p


def test_max_entry_gradient_is_the_exact_partial():
    """The max entry of a WKV state: central differences (float64, num and den held) give g_num num + g_den den,
    what mixlens serves and the oracle uses (autograd through torch.maximum gives 0 there)."""
    g = torch.Generator().manual_seed(0)
    B, T, A = 1, 5, 3
    k, v = torch.randn(B, T, A, generator=g, dtype=torch.float64), torch.randn(B, T, A, generator=g, dtype=torch.float64)
    w, u = -torch.rand(B, T, A, generator=g, dtype=torch.float64), torch.randn(A, generator=g, dtype=torch.float64)
    W = torch.randn(B, T, A, generator=g, dtype=torch.float64)

    def f(delta, t_at):  # dy . W with `delta` added to the max after token t_at
        num, den, mx = torch.zeros(B, A, dtype=torch.float64), torch.zeros(B, A, dtype=torch.float64), \
            torch.full((B, A), -1e30, dtype=torch.float64)
        y1, _, st = orw.wkv(k[:, :t_at + 1], v[:, :t_at + 1], w[:, :t_at + 1], u, num, den, mx)
        num, den, mx = st[0].detach().requires_grad_(True), st[1].detach().requires_grad_(True), st[2] + delta
        y2, _, _ = orw.wkv(k[:, t_at + 1:], v[:, t_at + 1:], w[:, t_at + 1:], u, num, den, mx)
        return (torch.cat([y1, y2], 1) * W).sum(), num, den

    for t_at in (1, 3):
        s, num, den = f(torch.zeros(B, A, dtype=torch.float64), t_at)
        s.backward()
        exact = (num.grad * num + den.grad * den).detach()
        h = 1e-6
        for a in range(A):
            e = torch.zeros(B, A, dtype=torch.float64)
            e[0, a] = h
            fd = (f(e, t_at)[0] - f(-e, t_at)[0]).detach() / (2 * h)
            assert abs(float(fd) - float(exact[0, a])) <= 1e-7 * max(1.0, abs(float(fd))), (t_at, a, fd, exact)
        assert float(exact.abs().max()) > 1e-3  # not the trivial zero


def test_states_gradient_is_the_next_calls_state_input_gradient():
    """states' gradient at token j - 1 (all five parts: num | den | max and both shift states, what later tokens
    read) equals state_input's (checked against torch above) when tokens j.. run as a call of their own, the
    metric reading positions j.. only."""
    c = Case("basic")
    cont, j = [[5, 17, 40, 9, 22, 31]], 3
    W = torch.as_tensor(np.random.default_rng(3).standard_normal((1, len(cont[0]), 96)).astype(np.float32))

    whole, split = split_call_grads(c.model, c.prompts, cont, j, range(c.L), W)
    for i, (g, g_in) in enumerate(zip(whole, split)):
        assert rel_rms(g[:, j - 1], g_in) <= 1e-5, i
        assert np.abs(g_in).max() > 0


def test_gradients_through_edits_match_torch():
    c = Case("basic", [[5, 17, 40, 9]])
    edits = [dict(path="layers.0.linear_attn.attention_keys", index=2, value=0.0),
             dict(path="layers.1.linear_attn.attention_values", index=1, value=0.25),
             dict(path="layers.0.linear_attn.decays", index=0, value=-0.5),
             dict(path="layers.2.linear_attn.attention_output", index=3, value=0.0),
             dict(path="layers.1.mlp.output", index=0, value=0.0),
             dict(path="layers.2.linear_attn.state_input", index=1, value=0.0)]
    got, _ = c.mixlens_grads(mixlens_edits(edits))
    compare(got, c.torch_grads(edits), "edited", paths=c.paths())
    # A written element is a constant: its own gradient is served, nothing flows through it upstream.
    assert np.all(got["layers.0.linear_attn.attention_keys"][0, 2] != 0)
    unedited = c.torch_grads()
    assert rel_rms(got["layers.0.linear_attn.attention_queries"], unedited["layers.0.linear_attn.attention_queries"]) > 1e-3
