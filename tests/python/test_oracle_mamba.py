"""Tests of the Mamba-1 oracle (mixlens_dev/oracle_mamba.py) and of the committed goldens in
tests/fixtures/mamba and tests/fixtures/falcon_mamba: they still agree with the installed transformers, the patching is transparent
and cannot silently stop taking effect, and the captured values mean what values.md says."""

import types

import numpy as np
import pytest
import torch
import transformers.models.mamba.modeling_mamba as mm
from transformers import FalconMambaForCausalLM, MambaForCausalLM

from mixlens_dev import fixtures
from mixlens_dev import oracle_mamba as om

CASES = fixtures.committed_cases("mamba")
CLASSES = {"mamba": MambaForCausalLM, "falcon_mamba": FalconMambaForCausalLM}
ALL_CASES = [(f, n) for f in CLASSES for n in fixtures.committed_cases(f)]


def load_case(name, family="mamba"):
    return fixtures.load_committed(family, name, CLASSES[family])


@pytest.fixture(scope="module")
def basic():
    return load_case("basic")


def test_fixture_cases_present():
    assert set(CASES) >= {"basic", "bias_untied", "short_prompt", "padded_batch", "padded_bias"}
    assert set(fixtures.committed_cases("falcon_mamba")) >= {"basic", "padded_untied_eps", "short_prompt"}


@pytest.mark.parametrize("family, name", ALL_CASES)
def test_live_capture_matches_golden(family, name):
    case, model, golden = load_case(name, family)
    live = om.capture(model, case["prompts"], case["n_steps"], case["edits"])
    fixtures.assert_matches_golden(live, golden)


@pytest.mark.parametrize("family, name", ALL_CASES)
def test_golden_keys_shapes_and_invariants(family, name):
    case, model, golden = load_case(name, family)
    cfg = model.config
    n_layers, n_steps = cfg.num_hidden_layers, case["n_steps"]
    assert set(golden) == om.expected_keys(n_layers, n_steps, [e["name"] for e in case["edits"]])
    om.check_invariants(golden, n_layers, n_steps)
    B, T0 = len(case["prompts"]), max(len(p) for p in case["prompts"])
    E, N = cfg.intermediate_size, cfg.state_size
    for k in range(n_steps):
        T = T0 if k == 0 else 1
        m = "layers.0.linear_attn."
        assert golden[f"{m}states@step{k}"].shape == (B, T, E, N)
        assert golden[f"{m}decays@step{k}"].shape == (B, T, E, N)
        assert golden[f"{m}attention_keys@step{k}"].shape == (B, T, N)
        assert golden[f"{m}attention_values@step{k}"].shape == (B, T, E)
        assert golden[f"{m}betas@step{k}"].shape == (B, T, E)
        assert golden[f"{m}state_output@step{k}"].shape == (B, E, N)
        np.testing.assert_array_equal(golden[f"logits@step{k}"][:, -1].argmax(-1), golden["tokens"][:, k])


def test_patching_is_transparent_and_removed(basic):
    case, model, golden = basic
    orig = mm.mamba_selective_scan, mm.mamba_selective_state_update
    values, rec = om.run(model, case["prompts"], 3, return_recorder=True)
    n = model.config.num_hidden_layers
    assert rec.kernel_log == [(k, i, "scan" if k == 0 else "update") for k in range(3) for i in range(n)]
    assert (mm.mamba_selective_scan, mm.mamba_selective_state_update) == orig
    ids = torch.as_tensor(values["input_ids"])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.as_tensor(values["attention_mask"]), use_cache=True)
        np.testing.assert_array_equal(out.logits.numpy(), values["logits@step0"])
        out2 = model(input_ids=torch.as_tensor(values["tokens"][:, :1]), cache_params=out.cache_params, use_cache=True)
        np.testing.assert_array_equal(out2.logits.numpy(), values["logits@step1"])
        # transformers' own cache holds the served state_output ([B,E,N], same layout)
        np.testing.assert_array_equal(out2.cache_params.layers[0].recurrent_states[0].numpy(),
                                      values["layers.0.linear_attn.state_output@step1"])


def test_guard_catches_a_mixer_that_bypasses_the_module_globals(basic, monkeypatch):
    """Negative control: a forward bound to a frozen copy of the module namespace never calls the
    patched kernels; the oracle must refuse rather than record nothing."""
    inner = mm.MambaMixer.forward.__wrapped__  # under force_accelerate_hooks
    frozen = types.FunctionType(inner.__code__, dict(mm.__dict__), inner.__name__, inner.__defaults__, inner.__closure__)
    monkeypatch.setattr(mm.MambaMixer, "forward", frozen)
    case, model, golden = basic
    with pytest.raises(RuntimeError, match="patching has no effect"):
        om.run(model, case["prompts"], 1)
    assert not isinstance(getattr(mm.mamba_selective_scan, "__self__", None), om._Recorder)


def test_head_outputs_read_the_state(basic):
    """y_t[e] = sum_n C_t[n] S_t[e,n] + D_e u_t[e] with the served [B,T,E,N] states; attention_output
    is out_proj(y * silu(z)) (checked through the recorded layer residual)."""
    case, model, golden = basic
    for i, blk in enumerate(model.backbone.layers):
        D = blk.mixer.D.detach().numpy()
        for k in (0, 1, 5):
            m = f"layers.{i}.linear_attn."
            C, S = golden[f"{m}attention_queries@step{k}"], golden[f"{m}states@step{k}"]
            u, y = golden[f"{m}attention_values@step{k}"], golden[f"{m}attention_head_outputs@step{k}"]
            pred = np.einsum("btn,bten->bte", C, S) + D[None, None] * u
            np.testing.assert_allclose(pred, y, rtol=1e-4, atol=1e-5)
            res = golden[f"layers.{i}.layer_output@step{k}"] - golden[f"layers.{i}.layer_input@step{k}"]
            np.testing.assert_allclose(res, golden[f"{m}attention_output@step{k}"], rtol=1e-5, atol=1e-5)


def test_betas_zero_skips_token_exactly(basic):
    case, model, golden = basic
    t = 5
    e = dict(name="skip", path="layers.1.linear_attn.betas", step=0, op="set_index", index=t, value=0.0)
    v = om.run(model, case["prompts"], 3, [e])
    st = v["layers.1.linear_attn.states@step0"]
    assert np.array_equal(st[:, t], st[:, t - 1]) and not np.array_equal(st[:, t + 1], st[:, t])
    e2 = dict(name="skip_decode", path="layers.0.linear_attn.betas", step=2, op="scale", factor=0.0)
    v2 = om.run(model, case["prompts"], 4, [e2])
    m = "layers.0.linear_attn."
    assert np.array_equal(v2[f"{m}state_output@step2"], v2[f"{m}state_input@step2"])


def _max_logit_diff(a, b, n_steps):
    return max(float(np.abs(a[f"logits@step{k}"] - b[f"logits@step{k}"]).max()) for k in range(n_steps))


def test_decays_write_is_a_dt_write(basic):
    """decays*0.5 maps back to dt*0.5 (one dt per (token, channel)): same as betas*0.5."""
    case, model, golden = basic
    forced = golden["tokens"].T
    for step in (0, 2):
        eb = dict(name="b", path="layers.0.linear_attn.betas", step=step, op="scale", factor=0.5)
        ed = dict(name="d", path="layers.0.linear_attn.decays", step=step, op="scale", factor=0.5)
        vb = om.run(model, case["prompts"], 4, [eb], forced_tokens=forced)
        vd = om.run(model, case["prompts"], 4, [ed], forced_tokens=forced)
        assert _max_logit_diff(vb, vd, 4) < 1e-5
        assert _max_logit_diff(vb, golden, 4) > 1e-3


def test_decays_rule():
    A = -torch.tensor([[1.0, 2.0, 4.0], [0.5, 3.0, 6.0]])
    dt = torch.tensor([[[0.1, 0.2]]])  # [1,1,E=2]
    before = A[None, None] * dt[..., None]
    # unchanged rows keep dt bit for bit; a consistent scale maps to dt * factor; zero to 0
    assert torch.equal(om.dt_from_decays(before.clone(), before, A, dt), dt)
    written = before.clone()
    written[0, 0, 0] *= 0.5
    written[0, 0, 1] = 0.0
    got = om.dt_from_decays(written, before, A, dt)
    torch.testing.assert_close(got, torch.tensor([[[0.05, 0.0]]]))
    written[0, 0, 0, 2] *= 3.0  # one state index alone: no single dt produces it
    with pytest.raises(ValueError, match="different dt"):
        om.dt_from_decays(written, before, A, dt)


def test_continuation_is_refused_because_transformers_restarts_the_scan(basic):
    """transformers 5.18 scans a multi-token call over a cache from a zero state; the oracle refuses
    to record such a call rather than record that."""
    case, model, golden = basic
    with torch.no_grad(), om._Recorder(model) as rec:
        rec.begin_step(0)
        out = model(input_ids=torch.tensor([case["prompts"][0][:5]]), use_cache=True)
        rec.end_step()
        rec.begin_step(1)
        with pytest.raises(NotImplementedError, match="continuation"):
            model(input_ids=torch.tensor([case["prompts"][0][5:9]]), cache_params=out.cache_params, use_cache=True)


def test_falcon_keys_queries_betas_are_the_normed_x_proj_outputs():
    """FalconMamba goldens: attention_keys / attention_queries are x_proj(u)'s B / C after the weightless
    RMS norm (what the kernels read), betas is softplus(dt_proj(rmsnorm(dt_low))) -- recomputed here from
    the served u (unedited run) with the case's mixer_rms_eps."""
    case, model, golden = load_case("padded_untied_eps", "falcon_mamba")
    eps = model.config.mixer_rms_eps
    assert eps == 0.05

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    for i, blk in enumerate(model.backbone.layers):
        mx = blk.mixer
        R, N = mx.time_step_rank, mx.ssm_state_size
        for k in (0, 3):
            m = f"layers.{i}.linear_attn."
            u = torch.as_tensor(golden[f"{m}attention_values@step{k}"])
            with torch.no_grad():
                dt_low, B, C = torch.split(mx.x_proj(u), [R, N, N], dim=-1)
                dt = torch.nn.functional.softplus(rms(dt_low) @ mx.dt_proj.weight.T + mx.dt_proj.bias)
            np.testing.assert_allclose(golden[f"{m}attention_keys@step{k}"], rms(B).numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(golden[f"{m}attention_queries@step{k}"], rms(C).numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(golden[f"{m}betas@step{k}"], dt.numpy(), rtol=1e-5, atol=1e-6)
            # Not vacuous: the raw B is not unit-RMS.
            assert float((B.pow(2).mean(-1) - 1).abs().max()) > 0.1
