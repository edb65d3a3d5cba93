"""Issue 10 item 3: several ``tracer.invoke`` blocks in one trace run as one batched forward, each with its own
prompt, reads and writes; compared with the same batch written by hand, and with nnsight's invokes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev.common import SHIPPED_MODEL, rel_rms

A, B = "Once upon a time, there was a little", "The cat sat"


@pytest.fixture(scope="module")
def ml():
    return mixlens.StandardizedTransformer(str(SHIPPED_MODEL), output="torch")


def test_invokes_batch_into_one_forward_with_their_own_rows(ml):
    with ml.trace() as tracer:
        with tracer.invoke(A):
            ha = ml.layers_output[2]
            pa = ml.next_token_probs
        with tracer.invoke([B, A]):
            hb = ml.layers_output[2]
            pb = ml.next_token_probs
    assert len(tracer.calls) == 1 and tracer.calls[0]["batch"] == 3
    with ml.trace([A, B, A]) as ref:
        h = ml.layers_output[2]
        p = ml.next_token_probs
    T = h.shape[1]
    assert ha.shape == (1, T, ml.hidden_size) and hb.shape == (2, T, ml.hidden_size)
    torch.testing.assert_close(ha, h[:1], rtol=0, atol=0)
    torch.testing.assert_close(hb, h[1:], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([pa, pb]), p, rtol=0, atol=0)
    torch.testing.assert_close(tracer.logits, ref.logits, rtol=0, atol=0)
    np.testing.assert_array_equal(tracer.attention_mask.numpy(), ref.attention_mask.numpy())


def test_patching_across_invokes_equals_the_batched_write(ml):
    with ml.trace() as tracer:
        with tracer.invoke(A):
            h = ml.layers_output[3][:, -1]
        with tracer.invoke(B):
            ml.layers_output[3][:, -1] = h  # h: read in the invoke above (a retry until it exists)
            pb = ml.next_token_probs
    with ml.trace([A, B]):
        x = ml.layers_output[3].clone()
        x[1, -1] = x[0, -1]
        ml.layers_output[3] = x
        p = ml.next_token_probs
    torch.testing.assert_close(pb[0], p[1], rtol=0, atol=0)
    assert (pb[0] - ml.run(B)["logits"][0, -1].softmax(-1)).abs().max() > 1e-4


def test_invoke_errors(ml):
    with pytest.raises(ZeroDivisionError):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                ml.layers_output[0]
                1 / 0
            with tracer.invoke(B):
                ml.logits
    with pytest.raises(mixlens.InputError, match="read and write values inside an invoke"):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                ml.logits
            ml.layers_output[0]
    with pytest.raises(mixlens.InputError, match="needs tracer.invoke"):
        with ml.trace():
            pass
    with pytest.raises(mixlens.OutOfOrderError):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                ml.layers_output[3]
                ml.layers_output[1]
    with pytest.raises(NameError, match="undefined_name"):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                ml.layers_output[0] = undefined_name  # noqa: F821
    # The model is free afterwards.
    assert ml.run(A)["logits"].shape[0] == 1


def test_stop_inside_an_invoke(ml):
    with ml.trace() as tracer:
        with tracer.invoke(A):
            h = ml.layers_output[0]
            tracer.stop()
        with tracer.invoke(B):
            ml.logits
    assert tracer.stopped and h.shape[0] == 1
    with pytest.raises(mixlens.InputError, match="stopped"):
        tracer.logits


def test_generate_with_invokes(ml):
    with ml.generate(max_new_tokens=4) as tracer:
        with tracer.invoke(A):
            ml.steer(1, torch.ones(ml.hidden_size), factor=3.0)
        with tracer.invoke(B):
            pass
    with ml.generate([A, B], max_new_tokens=4) as ref:
        h = ml.layers_output[1].clone()
        h[0] += 3.0
        ml.layers_output[1] = h
    assert tracer.tokens == ref.tokens


def test_invokes_match_nnsight(ml):
    nnterp = pytest.importorskip("nnterp")
    from nnterp.rename_utils import RenameConfig

    nn = nnterp.StandardizedTransformer(
        str(SHIPPED_MODEL), check_renaming=False, dispatch=True,
        rename_config=RenameConfig(layers_name="backbone.layers", attn_name="mixer", ignore_mlp=True,
                                   model_name="backbone"))
    vec = torch.linspace(-1, 1, ml.hidden_size)
    with nn.trace() as tracer:
        with tracer.invoke(A):
            nn.layers_output[2][:, -1] += vec
            na = nn.next_token_probs.save()
        with tracer.invoke(B):
            nb = nn.next_token_probs.save()
    with ml.trace() as tracer:
        with tracer.invoke(A):
            ml.layers_output[2][:, -1] += vec
            ma = ml.next_token_probs
        with tracer.invoke(B):
            mb = ml.next_token_probs
    # nnsight 0.6 hands each invoke the model output of the whole batch here; mixlens its own rows.
    na, nb = na.detach().numpy(), nb.detach().numpy()
    assert rel_rms(ma.numpy()[0], na[0]) < 1e-4
    assert rel_rms(mb.numpy()[0], nb[-1]) < 1e-4
    assert rel_rms(ma.numpy()[0], ml.run(A)["logits"][0, -1].softmax(-1).numpy()) > 1e-4  # the write counted
