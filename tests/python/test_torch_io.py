"""Issue 10 items 1 and 2: values as torch tensors or numpy arrays, writes from any of them, and
in-place edits that reach the forward (or raise) - never a silent no-op."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mixlens
from mixlens_dev.common import rel_rms

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module", params=["torch", "numpy"])
def model(request, text_model_dir):
    return mixlens.StandardizedTransformer(str(text_model_dir), output=request.param)


@pytest.fixture(scope="module")
def tmodel(text_model_dir):
    return mixlens.StandardizedTransformer(str(text_model_dir), output="torch")


def np32(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def test_output_option(text_model_dir, monkeypatch):
    monkeypatch.delenv("MIXLENS_OUTPUT", raising=False)
    auto = mixlens.StandardizedTransformer(str(text_model_dir))
    assert auto.output_format == "torch"  # torch is installed here
    monkeypatch.setenv("MIXLENS_OUTPUT", "numpy")
    assert mixlens.StandardizedTransformer(str(text_model_dir)).output_format == "numpy"
    with pytest.raises(mixlens.InputError, match="output must be one of"):
        mixlens.StandardizedTransformer(str(text_model_dir), output="jax")
    monkeypatch.setenv("MIXLENS_OUTPUT", "bogus")  # the error names the variable the bad value came from
    with pytest.raises(mixlens.InputError, match=r"\$MIXLENS_OUTPUT must be one of .*'bogus'"):
        mixlens.StandardizedTransformer(str(text_model_dir))
    monkeypatch.setenv("MIXLENS_OUTPUT", "numpy")
    auto.output_format = "numpy"
    assert isinstance(auto.run(PROMPT)["logits"], np.ndarray)
    auto.output_format = "torch"
    assert isinstance(auto.run(PROMPT)["logits"], torch.Tensor)


def test_reads_are_torch_tensors_or_numpy_arrays(model):
    torch_out = model.output_format == "torch"
    with model.trace(PROMPT) as tracer:
        b = model.layers[1].linear_attn.betas
        h = model.layers_output[1]
        assert model.layers[0].linear_attn.state_input is None if False else True
        s = b.save()
        assert s is b
    kind = torch.Tensor if torch_out else np.ndarray
    for v in (b, h, tracer.logits):
        assert isinstance(v, kind)
        assert (v.dtype == torch.float32) if torch_out else (v.dtype == np.float32)
    assert isinstance(b, mixlens.ValueTensor if torch_out else mixlens.ValueArray)
    # value + torch.Tensor works either way, and gives a torch tensor.
    summed = h + torch.ones(h.shape[-1])
    assert isinstance(summed, torch.Tensor) and torch.allclose(summed - 1, torch.as_tensor(np32(h)))
    # Operations on a ValueTensor give plain tensors (no subclass leaking into user code).
    if torch_out:
        assert type(h * 2) is torch.Tensor
    # run / saved / logits follow the option too.
    out = model.run(PROMPT, saves=["layers.1.linear_attn.betas"])
    assert isinstance(out["logits"], kind) and isinstance(out["layers.1.linear_attn.betas"], kind)
    np.testing.assert_array_equal(np32(out["layers.1.linear_attn.betas"]), np32(b))
    np.testing.assert_array_equal(np32(out["logits"]), np32(tracer.logits))


def test_torch_reads_are_zero_copy_views_of_the_served_copy(tmodel):
    with tmodel.trace(PROMPT):
        h = tmodel.layers_output[0]
        base = h.numpy()  # shares memory: no copy between the C++ buffer handed over and the tensor
        assert np.shares_memory(base, h.numpy())
        assert h.data_ptr() == base.__array_interface__["data"][0]


@pytest.mark.parametrize("make", [
    lambda b: torch.as_tensor(b, dtype=torch.bfloat16) * 0 + 0.5,      # bf16, cast
    lambda b: (torch.as_tensor(b, dtype=torch.float64) * 0 + 0.5).requires_grad_(),  # grad: detached
    lambda b: np.full(b.shape, 0.5, np.float64),                          # numpy float64
    lambda b: 0.5,                                                        # Python scalar, broadcast
    lambda b: torch.tensor(0.5),                                          # 0-d tensor, broadcast
    lambda b: torch.full((b.shape[-1],), 0.5, dtype=torch.float16),       # vector, broadcast over [B, T]
])
def test_writes_accept_torch_numpy_and_scalars(model, make):
    with model.trace(PROMPT) as ref:
        b = model.layers[0].linear_attn.betas
        model.layers[0].linear_attn.betas = np.full(tuple(b.shape), 0.5, np.float32)
    with model.trace(PROMPT) as got:
        b = model.layers[0].linear_attn.betas
        model.layers[0].linear_attn.betas = make(np32(b))
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))


def test_bad_writes_name_the_problem(tmodel):
    with tmodel.trace(PROMPT):
        b = tmodel.layers[0].linear_attn.betas
        with pytest.raises(mixlens.WriteError, match="dtype torch.complex64"):
            tmodel.layers[0].linear_attn.betas = torch.zeros(b.shape, dtype=torch.complex64)
        with pytest.raises(mixlens.WriteError, match=r"expected shape \[1, \d+, 4\], got \[3, 2\]"):
            tmodel.layers[0].linear_attn.betas = torch.zeros(3, 2)
        # A tensor with no values (meta) or that torch cannot turn into numbers is a WriteError, not torch's own
        with pytest.raises(mixlens.WriteError, match="'meta' device has no values"):
            tmodel.layers[0].linear_attn.betas = torch.zeros(b.shape, device="meta")
        with pytest.raises(mixlens.WriteError, match="a nested tensor"):
            tmodel.layers[0].linear_attn.betas = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)],
                                                                            layout=torch.jagged)
        with pytest.raises(mixlens.WriteError, match="dtype object cannot be written"):  # None is not NaN
            tmodel.layers[0].linear_attn.betas = np.full(tuple(b.shape), None, dtype=object)
        # Quantized tensors and lazy negation views write their real values
        with warnings.catch_warnings():  # torch deprecates quantized tensors; users still have them
            warnings.simplefilter("ignore")
            q = torch.quantize_per_tensor(torch.full(tuple(b.shape), 0.5), 0.1, 0, torch.qint8)
        tmodel.layers[0].linear_attn.betas = q
        np.testing.assert_allclose(np32(tmodel.layers[0].linear_attn.betas), 0.5, rtol=1e-6)
        tmodel.layers[0].linear_attn.betas = torch._neg_view(torch.full(tuple(b.shape), -0.75))
        np.testing.assert_array_equal(np32(tmodel.layers[0].linear_attn.betas), 0.75)
        # A sparse tensor writes its dense values
        dense = torch.full(tuple(b.shape), 0.25)
        tmodel.layers[0].linear_attn.betas = dense.to_sparse()
        np.testing.assert_array_equal(np32(tmodel.layers[0].linear_attn.betas), dense.numpy())


# ---- in-place edits (item 2) ------------------------------------------------------------------


def test_inplace_slice_of_layers_output_equals_the_assignment(model):
    x = np.linspace(-1, 1, 256 if False else model.hidden_size, dtype=np.float32)
    with model.trace(PROMPT) as ref:
        h = np32(model.layers_output[0]).copy()
        h[:, 3] = x
        model.layers_output[0] = h
    with model.trace(PROMPT) as got:
        model.layers_output[0][:, 3] = torch.as_tensor(x) if model.output_format == "torch" else x
        out1 = model.layers_output[1]  # the block moves on: the edit is consumed first
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))
    base = model.run(PROMPT)["logits"]
    assert rel_rms(np32(got.logits), np32(base)) > 1e-4, "the in-place edit changed nothing"
    assert out1 is not None


def test_inplace_betas_skip_token_equals_the_assignment(model):
    with model.trace(PROMPT) as ref:
        b = np32(model.layers[1].linear_attn.betas).copy()
        b[:, 3] = 0
        model.layers[1].linear_attn.betas = b
        ref_states = np32(model.layers[1].linear_attn.states).copy()
    with model.trace(PROMPT) as got:
        mix = model.layers[1].linear_attn
        mix.betas[:, 3] = 0
        states = np32(mix.states).copy()
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))
    np.testing.assert_array_equal(states, ref_states)
    # Skipping token 3 (values.md): the state after token 3 equals the state after token 2.
    np.testing.assert_allclose(states[:, 3], states[:, 2], rtol=1e-6, atol=1e-7)


def test_augmented_assignment_on_a_layer_value(model):
    with model.trace(PROMPT) as ref:
        model.layers_output[0] = np32(model.layers_output[0]) * 2
    with model.trace(PROMPT) as got:
        model.layers_output[0] *= 2  # read, in-place multiply, assign back: applied once
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))


def test_inplace_edit_at_the_end_of_the_block_and_at_a_step(model):
    with model.trace(PROMPT) as ref:
        model.ln_final.output = np32(model.ln_final.output) * 0.5
    with model.trace(PROMPT) as got:
        model.ln_final.output.__imul__(0.5)  # last read of the block: consumed at exit
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))
    # In generation, moving to the next step consumes the edit too.
    with model.generate(PROMPT, max_new_tokens=3) as gref:
        for step in gref.iter[:]:
            if step == 1:
                model.layers_output[1] = np32(model.layers_output[1]) * 3
    with model.generate(PROMPT, max_new_tokens=3) as ggot:
        for step in ggot.iter[:]:
            if step == 1:
                model.layers_output[1][:] *= 3
    assert ggot.tokens == gref.tokens


def test_inplace_after_an_assignment_still_counts(model):
    with model.trace(PROMPT) as ref:
        b = model.layers[0].linear_attn.betas
        model.layers[0].linear_attn.betas = np32(b) * 0 + 0.25
    with model.trace(PROMPT) as got:
        b = model.layers[0].linear_attn.betas
        model.layers[0].linear_attn.betas = np32(b) * 7
        b[...] = 0.25  # the forward is still at betas: this edit wins
    np.testing.assert_array_equal(np32(got.logits), np32(ref.logits))


def test_editing_a_value_the_forward_has_passed_raises(model):
    torch_out = model.output_format == "torch"
    with pytest.raises(mixlens.WriteError, match=r"in-place edit of 'layers.0.layer_output'.*assign"):
        with model.trace(PROMPT):
            h = model.layers_output[0]
            model.layers_output[1]
            h[:, 0] = 0  # numpy: raises here; torch: at the next move
            model.layers_output[2] if model.num_layers > 2 else model.logits
    # After the block values are ordinary arrays again.
    with model.trace(PROMPT):
        h = model.layers_output[0]
        model.logits
    h[:, 0] = 1
    assert float(np32(h)[0, 0, 0]) == 1.0
    if not torch_out:
        with model.trace(PROMPT):
            h = model.layers_output[0]
            model.layers_output[1]
            with pytest.raises(mixlens.WriteError, match="moved past it"):
                h += 1
            with pytest.raises(ValueError, match="read-only"):
                np.add(h, 1, out=h)  # numpy's own message, but never silent


@pytest.fixture(params=["copy", "checksum", "version"])
def watch(request, monkeypatch):
    """Every way a released torch value is checked: its bytes against a copy (up to
    mixlens._inplace.WATCH_COPY_LIMIT bytes: all of this model's values), against a checksum (up to
    WATCH_LIMIT) and torch's version counter (larger ones)."""
    if request.param == "checksum":
        monkeypatch.setattr(mixlens._inplace, "WATCH_COPY_LIMIT", 0)
    if request.param == "version":
        monkeypatch.setattr(mixlens._inplace, "WATCH_LIMIT", 0)
    return request.param


def test_torch_values_held_in_a_block_are_checked_at_the_end_and_released_ones_when_dropped(tmodel, watch):
    # Issue 9 item 5: a read does not recheck every held torch value (that made a read cost grow with the
    # number held); an edit after the release is still never silent.
    VT = mixlens.ValueTensor
    n = tmodel.num_layers
    # Held to the end of the block: raised when it ends, naming the edited value.
    reads = 0
    with pytest.raises(mixlens.WriteError, match=r"in-place edit of 'layers.0.linear_attn.betas' \(read at step 0\)"):
        with tmodel.trace(PROMPT):
            held = [tmodel.layers[0].linear_attn.betas, tmodel.layers_output[0]]
            held[0][:, 0] = 0  # betas was released by the second read
            for i in range(1, n):
                held.append(tmodel.layers_output[i])
                reads += 1
            tmodel.logits
            reads += 1
    assert reads == n  # the reads themselves do not check held values
    # Edited, then dropped (collected): raised at the next read.
    reached = []
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.trace(PROMPT):
            h = tmodel.layers_output[0]
            tmodel.layers_output[1]
            h.add_(1)
            del h
            reached.append(1)
            tmodel.logits
            reached.append(2)
    assert reached == [1]
    # Edited through a view that outlives it: raised at the end of the block.
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.trace(PROMPT):
            h = tmodel.layers_output[0]
            tmodel.layers_output[1]
            view = h[:, 1:]
            del h
            view.mul_(2)
            tmodel.logits
    # Unedited held values: no error, and after the block they are ordinary ValueTensors again.
    with tmodel.trace(PROMPT):
        held = [tmodel.layers_output[i] for i in range(n)]
        tmodel.logits
    for v in held:
        assert type(v) is VT and "_mixlens_released" not in v.__dict__
        v[:, 0] = 1  # no error after the block
    # In a generation, a held value edited after its release raises when the block moves to the next step.
    steps = []
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.generate(PROMPT, max_new_tokens=3) as g:
            for step in g.iter[:]:
                steps.append(step)
                if step == 0:
                    h = tmodel.layers_output[0]
                    tmodel.layers_output[1]
                    h[:, 0] = 0
    assert steps == [0]


# Writes that bypass torch's in-place ops (no version counter moves): the checksum of a released value's
# bytes still sees them, for a value held to the end of the block and for one dropped after the edit.
BYPASS = {
    "numpy view": lambda h: h.numpy().__setitem__((0, 0), 7.0),
    "data": lambda h: h.data.__setitem__((0, 0), 7.0),
    "dlpack re-export": lambda h: np.from_dlpack(h.detach()).__setitem__((0, 0), 7.0),
    "torch dlpack re-export": lambda h: torch.from_dlpack(h.detach()).__setitem__((0, 0), 7.0),
}


@pytest.fixture(params=["copy", "checksum"])
def watch_bytes(request, monkeypatch):
    """The two byte checks (values are compared with a copy up to WATCH_COPY_LIMIT, a checksum above)."""
    if request.param == "checksum":
        monkeypatch.setattr(mixlens._inplace, "WATCH_COPY_LIMIT", 0)
    return request.param


@pytest.mark.parametrize("how", list(BYPASS))
def test_released_torch_values_edited_around_the_version_counter_raise(tmodel, how, watch_bytes):
    edit = BYPASS[how]
    # Held to the end of the block.
    with pytest.raises(mixlens.WriteError, match=r"in-place edit of 'layers.0.layer_output' \(read at step 0\)"):
        with tmodel.trace(PROMPT):
            h = tmodel.layers_output[0]
            tmodel.layers_output[1]
            v0 = h._version
            edit(h)
            assert h._version == v0  # what the version counter cannot see
            tmodel.logits
    # Edited, then dropped: raised at the next read.
    reached = []
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.trace(PROMPT):
            h = tmodel.layers_output[0]
            tmodel.layers_output[1]
            edit(h)
            del h
            reached.append(1)
            tmodel.logits
            reached.append(2)
    assert reached == [1]


def test_a_view_outliving_its_dropped_value_is_watched(tmodel, watch_bytes):
    # Only a view of the value is kept (the value itself is dropped at once): its storage is watched.
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.trace(PROMPT):
            view = tmodel.layers_output[0][:, 1:]
            tmodel.layers_output[1]
            view.mul_(2)
            tmodel.logits
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with tmodel.trace(PROMPT):
            arr = tmodel.layers_output[0].numpy()
            tmodel.layers_output[1]
            arr[0, 0, 0] += 1
            tmodel.logits
    # Edited while live through the view: a write, as the assignment.
    with tmodel.trace(PROMPT):
        view = tmodel.layers_output[0][:, 1:]
        view.zero_()
        got = tmodel.logits.clone()
    with tmodel.trace(PROMPT):
        h = tmodel.layers_output[0]
        h[:, 1:] = 0
        tmodel.layers_output[0] = h
        want = tmodel.logits.clone()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_view_made_before_the_release_is_watched(model, watch_bytes):
    # numpy: only the value itself becomes read-only at its release; a view made while it was live stays
    # writable, so its bytes are watched too (torch: every released value is).
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with model.trace(PROMPT):
            h = model.layers_output[0]
            view = h[:, 1:]
            model.layers_output[1]
            view[0, 0, 0] += 1
            model.logits
    # Only the view kept, edited and dropped: raised at the next read.
    reached = []
    with pytest.raises(mixlens.WriteError, match="'layers.0.layer_output'"):
        with model.trace(PROMPT):
            view = model.layers_output[0][:, 1:]
            model.layers_output[1]
            view[0, 0, 0] += 1
            del view
            reached.append(1)
            model.logits
            reached.append(2)
    assert reached == [1]
    # A view edited while the value is live: a write, as the assignment.
    with model.trace(PROMPT):
        view = model.layers_output[0][:, 1:]
        view[0, 0, 0] += 1
        got = np32(model.logits).copy()
    with model.trace(PROMPT):
        h = model.layers_output[0]
        h2 = np32(h).copy()
        h2[0, 1, 0] += 1
        model.layers_output[0] = h2
        want = np32(model.logits).copy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("flat", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 31, -2, -1])
def test_one_bit_edit_of_a_released_torch_value_anywhere_raises(tmodel, flat, watch_bytes):
    # The copy is exact; the checksum changes for any edit within one 8-byte word (its steps are bijective):
    # the lowest mantissa bit of one element at the start, in each of its four lanes, past the first
    # 32-byte block, at the end (the 4-byte tail when the size is not a multiple of 8).
    with pytest.raises(mixlens.WriteError, match="'layers.0.linear_attn.betas'"):
        with tmodel.trace(PROMPT):
            b = tmodel.layers[0].linear_attn.betas
            tmodel.layers_output[0]
            bits = b.numpy().reshape(-1).view(np.uint32)
            bits[flat] ^= 1
            tmodel.logits
    with pytest.raises(mixlens.WriteError, match="'layers.0.linear_attn.betas'"):
        with tmodel.trace(PROMPT):
            b = tmodel.layers[0].linear_attn.betas
            tmodel.layers_output[0]
            b.numpy().reshape(-1).view(np.uint32)[flat] ^= 1 << 31  # sign bit: -0.0 counts
            del b
            tmodel.logits


def test_editing_states_in_place_raises(model):
    with pytest.raises(mixlens.WriteError):
        with model.trace(PROMPT):
            s = model.layers[0].linear_attn.states
            s[:, 0] = 0
            model.logits


def test_inplace_moment_sibling_after_a_later_read_raises(model):
    with pytest.raises(mixlens.OutOfOrderError, match="in-place edit of 'layers.0.linear_attn.betas'"):
        with model.trace(PROMPT):
            mix = model.layers[0].linear_attn
            mix.decays  # the forward is at decays; betas is served from its copy
            mix.betas[:, 0] = 0
            model.logits


def test_edit_callables_may_edit_in_place(model):
    ref = model.run(PROMPT, edits={"layers.0.linear_attn.betas": lambda b: b * 0})["logits"]

    def zero(b):
        b[:] = 0  # returns None: the in-place edit is the edit

    got = model.run(PROMPT, edits={"layers.0.linear_attn.betas": zero})["logits"]
    np.testing.assert_array_equal(np32(got), np32(ref))


# ---- tracer.stop, attention mask ---------------------------------------------------------------


def test_tracer_stop_ends_the_block_early(model):
    with model.trace(PROMPT) as tracer:
        h = model.layers_output[0]
        tracer.stop()
        raise AssertionError("not reached")
    assert tracer.stopped and h is not None
    with pytest.raises(mixlens.InputError, match="stopped"):
        tracer.logits
    ref = model.run(PROMPT, saves=["layers.0.layer_output"])["layers.0.layer_output"]
    np.testing.assert_array_equal(np32(h), np32(ref))
    with model.trace(PROMPT) as again:  # the model is free again
        model.logits
    assert again.logits is not None


def test_attention_mask_of_a_left_padded_batch(model):
    prompts = [PROMPT, "Hi"]
    n = [len(model.tokenizer.encode(p)) for p in prompts]
    with model.trace(prompts) as tracer:
        mask = model.attention_mask
        ids = model.input_ids
    T = max(n)
    expect = np.array([[0] * (T - k) + [1] * k for k in n])
    np.testing.assert_array_equal(np32(mask), expect)
    np.testing.assert_array_equal(np32(tracer.attention_mask), expect)
    assert list(np32(ids)[1, T - n[1]:]) == model.tokenizer.encode("Hi")


def test_a_tokenizer_output_with_left_padding_matches_transformers(tmodel, text_model_dir):
    """The HF habit: tokenize a batch with padding_side="left" and pass the whole output; every position
    (padded ones included) matches transformers run on the same input_ids and attention_mask."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(text_model_dir / "tokenizer.json"),
                                               pad_token="<|padding|>", padding_side="left")
    enc = tok([PROMPT, "Hi there"], return_tensors="pt", padding=True)
    assert enc["attention_mask"][1, 0] == 0
    hf = transformers.Mamba2ForCausalLM.from_pretrained(str(text_model_dir)).eval()
    with torch.no_grad():
        ref = hf(**enc).logits.numpy()
    with tmodel.trace(enc) as tracer:
        pass
    assert rel_rms(tracer.logits.numpy(), ref) <= 1e-4
    assert rel_rms(tracer.logits.numpy()[1, :2], ref[1, :2]) <= 1e-4  # padded positions too


def test_save_works_on_what_is_computed_from_values_as_in_nnsight(tmodel):
    """nnsight idioms port unchanged: `.save()` on a slice, a reduction or a helper's result of a value."""
    with tmodel.trace(PROMPT) as tracer:
        h = tmodel.layers_output[1]
        last = h[:, -1].save()
        mean = h.mean(1).save()
        probs = tmodel.next_token_probs.save()
    assert torch.equal(last, h[:, -1]) and torch.equal(mean, h.mean(1))
    assert torch.allclose(probs, tracer.logits[:, -1].softmax(-1))
    # Mounted only while a trace is open, so nnsight's own `.save` (mounted on every object) works between.
    assert "save" not in vars(torch.Tensor)


def test_save_works_on_helper_results_with_numpy_output(text_model_dir):
    """numpy output: next_token_probs / project_on_vocab are computed arrays, yet `.save()` works on them as
    on values and torch results (they were plain ndarrays: AttributeError)."""
    m = mixlens.StandardizedTransformer(str(text_model_dir), output="numpy")
    with m.trace(PROMPT) as tracer:
        h = m.layers_output[1]
        last = h[:, -1].save()
        lens = m.project_on_vocab(h).save()
        probs = m.next_token_probs.save()
    x = tracer.logits[:, -1].astype(np.float64)
    want = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lens[:, -1], m.project_on_vocab(last), rtol=1e-6, atol=1e-6)
    assert lens.shape == (*h.shape[:2], m.vocab_size)



def test_numpy_values_pickle_as_plain_arrays(text_model_dir):
    import pickle

    m = mixlens.StandardizedTransformer(str(text_model_dir), output="numpy")
    with m.trace(PROMPT):
        h = m.layers_output[1]
    back = pickle.loads(pickle.dumps(h))
    assert type(back) is np.ndarray and back.dtype == np.float32
    np.testing.assert_array_equal(back, h)
