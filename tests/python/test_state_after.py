"""Per-token state (docs/values.md "Per-token state"): `state_after(t)`, `set_state_after(t, v)`,
`for t in tracer.iter[...]: mix.state`, and the `state@t<t>` path, on every family, against
transformers 5.18.

Reads: the oracle captures the state after every token inside transformers' own token-by-token
kernels (tests/python/oracle_*.py patch them); `state_after(t)` must equal it for every t of prompts
of lengths 1, chunk-1, chunk, chunk+1, 2*chunk+1, on the default and forced routes, in a
left-padded batch.
Writes: transformers runs tokens 0..t, its cache's recurrent state is replaced by the written one
(conv window kept: the oracle's state_input edit of the next call), then the rest of the prompt is
fed (Mamba: one decode step per token, as transformers cannot continue a scan from a state;
Qwen: one multi-token call). mixlens must match it on every token, before and after t.

Tolerance: relative RMS <= 1e-5 on states, 1e-4 on logits (float32 on both sides; the chunked
kernels associate sums differently, and a split scan restarts its chunks at t + 1).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev import oracle_mamba as om1
from mixlens_dev import oracle_mamba2 as om2
from mixlens_dev import oracle_qwen as oq
from mixlens_dev.common import build_mamba2, rel_rms

STATE_TOL, LOGIT_TOL = 1e-5, 1e-4
QWEN_PAD = 0
LIN, FULL = "linear_attention", "full_attention"


def mix(layer: int, value: str) -> str:
    return f"layers.{layer}.linear_attn.{value}"


class Family:
    """A fresh random model of one family, with its oracle and chunk length."""

    def __init__(self, name: str, tmp_path):
        from mixlens_dev import fixtures as mf

        self.name = name
        if name == "mamba2":
            self.torch_model = build_mamba2(tmp_path, 81, dict(num_hidden_layers=2, n_groups=1, chunk_size=4,
                                                               tie_word_embeddings=True))
            self.chunk, self.route_family, self.layers = 4, "mamba2", [0, 1]
        elif name in ("mamba", "falcon_mamba"):
            from mixlens_dev.fixtures import mamba as mfm

            model = mfm.build_model({"seed": 82, "config": dict(num_hidden_layers=2, tie_word_embeddings=True)}, name)
            model.save_pretrained(str(tmp_path))
            self.torch_model = mfm.load_model(tmp_path, name)
            self.chunk, self.route_family, self.layers = 64, name, [0, 1]
        else:
            from mixlens_dev.fixtures import qwen as qf

            spec = dict(seed=83, prompts=[1], config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
                                                            linear_num_key_heads=2, linear_num_value_heads=4))
            if name == "kimi_linear":  # KDA (decays per key channel), MLA, the MoE on the last layer
                spec = dict(seed=84, prompts=[1], config=dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
                                                                mlp_layer_types=["dense", "dense", "sparse"]))
            model = qf.build_model(name, spec)  # qwen3_5, olmo_hybrid or kimi_linear (gated DeltaNet, same oracle)
            model.save_pretrained(tmp_path)
            self.torch_model = type(model).from_pretrained(tmp_path).eval()
            self.chunk, self.route_family, self.layers = 64, name, [0, 2]
        self.gdn = name in ("qwen3_5", "olmo_hybrid", "kimi_linear")
        self.vocab = self.torch_model.config.vocab_size
        self.prompts_of = lambda lens, seed=5: mf.make_prompts(seed, lens, self.vocab)
        self.model = mixlens.StandardizedTransformer(str(tmp_path))

    def ref(self, prompts, n_steps=1, edits=(), feeds=None) -> dict:
        """The oracle's values; `feeds` [n_steps-1][B][n] tokens fed after each step."""
        if self.gdn:
            values, _ = oq.run(self.torch_model, prompts, QWEN_PAD, n_steps, list(edits), feeds=feeds)
            return values
        oracle = om2 if self.name == "mamba2" else om1
        forced = None if not feeds else np.array([[row[0] for row in step] for step in feeds])
        return oracle.run(self.torch_model, prompts, n_steps, list(edits), forced_tokens=forced)


@pytest.fixture(scope="module", params=["mamba2", "mamba", "falcon_mamba", "qwen3_5", "olmo_hybrid", "kimi_linear"])
def fam(request, tmp_path_factory):
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def _lengths(q: int) -> list[int]:
    return [1, q - 1, q, q + 1, 2 * q + 1]


@pytest.mark.parametrize("route", ["default", "chunked", "recurrent"])
def test_state_after_every_token_matches_transformers(fam, route):
    """Every t of each prompt length (batched, left-padded: the longest row sets T), read in a token
    loop in one layer and by state_after(t) (negative too) in another."""
    lens = _lengths(fam.chunk)
    prompts = fam.prompts_of([max(lens)] + lens[:-1])  # one batch: rows of every length
    single = fam.prompts_of([lens[1]], seed=6)
    mixlens.route_kernels(fam.route_family, route)
    try:
        for batch in (prompts, single):
            ref = fam.ref(batch)
            T = max(len(p) for p in batch)
            la, lb = fam.layers
            with fam.model.trace(batch) as tracer:
                loop = [fam.model.layers[la].linear_attn.state for _ in tracer.iter[:]]
                mb = fam.model.layers[lb].linear_attn
                by_index = [mb.state_after(t - T if t % 2 else t) for t in range(T)]
            for layer, got in ((la, loop), (lb, by_index)):
                want = ref[oq.key(mix(layer, "states"), 0)]
                assert len(got) == T == want.shape[1]
                for t in range(T):
                    err = rel_rms(got[t], want[:, t])
                    assert err <= STATE_TOL, f"{fam.name} {route} layer {layer} t={t}/{T}: rel rms {err:.2e}"
    finally:
        mixlens.route_kernels(fam.route_family, "default")


def _ref_write(fam, prompts, t, factor, layer):
    """transformers with the state after token t of `layer` scaled by `factor` through its cache:
    (its values, its logits of every token, the tokens after t)."""
    T = max(len(p) for p in prompts)
    pads = [T - len(p) for p in prompts]
    assert t >= max(pads), "the oracle's prefix must hold a real token in every row"
    prefix = [p[: t + 1 - pad] for p, pad in zip(prompts, pads)]
    rest = [p[t + 1 - pad:] for p, pad in zip(prompts, pads)]
    R = T - t - 1
    edit = dict(name="w", path=mix(layer, "state_input"), step=1, op="scale", factor=factor)
    if fam.gdn:
        ref = fam.ref(prefix, 2, [edit], feeds=[rest]) if R else fam.ref(prefix, 1)
        ref_logits = np.concatenate([ref[oq.key("logits", 0)]] + ([ref[oq.key("logits", 1)]] if R else []), axis=1)
    else:
        feeds = [[[r[k]] for r in rest] for k in range(R)]
        ref = fam.ref(prefix, 1 + R, [edit] if R else [], feeds=feeds)
        ref_logits = np.concatenate([ref[om2.key("logits", k)] for k in range(1 + R)], axis=1)
    return ref, ref_logits, R


def _write_case(fam, lens, t, factor, layer, how):
    """mixlens with the state after token t of `layer` scaled by `factor`, and transformers doing the
    same through its cache; compares every logit and the states after t."""
    prompts = fam.prompts_of(lens, seed=7)
    ref, ref_logits, R = _ref_write(fam, prompts, t, factor, layer)

    path = f"{mix(layer, 'state')}@t{t}"
    if how == "interleaved":
        with fam.model.trace(prompts) as tracer:
            mb = fam.model.layers[layer].linear_attn
            mb.set_state_after(t, mb.state_after(t) * factor)
            out_state = mb.state_output
        logits = tracer.logits
    else:
        got = fam.model.run(prompts, saves=[mix(layer, "state_output")], edits={path: lambda v: v * factor})
        logits, out_state = got["logits"], got[mix(layer, "state_output")]
    err = rel_rms(logits, ref_logits)
    assert err <= LOGIT_TOL, f"{fam.name} write at t={t} ({how}): logits rel rms {err:.2e}"
    last = 1 if (R and fam.gdn) else R
    want_out = ref[oq.key(mix(layer, "state_output"), last)] * (1.0 if R else factor)  # t = T-1: the write is it
    assert rel_rms(out_state, want_out) <= STATE_TOL
    return logits


@pytest.mark.parametrize("how", ["interleaved", "pre_registered"])
def test_write_at_t_matches_transformers_cache_replacement(fam, how):
    q = fam.chunk
    lens = [2 * q + 1, q + 2]
    pad = lens[0] - lens[1]
    for t in sorted({pad, q - 1, q, 2 * q - 1, 2 * q}):  # mid-chunk, chunk ends and starts, last token
        if t >= pad:
            _write_case(fam, lens, t, 0.25, fam.layers[-1], how)
    _write_case(fam, [q + 1], q // 2, -1.5, fam.layers[0], how)


@pytest.mark.parametrize("route", ["chunked", "recurrent"])
def test_a_write_on_one_row_matches_transformers_there_and_leaves_the_other_row(fam, route):
    """Issue 23's trial: in a left-padded batch, a state written on row 1 alone splits row 1 only. Row 1
    matches transformers writing that row's state (the oracle on the row alone, unpadded); row 0 and
    row 1's tokens through t are bitwise the run without the write."""
    q = fam.chunk
    lens = [2 * q + 1, q + 2]
    pad = lens[0] - lens[1]
    t, factor, layer = 2 * q - 1, 0.25, fam.layers[-1]
    prompts = fam.prompts_of(lens, seed=15)
    mixlens.route_kernels(fam.route_family, route)
    try:
        plain = np.asarray(fam.model.run(prompts)["logits"])
        with fam.model.trace(prompts) as tracer:
            mb = fam.model.layers[layer].linear_attn
            v = np.array(mb.state_after(t), dtype=np.float32)
            v[1] *= factor
            mb.set_state_after(t, v)
            out_state = np.array(mb.state_output)
        logits = np.asarray(tracer.logits)
    finally:
        mixlens.route_kernels(fam.route_family, "default")
    np.testing.assert_array_equal(logits[0], plain[0])
    np.testing.assert_array_equal(logits[1, : t + 1], plain[1, : t + 1])
    ref, ref_logits, R = _ref_write(fam, [prompts[1]], t - pad, factor, layer)
    err = rel_rms(logits[1:, pad:], ref_logits)
    assert err <= LOGIT_TOL, f"{fam.name} {route} row 1 written at t={t}: logits rel rms {err:.2e}"
    last = 1 if (R and fam.gdn) else R
    assert rel_rms(out_state[1:], ref[oq.key(mix(layer, "state_output"), last)]) <= STATE_TOL
    assert np.abs(logits[1, t + 1:] - plain[1, t + 1:]).max() > 1e-3  # the write did something


def test_write_changes_only_tokens_after_t_and_the_cache_follows(fam):
    prompts = fam.prompts_of([fam.chunk + 3], seed=9)
    t, layer = fam.chunk // 2, fam.layers[0]
    base = fam.model.run(prompts, saves=[mix(layer, "states")])
    # A write of the unchanged state: every value equals the plain run within float tolerance.
    same = fam.model.run(prompts, saves=[mix(layer, "states")], edits={f"{mix(layer, 'state')}@t{t}": lambda v: v})
    assert rel_rms(same["logits"], base["logits"]) <= LOGIT_TOL
    zero = fam.model.run(prompts, saves=[mix(layer, "states")], edits={f"{mix(layer, 'state')}@t{t}": lambda v: v * 0})
    assert rel_rms(zero["logits"][:, : t + 1], base["logits"][:, : t + 1]) <= LOGIT_TOL
    assert np.abs(zero["logits"][:, t + 1:] - base["logits"][:, t + 1:]).max() > 1e-3
    assert np.abs(zero[mix(layer, "states")][:, t]).max() == 0.0
    # The decode step after a write at the last prompt token equals writing its state_input.
    with fam.model.generate(prompts, max_new_tokens=2, eos_token_id=-1) as tr:
        mb = fam.model.layers[layer].linear_attn
        for step in tr.iter[:]:
            if step == 0:
                v = mb.state_after(-1) * 0.5
                mb.set_state_after(-1, v)
            else:
                step1 = fam.model.logits
    with fam.model.generate(prompts, max_new_tokens=2, eos_token_id=-1) as tr:
        mb = fam.model.layers[layer].linear_attn
        for step in tr.iter[:]:
            if step == 1:
                mb.state_input = v
                want = fam.model.logits
    np.testing.assert_array_equal(step1, want)


def test_two_writes_compose_in_token_order(fam):
    q = fam.chunk
    prompts = fam.prompts_of([2 * q + 1], seed=11)
    layer = fam.layers[-1]
    t1, t2 = q // 2, q + 1
    p = mix(layer, "state")
    both = fam.model.run(prompts, saves=[mix(layer, "states")],
                         edits={f"{p}@t{t1}": lambda v: v * 0.5, f"{p}@t{t2}": lambda v: v * 3.0})
    with fam.model.trace(prompts) as tracer:
        mb = fam.model.layers[layer].linear_attn
        mb.set_state_after(t1, mb.state_after(t1) * 0.5)
        mb.set_state_after(t2, mb.state_after(t2) * 3.0)
    assert rel_rms(tracer.logits, both["logits"]) <= LOGIT_TOL
    one = fam.model.run(prompts, saves=[mix(layer, "states")], edits={f"{p}@t{t1}": lambda v: v * 0.5})
    S1, S2 = one[mix(layer, "states")], both[mix(layer, "states")]
    assert rel_rms(S2[:, :t2], S1[:, :t2]) <= STATE_TOL
    assert rel_rms(S2[:, t2], 3.0 * S1[:, t2]) <= STATE_TOL


def test_token_loop_writes_and_errors(fam):
    prompts = fam.prompts_of([6], seed=12)
    la, lb = fam.layers
    with fam.model.trace(prompts) as tracer:
        for t in tracer.iter[:]:
            s = fam.model.layers[la].linear_attn.state
            fam.model.layers[la].linear_attn.state = s * 0.5  # every token's state halved in turn
    ref = fam.model.run(prompts, edits={f"{mix(la, 'state')}@t{t}": (lambda v: v * 0.5) for t in range(6)})
    assert rel_rms(tracer.logits, ref["logits"]) <= LOGIT_TOL
    # Layers inside the token loop go back in forward order: a clear OutOfOrderError.
    with pytest.raises(mixlens.OutOfOrderError, match="loop layers outside tokens"):
        with fam.model.trace(prompts) as tracer:
            for t in tracer.iter[:2]:
                fam.model.layers[la].linear_attn.state
                fam.model.layers[lb].linear_attn.state
    with pytest.raises(mixlens.InputError, match="tracer.iter"):
        with fam.model.trace(prompts):
            fam.model.layers[la].linear_attn.state
    with pytest.raises(mixlens.InputError, match="out of range"):
        with fam.model.trace(prompts):
            fam.model.layers[la].linear_attn.state_after(6)
    with pytest.raises(mixlens.WriteError, match="shape"):
        fam.model.run(prompts, edits={f"{mix(la, 'state')}@t1": np.zeros((1, 2), np.float32)})
    # A bad per-token state write names the token, as written (the value path alone would not say which)
    with fam.model.trace(prompts):
        with pytest.raises(mixlens.WriteError, match=r"linear_attn\.state@t2'.*shape"):
            fam.model.layers[la].linear_attn.set_state_after(2, np.zeros(3, np.float32))
        with pytest.raises(mixlens.WriteError, match=r"linear_attn\.state@t-1'.*(NaN|nan)"):
            s = fam.model.layers[la].linear_attn.state_after(-1)
            fam.model.layers[la].linear_attn.set_state_after(-1, np.full(tuple(s.shape), np.nan, np.float32))
    with pytest.raises(mixlens.UnknownValueError, match="per token"):
        fam.model.run(prompts, saves=[mix(la, "state")])


def test_support_and_values(fam):
    sup = fam.model.support()
    for name in ("linear_attn.state", "linear_attn.state_after", "linear_attn.set_state_after"):
        assert name in sup
    if fam.gdn:
        assert sup["linear_attn.state_after"][0] is None and "attention block" in sup["linear_attn.state_after"][1]
        assert fam.model.support(layer=1)["linear_attn.set_state_after"] is not None
        assert fam.model.support(layer=-1)["linear_attn.state_after"] is None
    else:
        assert sup["linear_attn.state_after"] is None
        assert fam.model.support(layer=0)["linear_attn.state"] is None
    per_token = {v["path"].split(".")[-1]: v["per_token"] for v in fam.model.values() if v["layer"] == fam.layers[0]}
    assert per_token["states"] and "state" not in per_token  # addressed per token, not a values() entry
    assert not per_token["state_input"] and not per_token["state_output"]
    assert "state_after" in dir(fam.model.layers[fam.layers[0]].linear_attn)


def test_a_scalar_state_write_fills_the_state_like_other_writes():
    """`set_state_after(t, 0.0)` and `edits={"...state@t2": 0.0}` broadcast the scalar, as betas writes do."""
    m = mixlens.load(output="numpy")  # the shipped Mamba-2
    prompt = "Once upon a time, there was"
    with m.trace(prompt):
        m.layers[1].linear_attn.set_state_after(2, 0.0)
        scalar = m.logits.save()
    with m.trace(prompt):
        s = m.layers[1].linear_attn.state_after(2)
        m.layers[1].linear_attn.set_state_after(2, np.zeros_like(s))
        zeros = m.logits.save()
    plain = m.run(prompt)["logits"]
    pre = m.run(prompt, edits={"layers.1.linear_attn.state@t2": 0.0})["logits"]
    np.testing.assert_array_equal(np.asarray(scalar), np.asarray(zeros))
    np.testing.assert_array_equal(np.asarray(pre), np.asarray(zeros))
    assert np.abs(np.asarray(zeros)[:, 3:] - np.asarray(plain)[:, 3:]).max() > 1e-3  # the write did something
    # tokens <= t: the same up to rounding (the scan is split at t)
    assert rel_rms(np.asarray(zeros)[:, :3], np.asarray(plain)[:, :3]) <= 1e-5



def _address(v) -> int:
    return v.data_ptr() if hasattr(v, "data_ptr") else v.__array_interface__["data"][0]


def test_a_states_stack_held_by_the_block_is_never_reused_for_the_next_layer(fam):
    """Issue 7 item 3: the forward writes a layer's `states` into the previous layer's stack once the block
    dropped it (tests/cpp/test_state_after.cpp counts the allocations); a stack the block still holds must
    keep its values, and a dropped-and-reused one must serve the right ones."""
    prompts = fam.prompts_of([2 * fam.chunk + 1, fam.chunk], seed=13)
    la, lb = fam.layers
    want = fam.model.run(prompts, saves=[mix(la, "states"), mix(lb, "states")])
    with fam.model.trace(prompts):
        s = fam.model.layers[la].linear_attn.states
        a_sum = float(np.asarray(s, dtype=np.float64).sum())
        del s
        s = fam.model.layers[lb].linear_attn.states
        np.testing.assert_array_equal(np.asarray(s), want[mix(lb, "states")])
        del s
    assert a_sum == float(np.asarray(want[mix(la, "states")], dtype=np.float64).sum())
    with fam.model.trace(prompts):
        kept = fam.model.layers[la].linear_attn.states
        other = fam.model.layers[lb].linear_attn.states
    assert _address(other) != _address(kept)
    np.testing.assert_array_equal(np.asarray(kept), want[mix(la, "states")])
    np.testing.assert_array_equal(np.asarray(other), want[mix(lb, "states")])


def test_states_and_per_token_state_of_one_layer_in_one_block_in_either_order():
    """Reading a layer's `states` and its per-token `state` in one block works either way round (issue 23;
    bitwise checks in test_invariance_scan.py); writing the per-token state after the stack was read
    fails with a message giving the rule and the reason; the pre-registered stack still works."""
    m = mixlens.load(output="numpy")  # the shipped Mamba-2
    prompt = "Once upon a time, there was"
    with m.trace(prompt):
        s2 = m.layers[1].linear_attn.state_after(2)
        st = m.layers[1].linear_attn.states
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(st)[:, 2])
    with m.trace(prompt):
        st = m.layers[1].linear_attn.states
        s2 = m.layers[1].linear_attn.state_after(2)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(st)[:, 2])
    with pytest.raises(mixlens.OutOfOrderError, match="written only before") as e:
        with m.trace(prompt):
            m.layers[1].linear_attn.states
            m.layers[1].linear_attn.set_state_after(2, 0.0)
    assert "the scan has ended" in str(e.value) or "written during the layer's scan" in str(e.value)
    with m.trace(prompt, saves=["layers.1.linear_attn.states"]) as tr:
        s2 = m.layers[1].linear_attn.state_after(2)
    assert rel_rms(s2, tr.saved["layers.1.linear_attn.states"][:, 2]) <= STATE_TOL
