"""Batch- and thread-invariant numerics (issue 23 item 2), the guarantee of ``deterministic=True``:
every value of a row is bitwise the same alone and inside left-padded batches of other rows, and on
1, 2 or 4 threads. Each test runs on both scan routes: the token-by-token (recurrent) scan, and the
default route (chunked prompts), whose chunk grid starts at each row's own first real token
(tests/python/test_invariance_scan.py checks the scans alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mixlens  # noqa: E402
from mixlens_dev.common import REPO  # noqa: E402

MODELS = {
    "mamba2": REPO / "models/mamba2-tinystories",
    "mamba": REPO / "models/mamba-tinystories",
    "falcon_mamba": REPO / "tests/fixtures/falcon_mamba/padded_untied_eps",
    "qwen3_5": REPO / "models/qwen3_5-tinystories",
    "qwen3_next": REPO / "tests/fixtures/qwen3_next/padded_batch",
    "qwen3_5_moe": REPO / "tests/fixtures/qwen3_5_moe/padded_batch",
    "nemotron_h": REPO / "tests/fixtures/nemotron_h/padded_batch",
    "bamba": REPO / "tests/fixtures/bamba/padded_batch",
    "falcon_h1": REPO / "tests/fixtures/falcon_h1/norm_before_gate",
    "granitemoehybrid": REPO / "tests/fixtures/granitemoehybrid/rope_moe_edits",
    "jamba": REPO / "tests/fixtures/jamba/moe_edits",
    "olmo_hybrid": REPO / "tests/fixtures/olmo_hybrid/padded_batch",
    "zamba2": REPO / "tests/fixtures/zamba2/shared_lora_edits",
    "zamba": REPO / "tests/fixtures/zamba/shared_edits",
    "kimi_linear": REPO / "tests/fixtures/kimi_linear/padded_batch",
    "xlstm": REPO / "tests/fixtures/xlstm/basic",
}
_models: dict = {}


def _model(name):
    if name not in _models:
        _models[name] = mixlens.load(str(MODELS[name]), deterministic=True)
    return _models[name]


@pytest.fixture(autouse=True, params=["recurrent", "default"])
def _route(request):
    families = {_model(n).info["family"] for n in MODELS}
    for f in families:
        mixlens.route_kernels(f, request.param)
    yield request.param
    for f in families:
        mixlens.route_kernels(f, "default")


def _paths(m):
    """Every value path (forward order) and, per path, the axes that follow the call's token count."""
    a = {v["path"]: v["shape"] for v in m.values(1, 3)}
    b = {v["path"]: v["shape"] for v in m.values(1, 5)}
    return {p: [i for i, (x, y) in enumerate(zip(a[p], b[p])) if x != y] for p in a}


def _row(batched, alone, axes, r):
    """Row r of a batched value cut to the row alone's positions: along each token axis the last ones
    (left padding puts the real tokens, and their keys, last)."""
    a = np.asarray(batched)[r : r + 1]
    for ax in axes:
        n = np.asarray(alone).shape[ax]
        a = np.take(a, np.arange(a.shape[ax] - n, a.shape[ax]), axis=ax)
    return a


def _run(m, rows, paths):
    out = m.run(rows, saves=list(paths))
    return out


def _ids(rng, m, n):
    return [int(t) for t in rng.integers(3, min(int(m.info["vocab_size"]), 1000), n)]


def test_default_is_not_deterministic_and_the_option_is_reported():
    m = mixlens.load(str(MODELS["mamba2"]))
    assert m.info["deterministic"] is False
    assert _model("mamba2").info["deterministic"] is True
    with pytest.raises(mixlens.MixlensError, match="deterministic must be True or False"):
        mixlens.load(str(MODELS["mamba2"]), deterministic=1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(MODELS)), lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_every_value_of_a_row_alone_equals_it_in_a_padded_batch(name, lens, seed):
    m = _model(name)
    rng = np.random.default_rng(seed)
    rows = [_ids(rng, m, n) for n in lens]
    axes = _paths(m)
    batch = _run(m, rows, axes)
    for r, ids in enumerate(rows):
        alone = _run(m, [ids], axes)
        # A fresh call has no state_input to save: both calls return the same set of values.
        assert set(alone) == set(batch) and len(batch) > len(axes) // 2, sorted(set(alone) ^ set(batch))
        for p in alone:
            a = np.asarray(alone[p])
            b = _row(batch[p], a, axes.get(p, [1]), r)
            assert a.shape == b.shape, p
            assert np.array_equal(a, b), f"{name}: {p} of row {r} (lengths {lens}) differs from the row alone by " \
                f"{np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_of_a_row_batched_equals_it_alone(name):
    """Greedy generation: a row's tokens and every value of every step (prompt and decode steps) are
    bitwise those of the row generated alone."""
    m = _model(name)
    rng = np.random.default_rng(3)
    rows = [_ids(rng, m, n) for n in (5, 17, 9)]
    axes = _paths(m)
    saves = list(axes) + ["logits"]
    batched = m.generate(rows, max_new_tokens=4, eos_token_id=-1, saves=saves).run()
    for r, ids in enumerate(rows):
        alone = m.generate([ids], max_new_tokens=4, eos_token_id=-1, saves=saves).run()
        assert alone.tokens[0] == batched.tokens[r], f"{name}: row {r}'s tokens"
        assert set(alone.saved) == set(batched.saved)
        for p, steps in alone.saved.items():
            assert len(steps) == len(batched.saved[p]) == 4, p
            for k, (a, b) in enumerate(zip(steps, batched.saved[p])):
                if a is None or b is None:  # state_input of the prompt step: there is none
                    assert a is None and b is None, f"{p} at step {k}"
                    continue
                a = np.asarray(a)
                b = _row(b, a, axes.get(p, [1, 2]), r)
                assert a.shape == b.shape and np.array_equal(a, b), f"{name}: {p} at step {k} of row {r}"


_CHILD = r"""
import hashlib, json, sys
import numpy as np
import mixlens
name, path = sys.argv[1], sys.argv[2]
m = mixlens.load(path, deterministic=True, output="numpy")
mixlens.route_kernels(m.info["family"], sys.argv[3])
rng = np.random.default_rng(11)
hi = min(int(m.info["vocab_size"]), 1000)
rows = [[int(t) for t in rng.integers(3, hi, n)] for n in (21, 37, 5)]
paths = [v["path"] for v in m.values(1, 2)]
got = {}
for i, call in enumerate([rows, rows[:1]]):  # the batch, and its first row alone
    out = m.run(call, saves=paths)
    got.update({f"{p} (call {i})": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for p, v in out.items()})
print(json.dumps(got))
"""


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_value_is_the_same_on_1_2_and_4_threads(name, _route):
    got = {}
    for n in ("1", "2", "4"):
        env = dict(os.environ, MIXLENS_NUM_THREADS=n)
        r = subprocess.run([sys.executable, "-c", _CHILD, name, str(MODELS[name]), _route], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        got[n] = json.loads(r.stdout.strip().splitlines()[-1])
    for n in ("2", "4"):
        assert set(got[n]) == set(got["1"])
        diff = [p for p in got["1"] if got["1"][p] != got[n][p]]
        assert not diff, f"{name}: {len(diff)} values differ between 1 and {n} threads, first {diff[0]}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_split_into_chunks_changes_no_logit(name, _route):
    """A call nobody observes runs as a chunked prefill: the last logits equal the unsplit call's. The
    token loop takes any split; the chunked scans a split on their chunk grid (a multiple of the scan's
    chunk: 64 for gated DeltaNet and these SSD layouts, whose chunk_size divides 64), since a call
    starts a chunk where it starts."""
    m = _model(name)
    ids = _ids(np.random.default_rng(5), m, 41 if _route == "recurrent" else 150)
    before = m.prefill_chunk
    try:
        m.prefill_chunk = 0
        whole = np.asarray(m.run([ids], logits="last")["logits"])
        for c in (5, 16) if _route == "recurrent" else (64, 128):
            m.prefill_chunk = c
            assert np.array_equal(np.asarray(m.run([ids], logits="last")["logits"]), whole), f"{name}: chunks of {c}"
    finally:
        m.prefill_chunk = before


def test_cli_deterministic_runs_a_prompt_alone_and_batched_alike(tmp_path):
    """`mixlens run --deterministic`: a prompt's logits alone equal its row of a left-padded batch
    (Mamba-1: its scan is invariant under padding on every route); the flag is refused by a command
    that runs no forward."""
    from safetensors.numpy import load_file
    from mixlens_dev.cli import cli

    model = str(MODELS["mamba"])
    a, b = "Once upon a time", "The little dog ran to the park and found a big red ball"
    alone, both = tmp_path / "alone.safetensors", tmp_path / "both.safetensors"
    for out, prompts in ((alone, [a]), (both, [a, b])):
        r = cli("run", "--model", model, "--deterministic", *prompts, "--save", "logits", "--out", str(out))
        assert r.returncode == 0, r.stderr
    la, lb = load_file(str(alone))["logits"], load_file(str(both))["logits"]
    assert np.array_equal(la[0], lb[0, lb.shape[1] - la.shape[1]:])
    r = cli("tokenize", "--model", model, "--deterministic", "hi")
    assert r.returncode == 2 and "--deterministic" in r.stderr, r


_ENV_CHILD = r"""
import sys, mixlens
arg = {"none": None, "true": True, "false": False}[sys.argv[2]]
try:
    print(mixlens.load(sys.argv[1], deterministic=arg).info["deterministic"])
except mixlens.InputError as e:
    print("InputError:", e)
"""


@pytest.mark.parametrize("env, arg, want", [
    (None, "none", "False"), ("1", "none", "True"), ("0", "none", "False"),
    ("1", "false", "False"), ("0", "true", "True"),  # an explicit argument wins over the variable
    ("false", "none", "InputError: MIXLENS_DETERMINISTIC='false' must be 1 (on) or 0 (off)"),
    ("yes", "true", None), (" 1", "none", None),  # a typo is refused even where the argument decides
])
def test_mixlens_deterministic_is_1_or_0_and_an_explicit_argument_wins(env, arg, want):
    e = {k: v for k, v in os.environ.items() if k != "MIXLENS_DETERMINISTIC"}
    if env is not None:
        e["MIXLENS_DETERMINISTIC"] = env
    r = subprocess.run([sys.executable, "-c", _ENV_CHILD, str(MODELS["mamba2"]), arg], env=e, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = r.stdout.strip().splitlines()[-1]
    if want is None:
        assert got.startswith("InputError: MIXLENS_DETERMINISTIC="), got
    else:
        assert got == want
