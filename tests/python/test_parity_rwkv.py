"""Live parity of RWKV-4 with transformers 5.18 (RwkvForCausalLM in eval mode, rwkv_linear_attention_cpu) on
tiny random checkpoints transformers writes here: every value of a prompt and 7 decode steps (oracle_rwkv,
itself checked against transformers' forward and generate), edits vs transformers with the same edit, left
padding vs per-row runs (transformers ignores attention_mask for RWKV). Gradients: test_grad_rwkv.py.

Tolerance: relative RMS <= 1e-4 on logits, 3e-5 on values (float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import rel_rms
from mixlens_dev.parity import (check_edit, check_every_value, check_greedy_tokens,
                                check_padded_rows_alone, live_case)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mixlens_dev import oracle_rwkv as orw  # noqa: E402
from mixlens_dev.fixtures import make_prompts, mix  # noqa: E402
from mixlens_dev.fixtures import rwkv as frw  # noqa: E402

CASES = {
    "rescale_every_1": dict(seed=71, config=dict(num_hidden_layers=3, rescale_every=1), lens=[10],
                            edit=dict(name="keys_half", path=mix(1, "attention_keys"), step=0, op="scale", factor=0.5)),
    "batch_no_rescale": dict(seed=72, config=dict(num_hidden_layers=2, rescale_every=0, intermediate_size=40),
                             lens=[7, 7],
                             edit=dict(name="state_in", path=mix(0, "state_input"), step=2, op="scale", factor=0.5)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return live_case(CASES[request.param], request.param, tmp_path_factory, frw.build_model, orw.run, make_prompts)


def test_every_value_every_step(case):
    check_every_value(case, "rwkv")


def test_greedy_tokens(case):
    check_greedy_tokens(case)


def test_edit_matches_transformers_with_the_same_edit(case):
    check_edit(case, orw.run, "rwkv")


def test_left_padded_rows_equal_their_own_runs(case):
    check_padded_rows_alone(case, make_prompts)


def test_state_after_reads_and_writes_follow_the_recurrence(case):
    """state_after(t) is transformers' state after token t re-laid (oracle states); set_state_after(t, v) with
    a new num | den | max continues as the WKV recurrence (oracle_rwkv.wkv) from v over the same k, v, w."""
    m, tm = case["model"], case["torch_model"]
    p = case["prompts"]
    A, t = tm.config.attention_hidden_size, 3
    ref = case["ref"][f"{mix(1, 'states')}@step0"]
    with m.trace(p) as tr:
        la = m.layers[1].linear_attn
        k, v, w = la.attention_keys, la.attention_values, la.decays
        s = la.state_after(t)
        assert rel_rms(s, ref[:, t]) <= 3e-5
        new = s.copy()
        new[:, :A] = new[:, :A] * 2 + 0.25
        la.set_state_after(t, new)
        y = la.attention_head_outputs
    st = torch.tensor(new)
    want, _, _ = orw.wkv(torch.tensor(k[:, t + 1:]), torch.tensor(v[:, t + 1:]), torch.tensor(w[:, t + 1:]),
                         tm.rwkv.blocks[1].attention.time_first.detach(), st[:, :A], st[:, A:2 * A], st[:, 2 * A:3 * A])
    assert rel_rms(y[:, t + 1:], want.numpy()) <= 1e-6
    assert np.abs(y[:, t + 1:] - case["ref"][f"{mix(1, 'attention_head_outputs')}@step0"][:, t + 1:]).max() > 1e-3


def test_attention_hidden_size_other_than_hidden_size(tmp_path):
    """attention_hidden_size 24 beside hidden 32: transformers runs it on a prompt without a cache (its cache is
    sized hidden_size, so generation fails there); mixlens' prompt logits and [B, 3A + 2D] state follow."""
    tm = frw.build_model(dict(seed=73, config=dict(num_hidden_layers=2, attention_hidden_size=24, rescale_every=1)))
    tm.save_pretrained(str(tmp_path))
    ids = make_prompts(73, [11], tm.config.vocab_size)
    with torch.no_grad():
        want = tm(torch.tensor(ids), use_cache=False).logits.numpy()
    run = mixlens.StandardizedTransformer(str(tmp_path)).generate(
        ids, max_new_tokens=1, eos_token_id=-1, saves=["logits", mix(1, "state_output")]).run()
    assert rel_rms(np.asarray(run.saved["logits"][0]), want) <= 1e-4
    assert np.asarray(run.saved[mix(1, "state_output")][0]).shape == (1, 3 * 24 + 2 * 32)


def test_transformer_lens_names_map_the_residual_stream_only(case):
    """TL 4.3's RWKV-4 adapter: hook_resid_post is the block's output before transformers' halving, so it maps only
    on blocks not followed by one; its blocks have no hook_mlp_out (channel mixing is hook_channel_mix_out, mapped
    to mlp.output: tests/python/test_tl_names.py)."""
    m, every = case["model"], case["torch_model"].config.rescale_every
    if every > 0 and 2 % every == 0:
        with pytest.raises(mixlens.UnknownValueError, match=r"2 \* layers\.1\.layer_output"):
            m.run(case["prompts"], saves=["blocks.1.hook_resid_post"])
    else:
        out = m.run(case["prompts"], saves=["blocks.1.hook_resid_post", "layers.1.layer_output"])
        assert np.array_equal(out["blocks.1.hook_resid_post"], out["layers.1.layer_output"])
    with pytest.raises(mixlens.UnknownValueError, match="RWKV-4 blocks have no mixlens alias for 'hook_mlp_out'"):
        m.run(case["prompts"], saves=["blocks.1.hook_mlp_out"])
