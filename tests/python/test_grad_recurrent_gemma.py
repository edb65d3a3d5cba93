"""Native gradients of RecurrentGemma (issue 25) against torch autograd on transformers' pure-torch
RecurrentGemmaForCausalLM (the committed fixtures tests/fixtures/recurrent_gemma), run by
oracle_grad_recurrent_gemma with every intermediate retained: every value's gradient (residual stream, the
RG-LRU values with the per-token states (window rows and h), local attention q / k / v / output, MLP output,
the soft-capped logits), prompts, a left-padded batch, a continuation from a cache (state_input included),
decode steps, and set_index edits; relative RMS <= 1e-4 in float32."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, rel_rms
from mixlens_dev.grad_common import call_grads, compare, mixlens_edits, split_call_grads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from mixlens_dev import oracle_grad_recurrent_gemma as org  # noqa: E402

FIX = REPO / "tests" / "fixtures" / "recurrent_gemma"
RG = ("attention_values", "betas", "decays", "states", "attention_head_outputs", "attention_output")
ATT = ("attention_queries", "attention_keys", "attention_values", "attention_output")
WORST: dict[str, float] = {}  # value name -> worst relative RMS over the cases (printed by the last test)


class Case:
    def __init__(self, name, cont=None, window=None, tmp=None):
        d = FIX / name
        self.prompts = json.loads((d / "case.json").read_text())["prompts"]
        if window:  # the fixture with a smaller attention_window_size, saved by transformers under tmp
            self.torch_model = transformers.RecurrentGemmaForCausalLM.from_pretrained(
                str(d), attention_window_size=window).eval()
            d = tmp.mktemp(f"{name}_window{window}")
            self.torch_model.save_pretrained(d)
        else:
            self.torch_model = transformers.RecurrentGemmaForCausalLM.from_pretrained(str(d)).eval()
        self.model = mixlens.StandardizedTransformer(str(d), output="torch")
        self.cont = cont
        cfg = self.torch_model.config
        self.kinds = cfg.layers_block_type[: cfg.num_hidden_layers]
        B, T = len(self.prompts), len(cont[0]) if cont else max(map(len, self.prompts))
        self.targets = torch.as_tensor(np.random.default_rng(len(name)).integers(0, cfg.vocab_size, size=(B, T)))

    def paths(self):
        out = ["embed_tokens.output", "ln_final.output", "logits"]
        for i, kind in enumerate(self.kinds):
            out += [f"layers.{i}.layer_input", f"layers.{i}.layer_output", f"layers.{i}.mlp.output"]
            if kind == "recurrent":
                out += [f"layers.{i}.linear_attn.{v}" for v in RG]
                if self.cont:
                    out.append(f"layers.{i}.linear_attn.state_input")
            else:
                out += [f"layers.{i}.self_attn.{v}" for v in ATT]
        return out

    def metric(self, logits):
        lp = torch.log_softmax(logits, -1).gather(-1, self.targets[..., None])[..., 0]
        return lp.sum() + 0.5 * (logits[:, -1, 3] - logits[:, -1, 7]).sum()

    def mixlens_grads(self, edits=None):
        return call_grads(self.model, self.prompts, self.cont, self.paths(), self.metric, edits)

    def torch_grads(self, edits=()):
        return org.run(self.torch_model, self.prompts, self.metric, edits, continuation=self.cont)


CASES = [("griffin", None), ("padded_batch", None), ("attention_first", None), ("griffin", [[5, 17, 40, 9]]),
         ("griffin", [[7]]), ("attention_first", [[3, 8, 1]]), ("attention_first", [[4]]),
         # attention_window_size 5: the 12-token prompt, the continuation and the decode step run past it
         ("griffin", None, 5), ("griffin", [[5, 17, 40, 9, 22, 31, 8]], 5), ("griffin", [[7]], 5)]


def case_id(c):
    return c[0] + (f"/continuation{len(c[1][0])}" if c[1] else "") + (f"/window{c[2]}" if len(c) > 2 else "")


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def case(request, tmp_path_factory):
    return Case(*request.param, tmp=tmp_path_factory)


def test_every_gradient_matches_torch_autograd(case):
    got, tr = case.mixlens_grads()
    assert tr.calls[-1]["kernel"] == "recurrent"
    ref = case.torch_grads()
    assert compare(got, ref, "recurrent_gemma", paths=case.paths()) == len(case.paths())
    for p in case.paths():
        name = p.split(".", 2)[-1] if p.startswith("layers.") else p
        WORST[name] = max(WORST.get(name, 0.0), rel_rms(got[p], ref[p]))
        assert np.abs(got[p]).max() > 0, p  # not the trivial zero


def test_gradients_through_edits_match_torch():
    c = Case("griffin", [[5, 17, 40, 9, 22]])
    table = {"0.linear_attn.attention_values": (2, 0.5), "1.linear_attn.betas": (1, 0.9),
             "0.linear_attn.decays": (3, -0.05), "1.linear_attn.attention_head_outputs": (0, 0.0),
             "3.linear_attn.attention_output": (4, 0.0), "2.self_attn.attention_values": (1, 0.25),
             "2.self_attn.attention_keys": (2, 0.0), "1.mlp.output": (0, 0.0),
             "3.linear_attn.state_input": (1, 0.0)}  # state_input: window row 1
    edits = [dict(path="layers." + p, index=i, value=v) for p, (i, v) in table.items()]
    got, _ = c.mixlens_grads(mixlens_edits(edits))
    compare(got, c.torch_grads(edits), "edited", paths=c.paths())
    # A written element is a constant: its own gradient is served, nothing flows through it upstream.
    assert np.all(got["layers.0.linear_attn.attention_values"][0, 2] != 0)
    unedited, _ = c.mixlens_grads()
    assert rel_rms(got["layers.0.linear_attn.betas"], unedited["layers.0.linear_attn.betas"]) > 1e-3


def test_states_gradient_is_the_next_calls_state_input_gradient():
    """states' gradient at token j - 1 equals state_input's (checked against torch above) when tokens j.. run
    as a call of their own, the metric reading positions j.. only: the window rows (only later tokens' conv
    reads them) in every recurrent block, h in the blocks after the last attention block (before one, h_{j-1}
    also reaches the later tokens through the attention's key and value at position j - 1, which the split
    call's cache holds as constants)."""
    c = Case("griffin")
    cont, j = [[5, 17, 40, 9, 22, 31]], 3
    W = torch.as_tensor(np.random.default_rng(3).standard_normal((1, len(cont[0]), 96)).astype(np.float32))

    rec = [i for i, k in enumerate(c.kinds) if k == "recurrent"]
    whole, split = split_call_grads(c.model, c.prompts, cont, j, rec, W)
    last_attention = max(i for i, k in enumerate(c.kinds) if k == "attention")
    assert rec[-1] > last_attention  # the fixture has a block whose h the check covers
    for i, g, g_in in zip(rec, whole, split):
        rows = slice(None) if i > last_attention else slice(None, -1)
        assert rel_rms(g[:, j - 1, rows], g_in[:, rows]) <= 1e-5, i
        assert np.abs(g_in[:, rows]).max() > 0, i


def test_report_worst_relative_rms():
    """The worst relative RMS per value over the cases above (run with -s to read it)."""
    if not WORST:
        pytest.skip("no case ran")
    for name, err in sorted(WORST.items()):
        print(f"recurrent_gemma grad {name}: worst rel RMS {err:.2e}")
    assert max(WORST.values()) <= 1e-4
