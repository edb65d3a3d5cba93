"""Property tests (hypothesis) of per-token state writes, on the committed tiny checkpoints of each
family: over prompt lengths 1..300, chunk sizes, write positions and left-padded batch
compositions, a write of `state@t` equals, row by row, the row's own prefix run up to t with its
cached state replaced by the written one (state_input of the next call), then the rest of the row
as a continuation; rows whose token t is padding are unchanged (padding keeps a zero state).
mixlens against itself through a different path (prefix + continuation, itself checked against
transformers elsewhere). A bounded number of examples keeps CI time modest.
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mixlens  # noqa: E402
from mixlens_dev.common import REPO, rel_rms  # noqa: E402

CHECKPOINTS = {
    "mamba2": (REPO / "tests/fixtures/mamba2/g1_chunks", [1, 3, 8, 64]),  # config chunk 8; no dt clamp
    "mamba": (REPO / "tests/fixtures/mamba/basic", [1, 5, 64]),
    "qwen3_5": (REPO / "tests/fixtures/qwen3_5/hv_2hk", [0]),  # the gated-delta chunk is fixed (64)
}
_models: dict = {}


def _model(name):
    if name not in _models:
        _models[name] = mixlens.StandardizedTransformer(str(CHECKPOINTS[name][0]))
    return _models[name]


def _linear_layers(m):
    return [i for i, k in enumerate(m.info["layer_kinds"]) if k != "attention"]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(CHECKPOINTS)))
    chunk = draw(st.sampled_from(CHECKPOINTS[name][1]))
    lens = draw(st.lists(st.integers(1, 300), min_size=1, max_size=3))
    T = max(lens)
    t = draw(st.integers(0, T - 1))
    seed = draw(st.integers(0, 2**16))
    factor = draw(st.sampled_from([0.0, 0.5, -2.0]))
    return name, chunk, lens, t, seed, factor


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_write_at_t_equals_prefix_then_replaced_cache_then_rest(case):
    name, chunk, lens, t, seed, factor = case
    m = _model(name)
    if chunk:
        m._core.set_chunk_size(chunk)
    try:
        rng = np.random.default_rng(seed)
        rows = [rng.integers(3, 97, size=n).tolist() for n in lens]
        layer = _linear_layers(m)[rng.integers(len(_linear_layers(m)))]
        T = max(lens)
        path = f"layers.{layer}.linear_attn.state@t{t}"
        got = m.run(rows, edits={path: lambda v: v * factor})["logits"]
        plain = m.run(rows)["logits"]
        for r, row in enumerate(rows):
            pad = T - len(row)
            k = t - pad  # the row's own index of token t
            mine = got[r:r + 1, pad:]
            if k < 0:  # token t is padding in this row: its state is zero, so the write changes nothing
                assert rel_rms(mine, plain[r:r + 1, pad:]) <= 1e-5
                continue
            cache = m.new_cache(1)
            head = m.forward([row[: k + 1]], cache)["logits"]
            parts = [head]
            if k + 1 < len(row):
                parts.append(m.forward([row[k + 1:]], cache,
                                       edits={f"layers.{layer}.linear_attn.state_input": lambda v: v * factor})["logits"])
            want = np.concatenate(parts, axis=1)
            err = rel_rms(mine, want)
            assert err <= 1e-4, f"{name} chunk {chunk} lens {lens} t={t} row {r}: rel rms {err:.2e}"
            if k + 1 == len(row):  # the write is the call's last state: the cache holds it
                assert rel_rms(mine, head) <= 1e-4
    finally:
        m._core.set_chunk_size(0)
