"""One number per value, scan side (issue 23, docs/values.md "One number per value"), as a user writes it
in a `with` block: `states[:, t]`, `state_after(t)` and the per-token state are equal (torch.equal /
array_equal, not a tolerance), `states[:, -1] == state_output`, a skipped token (dt / beta 0) keeps
the state exactly, a layer's states and per-token state go in any order the code says, on the
committed tiny checkpoints of every family (tests/cpp/test_invariance_scan.cpp covers both routes,
continuations, decode steps and padded batches in C++); hypothesis draws the write positions."""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO

FAMILIES = {
    "mamba2": "mamba2/g1_chunks",
    "mamba": "mamba/basic",
    "falcon_mamba": "falcon_mamba/basic",
    "qwen3_5": "qwen3_5/hv_2hk",
    "qwen3_next": "qwen3_next/moe_hv_2hk",
    "qwen3_5_moe": "qwen3_5_moe/moe_hv_2hk",
    "nemotron_h": "nemotron_h/groups2_edits",
    "bamba": "bamba/groups2_edits",
    "falcon_h1": "falcon_h1/norm_before_gate",
    "granitemoehybrid": "granitemoehybrid/rope_moe_edits",
    "jamba": "jamba/moe_edits",
    "olmo_hybrid": "olmo_hybrid/hv_2hk_chunks",
    "zamba2": "zamba2/shared_lora_edits",
    "zamba": "zamba/shared_edits",
    "kimi_linear": "kimi_linear/kda_mla_moe_chunks",
    "xlstm": "xlstm/basic",
}
_models: dict = {}
# A MoE product gathers every row's routed tokens, so a write on one row can move another row's
# rounding unless deterministic (README "Batch invariance"): on Jamba's fixture the row-1 state
# writes below flip routings, and BLAS's per-row sums depend on an expert's token count on some cores
# (OpenBLAS's Haswell / Zen sgemm kernels, not SkylakeX's).
DETERMINISTIC = {"jamba", "qwen3_5_moe", "qwen3_next", "kimi_linear", "granitemoehybrid", "nemotron_h"}


def _model(name):
    if name not in _models:
        _models[name] = mixlens.StandardizedTransformer(str(REPO / "tests/fixtures" / FAMILIES[name]), output="numpy",
                                                        deterministic=True if name in DETERMINISTIC else None)
    return _models[name]


def _linear(m):
    return [i for i, k in enumerate(m.info["layer_kinds"]) if k not in ("attention", "mlp", "moe")]


def _prompt(m, n, seed=3):
    return [np.random.default_rng(seed).integers(3, 97, size=n).tolist()]


def _chunk(name):
    return 64 if name.startswith("qwen") or name == "olmo_hybrid" else 8


@pytest.fixture(params=sorted(FAMILIES))
def name(request):
    return request.param


def test_chunk_per_token_states_end_is_state_output_and_a_skipped_token_keeps_the_state():
    """The issue's Mamba-2 report: with chunk_per_token, states[:, -1] == state_output and betas[:, 3] = 0
    holds the state (held[:, 3] == held[:, 2]), bitwise."""
    m = _model("mamba2")
    mixlens.chunk_per_token(m)
    try:
        prompt = _prompt(m, 12)
        with m.trace(prompt):
            mix = m.layers[1].linear_attn
            states = mix.states.save()
            out = mix.state_output.save()
        np.testing.assert_array_equal(np.asarray(states)[:, -1], np.asarray(out))
        with m.trace(prompt):
            mix = m.layers[1].linear_attn
            mix.betas[:, 3] = 0
            held = mix.states.save()
        held = np.asarray(held)
        np.testing.assert_array_equal(held[:, 3], held[:, 2])
    finally:
        mixlens.chunk_per_token(m, False)


def test_state_after_in_one_trace_is_states_in_another(name):
    """Qwen3.5's report: state_after(1) read in one trace and states[:, 1] in another are one number; on
    every family, at tokens inside, at the end of and after the first chunk."""
    m = _model(name)
    q = _chunk(name)
    prompt = _prompt(m, 2 * q + 1)
    layer = _linear(m)[0]
    with m.trace(prompt):
        states = m.layers[layer].linear_attn.states.save()
        out = m.layers[layer].linear_attn.state_output.save()
    states = np.asarray(states)
    np.testing.assert_array_equal(states[:, -1], np.asarray(out))
    for t in (1, q - 1, q, 2 * q):
        with m.trace(prompt):
            s = m.layers[layer].linear_attn.state_after(t)
        np.testing.assert_array_equal(np.asarray(s), states[:, t])


def test_reading_a_per_token_state_changes_no_other_number(name):
    m = _model(name)
    q = _chunk(name)
    prompt = _prompt(m, q + 3, seed=4)
    layer = _linear(m)[0]
    plain = m.run(prompt, saves=["logits", f"layers.{layer}.linear_attn.attention_head_outputs"])
    with m.trace(prompt):
        mix = m.layers[layer].linear_attn
        for t in (0, 2, q + 1):
            mix.state_after(t)
        y = mix.attention_head_outputs.save()
        logits = m.logits.save()
    np.testing.assert_array_equal(np.asarray(y), plain[f"layers.{layer}.linear_attn.attention_head_outputs"])
    np.testing.assert_array_equal(np.asarray(logits), plain["logits"])


def test_states_and_per_token_state_in_any_order_in_one_block(name):
    """set_state_after(0, v) then states; states then state_after(3); state_after(2) then states: in one
    block, no pre-registration, the same numbers as the pre-registered runs."""
    m = _model(name)
    prompt = _prompt(m, 11, seed=6)
    layer = _linear(m)[-1]
    path = f"layers.{layer}.linear_attn."
    with m.trace(prompt):
        mix = m.layers[layer].linear_attn
        v = np.asarray(mix.state_after(0)) * 0.5
        mix.set_state_after(0, v)
        written = mix.states.save()
    ref = m.run(prompt, saves=[path + "states"], edits={path + "state@t0": lambda x: x * 0.5})[path + "states"]
    np.testing.assert_array_equal(np.asarray(written), ref)
    np.testing.assert_array_equal(np.asarray(written)[:, 0], v)

    plain = m.run(prompt, saves=[path + "states"])[path + "states"]
    with m.trace(prompt):
        mix = m.layers[layer].linear_attn
        states = mix.states.save()
        s3 = mix.state_after(3).save()
    np.testing.assert_array_equal(np.asarray(states), plain)
    np.testing.assert_array_equal(np.asarray(s3), plain[:, 3])

    with m.trace(prompt):
        mix = m.layers[layer].linear_attn
        s2 = mix.state_after(2).save()
        states = mix.states.save()
    np.testing.assert_array_equal(np.asarray(states), plain)
    np.testing.assert_array_equal(np.asarray(s2), plain[:, 2])


@pytest.mark.parametrize("route", ["chunked", "recurrent"])
def test_a_write_on_one_row_leaves_the_other_rows_and_writing_back_the_state_is_no_write(name, route):
    """Issue 23's fresh-user trial: a per-token state written on row 1 of a left-padded batch of three
    moved rows 0 and 2 (the scan was split at t for every row), and set_state_after(t, state_after(t))
    moved later values. Now rows 0 and 2 are bitwise the run without the write (every mixer layer's
    states, state_output, head outputs, and the logits), row 1 keeps its values through t, and the state
    written back unchanged is bitwise no write; pre-registered and in the block."""
    m = _model(name)
    q = _chunk(name)
    T = 2 * q + 1
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (T, T - 2, T - 3)]
    layers = _linear(m)
    layer = layers[0]
    saves = ["logits"] + [f"layers.{i}.linear_attn.{v}" for i in layers
                          for v in ("states", "state_output", "attention_head_outputs")]

    def half_row_1(v):
        v[1] *= 0.5

    mixlens.route_kernels(name, route)
    try:
        plain = m.run(prompts, saves=saves)
        for t in (q + 1, q + q // 2):  # row 1 (padded by 2): the last token of its first chunk; mid-chunk
            edited = m.run(prompts, saves=saves, edits={f"layers.{layer}.linear_attn.state@t{t}": half_row_1})
            with m.trace(prompts) as tracer:
                mix = m.layers[layer].linear_attn
                v = np.array(mix.state_after(t))
                v[1] *= 0.5
                mix.set_state_after(t, v)
            with m.trace(prompts, saves=saves) as back:
                mix = m.layers[layer].linear_attn
                mix.set_state_after(t, mix.state_after(t))
            for key in saves:
                a, b = np.asarray(edited[key]), np.asarray(plain[key])
                for row in (0, 2):
                    np.testing.assert_array_equal(a[row], b[row], err_msg=f"{route} t={t} row {row}: {key}")
                if key == "logits" or key.endswith("attention_head_outputs"):
                    np.testing.assert_array_equal(a[1, : t + 1], b[1, : t + 1], err_msg=f"{route} t={t}: {key}")
                np.testing.assert_array_equal(np.asarray(back.saved[key]), b, err_msg=f"{route} t={t} written back: {key}")
            got = np.asarray(tracer.logits)
            np.testing.assert_array_equal(got, np.asarray(edited["logits"]))
            assert np.abs(got[1, t + 1:] - np.asarray(plain["logits"])[1, t + 1:]).max() > 0  # the write did something
    finally:
        mixlens.route_kernels(name, "default")


def test_a_write_after_states_was_read_names_the_rule():
    m = _model("mamba2")
    prompt = _prompt(m, 6)
    with pytest.raises(mixlens.OutOfOrderError, match="written only before"):
        with m.trace(prompt):
            mix = m.layers[1].linear_attn
            mix.states.save()
            mix.set_state_after(2, np.zeros_like(np.asarray(mix.state_output)))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FAMILIES)), route=st.sampled_from(["chunked", "recurrent"]),
       extra=st.integers(0, 20), writes=st.lists(st.integers(0, 200), min_size=0, max_size=3, unique=True),
       factor=st.sampled_from([0.0, 0.5, -2.0]), seed=st.integers(0, 2**16))
def test_identities_hold_for_any_write_positions(name, route, extra, writes, factor, seed):
    """Writes at any tokens (in order, in the block): every state_after(t) read afterwards in another run
    equals states[:, t] of the written run, states[:, w] is the written state, states[:, -1] ==
    state_output."""
    m = _model(name)
    q = _chunk(name)
    T = q + 1 + extra
    writes = sorted({w % T for w in writes})
    prompt = _prompt(m, T, seed=seed)
    layer = _linear(m)[0]
    path = f"layers.{layer}.linear_attn."
    mixlens.route_kernels(name, route)
    try:
        edits = {f"{path}state@t{w}": (lambda x: x * factor) for w in writes}
        got = m.run(prompt, saves=[path + "states", path + "state_output"], edits=edits)
        states = got[path + "states"]
        np.testing.assert_array_equal(states[:, -1], got[path + "state_output"])
        with m.trace(prompt):
            mix = m.layers[layer].linear_attn
            for w in writes:
                mix.set_state_after(w, np.asarray(mix.state_after(w)) * factor)
            after = mix.states.save()
        np.testing.assert_array_equal(np.asarray(after), states)
        for t in sorted(set(writes) | {0, T // 2, T - 1}):
            saves = [f"{path}state@t{t}"]
            one = m.run(prompt, saves=saves, edits=edits)[saves[0]]
            np.testing.assert_array_equal(one, states[:, t])
    finally:
        mixlens.route_kernels(name, "default")


_THREADS_WORKER = r"""
import sys, numpy as np, mixlens
src, out, layer, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
m = mixlens.StandardizedTransformer(src, output="numpy")
mixlens.route_kernels(sys.argv[5], sys.argv[6])
prompt = [np.random.default_rng(9).integers(3, 97, size=300).tolist()]
p = f"layers.{layer}.linear_attn."
inputs = dict(np.load(sys.argv[7])) if len(sys.argv) > 7 else None
edits = {p + k: v for k, v in inputs.items()} if inputs else None
got = m.run(prompt, saves=[p + k for k in names + ["states", "state_output", "attention_head_outputs", "state@t70"]],
            edits=edits)
np.savez(out, **{k[len(p):]: np.asarray(v) for k, v in got.items() if k.startswith(p)})
"""


@pytest.mark.parametrize("name", ["mamba2", "mamba", "qwen3_5"])
@pytest.mark.parametrize("route", ["chunked", "recurrent", "default"])
def test_scan_values_do_not_depend_on_the_thread_count(name, route, tmp_path):
    """Given the same mixer inputs (written from a 1-thread run), the scan's values are bitwise the same on
    1, 2 and 4 threads (MIXLENS_NUM_THREADS), on each route and the default one (Mamba-1's default was
    chosen by thread count); the projections before the scan are the other work item's."""
    import os
    import subprocess
    import sys

    src = str(REPO / "tests/fixtures" / FAMILIES[name])
    layer = _linear(_model(name))[0]
    names = ["attention_queries", "attention_keys", "attention_values", "betas"] + (["decays"] if name.startswith("qwen") else [])
    runs = {}
    for threads in (1, 2, 4):
        out = tmp_path / f"t{threads}.npz"
        args = [sys.executable, "-c", _THREADS_WORKER, src, str(out), str(layer), ",".join(names), name, route]
        if threads != 1:
            args.append(str(tmp_path / "inputs.npz"))
        subprocess.run(args, check=True, env={**os.environ, "MIXLENS_NUM_THREADS": str(threads)})
        runs[threads] = dict(np.load(out))
        if threads == 1:
            np.savez(tmp_path / "inputs.npz", **{k: runs[1][k] for k in names})
    for threads in (2, 4):
        for k in ("states", "state_output", "attention_head_outputs", "state@t70"):
            np.testing.assert_array_equal(runs[threads][k], runs[1][k], err_msg=f"{name} {route} {threads} threads: {k}")
