"""token_mixing / state_input_mixing / state_contributions (issue 26 item 1; docs/values.md
"token_mixing") on the committed fixtures of every family that runs the SSD kernels (Mamba-2, the
Mamba-2 hybrids, MiniMax's lightning attention):

- attention_head_outputs == token_mixing @ attention_values + state_input_mixing @ state_input + skip
  (Mamba-2: D x, D read from the checkpoint; lightning: none), relative RMS <= 1e-5, at every prompt
  length 1 .. 2*chunk+1 (chunk set to 4), left-padded batches, the prompt and every decode step of a
  generation (a decode step's row: [B,H,1,1] plus its state_input term), on both kernel routes;
- the block API (model.token_mixing) equals slices of the trace value; state_contributions sum to the
  per-token states; the value is read-only; kinds without a derived mixing are refused with the reason.
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
SSD_FIXTURES = ["mamba2/g2_clamp", "mamba2/padded_batch", "bamba/padded_batch", "falcon_h1/norm_before_gate",
                "nemotron_h/padded_batch", "zamba2/shared_lora_edits", "granitemoehybrid/nope_dense_padded",
                "minimax/lightning_attn", "qwen3_5/padded_batch", "qwen3_next/padded_batch", "olmo_hybrid/padded_batch",
                "kimi_linear/padded_batch"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23]]
CHUNK = 4  # set where the family allows it; the delta rule's chunk stays 64 (transformers' fixed chunk)


def _existing(names):
    return [n for n in names if (FIX / n / "config.json").exists()]


def _model(name):
    """The fixture's model with chunk CHUNK where settable, and the chunk its kernels then run."""
    m = mixlens.StandardizedTransformer(str(FIX / name), output="numpy")
    try:
        m._core.set_chunk_size(CHUNK)
        return m, CHUNK
    except mixlens.UnsupportedError:
        cfg = json.loads((FIX / name / "config.json").read_text())
        return m, int(cfg.get("chunk_size", cfg.get("block_size", 64)))


def _lengths(chunk):
    """1 .. 2*chunk+1: every length for small chunks, the boundaries for the delta rule's 64."""
    if chunk <= 8:
        return list(range(1, 2 * chunk + 2))
    return [1, 2, 3, chunk - 1, chunk, chunk + 1, 2 * chunk, 2 * chunk + 1]


def _prompt(T, shift=0):
    return [3 + (5 + 7 * i + shift) % 60 for i in range(T)]


def _mixing_layers(m):
    return sorted({v["layer"] for v in m.values() if v["path"].endswith(".linear_attn.token_mixing")})


def _skip_weight(name, layer):
    """D [H] of the layer's Mamba-2 mixer from the checkpoint, or None (lightning: no skip)."""
    from safetensors.numpy import load_file

    w = load_file(str(FIX / name / "model.safetensors"))
    keys = [k for k in w if re.search(rf"layers\.{layer}\.(.+\.)?D$", k)]
    return w[keys[0]].astype(np.float64) if keys else None


def _rebuild(M, Sin, x, S0, D):
    """M [B,H,T,T] @ x [B,T,H,P] + Sin [B,H,T,N] @ S0 [B,H,N,P] + D x -> [B,T,H,P], in float64."""
    y = np.einsum("bhts,bshp->bthp", M.astype(np.float64), x.astype(np.float64))
    if S0 is not None:
        y += np.einsum("bhtn,bhnp->bthp", Sin.astype(np.float64), S0.astype(np.float64))
    if D is not None:
        y += D[None, None, :, None] * x
    return y


@pytest.fixture(scope="module", params=_existing(SSD_FIXTURES))
def fx(request):
    return request.param


@pytest.mark.parametrize("route", ["chunked", "recurrent"])
def test_mixing_rebuilds_the_head_outputs_at_every_length_and_decode_step(fx, route):
    m, chunk = _model(fx)
    fam = m.info["family"]
    mixlens.route_kernels(fam, route)
    try:
        for layer in _mixing_layers(m):
            D = _skip_weight(fx, layer)
            p = f"layers.{layer}.linear_attn."
            names = ["token_mixing", "state_input_mixing", "attention_values", "attention_head_outputs", "state_input"]
            for T in _lengths(chunk):
                rows = [_prompt(T), _prompt(max(1, T - 3), 11)]  # the second row left-padded
                got = m.generate(rows, max_new_tokens=3, eos_token_id=-1, saves=[p + n for n in names]).run().saved
                for step in range(3):
                    M, Sin, x, y, S0 = (got[p + n][step] for n in names)
                    assert M.shape == (2, x.shape[2], x.shape[1], x.shape[1])
                    err = rel_rms(_rebuild(M, Sin, x, S0, D), y)
                    assert err <= 1e-5, (fx, route, layer, T, step, err)
    finally:
        mixlens.route_kernels(fam, "default")


def test_a_broken_mixing_fails_the_check(fx):
    # The check above is not vacuous: dropping one source token's weight breaks it.
    m, _ = _model(fx)
    layer = _mixing_layers(m)[0]
    p = f"layers.{layer}.linear_attn."
    got = m.run(PROMPTS, saves=[p + "token_mixing", p + "attention_values", p + "attention_head_outputs"])
    M, x, y = got[p + "token_mixing"], got[p + "attention_values"], got[p + "attention_head_outputs"]
    D = _skip_weight(fx, layer)
    assert rel_rms(_rebuild(M, None, x, None, D), y) <= 1e-5
    broken = M.copy()
    broken[:, :, 5, 2] = 0.0
    assert rel_rms(_rebuild(broken, None, x, None, D), y) > 1e-4


def test_block_api_is_a_slice_of_the_value_and_contributions_sum_to_the_states(fx):
    m, _ = _model(fx)
    layer = _mixing_layers(m)[-1]
    p = f"layers.{layer}.linear_attn."
    got = m.run(PROMPTS, saves=[p + "token_mixing", p + "states", p + "attention_values", p + "attention_head_outputs"])
    M, states = got[p + "token_mixing"], got[p + "states"]
    T = M.shape[-1]
    full = m.token_mixing(PROMPTS, layer)
    np.testing.assert_array_equal(full["mixing"], M)
    D = _skip_weight(fx, layer)
    x = got[p + "attention_values"]
    np.testing.assert_allclose(full["skip"], (D[None, None, :, None] * x) if D is not None else 0 * x, rtol=1e-6, atol=1e-7)
    assert full["skip_meaning"] == ("D x" if D is not None else "none")
    # A block is the slice (SSD: bitwise; the delta rule's float64 chunk products: within float rounding).
    part = m.token_mixing(PROMPTS, layer, rows=slice(2, -1), cols=slice(-4, None), heads=1)
    np.testing.assert_allclose(part["mixing"], M[:, 1:2, 2:-1, -4:], rtol=1e-6, atol=1e-9)
    row = m.token_mixing(PROMPTS, layer, rows=-1)
    np.testing.assert_allclose(row["mixing"], M[:, :, -1:, :], rtol=1e-6, atol=1e-9)
    for t in (0, 4, -1):
        c = m.state_contributions(PROMPTS, layer, t)
        assert c.shape == (2, M.shape[1], T) + states.shape[3:]
        tt = t % T
        assert not np.any(c[:, :, tt + 1:])
        assert rel_rms(c.sum(axis=2, dtype=np.float64), states[:, tt]) <= 1e-5
        # Source token 5's share alone, one head.
        one = m.state_contributions(PROMPTS, layer, t, cols=slice(5, 6), heads=slice(0, 1))
        np.testing.assert_allclose(one, c[:, 0:1, 5:6], rtol=1e-6, atol=1e-9)
    with pytest.raises(mixlens.InputError):
        m.token_mixing(PROMPTS, layer, rows=slice(0, T + 1))
    with pytest.raises(mixlens.WriteError, match="derived"):
        m.run(PROMPTS, edits={p + "token_mixing": lambda v, where: v})


def test_kinds_without_a_derived_mixing_say_why():
    m = mixlens.StandardizedTransformer(str(FIX / "mamba/short_prompt"), output="numpy")
    reason = m.support(layer=0)["linear_attn.token_mixing"]
    assert "not derived yet" in reason and "mamba" in reason
    with pytest.raises(mixlens.UnsupportedError, match="not derived yet"):
        m.token_mixing([[5, 6, 7]], 0)
    with pytest.raises(mixlens.UnknownValueError, match="not derived yet"):
        m.run([[5, 6, 7]], saves=["layers.0.linear_attn.token_mixing"])


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
