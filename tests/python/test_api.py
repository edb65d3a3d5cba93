"""The Python API's semantics: interleaved reads and writes in forward order, errors, generation
steps, batches, continuations, support(), kernel routing, and hub-id resolution."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, rel_rms

PROMPT = "Once upon a time, there was a little"
FIXTURE = REPO / "tests" / "fixtures" / "mamba2" / "g1_chunks"


@pytest.fixture(scope="module")
def model(text_model_dir):
    return mixlens.StandardizedTransformer(str(text_model_dir))


def test_read_then_write_the_same_site(model):
    base = model.run(PROMPT)["logits"]
    with model.trace(PROMPT) as tracer:
        b = model.layers[1].linear_attn.betas
        assert isinstance(b, np.ndarray) and b.dtype == np.float32 and b.shape == (1, len(model.tokenizer.encode(PROMPT)), 4)
        model.layers[1].linear_attn.betas = b * 0.5
        again = model.layers[1].linear_attn.betas
        out = model.logits.save()
    np.testing.assert_array_equal(again, b * np.float32(0.5))
    assert rel_rms(out, base) > 1e-4, "the write changed nothing downstream"
    np.testing.assert_array_equal(out, tracer.logits)
    # Same as the pre-registered edit.
    pre = model.run(PROMPT, edits={"layers.1.linear_attn.betas": b * 0.5})["logits"]
    np.testing.assert_array_equal(out, pre)


def test_editing_the_value_read_last_in_place_is_a_write(model):
    # Issue 10 item 2: the in-place edit reaches the forward when the block moves on (here: the end
    # of the block), exactly like the explicit assignment. test_torch_io.py covers the rest.
    ref = model.run(PROMPT, edits={"layers.0.linear_attn.betas": lambda b: b * 0})["logits"]
    with model.trace(PROMPT) as tracer:
        b = model.layers[0].linear_attn.betas
        b[:] = 0.0
    np.testing.assert_array_equal(tracer.logits, ref)


def test_reading_a_passed_site_raises_naming_both(model):
    with model.trace(PROMPT):
        model.layers[1].layer_output
        with pytest.raises(mixlens.OutOfOrderError) as e:
            model.layers[0].linear_attn.betas
        msg = str(e.value)
        assert "'layers.0.linear_attn.betas' at step 0" in msg and "'layers.1.layer_output' at step 0" in msg
        assert isinstance(e.value, mixlens.MixlensError) and isinstance(e.value, ValueError)
        # Still usable: later values are served.
        assert model.ln_final.output.shape[-1] == model.info["hidden_size"]


def test_moment_values_read_in_any_order(model):
    ref = model.run(PROMPT, saves=["layers.0.linear_attn.attention_queries", "layers.0.linear_attn.betas"])
    with model.trace(PROMPT):
        model.layers[0].linear_attn.attention_values
        np.testing.assert_array_equal(model.layers[0].linear_attn.attention_queries, ref["layers.0.linear_attn.attention_queries"])
        model.layers[0].linear_attn.decays
        np.testing.assert_array_equal(model.layers[0].linear_attn.betas, ref["layers.0.linear_attn.betas"])
        with pytest.raises(mixlens.OutOfOrderError, match="write each one before reading a later one"):
            model.layers[0].linear_attn.betas = ref["layers.0.linear_attn.betas"]


def test_unknown_path_suggests_the_nearest(model):
    with model.trace(PROMPT):
        with pytest.raises(mixlens.UnknownValueError, match=r"did you mean 'layers.1.linear_attn.betas'") as e:
            model.layers[1].linear_attn.beta
        assert isinstance(e.value, LookupError)
        with pytest.raises(mixlens.UnknownValueError, match="mamba2"):
            model.layers[0].self_attn.attention_output
        with pytest.raises(mixlens.UnknownValueError, match="no MLP"):
            model.layers[0].mlp.output
    with pytest.raises(IndexError):
        model.layers[7]


def test_bad_writes_raise_write_error_and_apply_nothing(model):
    base = model.run(PROMPT)["logits"]
    with model.trace(PROMPT) as tracer:
        b = model.layers[0].linear_attn.betas
        with pytest.raises(mixlens.WriteError, match=r"expected shape \[1, \d+, 4\], got \[1, 3\]"):
            model.layers[0].linear_attn.betas = np.zeros((1, 3), np.float32)
        with pytest.raises(mixlens.WriteError, match="betas must be >= 0"):
            model.layers[0].linear_attn.betas = -b
        with pytest.raises(mixlens.WriteError, match="NaN"):
            model.layers[0].linear_attn.betas = np.full_like(b, np.nan)
        with pytest.raises(mixlens.WriteError, match="dtype complex"):
            model.layers[0].linear_attn.betas = b.astype(np.complex64)
        with pytest.raises(mixlens.WriteError, match="None"):
            model.layers[0].linear_attn.betas = None
        # Finite numbers float32 cannot hold are named as such, not reported as NaN / inf after the cast.
        for big in (10**40, 1e300, b.astype(np.float64) * 1e300):
            with pytest.raises(mixlens.WriteError, match=r"e\+\d+ is outside float32's range"):
                model.layers[0].linear_attn.betas = big
        torch = pytest.importorskip("torch")
        with pytest.raises(mixlens.WriteError, match="outside float32's range"):
            model.layers[0].linear_attn.betas = torch.full(b.shape, 1e39, dtype=torch.float64)
        with pytest.raises(mixlens.WriteError, match="decays must be <= 0"):
            model.layers[0].linear_attn.decays = np.ones_like(b)
        with pytest.raises(mixlens.WriteError, match="read-only"):
            model.layers[1].linear_attn.states = np.zeros((1, 1), np.float32)
    np.testing.assert_array_equal(tracer.logits, base)


def test_safely_castable_writes_are_accepted(model):
    with model.trace(PROMPT) as t64:
        b = model.layers[0].linear_attn.betas
        model.layers[0].linear_attn.betas = b.astype(np.float64) * 2
    with model.trace(PROMPT) as t32:
        model.layers[0].linear_attn.betas = model.layers[0].linear_attn.betas * np.float32(2)
    np.testing.assert_array_equal(t64.logits, t32.logits)


def test_states_are_served_and_consistent(model):
    with model.trace(PROMPT):
        assert model.layers[0].linear_attn.state_input is None  # fresh prompt
        states = model.layers[0].linear_attn.states.save()
        out = model.layers[0].linear_attn.state_output
    assert states.ndim == 5 and states.shape[:2] == (1, len(model.tokenizer.encode(PROMPT)))
    np.testing.assert_allclose(states[:, -1], out, rtol=1e-5, atol=1e-6)


def test_generate_steps(model):
    n = 5
    with model.generate(PROMPT, max_new_tokens=n, eos_token_id=-1) as tracer:
        seen, outs, ins = [], [], []
        for step in tracer.iter[:]:
            seen.append(step)
            ins.append(model.layers[1].linear_attn.state_input)
            outs.append(model.layers[1].linear_attn.state_output)
            assert model.logits.shape[1] == (len(model.tokenizer.encode(PROMPT)) if step == 0 else 1)
    assert seen == list(range(n))
    assert ins[0] is None
    for k in range(1, n):
        np.testing.assert_array_equal(ins[k], outs[k - 1])
    ref = model.generate(PROMPT, max_new_tokens=n, eos_token_id=-1).run()
    assert tracer.tokens == ref.tokens and len(tracer.tokens) == n
    assert tracer.text == model.tokenizer.decode(ref.tokens)
    assert [c["kernel"] for c in tracer.calls] == ["chunked"] + ["recurrent"] * (n - 1)


def test_generate_step_slices_and_writes_carry_forward(model):
    with model.generate(PROMPT, max_new_tokens=6, eos_token_id=-1) as unedited:
        assert [s for s in unedited.iter[1:3]] == [1, 2]
        for step in unedited.iter[4]:
            assert step == 4
            logits4 = model.logits
    with model.generate(PROMPT, max_new_tokens=6, eos_token_id=-1) as edited:
        for step in edited.iter[4:5]:
            model.layers[0].linear_attn.state_input = model.layers[0].linear_attn.state_input * 0
            edited4 = model.logits
    assert edited.tokens[:4] == unedited.tokens[:4]  # steps before the write are untouched
    assert rel_rms(edited4, logits4) > 1e-4


def test_generation_stops_at_eos_and_iteration_follows(model):
    first = model.generate(PROMPT, max_new_tokens=3, eos_token_id=-1).run().tokens
    eos = first[1]  # the second generated token: generation stops after step 1
    with model.generate(PROMPT, max_new_tokens=6, eos_token_id=eos) as tracer:
        steps = [s for s in tracer.iter[:]]
    assert steps == [0, 1] and tracer.tokens == first[:2]
    with model.generate(PROMPT, max_new_tokens=6, eos_token_id=eos) as tracer:
        assert [s for s in tracer.iter[3:5]] == []


def test_sampling_options_reach_the_generator(model):
    def sample(**kw):
        return model.generate(PROMPT, max_new_tokens=6, do_sample=True, eos_token_id=-1, **kw).run().tokens

    assert sample(seed=3, temperature=1.5) == sample(seed=3, temperature=1.5)
    draws = {tuple(sample(seed=s, temperature=2.0)) for s in range(6)}
    assert len(draws) > 1, "different seeds never changed a sampled token"
    greedy = model.generate(PROMPT, max_new_tokens=6, eos_token_id=-1).run().tokens
    assert sample(seed=1, top_k=1) == greedy  # top-k 1 is greedy
    with pytest.raises(mixlens.InputError, match="temperature"):
        sample(temperature=0.0)
    with pytest.raises(mixlens.InputError, match="top_p"):
        sample(top_p=1.5)


def test_batch_of_prompts_is_left_padded_and_rows_are_independent(model):
    prompts = [PROMPT, "The cat"]
    lens = [len(model.tokenizer.encode(p)) for p in prompts]
    with model.trace(prompts) as tracer:
        x = model.layers[0].linear_attn.attention_values
    assert x.shape[:2] == (2, max(lens))
    for r, p in enumerate(prompts):
        single = model.run(p)["logits"]
        row = tracer.logits[r : r + 1, max(lens) - lens[r]:]
        assert rel_rms(row, single) <= 1e-5
    # Token ids work the same as text.
    ids = [model.tokenizer.encode(p) for p in prompts]
    with model.trace(ids) as by_ids:
        pass
    np.testing.assert_array_equal(by_ids.logits, tracer.logits)


def test_continuation_with_a_cache(model):
    ids = model.tokenizer.encode(PROMPT)
    whole = model.run([ids], saves=["layers.1.linear_attn.state_output"])
    cache = model.new_cache(1)
    first = model.forward([ids[:3]], cache=cache, saves=["layers.1.linear_attn.state_output"])
    with model.trace([ids[3:]], cache=cache) as tracer:
        assert tracer.step == 1
        np.testing.assert_array_equal(model.layers[1].linear_attn.state_input, first["layers.1.linear_attn.state_output"])
        out = model.layers[1].linear_attn.state_output
    assert cache.steps == 2 and cache.seen_tokens == len(ids)
    assert tracer.calls[0]["fresh"] is False and tracer.calls[0]["kernel"] == "chunked"
    assert rel_rms(out, whole["layers.1.linear_attn.state_output"]) <= 1e-5
    assert rel_rms(tracer.logits, whole["logits"][:, 3:]) <= 1e-5


def test_errors_outside_and_inside_blocks(model):
    with pytest.raises(mixlens.InputError, match="can only be read inside a `with model.trace"):
        model.layers[0].linear_attn.betas
    with model.trace(PROMPT):
        with pytest.raises(mixlens.InputError, match="already open"):
            with model.trace(PROMPT):
                pass
    with pytest.raises(RuntimeError, match="boom"):
        with model.trace(PROMPT):
            model.layers[0].linear_attn.betas
            raise RuntimeError("boom")
    # The aborted run left the model usable.
    assert model.run(PROMPT)["logits"].shape[0] == 1
    with pytest.raises(mixlens.InputError, match="no tokens"):
        model.run("")
    with pytest.raises(mixlens.InputError, match="outside the vocabulary"):
        model.run([[10**6]])


def test_python_edit_callables_run_and_their_errors_propagate(model):
    calls = []

    def halve(v):
        calls.append(v.shape)
        return v * 0.5

    out = model.run(PROMPT, edits={"layers.*.linear_attn.betas": halve})
    assert len(calls) == model.num_layers
    with model.trace(PROMPT, edits={"layers.1.linear_attn.betas": halve}) as tracer:
        pass
    assert rel_rms(tracer.logits, out["logits"]) > 0  # only layer 1 edited here

    def bad(v):
        raise KeyError("from the edit")

    with pytest.raises(KeyError, match="from the edit"):
        model.run(PROMPT, edits={"layers.0.linear_attn.betas": bad})
    with pytest.raises(KeyError, match="from the edit"):
        with model.trace(PROMPT, edits={"layers.0.linear_attn.betas": bad}):
            model.logits


def test_layers_output_shortcuts(model):
    with model.trace(PROMPT) as tracer:
        h = model.layers_output[0]
        model.layers_output[0] = h * 0
        h1 = model.layers_input[1]
    np.testing.assert_array_equal(h1, np.zeros_like(h))


def test_support_and_values(model):
    sup = model.support()
    for v in ("attention_queries", "attention_keys", "attention_values", "betas", "decays", "state_input",
              "state_output", "states", "attention_head_outputs", "attention_output"):
        assert sup[f"linear_attn.{v}"] is None
    assert "mamba2 block" in sup["self_attn.attention_output"] and "linear_attn" in sup["self_attn.attention_output"]
    assert "no MLP" in sup["mlp.output"]
    vals = {v["path"]: v for v in model.values(2, 5)}
    assert vals["layers.0.linear_attn.states"]["shape"] == (2, 5, 4, 16, 16)
    assert vals["layers.0.linear_attn.states"]["writable"] is False
    assert vals["logits"]["shape"] == (2, 5, 50280)


def test_route_kernels_and_chunk_per_token_agree(model):
    with model.trace(PROMPT) as ref:
        s_ref = model.layers[1].linear_attn.states
    try:
        for route in ("recurrent", "chunked"):
            mixlens.route_kernels("mamba2", route)
            assert mixlens.kernel_route("mamba2") == route
            with model.trace(PROMPT) as t:
                s = model.layers[1].linear_attn.states
            assert t.calls[0]["kernel"] == route
            assert rel_rms(s, s_ref) <= 1e-5 and rel_rms(t.logits, ref.logits) <= 1e-5
    finally:
        mixlens.route_kernels("mamba2", "default")
    try:
        mixlens.chunk_per_token(model, True)
        with model.trace(PROMPT) as t:
            s = model.layers[1].linear_attn.states
        assert rel_rms(s, s_ref) <= 1e-5
    finally:
        mixlens.chunk_per_token(model, False)
    with pytest.raises(mixlens.InputError, match="route"):
        mixlens.route_kernels("mamba2", "fast")


def _stand_in_cache(root, repo_id: str, folder) -> str:
    """A HuggingFace hub cache entry for `repo_id` holding `folder`'s files (as huggingface_hub lays it out)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / ("models--" + repo_id.replace("/", "--"))
    snap = entry / "snapshots" / commit
    snap.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy(f, snap / f.name)
    return commit


def test_hub_ids_resolve_from_a_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    commit = _stand_in_cache(tmp_path, "someone/tiny-mamba2", FIXTURE)
    snap = tmp_path / "models--someone--tiny-mamba2" / "snapshots" / commit
    assert os.path.samefile(mixlens.hub.resolve("someone/tiny-mamba2", cache_dir=str(tmp_path)), snap)
    assert os.path.samefile(mixlens.hub.resolve(f"someone/tiny-mamba2@{commit}", cache_dir=str(tmp_path)), snap)
    via_py = mixlens.StandardizedTransformer("someone/tiny-mamba2", cache_dir=str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    via_cpp = mixlens.load("someone/tiny-mamba2")  # the C++ lookup of the same cache
    assert os.path.samefile(via_py.info["path"], via_cpp.info["path"])
    ids = [[5, 6, 7]]
    np.testing.assert_array_equal(via_py.run(ids)["logits"], via_cpp.run(ids)["logits"])
    with pytest.raises(mixlens.CheckpointError, match="not in the local HuggingFace cache"):
        mixlens.hub.resolve("someone/absent", cache_dir=str(tmp_path))
    with pytest.raises(mixlens.CheckpointError, match="not in the local HuggingFace cache"):
        mixlens.load("someone/absent")
    with pytest.raises(mixlens.CheckpointError, match="does not exist"):
        mixlens.load(str(tmp_path / "no-such-folder"))


FAMILY_DIRS = sorted(p.parent for p in (REPO / "tests" / "fixtures").glob("*/*/config.json")) + \
    sorted(p.parent for p in (REPO / "models").glob("*/config.json"))


@pytest.mark.parametrize("folder", FAMILY_DIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_values_order_is_the_forward_order_for_every_family(folder):
    """The interleaver relies on Model.values() listing values in the order the forward visits
    them: reading all of them in that order, at a prompt step and a decode step, never goes back,
    and every value has the shape values() declares for that call."""
    m = mixlens.StandardizedTransformer(str(folder))
    with m.generate([[5, 6, 7, 8, 9]], max_new_tokens=2, eos_token_id=-1) as tracer:
        for step in tracer.iter[:]:
            declared = m.values(1, 5 if step == 0 else 1)
            for v in declared:
                value = m._read(v["path"])
                if value is None:
                    assert step == 0 and v["path"].endswith(".state_input"), v["path"]
                    continue
                shape = v["shape"]
                if v["path"].endswith(".attention_probabilities"):  # T_k counts the cached keys too
                    shape = shape[:3] + (5 + step,)
                assert value.shape == shape and value.dtype == np.float32, (v["path"], step, value.shape)
    assert tracer.steps == 2
