"""Issue 10 item 3: nnterp's surface on mixlens, workflow by workflow, against nnterp 1.3.0 (nnsight 0.6.3,
the newest nnsight that nnterp 1.3.0 imports with; requirements-dev.txt) running transformers 5.18 on
the same checkpoint (the shipped Mamba-2). nnterp needs a RenameConfig for Mamba-2 (layers under
``backbone.layers``, the mixer as its "attention") and check_renaming=False (it looks for
``embed_tokens`` under names Mamba-2 does not use)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev.common import SHIPPED_MODEL, rel_rms

nnterp = pytest.importorskip("nnterp")
from nnterp.interventions import TargetPrompt as NnTargetPrompt  # noqa: E402
from nnterp.interventions import logit_lens as nn_logit_lens  # noqa: E402
from nnterp.interventions import patchscope_generate as nn_patchscope_generate  # noqa: E402
from nnterp.interventions import patchscope_lens as nn_patchscope_lens  # noqa: E402
from nnterp.rename_utils import RenameConfig  # noqa: E402

from mixlens import interventions as ml_iv  # noqa: E402

PROMPTS = ["Once upon a time, there was a little", "The cat sat"]
TOL = 1e-5  # relative RMS, float32 against float32 torch
TOL_LOGITS = 1e-4


@pytest.fixture(scope="module")
def nn():
    torch.manual_seed(0)
    return nnterp.StandardizedTransformer(
        str(SHIPPED_MODEL), check_renaming=False, dispatch=True,
        rename_config=RenameConfig(layers_name="backbone.layers", attn_name="mixer", ignore_mlp=True,
                                   model_name="backbone"))


@pytest.fixture(scope="module")
def ml():
    return mixlens.StandardizedTransformer(str(SHIPPED_MODEL), output="torch")


def close(got, ref, tol=TOL):
    got, ref = np.asarray(torch.as_tensor(got).detach()), np.asarray(torch.as_tensor(ref).detach())
    err = rel_rms(got, ref)
    assert err < tol, f"relative RMS {err:.3g} >= {tol}"


def test_sizes_and_weights(nn, ml):
    assert (ml.num_layers, ml.hidden_size, ml.vocab_size) == (nn.num_layers, nn.hidden_size, nn.vocab_size)
    hf = nn._model
    np.testing.assert_array_equal(ml.lm_head.weight.numpy(), hf.lm_head.weight.detach().numpy())
    np.testing.assert_array_equal(ml.embed_tokens.weight.numpy(), hf.backbone.embeddings.weight.detach().numpy())
    np.testing.assert_array_equal(ml.ln_final.weight.numpy(), hf.backbone.norm_f.weight.detach().numpy())


def test_layer_values_logits_probs_and_mask(nn, ml):
    L = nn.num_layers
    n_in, n_attn, n_out = [], [], []  # nnsight: lists made outside the block come back filled
    with nn.trace(PROMPTS):
        n_mask = nn.attention_mask.save()  # nnsight: the inputs come first
        for i in range(L):
            n_in.append(nn.layers_input[i].save())
            n_attn.append(nn.attentions_output[i].save())
            n_out.append(nn.layers_output[i].save())
        n_logits = nn.logits.save()
        n_probs = nn.next_token_probs.save()
    with ml.trace(PROMPTS) as tracer:
        m_in, m_attn, m_out = [], [], []
        for i in range(L):
            m_in.append(ml.layers_input[i])
            m_attn.append(ml.attentions_output[i])
            m_out.append(ml.layers_output[i])
        m_logits = ml.logits
        m_probs = ml.next_token_probs
        m_mask = ml.attention_mask
    np.testing.assert_array_equal(m_mask.numpy(), n_mask.numpy())
    mask = n_mask.bool()
    for i in range(L):  # real tokens only: padded positions are not part of the contract
        close(m_in[i][mask], n_in[i][mask])
        close(m_attn[i][mask], n_attn[i][mask])
        close(m_out[i][mask], n_out[i][mask])
    close(m_logits[mask], n_logits[mask], TOL_LOGITS)
    close(m_probs, n_probs, TOL_LOGITS)
    close(tracer.logits[mask], n_logits[mask], TOL_LOGITS)


def test_steer(nn, ml):
    vec = torch.linspace(-1, 1, nn.hidden_size)
    with nn.trace(PROMPTS[0]):
        nn.steer(layers=[1, 3], steering_vector=vec, factor=2.0, positions=[2, 4])
        n_logits = nn.logits.save()
    with ml.trace(PROMPTS[0]):
        ml.steer(layers=[1, 3], steering_vector=vec, factor=2.0, positions=[2, 4])
        m_logits = ml.logits
    close(m_logits, n_logits, TOL_LOGITS)
    base = ml.run(PROMPTS[0])["logits"]
    assert rel_rms(m_logits.numpy(), base.numpy()) > 1e-3


def test_skip_layers(nn, ml):
    nn.detect_layer_output_type()
    with nn.trace(PROMPTS[0]):
        nn.skip_layer(2)
        a = nn.logits.save()
    with nn.trace(PROMPTS[0]):
        nn.skip_layers(1, 3)
        b = nn.logits.save()
    with ml.trace(PROMPTS[0]):
        ml.skip_layer(2)
        ma = ml.logits
    with ml.trace(PROMPTS[0]):
        ml.skip_layers(1, 3)
        mb = ml.logits
    close(ma, a, TOL_LOGITS)
    close(mb, b, TOL_LOGITS)


def test_project_on_vocab(nn, ml):
    with nn.trace(PROMPTS[0]):
        h = nn.layers_output[2].save()
        proj = nn.project_on_vocab(nn.layers_output[2]).save()
    close(ml.project_on_vocab(h), proj, TOL_LOGITS)
    close(ml.project_on_vocab(h.detach().numpy()), proj, TOL_LOGITS)
    with pytest.raises(mixlens.InputError, match=r"\[\.\.\., 256\]"):
        ml.project_on_vocab(torch.zeros(3, 7))


def test_inplace_write_matches_nnterp(nn, ml):
    x = torch.linspace(-2, 2, nn.hidden_size)
    with nn.trace(PROMPTS[0]):
        nn.layers_output[1][:, 3] = x
        n_logits = nn.logits.save()
    with ml.trace(PROMPTS[0]):
        ml.layers_output[1][:, 3] = x
        m_logits = ml.logits
    close(m_logits, n_logits, TOL_LOGITS)


def test_logit_lens(nn, ml):
    n = nn_logit_lens(nn, PROMPTS)
    m = ml_iv.logit_lens(ml, PROMPTS)
    assert m.shape == n.shape == (2, nn.num_layers, nn.vocab_size)
    close(m, n, TOL_LOGITS)
    n_p, n_inv = nn_logit_lens(nn, PROMPTS, return_inv_logits=True)
    m_p, m_inv = ml_iv.logit_lens(ml, PROMPTS, return_inv_logits=True)
    close(m_inv, n_inv, TOL_LOGITS)


def test_patchscope_lens(nn, ml):
    target = NnTargetPrompt("cat cat\ndog dog\n?", -1)
    n = nn_patchscope_lens(nn, source_prompts=PROMPTS, target_patch_prompts=target, layers=[0, 2, 5])
    m = ml_iv.patchscope_lens(ml, source_prompts=PROMPTS, target_patch_prompts=ml_iv.TargetPrompt(target.prompt, -1),
                              layers=[0, 2, 5])
    assert m.shape == n.shape == (2, 3, nn.vocab_size)
    close(m, n, TOL_LOGITS)


def test_patchscope_generate(nn, ml):
    target = NnTargetPrompt("cat cat\ndog dog\n?", -1)
    # Every layer: nnterp 1.3.0 indexes its hidden states by layer number, so a subset of layers fails there.
    n = nn_patchscope_generate(nn, PROMPTS, target, max_length=6)
    m = ml_iv.patchscope_generate(ml, PROMPTS, ml_iv.TargetPrompt(target.prompt, -1), max_length=6)
    assert sorted(m) == sorted(n) == list(range(nn.num_layers))
    for layer in m:
        np.testing.assert_array_equal(m[layer].numpy(), n[layer].numpy())
