"""Hostile inputs through the Python API (issue 11 items 2, 4, 6, 7): every case is a MixlensError
subclass with a clear message; none kills the interpreter, hangs, or returns wrong numbers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mixlens

REPO = Path(__file__).resolve().parents[2]
MAMBA2 = REPO / "tests" / "fixtures" / "mamba2" / "short_prompt"
QWEN = REPO / "tests" / "fixtures" / "qwen3_5" / "short_prompt"


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def _edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_deeply_nested_config_is_a_config_error_in_a_child_interpreter(tmp_path):
    # It used to kill the interpreter (stack overflow); run in a child so a regression fails the test
    # instead of the whole pytest run.
    folder = _copy(MAMBA2, tmp_path / "m")
    text = (folder / "config.json").read_text().rstrip()
    deep = '{"__float__":' * 40000 + "1" + "}" * 40000
    (folder / "config.json").write_text(text[:-1] + ', "x": ' + deep + "}")
    code = (
        "import mixlens, sys\n"
        "try:\n"
        f"    mixlens.load({str(folder)!r})\n"
        "except mixlens.ConfigError as e:\n"
        "    print('CONFIGERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CONFIGERROR" in out.stdout and "nested deeper than 128 levels" in out.stdout, out.stdout


def test_deeply_nested_tokenizer_is_a_tokenizer_error():
    deep = "null"
    for _ in range(2000):
        deep = '{"type":"Sequence","pretokenizers":[' + deep + "]}"
    text = '{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":[]},"pre_tokenizer":' + deep + "}"
    with pytest.raises(mixlens.TokenizerError, match="nested deeper than 128 levels"):
        _load_tokenizer_file(text)


def _load_tokenizer_file(text: str):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        folder = _copy(MAMBA2, Path(d))
        (folder / "tokenizer.json").write_text(text)
        mixlens.load(str(folder))


def test_huge_write_raises_numeric_error_naming_the_value():
    model = mixlens.load(str(QWEN))
    shape = next(v["shape"] for v in model.values(1, 4) if v["path"] == "layers.0.linear_attn.betas")
    huge = np.full(shape, 3e38, dtype=np.float32)
    with pytest.raises(mixlens.NumericError, match=r"non-finite logits.*first non-finite value was "
                                                   r"layers\.0\.linear_attn\.attention_output = NaN"):
        model.run([[5, 6, 7, 8]], edits={"layers.0.linear_attn.betas": huge})
    assert issubclass(mixlens.NumericError, mixlens.MixlensError)
    # The model stays usable afterwards.
    assert np.isfinite(model.run([[5, 6, 7, 8]])["logits"]).all()


@pytest.mark.parametrize("folder, site", [
    (MAMBA2, "layers.0.layer_output"),
    (QWEN, "layers.1.layer_output"),
    (QWEN, "layers.0.linear_attn.attention_head_outputs"),  # the gated norm over each head
    (QWEN, "layers.0.linear_attn.attention_keys"),  # the l2norm of k
])
def test_finite_huge_write_overflowing_a_norm_raises(folder, site):
    # 3e38 is finite, but the next norm's mean of squares overflows float32 and the row normalised to
    # zeros (as in transformers): all-zero logits, silently. The norm now gives NaN, and the watch raises.
    model = mixlens.load(str(folder))
    shape = next(v["shape"] for v in model.values(1, 4) if v["path"] == site)
    with pytest.raises(mixlens.NumericError, match=r"forward produced non-finite logits"):
        model.run([[5, 6, 7, 8]], edits={site: np.full(shape, 3e38, dtype=np.float32)})
    moderate = model.run([[5, 6, 7, 8]], edits={site: np.full(shape, 1e6, dtype=np.float32)})["logits"]
    assert np.isfinite(moderate).all()


@pytest.mark.parametrize("field, value, needle", [
    ("rope_theta", float("nan"), "field 'rope_parameters.rope_theta' = NaN is out of range: must be a finite number > 0"),
    ("rope_theta", 0, "field 'rope_parameters.rope_theta' = 0 is out of range"),
    ("rope_theta", -10.0, "field 'rope_parameters.rope_theta' = -10.0 is out of range"),
])
def test_bad_rope_theta_is_a_config_error(tmp_path, field, value, needle):
    folder = _copy(QWEN, tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"][field] = value
    (folder / "config.json").write_text(json.dumps(cfg))  # Python writes NaN bare
    with pytest.raises(mixlens.ConfigError) as e:
        mixlens.load(str(folder))
    assert needle in str(e.value)


def test_token_ids_and_chunk_size_are_range_checked(tmp_path):
    folder = _copy(MAMBA2, tmp_path / "m")
    _edit_config(folder, eos_token_id=10**12)
    with pytest.raises(mixlens.ConfigError, match=r"field 'eos_token_id' = 1000000000000 is out of range"):
        mixlens.load(str(folder))
    _edit_config(folder, eos_token_id=["x"])  # a JSON type error is a ConfigError, not a RuntimeError
    with pytest.raises(mixlens.ConfigError, match="expected an integer token id"):
        mixlens.load(str(folder))
    _edit_config(folder, eos_token_id=2, chunk_size=16384)
    with pytest.raises(mixlens.ConfigError, match=r"field 'chunk_size' = 16384 is out of range: a chunk size must be in \[1, 2048\]"):
        mixlens.load(str(folder))


def test_fifo_in_the_model_folder_is_refused_without_hanging(tmp_path):
    folder = _copy(MAMBA2, tmp_path / "m")
    os.remove(folder / "model.safetensors")
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(mixlens.CheckpointError, match="is not a regular file"):
        mixlens.load(str(folder))


def test_save_budget_is_a_resource_error(tmp_path, monkeypatch):
    folder = _copy(MAMBA2, tmp_path / "m")
    _edit_config(folder, eos_token_id=None)
    model = mixlens.load(str(folder))
    monkeypatch.setenv("MIXLENS_SAVE_BUDGET_MB", "1")
    with pytest.raises(mixlens.ResourceError, match="MiB budget") as e:
        model.generate([[5, 6, 7]], max_new_tokens=10**6, saves=["layers.*.linear_attn.states"]).run()
    assert isinstance(e.value, MemoryError) and isinstance(e.value, mixlens.MixlensError)


def test_out_of_memory_is_a_resource_error():
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("overcommit_memory=1: a huge allocation would succeed and the zero-fill OOM-kill us")
    model = mixlens.load(str(MAMBA2))
    # A batch whose cache needs ~1.6 TB: std::bad_alloc inside the library.
    with pytest.raises(mixlens.ResourceError, match="out of memory") as e:
        model._core.new_cache(2**30)
    assert isinstance(e.value, MemoryError)


def _hub_entry(cache: Path, ref: str) -> Path:
    repo = cache / "models--someone--m"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    _copy(MAMBA2, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(ref)
    return snap


@pytest.mark.parametrize("ref", ["/etc", "../../outside", "..", "../snapshots/../../x"])
def test_hub_resolve_refuses_refs_outside_the_cache(tmp_path, ref):
    cache = tmp_path / "hub"
    (tmp_path / "outside").mkdir()
    _hub_entry(cache, ref)
    with pytest.raises(mixlens.CheckpointError, match=r"refs/main holds '.*', not a commit hash"):
        mixlens.hub.resolve("someone/m", cache_dir=str(cache))
    with pytest.raises(mixlens.CheckpointError, match="not a commit hash"):
        mixlens.load("someone/m", cache_dir=str(cache))


def test_hub_resolve_is_the_cpp_resolver(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = _hub_entry(cache, "0123456789abcdef0123456789abcdef01234567\n")
    assert os.path.samefile(mixlens.hub.resolve("someone/m", cache_dir=str(cache)), snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert mixlens.hub.default_cache_dir() == str(cache)
    assert os.path.samefile(mixlens.hub.resolve("someone/m"), snap)
    assert os.path.samefile(mixlens.load("someone/m").info["path"], snap)


def test_error_quoting_invalid_utf8_bytes_is_still_a_mixlens_error(tmp_path):
    # nlohmann's parse error quotes the bytes it read ("last read: '\xff'"): the message used to reach
    # PyErr_SetString as-is and surface as UnicodeDecodeError instead of CheckpointError.
    folder = _copy(MAMBA2, tmp_path / "m")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:20] = b"\xff" * 12
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(mixlens.CheckpointError, match=r"not valid JSON.*\\xff"):
        mixlens.load(str(folder))


def test_text_with_a_lone_surrogate_is_an_input_error(tmp_path):
    # nanobind cannot convert such a str and raised TypeError "encode(): incompatible function arguments".
    model = mixlens.load()
    with pytest.raises(mixlens.InputError, match="not valid Unicode"):
        model.tokenizer.encode("a\ud800")
    with pytest.raises(mixlens.InputError, match="not valid Unicode"):
        model.run(["fine", "x\udfff"])
    with pytest.raises(mixlens.InputError, match="prompt 1 is not valid Unicode"):
        model.extract(["fine", "a\ud800"], values=["logits"], out=str(tmp_path / "acts"))


def test_a_broken_mixlens_model_variable_is_named_in_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXLENS_MODEL", str(tmp_path / "gone"))
    with pytest.raises(mixlens.CheckpointError, match=r"does not exist \(the path came from \$MIXLENS_MODEL"):
        mixlens.load()


def test_assigning_a_head_weight_is_a_write_error():
    # embed_tokens.weight = x used to say "'embed_tokens.weight' is read inside `with model.trace(...)`",
    # and lm_head.weight = x raised a bare AttributeError.
    model = mixlens.load()
    for obj, role in ((model.embed_tokens, "embed_tokens"), (model.ln_final, "ln_final"), (model.lm_head, "lm_head")):
        with pytest.raises(mixlens.WriteError, match=f"{role}.weight is read-only"):
            obj.weight = np.zeros(3, dtype=np.float32)


def test_a_cache_left_midway_by_a_failed_call_is_refused_until_restored():
    # A trace over a cache that raised or stopped, or a forward that raised mid-way, used to leave the
    # cache partly advanced (the next logits differed by ~8 from the snapshot's; NaN after a NumericError)
    # while seen_tokens / steps showed the old counts, and nothing stopped a continuation from it.
    model = mixlens.load()
    ids = model.tokenizer.encode("Once upon a time")

    def stop(c):
        with model.trace([[42]], cache=c) as tr:
            model.layers[2].layer_output
            tr.stop()

    def user_error(c):
        with pytest.raises(RuntimeError):
            with model.trace([[42]], cache=c):
                model.layers[2].layer_output
                raise RuntimeError("user code")

    def numeric(c):
        with pytest.raises(mixlens.NumericError):
            model.forward([[42]], cache=c, edits={"layers.1.linear_attn.attention_values": 3e38})

    for fail in (stop, user_error, numeric):
        cache = model.new_cache(1)
        model.forward([ids], cache=cache)
        snap = cache.copy()
        fail(cache)
        assert "stopped midway" in cache.broken
        with pytest.raises(mixlens.InputError, match="partly updated"):
            model.forward([[42]], cache=cache)
        with pytest.raises(mixlens.InputError, match="partly updated"):
            cache.copy()
        cache.restore(snap)
        assert cache.broken == ""
        a = np.asarray(model.forward([[42]], cache=cache)["logits"])
        b = np.asarray(model.forward([[42]], cache=snap)["logits"])
        assert np.array_equal(a, b)
    # Inputs refused before the forward starts leave the cache usable.
    cache = model.new_cache(1)
    model.forward([ids], cache=cache)
    with pytest.raises(mixlens.InputError, match="outside the vocabulary"):
        model.forward([[10**6]], cache=cache)
    assert cache.broken == ""
    model.forward([[42]], cache=cache)


def test_torch_values_save_load_and_deepcopy_as_plain_tensors(tmp_path):
    # torch.load (weights_only=True by default) refused a saved ValueTensor, and copy.deepcopy raised
    # RuntimeError (torch's subclass deepcopy needs new_empty()).
    import copy

    torch = pytest.importorskip("torch")
    model = mixlens.load(output="torch")
    with model.trace("Once upon a time") as tr:
        b = model.layers[1].linear_attn.betas
    torch.save({"b": b}, tmp_path / "v.pt")
    loaded = torch.load(tmp_path / "v.pt")["b"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, b)
    c = copy.deepcopy({"b": b, "same": b})
    assert type(c["b"]) is torch.Tensor and torch.equal(c["b"], b) and c["b"] is c["same"]


@pytest.mark.parametrize("name", ["mamba-tinystories", "mamba2-tinystories", "qwen3_5-tinystories"])
def test_a_config_with_fewer_layers_than_its_checkpoint_is_refused(tmp_path, name):
    # A new user set num_hidden_layers 5 on the 6-layer model: it loaded a silently truncated model.
    src = Path(__file__).resolve().parents[2] / "models" / name
    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = layers - 1
    for key in ("layer_types", "layers_block_type"):  # per-layer lists follow the count
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][: layers - 1]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mixlens.ConfigError, match=rf"tensors of layer {layers - 1} .* describes {layers - 1} layers"):
        mixlens.load(str(dst))
    mixlens.load(str(src))  # the untouched folder loads


def _load_in_child(env: dict) -> str:
    """stdout of a child interpreter that loads the shipped model: 'INPUTERROR <message>' if load refused."""
    code = (
        "import mixlens\n"
        "try:\n"
        "    mixlens.load()\n"
        "except mixlens.InputError as e:\n"
        "    print('INPUTERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("value", ["bogus", "AVX512"])
def test_an_unknown_isa_level_is_refused_at_load_naming_the_variable(value):
    # It was accepted at load and raised at the first forward, without naming MIXLENS_ISA.
    out = _load_in_child(dict(os.environ, MIXLENS_ISA=value))
    assert "INPUTERROR" in out and f"MIXLENS_ISA={value}" in out and "avx2" in out, out


@pytest.mark.parametrize("var", ["MIXLENS_ARENA_MB", "MIXLENS_ARENA_BIG_MB", "MIXLENS_SAVE_BUDGET_MB"])
def test_a_mistyped_memory_setting_is_refused_at_load(var):
    # They were read where first used: a typo was accepted at load and raised later, inside a trace.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLENS_ARENA") and k != "MIXLENS_SAVE_BUDGET_MB"}
    env[var] = "12x"
    out = _load_in_child(env)
    assert "INPUTERROR" in out and var in out, out
