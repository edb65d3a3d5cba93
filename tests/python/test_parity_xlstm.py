"""Live parity of xLSTM with transformers 5.18 (xLSTMForCausalLM, pure torch, mode "inference") on tiny random
checkpoints transformers writes here: every value of a prompt and 7 decode steps (oracle_xlstm, itself checked
against transformers' forward with its cache and generate), edits vs transformers with the same edit, left
padding vs per-row runs (transformers takes no attention_mask for xLSTM), per-token state reads / writes vs
transformers' recurrent step, weight_mode "fused", and gradients against torch autograd.

Tolerance: relative RMS <= 1e-4 on logits, 3e-5 on values (float32 on both sides).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms
from mixlens_dev.parity import (check_edit, check_every_value, check_greedy_tokens,
                                check_padded_rows_alone, check_tl_residual_only, live_case)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mixlens_dev import oracle_xlstm as ox  # noqa: E402
from mixlens_dev.fixtures import make_prompts, mix  # noqa: E402
from mixlens_dev.fixtures import xlstm as fx  # noqa: E402

CASES = {
    # chunk_size 4 over 10 tokens: two chunks and a 2-token recurrent tail; strong caps.
    "chunks_and_tail": dict(seed=81, config=dict(chunk_size=4, gate_soft_cap=3.0, output_logit_soft_cap=4.0),
                            lens=[10], edit=dict(name="decays_half", path=mix(1, "decays"), step=0, op="scale",
                                                 factor=0.5)),
    "batch_one_chunk": dict(seed=82, config=dict(num_hidden_layers=3, num_heads=2, chunk_size=7), lens=[7, 7],
                            edit=dict(name="state_in", path=mix(0, "state_input"), step=2, op="scale", factor=0.5)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return live_case(CASES[request.param], request.param, tmp_path_factory, fx.build_model, ox.run, make_prompts)


def test_every_value_every_step(case):
    check_every_value(case, "xlstm")


def test_greedy_tokens(case):
    check_greedy_tokens(case)


def test_edit_matches_transformers_with_the_same_edit(case):
    check_edit(case, ox.run, "xlstm")


def test_left_padded_rows_equal_their_own_runs(case):
    check_padded_rows_alone(case, make_prompts)


@pytest.mark.parametrize("route", ["chunked", "recurrent"])
def test_backward_matches_torch_autograd(case, route):
    """Every value's gradient of a prompt on each kernel route against torch autograd through oracle_xlstm
    (transformers' recurrent step per token; per-value checks on the committed fixtures: test_grad_xlstm.py)."""
    m, tm, p = case["model"], case["torch_model"], case["prompts"]
    W = np.random.default_rng(1).standard_normal((len(p), len(p[0]), tm.config.vocab_size)).astype(np.float32)

    paths = ["embed_tokens.output"] + [f"layers.{i}.{v}" for i in range(tm.config.num_hidden_layers) for v in
                                       ("layer_input", "mlp.output", "linear_attn.betas", "linear_attn.decays",
                                        "linear_attn.states", "linear_attn.attention_queries")]
    mixlens.route_kernels("xlstm", route)
    try:
        with m.trace(p, saves=paths, grad=True) as tr:
            pass
        tr.backward(W)  # dMetric/dLogits of the metric sum(W * logits)
    finally:
        mixlens.route_kernels("xlstm", "default")
    assert tr.calls[-1]["kernel"] == route
    ref = ox.grads(tm, p, lambda z: (z * torch.as_tensor(W)).sum(), route="recurrent")
    for path in paths:
        got = np.asarray(tr.grad(path))
        assert rel_rms(got, ref[path]) <= 1e-4, (path, rel_rms(got, ref[path]))
        assert np.abs(got).max() > 0, path


def test_state_after_reads_and_writes_follow_the_recurrence(case):
    """state_after(t) is transformers' recurrent-step state after token t (oracle states); set_state_after(t, v)
    with a new C and m continues as transformers' mlstm_recurrent_step_native from v over the same q, k, v and
    gates (mixlens restarts its chunk grid at t + 1)."""
    m, tm = case["model"], case["torch_model"]
    p = case["prompts"]
    NH, Dqk, Dv = ox.dims(tm.config)
    t = 3
    ref = case["ref"][f"{mix(1, 'states')}@step0"]
    with m.trace(p) as tr:
        la = m.layers[1].linear_attn
        q, k, v, bi, lf = la.attention_queries, la.attention_keys, la.attention_values, la.betas, la.decays
        s = la.state_after(t)
        assert rel_rms(s, ref[:, t]) <= 3e-5
        new = s.copy()
        new[:, : NH * Dqk * Dv] = new[:, : NH * Dqk * Dv] * 2 + 0.25
        new[:, -NH:] += 1.5
        la.set_state_after(t, new)
        y = la.attention_head_outputs
    B, T = q.shape[:2]
    heads = lambda a: torch.tensor(a[:, t + 1:]).reshape(B, T - t - 1, NH, -1).transpose(1, 2)  # noqa: E731
    c, n, mm = ox.unflat(torch.tensor(new), NH, Dqk, Dv)
    ig, fg = torch.log(torch.tensor(bi[:, t + 1:])).transpose(1, 2), ox.fgate_of(torch.tensor(lf[:, t + 1:])).transpose(1, 2)
    qh, kh, vh = heads(q), heads(k), heads(v)
    want = []
    for j in range(T - t - 1):
        h, (c, n, mm) = ox.mx.mlstm_recurrent_step_native(qh[:, :, j], kh[:, :, j], vh[:, :, j], ig[:, :, j, None],
                                                           fg[:, :, j, None], c, n, mm, eps=tm.config.eps)
        want.append(h.reshape(B, -1))
    assert rel_rms(y[:, t + 1:], torch.stack(want, 1).numpy()) <= 3e-5
    assert np.abs(y[:, t + 1:] - case["ref"][f"{mix(1, 'attention_head_outputs')}@step0"][:, t + 1:]).max() > 1e-3


def test_fused_weight_mode_equals_single(case, tmp_path):
    """weight_mode "fused" (qkv_opreact, ifgate_preact, proj_up_gate_z): transformers 5.18 cannot build it from a
    config (its _init_weights breaks on the fused gate bias), so the fused checkpoint is the single one's
    tensors concatenated as xLSTMLayer / xLSTMFeedForward split them; mixlens gives transformers' logits."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(case["path"] / "model.safetensors"))
    out = {}
    for k, w in sd.items():
        base = k.rsplit(".", 2)[0] + "."
        if k.endswith("mlstm_layer.q.weight"):
            out[base + "qkv_opreact.weight"] = torch.cat([sd[base + n + ".weight"] for n in ("q", "k", "v", "ogate_preact")])
            for s in ("weight", "bias"):
                out[f"{base}ifgate_preact.{s}"] = torch.cat([sd[f"{base}igate_preact.{s}"], sd[f"{base}fgate_preact.{s}"]])
        elif k.endswith("ffn.proj_up_gate.weight"):
            out[base + "proj_up_gate_z.weight"] = torch.cat([w, sd[base + "proj_up.weight"]])
        elif not any(s in k for s in ("mlstm_layer.q.", "mlstm_layer.k.", "mlstm_layer.v.", "ogate_preact", "igate_preact",
                                       "fgate_preact", "proj_up.")):
            out[k] = w
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((case["path"] / "config.json").read_text())
    cfg["weight_mode"] = "fused"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = mixlens.StandardizedTransformer(str(tmp_path)).run(case["prompts"])["logits"]
    assert rel_rms(got, case["ref"]["logits@step0"]) <= 1e-4


def test_route_kernels_both_agree(case):
    m = case["model"]
    try:
        mixlens.route_kernels("xlstm", "recurrent")
        rec = m.run(case["prompts"])["logits"]
    finally:
        mixlens.route_kernels("xlstm", "default")
    assert rel_rms(rec, case["ref"]["logits@step0"]) <= 1e-4


def test_transformer_lens_names_map_the_residual_stream_only(case):
    check_tl_residual_only(case, "xLSTM")


@pytest.mark.parametrize("change, error, match", [
    (dict(use_bias=True), "UnsupportedError", "use_bias"),
    (dict(num_heads=3), "ConfigError", "multiple of num_heads"),
    (dict(embedding_dim=32), "UnsupportedError", "embedding_dim"),
])
def test_unsupported_or_bad_configs_are_refused_with_the_reason(tmp_path, change, error, match):
    import shutil

    from mixlens_dev.common import REPO

    src = REPO / "tests/fixtures/xlstm/short_prompt"
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(getattr(mixlens, error), match=match):
        mixlens.StandardizedTransformer(str(tmp_path))
