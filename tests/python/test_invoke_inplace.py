"""In-place edits inside ``tracer.invoke`` bodies (issue 10 item 2 for invokes, mixlens._inplace LiveValues):
the value read last is live (an edit is a write of the invoke's rows), a value the body moved past raises
WriteError when edited, and after the trace every value is an ordinary array again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev.common import SHIPPED_MODEL

A, B = "Once upon a time, there was a little", "The cat sat"


@pytest.fixture(scope="module", params=["torch", "numpy"])
def ml(request):
    return mixlens.StandardizedTransformer(str(SHIPPED_MODEL), output=request.param)


def np32(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def test_an_edit_of_a_value_the_body_moved_past_raises(ml):
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                h = ml.layers_output[0]
                ml.layers_output[1]
                h[:, 0] = 0  # numpy: raises here; torch: at the next read
                ml.layers_output[2]


def test_held_values_edited_after_the_release_raise_at_the_end_of_the_body(ml):
    # No later read in the body: the end of the body checks what it still holds.
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                held = [ml.layers_output[i] for i in range(3)]
                held[0][:, 0] = 0  # numpy: raises here (read-only); torch: at the end of the body


def test_an_edited_then_dropped_value_raises_at_the_next_read(ml):
    reached = []
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with ml.trace() as tracer:
            with tracer.invoke(A):
                h = ml.layers_output[0]
                ml.layers_output[1]
                reached.append(1)
                h[:, 0] = 0  # numpy: raises here
                del h
                reached.append(2)
                ml.layers_output[2]
                reached.append(3)
    assert reached in ([1], [1, 2])


def test_reads_in_a_body_do_not_recheck_held_torch_values(ml, monkeypatch):
    # Issue 9 item 5: a read's cost must not grow with the values the body holds; they are checked at its end.
    import mixlens._inplace as inplace

    calls = []
    real = inplace._version
    monkeypatch.setattr(inplace, "_version", lambda v: calls.append(1) or real(v))
    with ml.trace() as tracer:
        with tracer.invoke(A):
            held = [ml.layers_output[i] for i in range(ml.num_layers)]
    if isinstance(held[0], torch.Tensor):
        # A few reads of each value's version (when read, settled, released, and at the end of the body);
        # rechecking every held value at every read would add 0 + 1 + ... + (n - 1).
        assert len(calls) <= 4 * ml.num_layers + 2


def test_values_of_invoke_bodies_are_ordinary_after_the_trace(ml):
    with ml.trace() as tracer:
        with tracer.invoke(A):
            h = ml.layers_output[0]
            ml.layers_output[1]
    h[:, 0] = 1  # no error after the trace (numpy: writable again)
    assert float(np32(h)[0, 0, 0]) == 1.0


def test_a_live_edit_in_an_invoke_writes_its_rows_only(ml):
    with ml.trace() as tracer:
        with tracer.invoke(A):
            ml.layers_output[1][:, -1] = 0
        with tracer.invoke(B):
            pb = np32(ml.next_token_probs).copy()
    with ml.trace([A, B]):
        x = np32(ml.layers_output[1]).copy()
        x[0, -1] = 0
        ml.layers_output[1] = x
        p = np32(ml.next_token_probs).copy()
    np.testing.assert_array_equal(pb[0], p[1])
