"""Issue 10 item 3 on a hybrid (the shipped Qwen3.5-style model): attention probabilities of the softmax
attention blocks, project_on_vocab through Qwen's (1 + w) RMSNorm, head weights and the nnterp
accessors per block kind, against transformers 5.18 directly (eager attention, output_attentions;
nnterp's renaming does not cover the hybrid's two mixer kinds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev.common import REPO, rel_rms

MODEL = REPO / "models" / "qwen3_5-tinystories"
PROMPTS = ["Once upon a time, there was a little", "The cat sat"]


@pytest.fixture(scope="module")
def ml():
    return mixlens.StandardizedTransformer(str(MODEL), output="torch")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(MODEL), attn_implementation="eager", dtype=torch.float32)
    return m.eval()


def hf_batch(ml):
    rows = [ml.tokenizer.encode(p) for p in PROMPTS]
    T = max(map(len, rows))
    pad = 0
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_attention_probabilities_match_eager_attention(ml, hf):
    ids, mask = hf_batch(ml)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    attn_layers = [i for i, k in enumerate(ml.info["layer_kinds"]) if k == "attention"]
    assert attn_layers == [2, 5]
    with ml.trace(PROMPTS) as tracer:
        probs = {i: ml.attention_probabilities[i] for i in attn_layers}
    np.testing.assert_array_equal(tracer.attention_mask.numpy(), mask.numpy())
    real = mask.bool()
    # transformers 5.18 returns weights for the attention blocks only (the DeltaNet blocks have none).
    assert len(out.attentions) == len(attn_layers)
    for k, i in enumerate(attn_layers):
        ref = out.attentions[k]
        assert ref is not None and probs[i].shape == ref.shape  # [B, heads, T, T]
        # Real query rows only: transformers' eager softmax gives padded query rows a uniform-ish row
        # over masked keys; mixlens gives 0 (SDPA's safe softmax), neither is read by a real token.
        for b in range(ids.shape[0]):
            q = real[b]
            got, want = probs[i][b][:, q], ref[b][:, q]
            assert rel_rms(got.numpy(), want.numpy()) < 1e-5
        np.testing.assert_allclose(probs[i][real.unsqueeze(1).expand(-1, probs[i].shape[1], -1)].sum(-1).numpy(), 1,
                                   rtol=1e-5)
    # Recurrent blocks have no attention probabilities: an error naming the block's kind.
    with pytest.raises(mixlens.UnknownValueError, match="linear_attn"):
        with ml.trace(PROMPTS):
            ml.attention_probabilities[0]


def test_attention_probabilities_on_a_decode_step_and_read_only(ml):
    with ml.generate(PROMPTS[0], max_new_tokens=3) as tracer:
        shapes = []
        for step in tracer.iter[:]:
            shapes.append(tuple(ml.attention_probabilities[2].shape))
    T = len(ml.tokenizer.encode(PROMPTS[0]))
    H = shapes[0][1]
    assert shapes == [(1, H, T, T), (1, H, 1, T + 1), (1, H, 1, T + 2)]
    with pytest.raises(mixlens.WriteError, match="read-only"):
        with ml.trace(PROMPTS[0]):
            ml.layers[2].self_attn.attention_probabilities = torch.zeros(1)


def test_project_on_vocab_and_weights(ml, hf):
    ids, mask = hf_batch(ml)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h = out.hidden_states[3]  # the residual stream leaving block 2
        want = hf.lm_head(hf.model.norm(h))
    got = ml.project_on_vocab(h)
    real = mask.bool()
    assert rel_rms(got[real].numpy(), want[real].numpy()) < 1e-5
    np.testing.assert_array_equal(ml.ln_final.weight.numpy(), hf.model.norm.weight.detach().numpy())
    np.testing.assert_array_equal(ml.embed_tokens.weight.numpy(), hf.model.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(ml.lm_head.weight.numpy(), hf.lm_head.weight.detach().numpy())


def test_attentions_and_mlps_output_follow_the_block_kind(ml, hf):
    ids, mask = hf_batch(ml)
    got = {}
    with ml.trace(PROMPTS):
        for i in range(ml.num_layers):
            got[i] = (ml.attentions_output[i], ml.mlps_output[i], ml.layers_output[i])
    with ml.trace(PROMPTS):
        ref = {i: (getattr(ml.layers[i], "self_attn" if ml.info["layer_kinds"][i] == "attention" else "linear_attn")
                   .attention_output, ml.layers[i].mlp.output) for i in range(ml.num_layers)}
    with torch.no_grad():
        hs = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    real = mask.bool()
    for i in range(ml.num_layers):
        torch.testing.assert_close(got[i][0], ref[i][0], rtol=0, atol=0)
        torch.testing.assert_close(got[i][1], ref[i][1], rtol=0, atol=0)
        if i < ml.num_layers - 1:  # transformers' last hidden state is after the final norm
            assert rel_rms(got[i][2][real].numpy(), hs[i + 1][real].numpy()) < 1e-5


@pytest.mark.parametrize("family,config", [
    ("nemotron_h", dict(hybrid_override_pattern="M*-M")),
    ("bamba", dict(mamba_chunk_size=4)),
    ("falcon_h1", dict()),  # every µP multiplier away from 1: lm_head_multiplier in project_on_vocab
])
def test_mamba2_hybrids_attention_probabilities_and_projection(family, config, tmp_path):
    from mixlens_dev.fixtures import hybrids as mh

    model = mh.build_model(family, config, seed=61)
    model.save_pretrained(tmp_path)
    hf = type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompts = mh.prompts_for([11, 6], 61, hf.config.vocab_size)
    T = 11
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    ml = mixlens.StandardizedTransformer(str(tmp_path), output="torch")
    attn_layers = [i for i in range(ml.num_layers) if "self_attn" in dir(ml.layers[i])]
    assert attn_layers
    with ml.trace(prompts) as tracer:
        probs = {i: ml.attention_probabilities[i] for i in attn_layers}
    got_attn = [a for a in out.attentions if a is not None]
    assert len(got_attn) == len(attn_layers)
    real = mask.bool()
    for k, i in enumerate(attn_layers):
        for b in range(2):
            assert rel_rms(probs[i][b][:, real[b]].numpy(), got_attn[k][b][:, real[b]].numpy()) < 1e-5, (family, i)
    # project_on_vocab of the last block's output is the model's logits (final norm, head, multiplier).
    with ml.trace(prompts) as tracer:
        last = ml.layers_output[ml.num_layers - 1]
    proj = ml.project_on_vocab(last)
    assert rel_rms(proj[real].numpy(), tracer.logits[real].numpy()) < 1e-5
    assert rel_rms(proj[real].numpy(), out.logits[real].numpy()) < 1e-4
