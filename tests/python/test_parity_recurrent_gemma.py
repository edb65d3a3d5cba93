"""Live parity of RecurrentGemma (RG-LRU recurrent blocks + local MQA attention) with transformers
5.18 (pure torch) on tiny random checkpoints transformers writes here: prompt logits, greedy decode
through the cache, a continuation, the RG-LRU values and per-token states against an explicit
recurrence over transformers' own conv output, state writes, padding, and local attention past
attention_window_size (a window_8 case runs every test past it; gradients: test_grad_recurrent_gemma.py).

Padding: transformers runs the recurrent block's conv over the padding positions' linear_x outputs
(nothing masks them), so in transformers a left-padded row differs from the same row alone; mixlens
zeroes those inputs, and a padded row equals the row alone, which equals transformers' unpadded row.
Tolerance: relative RMS <= 1e-4 on logits, 3e-5 on values (float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
            lru_width=48, conv1d_width=4, attention_window_size=48, pad_token_id=0, bos_token_id=2, eos_token_id=1)
CASES = {
    # recurrent, recurrent, attention, recurrent: both block kinds and a second cycle of block_types.
    "griffin_4layers": dict(seed=3, config=dict(BASE, num_hidden_layers=4)),
    # lru_width = hidden_size, conv width 3, attention first, untied head.
    "attention_first": dict(seed=11, config=dict(BASE, num_hidden_layers=3, lru_width=32, conv1d_width=3,
                                                  block_types=["attention", "recurrent"], tie_word_embeddings=False)),
    # A window of 8 keys: the prompts (up to 30 tokens) and decode steps of every test run past it.
    "window_8": dict(seed=5, config=dict(BASE, num_hidden_layers=4, attention_window_size=8)),
}


def perturb(model):
    """Away from transformers' init (biases 0, norms 0, small projections) so that a misuse shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
            if "linear_" in name or "proj" in name:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    torch.manual_seed(spec["seed"])
    cfg = transformers.RecurrentGemmaConfig(**spec["config"])
    model = perturb(transformers.RecurrentGemmaForCausalLM(cfg).eval())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return dict(name=request.param, torch_model=model, model=mixlens.StandardizedTransformer(str(path)), config=cfg)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, size=n).tolist() for n in lengths]


def torch_logits(model, row):
    with torch.no_grad():
        return model(input_ids=torch.tensor([row])).logits.numpy()[0]


def test_prompt_logits_match_and_padding_is_invisible(case):
    rows = prompts(1, [21, 7])
    got = case["model"].run(rows)["logits"]
    for b, r in enumerate(rows):
        want = torch_logits(case["torch_model"], r)
        assert rel_rms(got[b, -len(r):], want) <= 1e-4
        alone = case["model"].run([r])["logits"][0]
        assert rel_rms(alone, got[b, -len(r):]) <= 1e-5


def test_transformers_left_padding_feeds_the_conv(case):
    """What the module docstring says: in transformers the padded row differs from the row alone."""
    rows = prompts(1, [21, 7])
    ids = torch.tensor([rows[0], [0] * 14 + rows[1]])
    mask = torch.tensor([[1] * 21, [0] * 14 + [1] * 7])
    with torch.no_grad():
        padded = case["torch_model"](input_ids=ids, attention_mask=mask).logits.numpy()[1, 14:]
    assert rel_rms(padded, torch_logits(case["torch_model"], rows[1])) > 1e-3


def test_greedy_decode_matches_transformers(case):
    row = prompts(2, [12])[0]
    with torch.no_grad():
        out = case["torch_model"].generate(input_ids=torch.tensor([row]), max_new_tokens=8, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    want = out[:, len(row):].tolist()
    tracer = case["model"].generate([row], max_new_tokens=8, eos_token_id=-1).run()
    assert [list(t) for t in np.asarray(tracer.tokens).tolist()] == want


def test_left_padded_greedy_decode_equals_each_row_alone(case):
    rows = prompts(7, [13, 5])
    both = np.asarray(case["model"].generate(rows, max_new_tokens=7, eos_token_id=-1).run().tokens).tolist()
    for b, r in enumerate(rows):
        alone = np.asarray(case["model"].generate([r], max_new_tokens=7, eos_token_id=-1).run().tokens).tolist()
        assert both[b] == alone[0]


def test_continuation_and_decode_steps_equal_one_call(case):
    row = prompts(3, [30])[0]
    whole = case["model"].run([row])["logits"]
    cache = case["model"].new_cache(1)
    parts = [case["model"].forward([row[:9]], cache=cache)["logits"], case["model"].forward([row[9:20]], cache=cache)["logits"]]
    parts += [case["model"].forward([[t]], cache=cache)["logits"] for t in row[20:]]
    assert rel_rms(np.concatenate(parts, axis=1), whole) <= 1e-5


def rec_layers(case):
    return [i for i, k in enumerate(case["config"].layers_block_type) if k == "recurrent"]


def test_values_match_the_modules_and_an_explicit_recurrence(case):
    """attention_values is the conv output transformers' RG-LRU receives; betas / decays / every
    per-token state and the head outputs follow from it by the RG-LRU written out here."""
    i = rec_layers(case)[0]
    p = f"layers.{i}.linear_attn."
    row = prompts(4, [19])[0]
    names = ["attention_values", "betas", "decays", "states", "state_output", "attention_head_outputs", "attention_output"]
    got = case["model"].run([row], saves=[p + n for n in names] + [f"layers.{i}.mlp.output"])
    blk = case["torch_model"].model.layers[i].temporal_block
    seen = {}
    hooks = [blk.rg_lru.register_forward_hook(lambda m, a, o: seen.update(u=a[0], h=o)),
             blk.register_forward_hook(lambda m, a, o: seen.update(out=o[0])),
             blk.linear_x.register_forward_hook(lambda m, a, o: seen.update(x=o)),
             case["torch_model"].model.layers[i].mlp_block.register_forward_hook(lambda m, a, o: seen.update(mlp=o))]
    try:
        with torch.no_grad():
            case["torch_model"](input_ids=torch.tensor([row]))
    finally:
        for h in hooks:
            h.remove()
    u = seen["u"][0].numpy().astype(np.float64)
    assert rel_rms(got[p + "attention_values"][0], u) <= 3e-5
    assert rel_rms(got[p + "attention_head_outputs"][0], seen["h"][0].numpy()) <= 3e-5
    assert rel_rms(got[p + "attention_output"][0], seen["out"][0].numpy()) <= 3e-5
    assert rel_rms(got[f"layers.{i}.mlp.output"][0], seen["mlp"][0].numpy()) <= 3e-5
    # The RG-LRU in float64 from the module's parameters.
    lru = blk.rg_lru
    H, bw = lru.input_gate_weight.shape[:2]
    ub = u.reshape(len(row), H, bw)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))
    ig = sig(np.einsum("thi,hij->thj", ub, lru.input_gate_weight.detach().double().numpy())
             + lru.input_gate_bias.detach().double().numpy()).reshape(len(row), -1)
    rg = sig(np.einsum("thi,hij->thj", ub, lru.recurrent_gate_weight.detach().double().numpy())
             + lru.recurrent_gate_bias.detach().double().numpy()).reshape(len(row), -1)
    loga = -8.0 * rg * np.log1p(np.exp(lru.recurrent_param.detach().double().numpy()))
    assert rel_rms(got[p + "betas"][0], ig) <= 3e-5
    assert rel_rms(got[p + "decays"][0], loga) <= 3e-5
    assert (got[p + "decays"] <= 0).all()
    K = blk.conv1d_width
    x = seen["x"][0].numpy()
    h = np.zeros(u.shape[1])
    states = got[p + "states"][0]
    assert states.shape == (len(row), K, u.shape[1])
    for t in range(len(row)):
        a = 0.0 if t == 0 else np.exp(loga[t])
        mult = 1.0 if t == 0 else np.sqrt(1 - np.exp(2 * loga[t]))
        h = a * h + mult * ig[t] * u[t]
        window = np.stack([x[j] if j >= 0 else np.zeros_like(x[0]) for j in range(t - K + 2, t + 1)])
        assert rel_rms(states[t, K - 1], h) <= 3e-5, t
        assert rel_rms(states[t, : K - 1], window) <= 3e-5, t
    np.testing.assert_array_equal(states[-1], got[p + "state_output"][0])


def test_state_write_equals_a_continuation_from_that_state(case):
    """Writing the state after token t (h and the conv window) gives what a fresh call continuing from
    that state gives: the window's change reaches the following tokens' conv."""
    i = rec_layers(case)[0]
    row = prompts(5, [16])[0]
    m = case["model"]
    path = f"layers.{i}.linear_attn.state@t7"
    base = m.run([row], saves=[path])[path]
    new = (np.asarray(base) * 0.5 + 0.1).astype(np.float32)
    out = m.run([row], edits={path: lambda v: new})["logits"]
    # The same from a cache: the first 8 tokens, the state replaced at the call's end, the rest.
    cache = m.new_cache(1)
    m.forward([row[:8]], cache=cache, edits={f"layers.{i}.linear_attn.state_output": lambda v: new})
    after = m.forward([row[8:]], cache=cache)["logits"]
    assert rel_rms(out[:, 8:], after) <= 1e-5
    assert rel_rms(out[:, 8:], m.run([row])["logits"][:, 8:]) > 1e-4  # the write mattered
    assert rel_rms(out[:, :8], m.run([row])["logits"][:, :8]) == 0.0  # and changed nothing before


def test_attention_past_the_window_matches_transformers(case):
    """Local attention sees the last attention_window_size keys (its own included) on a prompt longer than
    the window and on decode steps continuing it; the cache keeps the last window - 1 keys (a decode
    step's attention probabilities span window keys), as transformers' sliding-window cache layer."""
    w = case["config"].attention_window_size
    row = prompts(6, [w + 13])[0]
    tm, tkv = case["torch_model"], transformers.DynamicCache(config=case["config"])
    with torch.no_grad():
        out = tm(input_ids=torch.tensor([row]), position_ids=torch.arange(len(row))[None], past_key_values=tkv,
                 use_cache=True)
    assert rel_rms(case["model"].run([row])["logits"][0], out.logits.numpy()[0]) <= 1e-4
    cache = case["model"].new_cache(1)
    case["model"].forward([row], cache=cache)
    j = case["config"].layers_block_type.index("attention")
    tok = int(out.logits[0, -1].argmax())
    for step in range(6):
        with torch.no_grad():
            want = tm(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[len(row) + step]]),
                      past_key_values=tkv, use_cache=True).logits.numpy()[0]
        got = case["model"].forward([[tok]], cache=cache, saves=[f"layers.{j}.self_attn.attention_probabilities"])
        assert rel_rms(got["logits"][0], want) <= 1e-4, step
        assert got[f"layers.{j}.self_attn.attention_probabilities"].shape[-1] == w, step
        tok = int(want[-1].argmax())


def test_the_chunked_route_is_refused_not_ignored(case):
    with pytest.raises(mixlens.UnsupportedError, match="no chunked kernel"):
        mixlens.route_kernels("recurrent_gemma", "chunked")
    default = case["model"].run([[5, 6, 7]])["logits"]
    mixlens.route_kernels("recurrent_gemma", "recurrent")  # the one kernel, forced: the same numbers
    try:
        np.testing.assert_array_equal(case["model"].run([[5, 6, 7]])["logits"], default)
    finally:
        mixlens.route_kernels("recurrent_gemma", "default")


def test_layer_kinds_and_kernel_identity_name_the_rg_lru(case):
    kinds = case["model"].info["layer_kinds"]
    assert kinds == ["rg_lru" if k == "recurrent" else "attention" for k in case["config"].layers_block_type]
    ident = case["model"]._core.mixer_identity(rec_layers(case)[0], 16)
    assert ident["kind"] == "rg_lru" and ident["state_op"] == "rg_lru_step"


def test_support_and_state_layout(case):
    s = case["model"].support()
    i = rec_layers(case)[0]
    j = case["config"].layers_block_type.index("attention")
    assert s["linear_attn.decays"][i] is None
    assert "diagonal" in s["linear_attn.attention_queries"][i]
    assert "local attention block" in s["linear_attn.decays"][j]
    assert "RG-LRU" in s["self_attn.attention_output"][i]


def test_writes_the_reset_discards_are_errors_not_no_ops(case):
    """At a sequence's first token the RG-LRU resets (a_t = 0): a decays write there, or an h written
    into the state before it, would change nothing, so each is a WriteError; the same writes one
    token later take effect."""
    i = rec_layers(case)[0]
    m = case["model"]
    row = prompts(5, [6])[0]
    p = f"layers.{i}.linear_attn."

    def decays_at(t):
        def edit(v):
            v = np.array(v)
            v[:, t] = -5.0
            return v
        return edit

    with pytest.raises(mixlens.WriteError, match="resets"):
        m.run([row], edits={p + "decays": decays_at(0)})
    assert rel_rms(m.run([row], edits={p + "decays": decays_at(1)})["logits"], m.run([row])["logits"]) > 0

    cache = m.new_cache(1)
    m.forward([row[:3]], cache=cache)
    state = np.asarray(m.run([row[:3]], saves=[p + "state_output"])[p + "state_output"])

    def h_only(v):
        v = np.zeros_like(state)
        v[:, -1] = 0.5  # row K-1 is h
        return v

    with pytest.raises(mixlens.WriteError, match="resets h"):
        m.run([row], edits={p + "state_input": h_only})
    # On a continuation (position 3, no reset) the same write is taken.
    out = m.forward([row[3:]], cache=cache, edits={p + "state_input": h_only})["logits"]
    cache2 = m.new_cache(1)
    m.forward([row[:3]], cache=cache2)
    assert rel_rms(out, m.forward([row[3:]], cache=cache2)["logits"]) > 0


@pytest.mark.parametrize("name", ["griffin", "attention_first", "padded_batch"])
def test_committed_goldens_are_the_oracles_live_capture(name):
    """tests/fixtures/recurrent_gemma (scripts/make_fixtures.py) is what the oracle captures today,
    edits included: a transformers change, or an oracle change not rebuilt into the fixtures, fails here."""
    from mixlens_dev import fixtures, oracle_recurrent_gemma as org
    from mixlens_dev.fixtures import recurrent_gemma as frg

    case, model, golden = fixtures.load_committed("recurrent_gemma", name, transformers.RecurrentGemmaForCausalLM)
    live, _ = org.run(model, case["prompts"], frg.PAD, case["n_steps"])
    feeds = case["feeds"]
    for e in case["edits"]:
        ev, _ = org.run(model, case["prompts"], frg.PAD, case["n_steps"], edits=[e], feeds=feeds, record=False)
        live.update({f"edit/{e['name']}/{k}": v for k, v in ev.items() if k.startswith("logits@")})
    fixtures.assert_matches_golden(live, golden)
