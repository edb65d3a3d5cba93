"""Dataset extraction (issue 10 item 4): `mixlens extract` and `model.extract` write the same sharded
safetensors + index.json; every stored row equals the value read by a trace of its prompt alone;
positions all / last / mask; txt / jsonl / list / datasets inputs; size estimate and --max-bytes
refusal; resume after an interruption (a Python exception mid-way, a SIGKILLed CLI) equals a clean
run; bad inputs name the file line; Ray on a local cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mixlens
from mixlens import _extract
from mixlens_dev.common import SHIPPED_MODEL

PROMPTS = [
    "Once upon a time, there was a little",
    "The cat sat on the",
    "Tom and Lily went to the park to play with a ball",
    "One day",
    "She was very happy because her mom gave her a red",
]
VALUES = ["layers.*.linear_attn.betas", "layers.1.linear_attn.states", "layers.2.linear_attn.state_output",
          "logits"]


def cli_path() -> Path:
    for cand in (Path(sys.executable).parent / "mixlens", Path(__file__).resolve().parents[2] / "build" / "py" / "mixlens"):
        if cand.is_file():
            return cand
    pytest.fail("the mixlens CLI is not installed: run `make build`")


def cli(*args, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, MIXLENS_MODEL=str(SHIPPED_MODEL))
    r = subprocess.run([str(cli_path()), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def model():
    return mixlens.load(str(SHIPPED_MODEL), output="numpy")


def shard_tensors(out: Path) -> dict:
    index = json.loads((out / "index.json").read_text())
    return {s["file"]: _extract._read_safetensors(str(out / s["file"])) for s in index["shards"]}


def assert_same_extraction(a: Path, b: Path) -> None:
    """Same index.json and bitwise-equal shards (same batches, same code path)."""
    assert (a / "index.json").read_text() == (b / "index.json").read_text()
    ta, tb = shard_tensors(a), shard_tensors(b)
    assert ta.keys() == tb.keys()
    for f in ta:
        assert ta[f].keys() == tb[f].keys()
        for k in ta[f]:
            np.testing.assert_array_equal(ta[f][k], tb[f][k], err_msg=f"{f}:{k}")


@pytest.mark.parametrize("positions", ["all", "last", "mask"])
def test_rows_equal_a_trace_of_each_prompt(model, tmp_path, positions):
    masks = None
    if positions == "mask":
        masks = [[(i + t) % 2 for t in range(len(model.tokenizer.encode(p)))] for i, p in enumerate(PROMPTS)]
    res = model.extract(PROMPTS, values=VALUES, out=tmp_path, batch_size=2, positions=positions, masks=masks,
                        shard_bytes=150_000, progress=False)
    assert res["complete"] and res["num_shards"] >= 2 and res["shards_written"] == res["num_shards"]
    ex = mixlens.open_extraction(tmp_path)
    names = [v["name"] for v in ex.index["values"]]
    assert names == [f"layers.{l}.linear_attn.betas" for l in range(model.num_layers)] + VALUES[1:]
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenizer.encode(prompt)
        want_pos = {"all": list(range(len(ids))), "last": [len(ids) - 1],
                    "mask": [t for t in range(len(ids)) if masks and masks[i][t]]}[positions]
        alone = model.run(prompt, saves=names)  # one prompt, no padding
        got = ex.prompt(i)
        assert got["positions"].tolist() == want_pos
        assert got["token_ids"].tolist() == [ids[t] for t in want_pos]
        for name in names:
            want = alone[name][0]
            if name.endswith("state_output"):
                np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
            else:
                np.testing.assert_allclose(got[name], want[want_pos], rtol=1e-4, atol=1e-5, err_msg=name)
    idx = ex.index
    assert idx["positions"] == positions and idx["mixlens_version"] == mixlens.__version__
    assert idx["num_rows"] == sum(p["rows"] for p in idx["prompts"]) == ex.value("logits").shape[0]
    assert [p["text"] for p in idx["prompts"]] == PROMPTS
    assert idx["total_bytes"] == sum(s["bytes"] for s in idx["shards"]) == res["total_bytes"]
    # The estimate is the data size: each file is it plus its header.
    for s in idx["shards"]:
        size = (tmp_path / s["file"]).stat().st_size
        assert s["bytes"] < size < s["bytes"] + 8192


def test_cli_txt_jsonl_list_and_dataset_write_the_same_files(model, tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "body": p}) + "\n" for i, p in enumerate(PROMPTS)))
    args = ["--values", ",".join(VALUES[:2]), "--batch-size", 3, "--shard-bytes", "100K"]
    r = cli("extract", tmp_path / "p.txt", *args, "--out", f"{tmp_path / 'cli'}/")
    assert "about" in r.stderr and "prompts/s" in r.stderr and "ETA" in r.stderr  # estimate, progress line
    assert f"index: {tmp_path / 'cli' / 'index.json'}\n" in r.stderr  # no doubled slash from "--out dir/"
    cli("extract", tmp_path / "p.jsonl", *args, "--text-field", "body", "--out", tmp_path / "cli_jsonl")
    kw = dict(values=VALUES[:2], batch_size=3, shard_bytes=100 << 10, progress=False)
    model.extract(PROMPTS, out=tmp_path / "py", **kw)
    model.extract(str(tmp_path / "p.jsonl"), out=tmp_path / "py_jsonl", text_field="body", **kw)
    datasets = pytest.importorskip("datasets", reason="HuggingFace datasets is not installed")
    ds = datasets.Dataset.from_dict({"text": PROMPTS, "n": list(range(len(PROMPTS)))})
    model.extract(ds, out=tmp_path / "py_ds", **kw)
    for other in ("cli_jsonl", "py", "py_jsonl", "py_ds"):
        assert_same_extraction(tmp_path / "cli", tmp_path / other)


def test_read_back_as_torch_or_numpy_owned_copies(model, tmp_path, monkeypatch):
    import torch

    model.extract(PROMPTS[:2], values=VALUES[:2], out=tmp_path, progress=False)
    monkeypatch.delenv("MIXLENS_OUTPUT", raising=False)
    as_torch = mixlens.open_extraction(tmp_path)  # auto: torch is installed here
    as_numpy = mixlens.open_extraction(tmp_path, output="numpy")
    t, n = as_torch.prompt(1), as_numpy.prompt(1)
    assert set(t) == set(n) and all(isinstance(v, torch.Tensor) for v in t.values())
    assert all(isinstance(v, np.ndarray) and v.flags.writeable for v in n.values())
    for k in n:
        np.testing.assert_array_equal(t[k].numpy(), n[k])
    assert t["token_ids"].dtype == torch.int64 and t[VALUES[1]].dtype == torch.float32
    n[VALUES[1]][...] = 0  # an owned copy: the file and later reads are untouched
    assert np.abs(as_numpy.prompt(1)[VALUES[1]]).sum() > 0
    # Negative indices count from the end, as on a Python sequence; past either end is refused.
    np.testing.assert_array_equal(as_numpy.prompt(-1)["token_ids"], as_numpy.prompt(1)["token_ids"])
    np.testing.assert_array_equal(as_numpy.prompt(-2)["token_ids"], as_numpy.prompt(0)["token_ids"])
    for bad in (2, -3):
        with pytest.raises(mixlens.InputError, match=f"prompt {bad} is out of range"):
            as_numpy.prompt(bad)
    assert isinstance(as_torch.value(VALUES[1]), torch.Tensor)
    monkeypatch.setenv("MIXLENS_OUTPUT", "numpy")
    assert isinstance(mixlens.open_extraction(tmp_path).prompt(0)["positions"], np.ndarray)
    with pytest.raises(mixlens.InputError, match="output must be one of"):
        mixlens.open_extraction(tmp_path, output="jax")


def test_mask_from_jsonl_and_dataset(model, tmp_path):
    masks = [[1 if t in (0, 2) else 0 for t in range(len(model.tokenizer.encode(p)))] for p in PROMPTS]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"text": p, "keep": m}) + "\n" for p, m in zip(PROMPTS, masks)))
    cli("extract", tmp_path / "m.jsonl", "--values", "logits", "--positions", "mask", "--mask-field", "keep",
        "--out", tmp_path / "cli")
    ex = mixlens.open_extraction(tmp_path / "cli")
    assert [ex.prompt(i)["positions"].tolist() for i in range(len(PROMPTS))] == [
        [t for t in (0, 2) if t < len(m)] for m in masks]
    model.extract(PROMPTS, values="logits", positions="mask", masks=masks, out=tmp_path / "py", progress=False)
    assert_same_extraction(tmp_path / "cli", tmp_path / "py")
    datasets = pytest.importorskip("datasets", reason="HuggingFace datasets is not installed")
    ds = datasets.Dataset.from_dict({"text": PROMPTS, "keep": masks})
    model.extract(ds, values="logits", positions="mask", mask_field="keep", out=tmp_path / "ds", progress=False)
    assert_same_extraction(tmp_path / "cli", tmp_path / "ds")


def test_max_bytes_refusal_names_both_numbers(model, tmp_path):
    plan = _extract._plan(model._core, [(p, [], []) for p in PROMPTS], VALUES, 8, "all",
                          _extract.DEFAULT_SHARD_BYTES, None, True)
    with pytest.raises(mixlens.ResourceError) as e:
        model.extract(PROMPTS, values=VALUES, out=tmp_path / "o", max_bytes=plan.total_bytes - 1, progress=False)
    assert str(plan.total_bytes) in str(e.value) and str(plan.total_bytes - 1) in str(e.value)
    assert not (tmp_path / "o").exists()  # refused before anything is written
    model.extract(PROMPTS, values=VALUES, out=tmp_path / "o", max_bytes=plan.total_bytes, progress=False)
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS))
    r = cli("extract", tmp_path / "p.txt", "--values", "logits", "--out", tmp_path / "c", "--max-bytes", "1K", check=False)
    assert r.returncode == 1 and "past the limit of 1024 bytes" in r.stderr and "would take" in r.stderr
    assert not (tmp_path / "c").exists()


def test_resume_after_an_exception_equals_a_clean_run(model, tmp_path, monkeypatch):
    kw = dict(values=VALUES, batch_size=2, shard_bytes=60_000, progress=True)
    clean = model.extract(PROMPTS, out=tmp_path / "clean", **kw)
    assert clean["num_shards"] >= 4

    class Stop(Exception):
        pass

    def stop_after_two(self, p):  # stands in for the tqdm bar: a Ctrl-C after the second shard
        if p["shards_done"] == 2:
            raise Stop

    monkeypatch.setattr(_extract._Progress, "__call__", stop_after_two)
    with pytest.raises(Stop):
        model.extract(PROMPTS, out=tmp_path / "resumed", **kw)
    monkeypatch.undo()
    index = json.loads((tmp_path / "resumed" / "index.json").read_text())
    assert index["complete"] is False and [s["done"] for s in index["shards"]][:2] == [False, False]
    done = sorted(p.name for p in (tmp_path / "resumed").glob("shard-*.safetensors"))
    assert len(done) == 2
    before = {f: (tmp_path / "resumed" / f).stat().st_mtime_ns for f in done}
    res = model.extract(PROMPTS, out=tmp_path / "resumed", **kw)
    assert res["shards_skipped"] == 2 and res["shards_written"] == clean["num_shards"] - 2 and res["complete"]
    assert {f: (tmp_path / "resumed" / f).stat().st_mtime_ns for f in done} == before  # not rewritten
    assert_same_extraction(tmp_path / "clean", tmp_path / "resumed")


def test_resume_after_the_cli_is_killed_equals_a_clean_run(tmp_path):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(24)]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = ["extract", tmp_path / "p.txt", "--values", "layers.1.linear_attn.states", "--batch-size", 2,
            "--shard-bytes", "1M"]
    cli(*args, "--out", tmp_path / "clean")
    n_shards = len(json.loads((tmp_path / "clean" / "index.json").read_text())["shards"])
    assert n_shards >= 6
    out = tmp_path / "killed"
    env = dict(os.environ, MIXLENS_MODEL=str(SHIPPED_MODEL))
    proc = subprocess.Popen([str(cli_path()), *map(str, args), "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out / "shard-00002.safetensors").exists():
        time.sleep(0.01)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    shards = sorted(out.glob("shard-*.safetensors"))
    # The CLI may have finished before the kill on a fast machine: then lose the later shards as a
    # crash would, and leave a half-written .tmp and a truncated shard behind.
    if not killed or len(shards) == n_shards:
        for f in shards[3:]:
            f.unlink()
        (out / "shard-00004.safetensors.tmp").write_bytes(b"\0" * 100)
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])  # a damaged shard is written again, not trusted
    assert not json.loads((out / "index.json").read_text())["complete"] or not killed
    r = cli(*args, "--out", out)
    assert "already complete (resumed)" in r.stderr
    kept = int(r.stderr.split(" shards written, ")[1].split(" already")[0])
    assert 1 <= kept < n_shards
    assert_same_extraction(tmp_path / "clean", out)
    assert not list(out.glob("*.tmp"))


def test_another_extraction_in_the_same_folder_is_refused(model, tmp_path):
    model.extract(PROMPTS, values="logits", out=tmp_path, progress=False)
    with pytest.raises(mixlens.InputError, match="holds another extraction"):
        model.extract(PROMPTS[:2], values="logits", out=tmp_path, progress=False)


def test_bad_inputs_are_named(model, tmp_path):
    def refused(path, match, **kw):
        with pytest.raises(mixlens.InputError, match=match):
            model.extract(str(path), values="logits", out=tmp_path / "o", progress=False, **kw)

    refused(tmp_path / "missing.txt", r"missing.txt' does not exist")
    (tmp_path / "empty.txt").write_text("")
    refused(tmp_path / "empty.txt", "is empty")
    (tmp_path / "blank.txt").write_text("a\n\nb\n")
    refused(tmp_path / "blank.txt", "line 2 is empty")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    refused(tmp_path / "bad.jsonl", r"bad.jsonl line 3: not valid JSON")
    (tmp_path / "field.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    refused(tmp_path / "field.jsonl", r"line 2: no field 'text'")
    (tmp_path / "type.jsonl").write_text('{"text": 5}\n')
    refused(tmp_path / "type.jsonl", r"line 1: field 'text' is not a string")
    (tmp_path / "arr.jsonl").write_text('["a"]\n')
    refused(tmp_path / "arr.jsonl", r"line 1: expected a JSON object")
    (tmp_path / "mask.jsonl").write_text('{"text": "Once upon", "mask": [1, 2]}\n')
    refused(tmp_path / "mask.jsonl", r"line 1: field 'mask' must hold only 0 and 1", positions="mask")
    (tmp_path / "len.jsonl").write_text('{"text": "Once upon a time", "mask": [1]}\n')
    refused(tmp_path / "len.jsonl", r"prompt 0: the mask has 1 entries for \d+ tokens", positions="mask")
    with pytest.raises(mixlens.InputError, match="no prompts"):
        model.extract([], values="logits", out=tmp_path / "o")
    with pytest.raises(mixlens.InputError, match="prompt 1 is an empty string"):
        model.extract(["a", ""], values="logits", out=tmp_path / "o")
    with pytest.raises(mixlens.UnknownValueError):
        model.extract(PROMPTS, values="layers.*.linear_attn.betaz", out=tmp_path / "o")
    with pytest.raises(mixlens.UnsupportedError, match="@t"):
        model.extract(PROMPTS, values="layers.0.linear_attn.state@t1", out=tmp_path / "o")
    with pytest.raises(mixlens.InputError, match="positions must be"):
        model.extract(PROMPTS, values="logits", out=tmp_path / "o", positions="first")
    with pytest.raises(mixlens.InputError, match="masks="):
        model.extract(PROMPTS, values="logits", out=tmp_path / "o", positions="mask")
    # masks given in Python: only 0 / 1 (a 2 overflowed the row buffer and crashed the process)
    for masks, says in [([[1, 0, 2, 1]], r"mask entry 2 of prompt 0 is 2"), ([[1, 0, -1, 1]], "is -1"),
                        ([[1.0, 0, 1, 1]], "is 1.0"), ([["a", 0, 1, 1]], "is 'a'"), (5, "masks must be a list"),
                        (["1011"], "the mask of prompt 0 must be a list")]:
        with pytest.raises(mixlens.InputError, match=says):
            model.extract([[5, 6, 7, 8]], values="logits", out=tmp_path / "o", positions="mask", masks=masks,
                          progress=False)
    assert not (tmp_path / "o").exists()
    # The CLI says the same, with the line, and exits 1 (2 for a usage error).
    r = cli("extract", tmp_path / "bad.jsonl", "--values", "logits", "--out", tmp_path / "c", check=False)
    assert r.returncode == 1 and "bad.jsonl line 3: not valid JSON" in r.stderr
    r = cli("extract", tmp_path / "bad.jsonl", "--out", tmp_path / "c", check=False)
    assert r.returncode == 2 and "--values" in r.stderr


def test_extract_fuzzish_lines_never_crash(tmp_path):
    """Random bytes as prompt files: an InputError or prompts, never another exception."""
    rng = np.random.default_rng(0)
    for i in range(60):
        raw = bytes(rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8))
        if i % 3 == 0:
            raw = b'{"text": "a"}\n' + raw
        for ext in (".txt", ".jsonl"):
            f = tmp_path / f"f{i}{ext}"
            f.write_bytes(raw)
            try:
                prompts = mixlens._core.read_prompts_file(str(f))
            except mixlens.InputError as e:
                assert str(f) in str(e)
            else:
                assert prompts and all(p[0] for p in prompts)


def test_ray_extraction_on_a_local_cluster_equals_a_local_run(model, tmp_path):
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        pytest.skip(f"ray[data] is not importable ({e})")
    kw = dict(values=VALUES[:2], batch_size=2, shard_bytes=100_000, progress=False)
    local = model.extract(PROMPTS, out=tmp_path / "local", **kw)
    assert local["num_shards"] >= 3
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MIXLENS_OUTPUT": "numpy"}})
    try:
        res = model.extract(PROMPTS, out=tmp_path / "ray", ray=True, num_workers=2, **kw)
    finally:
        ray.shutdown()
    assert res["complete"] and res["shards_written"] == local["num_shards"]
    assert_same_extraction(tmp_path / "local", tmp_path / "ray")


def test_ray_missing_is_a_clear_error(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'ray\[data\]'"):
        model.extract(PROMPTS, values="logits", out=tmp_path, ray=True)


def test_progress_without_tqdm_is_a_plain_line(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    model.extract(PROMPTS, values="logits", out=tmp_path, shard_bytes=1)
    err = capsys.readouterr().err
    assert f"extract: {len(PROMPTS)}/{len(PROMPTS)} prompts" in err and "prompts/s" in err and "ETA" in err


def test_reading_a_truncated_or_corrupt_extraction_is_an_input_error(tmp_path):
    # open_extraction used to raise json.JSONDecodeError (or a numpy reshape error) on a damaged
    # index.json / shard instead of a mixlens error naming the file.
    model = mixlens.load(output="numpy")
    out = tmp_path / "acts"
    model.extract(["Once upon a time", "The dog"], values=["logits"], out=str(out))
    shard = out / "shard-00000.safetensors"
    size = shard.stat().st_size
    for cut in (size - 10, 100, 3):  # shrinking only
        os.truncate(shard, cut)
        with pytest.raises(mixlens.InputError, match="truncated or corrupt"):
            mixlens.open_extraction(str(out)).prompt(0)
    (out / "index.json").write_text("{")
    with pytest.raises(mixlens.InputError, match="index.json is not valid JSON"):
        mixlens.open_extraction(str(out))
