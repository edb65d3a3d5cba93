"""New-user problems of the Python API: hub ids without cache_dir, integer arguments out of range,
dir()/repr()/hasattr() of envoys on hybrid models, saves of steps that never ran, the default model,
ragged writes, and Ctrl-C during a long generation."""

from __future__ import annotations

import os
from pathlib import Path
import shutil
import signal
import threading
import time

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import REPO, SHIPPED_MODEL

PROMPT = "Once upon a time, there was a little"
QWEN = REPO / "models" / "qwen3_5-tinystories"


@pytest.fixture(scope="module")
def model(text_model_dir):
    return mixlens.StandardizedTransformer(str(text_model_dir))


@pytest.fixture(scope="module")
def hybrid():
    if not (QWEN / "config.json").is_file():
        pytest.skip("models/qwen3_5-tinystories is not in this checkout")
    return mixlens.load(str(QWEN))


# ---- 1. mixlens.hub without cache_dir ------------------------------------------------------------


def _fake_hub_cache(root, repo_id, src_dir, commit="0123456789abcdef0123456789abcdef01234567"):
    """A HuggingFace hub cache holding `src_dir`'s files as repo_id at revision main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src_dir.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_hub_ids_resolve_from_the_environment_cache_without_cache_dir(tmp_path, monkeypatch, text_model_dir):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snap = _fake_hub_cache(cache, "foo/bar", text_model_dir)
    # huggingface_hub reads HF_HUB_CACHE when it is imported; mixlens must read it when called.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert os.path.samefile(mixlens.hub.resolve("foo/bar"), snap)
    assert os.path.samefile(mixlens.hub.resolve("foo/bar@main"), snap)
    for m in (mixlens.load("foo/bar", use_hub=True), mixlens.load("foo/bar", revision="main")):
        assert os.path.samefile(m.info["path"], snap)
    with pytest.raises(mixlens.CheckpointError, match=str(cache)):
        mixlens.hub.resolve("foo/missing")


# ---- 2. integer arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    (dict(seed=-1), "seed"),
    (dict(seed=2**70), "seed"),
    (dict(max_new_tokens=2**40), "max_new_tokens"),
    (dict(max_new_tokens=1.7), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(top_k=2**31), "top_k"),
    (dict(eos_token_id=2**32), "eos_token_id"),
])
def test_bad_generation_integers_raise_input_error_naming_the_argument(model, kwargs, name):
    with pytest.raises(mixlens.InputError, match=name) as e:
        model.generate(PROMPT, **{"max_new_tokens": 2, **kwargs}).run()
    assert "incompatible function arguments" not in str(e.value)
    if not isinstance(next(iter(kwargs.values())), float):
        assert "[" in str(e.value), "the message names the range"


def test_out_of_range_token_ids_raise_input_error(model):
    for ids in ([1, 2**31], [[1, 2], [3, 2**31]], np.array([1, 2**31], dtype=np.int64), [1, 2.5]):
        with pytest.raises(mixlens.InputError) as e:
            model.run(ids)
        assert "incompatible function arguments" not in str(e.value)
        with pytest.raises(mixlens.InputError):
            with model.trace(ids):
                pass
    with pytest.raises(mixlens.InputError, match="2147483648"):
        model.generate([1, 2], max_new_tokens=2, forced_tokens=[2**31]).run()
    with pytest.raises(mixlens.InputError):
        model.tokenizer.decode([2**31])
    assert model.generate(np.array([1, 2], dtype=np.int64), max_new_tokens=2, do_sample=True,
                          seed=np.uint64(2**64 - 1)).run().steps == 2


@pytest.mark.parametrize("eos, says", [(10**9, "1000000000 is outside the vocabulary"), (-2, "-2 is out of range")])
def test_an_eos_id_no_token_can_take_is_refused(model, eos, says):
    with pytest.raises(mixlens.InputError, match=f"eos_token_id .*{says}"):
        model.generate(PROMPT, max_new_tokens=2, eos_token_id=eos).run()
    assert model.generate(PROMPT, max_new_tokens=2, eos_token_id=-1).run().steps == 2


@pytest.mark.parametrize("kwargs", [dict(temperature=0.8), dict(top_k=5), dict(top_p=0.9), dict(seed=3)])
def test_sampling_settings_with_greedy_decoding_raise_rather_than_do_nothing(model, kwargs):
    with pytest.raises(mixlens.InputError, match=f"{next(iter(kwargs))}=.*do_sample=True"):
        model.generate(PROMPT, max_new_tokens=2, **kwargs).run()
    model.generate(PROMPT, max_new_tokens=2, do_sample=True, **kwargs).run()


# ---- 3. dir / repr / hasattr ----------------------------------------------------------------------


def test_dir_and_repr_follow_each_layer_of_a_hybrid(hybrid):
    kinds = hybrid.info["layer_kinds"]
    attn = kinds.index("attention")
    lin = kinds.index("gated_deltanet")
    assert dir(hybrid.layers[attn].self_attn) == sorted(
        ["attention_queries", "attention_keys", "attention_values", "attention_probabilities", "gate",
         "attention_output"])
    assert dir(hybrid.layers[attn].linear_attn) == []
    assert dir(hybrid.layers[lin].self_attn) == []
    assert "betas" in dir(hybrid.layers[lin].linear_attn)
    assert dir(hybrid.layers[attn]) == ["layer_input", "layer_output", "mlp", "self_attn"]
    assert "linear_attn" in dir(hybrid.layers[lin]) and "self_attn" not in dir(hybrid.layers[lin])
    r = repr(hybrid.layers[attn])
    assert "self_attn" in r and "linear_attn" not in r
    # Every name dir() lists can be read (in forward order).
    prefix = f"layers.{attn}.self_attn."
    in_order = [v["path"][len(prefix):] for v in hybrid.values() if v["path"].startswith(prefix)]
    assert sorted(in_order) == dir(hybrid.layers[attn].self_attn)
    with hybrid.trace("Once upon a time"):
        for name in in_order:
            assert getattr(hybrid.layers[attn].self_attn, name) is not None


def test_per_token_state_on_an_attention_block_names_the_block_kind(hybrid):
    attn = hybrid.info["layer_kinds"].index("attention")
    lin = hybrid.layers[attn].linear_attn
    want = rf"'layers\.{attn}\.linear_attn\.%s': block {attn} is an attention block .*no recurrent state"
    with pytest.raises(mixlens.UnknownAttributeError, match=want % "state_after"):
        lin.state_after(1)  # outside a trace too
    with hybrid.trace("Once upon a time") as tr:
        with pytest.raises(mixlens.UnknownAttributeError, match=want % "state_after"):
            lin.state_after(1)
        with pytest.raises(mixlens.UnknownAttributeError, match=want % "set_state_after"):
            lin.set_state_after(1, np.zeros(1, np.float32))
        for _ in tr.iter[:1]:
            with pytest.raises(mixlens.UnknownAttributeError, match=want % "state"):
                lin.state
            with pytest.raises(mixlens.UnknownAttributeError, match=want % "state"):
                lin.state = np.zeros(1, np.float32)
    assert not hasattr(lin, "state_after") and hasattr(hybrid.layers[attn - 1].linear_attn, "state_after")


def test_generate_with_grad_says_gradients_are_per_call(model):
    with pytest.raises(mixlens.UnsupportedError, match=r"generate\(grad=True\).*model\.trace\(prompt, grad=True\)"):
        model.generate(PROMPT, max_new_tokens=2, grad=True)


def test_hasattr_is_false_for_unknown_names(model, hybrid):
    attn = hybrid.info["layer_kinds"].index("attention")
    assert not hasattr(model.layers[0].linear_attn, "nonexistent")
    assert not hasattr(model.layers[0], "nonexistent")
    assert not hasattr(model.embed_tokens, "nonexistent")
    assert not hasattr(hybrid.layers[attn].linear_attn, "betas")
    with model.trace(PROMPT):
        assert not hasattr(model.layers[0].linear_attn, "nonexistent")
        with pytest.raises(mixlens.UnknownValueError, match="did you mean") as e:
            model.layers[1].linear_attn.beta
        assert isinstance(e.value, AttributeError) and isinstance(e.value, LookupError)
        assert hasattr(model.layers[1].linear_attn, "betas")
    with hybrid.trace("Once upon a time"):
        assert not hasattr(hybrid.layers[attn].linear_attn, "betas")
    # A known value outside a trace still says where to read it.
    with pytest.raises(mixlens.InputError, match="inside"):
        model.layers[0].linear_attn.betas


def test_envoys_are_made_once_and_reads_check_the_context(model):
    # Issue 9 item 5: model.layers[i].linear_attn.x does no string work and no failed attribute
    # lookup per read (cached envoys, a property per value name), and still only reads the trace
    # this thread / context opened.
    n = model.num_layers
    assert model.layers[1] is model.layers[1] is model.layers[np.int64(1)] is model.layers[1 - n]
    assert model.layers[1].linear_attn is model.layers[1].linear_attn
    assert model.layers[:2] == [model.layers[0], model.layers[1]]
    with pytest.raises(IndexError, match=f"layer {n} out of range \\(the model has {n} layers\\)"):
        model.layers[n]
    # A descriptor on the envoy's class, not __getattr__ (whose miss builds an AttributeError per read).
    assert type(type(model.layers[0].linear_attn).__dict__.get("betas")).__name__ == "ValueAttr"
    assert type(type(model.layers[0]).__dict__.get("layer_output")).__name__ == "ValueAttr"
    import contextvars

    with model.trace(PROMPT):
        other = contextvars.Context()  # empty, as another asyncio task's or thread's
        with pytest.raises(mixlens.InputError, match="belongs to another asyncio task"):
            other.run(lambda: model.layers[0].linear_attn.betas)
        with pytest.raises(mixlens.InputError, match="belongs to another asyncio task"):
            other.run(lambda: model.layers_output[0])
        b = model.layers[0].linear_attn.betas  # the block's own context reads on
        assert b.shape[:2] == (1, len(model.tokenizer.encode(PROMPT)))


# ---- 4. saves of steps that never ran -------------------------------------------------------------


def test_saving_a_step_the_run_never_made_raises(model):
    path = "layers.0.linear_attn.betas"
    with pytest.raises(mixlens.InputError, match=r"step 9.*steps 0\.\.2"):
        model.generate(PROMPT, max_new_tokens=3, saves=[f"{path}@step9"]).run()
    with pytest.raises(mixlens.InputError, match=r"step 3.*step 0"):
        model.run(PROMPT, saves=[f"{path}@step3"])
    with pytest.raises(mixlens.InputError, match=r"step 1"):
        with model.trace(PROMPT, saves=[f"{path}@step1"]):
            pass
    # Steps that ran still save.
    tr = model.generate(PROMPT, max_new_tokens=3, saves=[f"{path}@step2"]).run()
    assert tr.saved[path][2] is not None


def test_a_step_past_max_new_tokens_is_refused_before_generating(model):
    path = "layers.0.linear_attn.betas"
    # Refused by generate() itself, before any forward runs (the tracer is never entered).
    with pytest.raises(mixlens.InputError, match=r"save 'layers.0.linear_attn.betas@step150'.*steps 0\.\.9"):
        model.generate(PROMPT, max_new_tokens=10, saves=[f"{path}@step150"])
    with pytest.raises(mixlens.InputError, match=r"edit 'layers.0.linear_attn.betas@step10'.*steps 0\.\.9"):
        model.generate(PROMPT, max_new_tokens=10, edits={f"{path}@step10": lambda v: v * 0})


def test_an_edit_of_a_step_the_run_never_made_raises_not_a_silent_no_op(model):
    path = "layers.0.linear_attn.betas"
    with pytest.raises(mixlens.InputError, match=r"edit 'layers.0.linear_attn.betas@step3'.*step 0"):
        model.run(PROMPT, edits={f"{path}@step3": lambda v: v * 0})
    with pytest.raises(mixlens.InputError, match=r"edit .*@step1'.*step 0"):
        with model.trace(PROMPT, edits={f"{path}@step1": lambda v: v * 0}):
            pass
    cache = model.new_cache()
    model.forward(PROMPT, cache=cache)
    with pytest.raises(mixlens.InputError, match=r"edit .*@step0'.*step 1"):
        model.forward([[5]], cache=cache, edits={f"{path}@step0": lambda v: v * 0})
    # A row stopping at EOS before the edited step: raised once the generation is over.
    eos = model.generate(PROMPT, max_new_tokens=2).run().tokens[0]
    with pytest.raises(mixlens.InputError, match=r"edit .*@step5'.*step 0"):
        model.generate(PROMPT, max_new_tokens=8, eos_token_id=eos, edits={f"{path}@step5": lambda v: v * 0}).run()
    # Edits of steps that ran apply (the logits move).
    base = model.run(PROMPT)["logits"]
    edited = model.run(PROMPT, edits={f"{path}@step0": lambda v: v * 0})["logits"]
    assert not np.allclose(np.asarray(base), np.asarray(edited))


# ---- 5. the default model ---------------------------------------------------------------------------


def test_load_without_a_path_uses_mixlens_model_then_the_shipped_model(monkeypatch, text_model_dir):
    monkeypatch.setenv("MIXLENS_MODEL", str(text_model_dir))
    assert mixlens.load().info["path"] == str(text_model_dir)
    assert mixlens.StandardizedTransformer().info["path"] == str(text_model_dir)
    monkeypatch.delenv("MIXLENS_MODEL")
    if not (SHIPPED_MODEL / "config.json").is_file():
        pytest.skip("the shipped model is not in this checkout")
    # The copy shipped in the installed package (package data), else the repository's.
    shipped = os.path.join(os.path.dirname(mixlens.__file__), "models", "mamba2-tinystories")
    want = shipped if os.path.isdir(shipped) else str(SHIPPED_MODEL)
    assert os.path.samefile(mixlens.default_model_path(), want)
    assert os.path.samefile(mixlens.load().info["path"], want)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(want) / f).read_bytes() == (SHIPPED_MODEL / f).read_bytes()


# ---- 6. docstrings point at files a clone has --------------------------------------------------------


def test_docstrings_point_at_docs_in_the_repository():
    import mixlens._model as m

    for doc in (mixlens.__doc__, m.StandardizedTransformer.__doc__, m.StandardizedTransformer.support.__doc__):
        assert "shared/spec" not in doc
    assert "docs/values.md" in mixlens.__doc__
    assert (REPO / "docs" / "values.md").is_file()


# ---- 7. ragged writes ------------------------------------------------------------------------------------


def test_a_ragged_write_raises_write_error_naming_the_value(model):
    path = "layers.0.linear_attn.betas"
    with model.trace(PROMPT):
        with pytest.raises(mixlens.WriteError, match=path):
            model.layers[0].linear_attn.betas = [[1.0, 2.0], [1.0]]
    with pytest.raises(mixlens.WriteError, match=path):
        model.run(PROMPT, edits={path: [[1.0, 2.0], [1.0]]})


# ---- 8. Ctrl-C during a long generation ------------------------------------------------------------------


def test_ctrl_c_stops_a_long_generation(model):
    # Time a short run to size a long one (several seconds) without EOS.
    t0 = time.perf_counter()
    model.generate([1, 2, 3], max_new_tokens=20, eos_token_id=-1).run()
    per_step = max((time.perf_counter() - t0) / 20, 1e-5)
    steps = int(min(max(6.0 / per_step, 100), 2**31 - 1))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate([1, 2, 3], max_new_tokens=steps, eos_token_id=-1).run()
    finally:
        timer.cancel()
    assert time.perf_counter() - t0 < 3.0, "the interrupt waited for the whole generation"
    # The model is usable afterwards.
    assert model.generate([1, 2, 3], max_new_tokens=2).run().steps == 2


# ---- arguments of the wrong kind: a mixlens error naming them, never a raw TypeError or a truth value --


@pytest.mark.parametrize("key", ["1", 1.0, True, np.bool_(True), None, slice("a", None)])
def test_a_layer_index_that_is_not_an_integer_is_refused(model, key):
    with pytest.raises(mixlens.InputError, match=r"model\.layers\[.*\]: a layer index is an integer"):
        model.layers[key]


def test_layer_indices_take_numpy_and_tensor_integers_and_past_the_end_is_an_index_error(model):
    import torch

    assert model.layers[np.int64(1)] is model.layers[1] is model.layers[torch.tensor(1)]
    assert model.layers[np.int32(-1)] is model.layers[model.num_layers - 1]
    with pytest.raises(IndexError, match="out of range") as e:
        model.layers[model.num_layers]
    assert isinstance(e.value, mixlens.InputError)  # and an IndexError: iteration stops at the end
    assert len(list(model.layers)) == model.num_layers


@pytest.mark.parametrize("key", [1.5, slice(None, None, 0), "a", None, [1, "x"], slice(0.5, 2)])
def test_a_bad_tracer_iter_key_is_an_input_error(model, key):
    with model.trace(PROMPT) as tracer:
        with pytest.raises(mixlens.InputError, match=r"tracer\.iter\[\.\.\.\]"):
            tracer.iter[key]
    with model.generate(PROMPT, max_new_tokens=2) as tracer:
        with pytest.raises(mixlens.InputError, match=r"tracer\.iter\[\.\.\.\]"):
            tracer.iter[key]


def test_tracer_iter_takes_numpy_and_tensor_integers_and_negative_lists_in_a_generation(model):
    import torch

    for key, want in [(np.int64(1), [1]), (torch.tensor(2), [2]), ([-1], [2]), ([np.int32(0), -2], [0, 1])]:
        with model.generate(PROMPT, max_new_tokens=3) as tracer:
            assert list(tracer.iter[key]) == want, key
    with model.trace(PROMPT) as tracer:
        assert list(tracer.iter[np.int64(-1)]) == [len(model.tokenizer.encode(PROMPT)) - 1]
        assert model.layers[0].linear_attn.state_after(torch.tensor(2)).shape[0] == 1  # 0-d int tensors too


@pytest.mark.parametrize("call", [
    lambda m: m.generate(PROMPT, max_new_tokens=2, do_sample="yes"),
    lambda m: m.generate(PROMPT, max_new_tokens=2, do_sample=1),
    lambda m: m.trace(PROMPT, grad="yes"),
    lambda m: mixlens.chunk_per_token(m, "yes"),
    lambda m: mixlens.chunk_per_token(m, 2),
])
def test_a_flag_that_is_not_true_or_false_is_refused(model, call):
    with pytest.raises(mixlens.InputError, match="must be True or False"):
        call(model)


def test_settings_of_the_wrong_type_raise_input_error():
    with pytest.raises(mixlens.InputError, match="chunk_per_token: model must be a mixlens model"):
        mixlens.chunk_per_token(None, True)
    with pytest.raises(mixlens.InputError, match="route_kernels: route must be a string"):
        mixlens.route_kernels("mamba2", None)
    with pytest.raises(mixlens.InputError, match="dtype 'float64' is not one of"):
        mixlens.load(str(SHIPPED_MODEL), dtype="float64")


def test_chunk_per_token_on_a_fixed_chunk_family_raises_instead_of_doing_nothing(hybrid):
    with pytest.raises(mixlens.UnsupportedError, match="chunks of 64 tokens, fixed"):
        mixlens.chunk_per_token(hybrid, True)
    mixlens.chunk_per_token(hybrid, False)  # the default: nothing to change, nothing to refuse


def test_without_torch_the_integer_and_flag_checks_accept_what_they_should():
    """The suite imports torch; this runs where nobody has (a numpy user): an earlier check took every plain
    int for a bool there (None == None)."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["torch"] = None  # `import torch` fails, as where it is not installed
import numpy as np, mixlens
m = mixlens.load({str(SHIPPED_MODEL)!r})
assert m.output_format == "numpy"
assert m.run("Once upon", logits="last")["logits"].shape[:2] == (1, 1)
with m.trace("Once upon a time") as tr:
    assert m.layers[np.int64(1)] is m.layers[1]
    m.layers[0].linear_attn.state_after(1)
    for t in tr.iter[np.int64(2)]:
        m.layers[1].linear_attn.state
with m.generate("Once", max_new_tokens=2, do_sample=np.bool_(True), seed=np.uint32(3)) as tr:
    pass
mixlens.chunk_per_token(m, True)
mixlens.chunk_per_token(m, False)
try:
    m.layers[True]
except mixlens.InputError:
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MIXLENS_OUTPUT": "auto"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def _wrong_kind_calls():
    from mixlens import interventions as iv, metrics

    P = "Once upon a time"
    return {
        "trace(cache='x')": lambda m: m.trace(P, cache="x"),
        "values(batch='1')": lambda m: m.values(batch="1"),
        "values(seq=0)": lambda m: m.values(seq=0),
        "kernel_route('bogus')": lambda m: mixlens.kernel_route("bogus"),
        "kernel_route(None)": lambda m: mixlens.kernel_route(None),
        "temperature='hot'": lambda m: m.generate(P, 2, do_sample=True, temperature="hot"),
        "top_p='0.9'": lambda m: m.generate(P, 2, do_sample=True, top_p="0.9"),
        "saves=5": lambda m: m.run(P, saves=5),
        "saves=[5]": lambda m: m.run(P, saves=[5]),
        "edits=['x']": lambda m: m.run(P, edits=["x"]),
        "edits={5: 1}": lambda m: m.run(P, edits={5: 1}),
        "encode(5)": lambda m: m.tokenizer.encode(5),
        "token_to_id(5)": lambda m: m.tokenizer.token_to_id(5),
        "LogProb(1.5)": lambda m: metrics.LogProb(1.5),
        "LogProb(True)": lambda m: metrics.LogProb(True),
        "LogitDiff(1, 'b')": lambda m: metrics.LogitDiff(1, "b"),
        "LogProb(5, position='x')": lambda m: metrics.LogProb(5, position="x"),
        "logit_lens(m, 5)": lambda m: iv.logit_lens(m, 5),
        "logit_lens(None, P)": lambda m: iv.logit_lens(None, P),
        "get_token_activations(idx=1.5)": lambda m: iv.get_token_activations(m, P, idx=1.5),
        "get_token_activations(idx=99)": lambda m: iv.get_token_activations(m, P, idx=99),
        "get_token_activations(layers='1')": lambda m: iv.get_token_activations(m, P, layers="1"),
        "TargetPrompt(P, 1.5)": lambda m: iv.TargetPrompt(P, 1.5),
        "patchscope_lens index 99": lambda m: iv.patchscope_lens(m, P, iv.TargetPrompt(P, 99)),
        "repeat_prompt(words=5)": lambda m: iv.repeat_prompt(words=5),
        "extract(ray='yes')": lambda m: m.extract([P], values="logits", out="never", ray="yes"),
        "extract(progress='no')": lambda m: m.extract([P], values="logits", out="never", progress="no"),
        "extract(store_prompts='no')": lambda m: m.extract([P], values="logits", out="never", store_prompts="no"),
        "extract(values=5)": lambda m: m.extract([P], values=5, out="never"),
        "extract(out=5)": lambda m: m.extract([P], values="logits", out=5),
        "open_extraction(5)": lambda m: mixlens.open_extraction(5),
    }


@pytest.mark.parametrize("name", list(_wrong_kind_calls()))
def test_public_calls_refuse_arguments_of_the_wrong_kind_by_name(model, name, tmp_path, monkeypatch):
    """A raw TypeError from deep inside, a string iterated as layers ("12" as layers 1 and 2), 1.5 taken as 1
    or "yes" as True: each is an InputError naming the argument (fresh-user trial)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mixlens.InputError):
        _wrong_kind_calls()[name](model)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("call", [
    lambda m, v: m.steer(layers="12", steering_vector=v),
    lambda m, v: m.steer(layers=[True], steering_vector=v),
    lambda m, v: m.steer(1, v, factor=None),
    lambda m, v: m.steer(1, v, positions=1.5),
    lambda m, v: m.steer(1, v, batch_index="a"),
    lambda m, v: m.skip_layer("1"),
    lambda m, v: m.skip_layers(0, 2.0),
    lambda m, v: m.layers[0].linear_attn.state_after(np.array([[1]])),
])
def test_intervention_arguments_of_the_wrong_kind_are_refused_inside_a_trace(model, call):
    with model.trace("Once upon a time"):
        with pytest.raises(mixlens.InputError):
            call(model, np.zeros(model.hidden_size, np.float32))


def test_a_mask_of_anything_but_zeros_and_ones_is_refused_not_a_crash(model, tmp_path):
    with pytest.raises(mixlens.InputError, match="mask entry 2 of prompt 0 is 2"):
        model.extract(["Once upon a time"], values="logits", out=tmp_path / "x", positions="mask",
                      masks=[[1, 0, 2, 1]], progress=False)


def test_extraction_indices_take_integers_and_past_the_end_is_an_index_error(model, tmp_path):
    model.extract(["Once upon a time", "The cat"], values="logits", out=tmp_path / "x", progress=False)
    ex = mixlens.open_extraction(tmp_path / "x")
    assert np.array_equal(np.asarray(ex.prompt(np.int64(1))["logits"]), np.asarray(ex.prompt(-1)["logits"]))
    for bad in ("0", True, 1.0):
        with pytest.raises(mixlens.InputError):
            ex.prompt(bad)
    with pytest.raises(IndexError, match="shard 99 is out of range"):
        ex.shard(99)
