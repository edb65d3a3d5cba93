"""token_mixing / state_input_mixing / state_contributions (issue 26 item 1; docs/values.md
"Token mixing") on the committed fixtures of every family with a recurrent mixer whose mixing is
derived: Mamba-2 SSD (Mamba-2 and its hybrids), lightning attention (MiniMax), gated DeltaNet and
KDA, Mamba-1 (Mamba, FalconMamba, Jamba, Zamba; per channel), the RG-LRU (RecurrentGemma; per
channel), LFM2's short conv (per channel), RWKV-4's WKV (per channel) and xLSTM's mLSTM (the last two
exact given the call's own denominator):

- attention_head_outputs == token_mixing @ attention_values + the state_input term + skip, relative
  RMS <= 1e-5, on every fixture and every mixer layer (a left-padded prompt and each decode step of a
  generation: a step's row is [B,H,1,1] plus its state_input term), and at every prompt length
  1 .. 2*chunk+1 on both kernel routes on one fixture per kind;
- the block API (model.token_mixing) equals slices of the trace value; state_contributions sum to the
  per-token states; the value is read-only; attention blocks are refused with the reason; bad layers /
  ranges raise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms

FIX = Path(__file__).resolve().parents[1] / "fixtures"
ALL_FIXTURES = sorted(str(p.parent.relative_to(FIX)) for p in FIX.glob("*/*/config.json")
                      if p.parent.parent.name not in {"tokenizer", "kimi_linear_mixers"})
# One fixture per kind for the lengths x routes sweep.
KIND_FIXTURES = ["mamba2/g2_clamp", "minimax/lightning_attn", "qwen3_5/padded_batch", "kimi_linear/padded_batch",
                 "mamba/padded_batch", "zamba/padded_bias", "lfm2/bias_short_prompt", "recurrent_gemma/padded_batch",
                 "rwkv/basic", "xlstm/basic"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23]]
CHUNK = 4  # set where the family allows it; the delta rule's chunk stays 64 (transformers' fixed chunk)


def _model(name):
    """The fixture's model with chunk CHUNK where settable, and the chunk its kernels then run (None:
    a token loop only)."""
    m = mixlens.StandardizedTransformer(str(FIX / name), output="numpy")
    try:
        m._core.set_chunk_size(CHUNK)
        return m, CHUNK
    except mixlens.UnsupportedError:
        cfg = json.loads((FIX / name / "config.json").read_text())
        c = cfg.get("chunk_size", cfg.get("block_size"))
        return m, int(c) if c else None


def _lengths(chunk):
    """1 .. 2*chunk+1: every length for small chunks, the boundaries for the delta rule's 64."""
    if chunk is None:
        return list(range(1, 10))
    if chunk <= 8:
        return list(range(1, 2 * chunk + 2))
    return [1, 2, 3, chunk - 1, chunk, chunk + 1, 2 * chunk, 2 * chunk + 1]


def _prompt(T, shift=0):
    return [3 + (5 + 7 * i + shift) % 60 for i in range(T)]


def _mixing_layers(m):
    return sorted({v["layer"] for v in m.values() if v["path"].endswith(".linear_attn.token_mixing")})


class Kind:
    """What a fixture's layer adds besides token_mixing @ values: its skip weights from the checkpoint
    (Mamba's D; LFM2's conv bias, read through C) and how state_input_mixing reads state_input."""

    def __init__(self, name, m, layer):
        from safetensors.numpy import load_file

        self.family = m.info["family"]
        w = {}
        for f in (FIX / name).glob("*.safetensors"):
            if "golden" not in f.name:
                w.update(load_file(str(f)))
        pick = lambda pat: next((w[k].astype(np.float64).reshape(-1) for k in w if re.search(pat, k)), None)
        self.D = pick(rf"layers\.{layer}\.(.+\.)?D$")
        self.conv_bias = pick(rf"layers\.{layer}\.conv\.conv\.bias$") if self.family.startswith("lfm2") else None
        # Falcon-H1 without mamba_rms_norm gates a decode step's head outputs by silu(z) (values.md).
        cfg = json.loads((FIX / name / "config.json").read_text())
        self.gated_decode = self.family == "falcon_h1" and not cfg.get("mamba_rms_norm", False)

    def rebuild(self, M, Sin, x, S0, C=None, real=None):
        """The head outputs [x's shape] from the mixing, in float64."""
        B, H, T, _ = M.shape
        xv = x.reshape(B, T, H, -1).astype(np.float64)
        y = np.einsum("bhts,bshp->bthp", M.astype(np.float64), xv)
        if S0 is not None:
            S0 = S0.astype(np.float64)
            Sin = Sin.astype(np.float64)
            if self.family == "recurrent_gemma":  # the h row of [K, W]
                y[..., 0] += np.einsum("bht,bh->bth", Sin[..., 0], S0[:, -1, :])
            elif self.family == "rwkv":  # num, the first A entries of the flat row
                y[..., 0] += np.einsum("bht,bh->bth", Sin[..., 0], S0[:, :H])
            elif self.family == "xlstm":  # C [NH, Dqk, Dv], first in the flat row
                Dqk = Sin.shape[-1]
                y += np.einsum("bhtn,bhnp->bthp", Sin, S0[:, :H * Dqk * xv.shape[-1]].reshape(B, H, Dqk, -1))
            elif S0.ndim == 3:  # Mamba-1 [E, N], the short conv's window [D, K]
                y[..., 0] += np.einsum("bhtn,bhn->bth", Sin, S0)
            else:  # [H, N, P] (SSD, the delta rule)
                y += np.einsum("bhtn,bhnp->bthp", Sin, S0)
        if self.D is not None:
            y += self.D[None, None, :, None] * xv  # [H] heads or [E] channels (Zamba's [heads, E/heads] flat)
        if self.conv_bias is not None:
            y[..., 0] += C.astype(np.float64) * self.conv_bias[None, None, :] * (1 if real is None else real[..., None])
        return y.reshape(x.shape)


def _real(rows, T):
    """[B, T] 1 at real tokens of left-padded rows."""
    return np.array([[1.0 if t >= T - len(r) else 0.0 for t in range(T)] for r in rows])


NAMES = ["token_mixing", "state_input_mixing", "attention_values", "attention_head_outputs", "state_input"]


def _check_generation(name, m, rows, steps, where):
    """Every mixing layer: the prompt and each decode step rebuild the head outputs."""
    for layer in _mixing_layers(m):
        kind = Kind(name, m, layer)
        p = f"layers.{layer}.linear_attn."
        names = NAMES + (["attention_queries"] if kind.conv_bias is not None else [])
        got = m.generate(rows, max_new_tokens=steps, eos_token_id=-1, saves=[p + n for n in names]).run().saved
        for step in range(steps):
            if step > 0 and kind.gated_decode:
                continue
            M, Sin, x, y, S0 = (got[p + n][step] for n in NAMES)
            C = got[p + "attention_queries"][step] if kind.conv_bias is not None else None
            assert M.shape[0] == len(rows) and M.shape[2] == x.shape[1] and M.shape[3] == x.shape[1]
            if step > 0:
                assert M.shape[2:] == (1, 1)  # a decode step's own row
            real = _real(rows, x.shape[1]) if step == 0 else None
            err = rel_rms(kind.rebuild(M, Sin, x, S0, C, real), y)
            assert err <= 1e-5, (name, where, layer, step, err)


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_and_layer_rebuilds_the_head_outputs_with_decode_steps(name):
    m, _ = _model(name)
    assert _mixing_layers(m), name
    _check_generation(name, m, PROMPTS, 3, "default route")


@pytest.mark.parametrize("route", ["chunked", "recurrent"])
@pytest.mark.parametrize("name", KIND_FIXTURES)
def test_every_length_on_both_routes(name, route):
    m, chunk = _model(name)
    fam = m.info["family"]
    try:
        mixlens.route_kernels(fam, route)
    except mixlens.UnsupportedError:
        pytest.skip(f"{fam} has one kernel (the token loop): its default route is tested")
    try:
        for T in _lengths(chunk):
            rows = [_prompt(T), _prompt(max(1, T - 3), 11)]  # the second row left-padded
            _check_generation(name, m, rows, 2, f"{route} T={T}")
    finally:
        mixlens.route_kernels(fam, "default")


@pytest.mark.parametrize("name", KIND_FIXTURES)
def test_a_broken_mixing_fails_the_check(name):
    # The check above is not vacuous: dropping one source token's weight breaks it.
    m, _ = _model(name)
    layer = _mixing_layers(m)[0]
    kind = Kind(name, m, layer)
    p = f"layers.{layer}.linear_attn."
    got = m.run(PROMPTS, saves=[p + n for n in NAMES[:4]] + [p + "attention_queries"] * (kind.conv_bias is not None))
    M, x, y = got[p + "token_mixing"], got[p + "attention_values"], got[p + "attention_head_outputs"]
    C = got.get(p + "attention_queries")
    real = _real(PROMPTS, x.shape[1])
    assert rel_rms(kind.rebuild(M, None, x, None, C, real), y) <= 1e-5
    broken = M.copy()
    broken[:, :, 5, 4] = 0.0
    assert rel_rms(kind.rebuild(broken, None, x, None, C, real), y) > 1e-4


def _contribution_sum(fam, c, states, t):
    """(sum over sources, the state part they split) for the kind's served state layout."""
    s = c.sum(axis=2, dtype=np.float64)
    if fam == "recurrent_gemma":  # h only (row K-1 of [K, W])
        return s, states[:, t, -1, :]
    if fam == "rwkv":  # (num, den) in the served max's frame
        A = c.shape[1]
        return s, np.stack([states[:, t, :A], states[:, t, A:2 * A]], axis=-1)
    if fam == "xlstm":  # (C | n) per head in the frame of m
        B, NH, _, Dqk, Dv1 = c.shape
        Cs = states[:, t, :NH * Dqk * (Dv1 - 1)].reshape(B, NH, Dqk, Dv1 - 1)
        ns = states[:, t, NH * Dqk * (Dv1 - 1):NH * Dqk * Dv1].reshape(B, NH, Dqk, 1)
        return s, np.concatenate([Cs, ns], axis=-1)
    return s, states[:, t]


@pytest.mark.parametrize("name", KIND_FIXTURES)
def test_block_api_is_a_slice_of_the_value_and_contributions_sum_to_the_states(name):
    m, _ = _model(name)
    layer = _mixing_layers(m)[-1]
    fam = m.info["family"]
    p = f"layers.{layer}.linear_attn."
    got = m.run(PROMPTS, saves=[p + "token_mixing", p + "states", p + "attention_values", p + "attention_head_outputs"])
    M, states = got[p + "token_mixing"], got[p + "states"]
    T = M.shape[-1]
    full = m.token_mixing(PROMPTS, layer)
    np.testing.assert_array_equal(full["mixing"], M)
    B, H = M.shape[:2]
    x = got[p + "attention_values"].reshape(B, T, H, -1)
    assert full["skip"].shape == x.shape
    y = np.einsum("bhts,bshp->bthp", M.astype(np.float64), x) + full["skip"]
    assert rel_rms(y.reshape(got[p + "attention_head_outputs"].shape), got[p + "attention_head_outputs"]) <= 1e-5
    # A block is the slice (bitwise where the block is computed alone; the delta rule's float64 chunk
    # products: within float rounding).
    part = m.token_mixing(PROMPTS, layer, rows=slice(2, -1), cols=slice(-4, None), heads=1)
    np.testing.assert_allclose(part["mixing"], M[:, 1:2, 2:-1, -4:], rtol=1e-6, atol=1e-9)
    row = m.token_mixing(PROMPTS, layer, rows=slice(-4, None))
    np.testing.assert_allclose(row["mixing"], M[:, :, -4:, :], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(row["skip"], full["skip"][:, -4:], rtol=1e-6, atol=1e-9)
    for t in (0, 4, -1):
        c = m.state_contributions(PROMPTS, layer, t)
        assert c.shape[:3] == (2, H, T)
        tt = t % T
        assert not np.any(c[:, :, tt + 1:])
        s, want = _contribution_sum(fam, c, states, tt)
        assert rel_rms(s, want) <= 1e-5, (name, t)
        one = m.state_contributions(PROMPTS, layer, t, cols=slice(5, 6), heads=slice(0, 1))
        np.testing.assert_allclose(one, c[:, 0:1, 5:6], rtol=1e-6, atol=1e-9)
    with pytest.raises(mixlens.WriteError, match="derived"):
        m.run(PROMPTS, edits={p + "token_mixing": lambda v, where: v})
    with pytest.raises(mixlens.WriteError, match="derived"):
        m.run(PROMPTS, edits={p + "state_input_mixing": lambda v, where: v})


def test_errors_name_the_problem():
    m, _ = _model("lfm2/conv_attn")
    layers = _mixing_layers(m)
    T = len(PROMPTS[0])
    with pytest.raises(mixlens.InputError):
        m.token_mixing(PROMPTS, layers[0], rows=slice(0, T + 1))
    with pytest.raises(mixlens.InputError):
        m.token_mixing(PROMPTS, layers[0], cols=slice(T + 2, None))
    with pytest.raises(mixlens.InputError):
        m.state_contributions(PROMPTS, layers[0], T)
    with pytest.raises(mixlens.InputError):
        m.token_mixing(PROMPTS, 99)
    attn = next(i for i in range(m.info["num_layers"]) if i not in layers)
    with pytest.raises(mixlens.UnsupportedError, match="attention block"):
        m.token_mixing(PROMPTS, attn)


def test_cli_saves_the_value(tmp_path):
    # `mixlens run --save ...token_mixing` writes the trace's value (the Python and C++ traces: above).
    import subprocess

    from safetensors.numpy import load_file

    from mixlens_dev.cli import find_cli

    name, path = "mamba2/g2_clamp", "layers.1.linear_attn.token_mixing"
    out = tmp_path / "mix.safetensors"
    r = subprocess.run([find_cli(), "run", "--model", str(FIX / name), "--ids", "5,6,7,8,9", "--save", path,
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m, _ = _model(name)
    m._core.set_chunk_size(0)
    want = m.run([[5, 6, 7, 8, 9]], saves=[path])[path]
    np.testing.assert_array_equal(load_file(str(out))[path], want)
