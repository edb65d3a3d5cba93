"""The `mixlens` command as installed (.venv/bin/mixlens, else the build tree's binary): generate,
run --save/--out, inspect, tokenize, against transformers; every bad input exits non-zero with a
clear one-line message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixlens_dev import oracle_mamba2 as om
from mixlens_dev.common import REPO, SHIPPED_MODEL, rel_rms, tolerance

PROMPT = "Once upon a time, there was a little"


def find_cli() -> str:
    for cand in (Path(sys.executable).parent / "mixlens", REPO / ".venv" / "bin" / "mixlens", REPO / "build" / "py" / "mixlens"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    pytest.fail("the mixlens CLI is not installed: run `make build`")


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([find_cli(), *map(str, args)], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def torch_model(text_model_dir):
    import torch
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM.from_pretrained(str(text_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(text_model_dir):
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(text_model_dir / "tokenizer.json")).encode(PROMPT).ids


def test_generate_greedy_matches_transformers(text_model_dir, torch_model, prompt_ids):
    import torch

    n = 8
    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--greedy")
    assert r.returncode == 0, r.stderr
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                   pad_token_id=torch_model.config.pad_token_id)
    new = out[0, len(prompt_ids):].tolist()
    import tokenizers

    text = tokenizers.Tokenizer.from_file(str(text_model_dir / "tokenizer.json")).decode(new)
    assert r.stdout == PROMPT + text + "\n"


@pytest.mark.skipif(not (SHIPPED_MODEL / "config.json").is_file(), reason="models/mamba2-tinystories is not trained yet")
def test_generate_on_the_shipped_model():
    r = cli("generate", PROMPT, "--max-new-tokens", 20, "--greedy")  # the default model
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT) and len(r.stdout) > len(PROMPT) + 20
    again = cli("generate", "--model", SHIPPED_MODEL, PROMPT, "--max-new-tokens", 20, "--greedy")
    assert again.stdout == r.stdout  # greedy is deterministic, and the default is the shipped model


def test_run_save_out_writes_transformers_values(tmp_path, text_model_dir, torch_model, prompt_ids):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    out = tmp_path / "values.safetensors"
    paths = ["layers.1.linear_attn.states", "layers.0.linear_attn.betas", "logits"]
    r = cli("run", "--model", text_model_dir, PROMPT, *sum((["--save", p] for p in paths), []), "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert set(got) == set(paths) | {"input_ids", "attention_mask"}
    np.testing.assert_array_equal(got["input_ids"], [prompt_ids])
    np.testing.assert_array_equal(got["attention_mask"], np.ones((1, len(prompt_ids))))
    ref = om.run(torch_model, [prompt_ids], 1)
    for p in paths:
        assert got[p].dtype == np.float32
        assert rel_rms(got[p], ref[om.key(p, 0)]) <= tolerance(p), p
    with safe_open(str(out), "np") as f:
        meta = json.loads(f.metadata()["mixlens"])
    assert Path(meta["model"]).resolve() == Path(text_model_dir).resolve()
    assert meta["prompts"] == [PROMPT] and meta["prompt_ids"] == [prompt_ids]


def test_run_out_carries_the_left_padded_batch_and_its_attention_mask(tmp_path, text_model_dir):
    import tokenizers
    from safetensors.numpy import load_file

    prompts = [PROMPT, "Hi there"]
    out = tmp_path / "values.safetensors"
    r = cli("run", "--model", text_model_dir, *prompts, "--save", "logits", "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    tok = tokenizers.Tokenizer.from_file(str(text_model_dir / "tokenizer.json"))
    tok.enable_padding(direction="left", pad_id=1)  # the fixture's pad_token_id
    enc = tok.encode_batch(prompts)
    assert got["input_ids"].dtype == np.int64 and got["attention_mask"].dtype == np.int64
    np.testing.assert_array_equal(got["input_ids"], [e.ids for e in enc])
    np.testing.assert_array_equal(got["attention_mask"], [e.attention_mask for e in enc])


def test_generate_save_writes_per_step_keys(tmp_path, text_model_dir, torch_model, prompt_ids):
    from safetensors.numpy import load_file

    n = 4
    out = tmp_path / "gen.safetensors"
    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--greedy",
            "--save", "layers.*.linear_attn.state_output", "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    ref = om.run(torch_model, [prompt_ids], n)
    want = {om.key(f"layers.{i}.linear_attn.state_output", k) for i in range(2) for k in range(n)}
    assert set(got) == want | {"input_ids", "attention_mask"}
    for k in want:
        assert rel_rms(got[k], ref[k]) <= tolerance(k), k


def test_inspect_and_tokenize(text_model_dir, prompt_ids):
    r = cli("inspect", "--model", text_model_dir, "--prompt-length", 5)
    assert r.returncode == 0, r.stderr
    assert "family: mamba2" in r.stdout
    assert "layers.1.linear_attn.states  [1, 5, 4, 16, 16]  read-only" in r.stdout
    assert "self_attn.attention_output" in r.stdout  # listed as not available, with the reason
    t = cli("tokenize", "--model", text_model_dir, PROMPT)
    assert t.returncode == 0, t.stderr
    assert json.loads(t.stdout.splitlines()[0]) == prompt_ids


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines and all(n in lines[0] for n in needles), r.stderr
    assert len(lines) <= 2 and (len(lines) == 1 or "--help" in lines[1]), r.stderr  # message (+ usage hint)
    return lines[0]


def test_each_command_has_its_own_help():
    whole = cli("--help")
    assert whole.returncode == 0 and "mixlens generate" in whole.stdout and "mixlens extract" in whole.stdout
    for command, own, other in [("generate", "--max-new-tokens N", "mixlens extract"),
                                ("run", "--save PATH ... --out FILE", "--max-new-tokens"),
                                ("inspect", "--prompt-length T  the tokens per call", "--save PATH"),
                                ("tokenize", "mixlens tokenize", "--save PATH"),
                                ("extract", "--hash-prompts     index.json", "mixlens generate")]:
        for args in ((command, "--help"), ("help", command)):
            r = cli(*args)
            assert r.returncode == 0, r.stderr
            assert own in r.stdout and other not in r.stdout, (args, r.stdout)
    for args, needle in [(("bogus", "--help"), "unknown command 'bogus'"), (("help", "bogus"), "no help for 'bogus'")]:
        r = cli(*args)
        assert r.returncode == 2 and needle in r.stderr and r.stdout == "", (args, r)


@pytest.mark.parametrize("args,needle", [
    (("tokenize", "--ids", "1,2"), "tokenize does not take --ids"),
    (("tokenize", "hi", "--max-new-tokens", "5"), "tokenize does not take --max-new-tokens"),
    (("run", "hi", "--save", "logits", "--out", "r.safetensors", "--temperature", "0.5"), "run does not take --temperature"),
    (("inspect", "--save", "logits"), "inspect does not take --save"),
    (("extract", "p.jsonl", "--values", "logits", "--out", "d", "--prompt-file", "x"), "extract does not take --prompt-file"),
    (("extract", "p.jsonl", "--values", "logits", "--out", "d", "--save", "logits"), "extract takes --values, not --save"),
    (("generate", "hi", "--max-new-tokens", "2", "--positions", "last"), "generate does not take --positions"),
    (("run", "hi", "--bogus"), "unknown flag --bogus"),
    (("help", "generate", "extra"), "help takes one command"),
])
def test_a_flag_the_command_does_not_take_is_refused_not_ignored(args, needle):
    r = cli(*args)
    assert r.returncode == 2, r
    _one_line_error(r, needle)


@pytest.mark.parametrize("flag,value,needle", [("--positions", "first", "positions must be 'all', 'last' or 'mask'"),
                                               ("--batch-size", "0", "batch size must be >= 1"),
                                               ("--shard-bytes", "0", "shard bytes must be > 0")])
def test_extract_settings_out_of_range_are_usage_errors(tmp_path, flag, value, needle):
    (tmp_path / "p.txt").write_text("hello\n")
    r = cli("extract", tmp_path / "p.txt", "--values", "logits", "--out", tmp_path / "d", flag, value)
    assert r.returncode == 2, r  # exit 2 as every usage error, before the model loads
    _one_line_error(r, needle)
    assert not (tmp_path / "d").exists()


def test_bad_inputs_exit_non_zero_with_a_clear_message(tmp_path, text_model_dir):
    _one_line_error(cli("generate", "--model", tmp_path / "nope", "hi", "--max-new-tokens", 2), "nope", "does not exist")
    _one_line_error(cli("run", "--model", text_model_dir, "hi", "--save", "layers.0.linear_attn.beta", "--out", tmp_path / "x"),
                    "layers.0.linear_attn.beta", "did you mean 'layers.0.linear_attn.betas'")
    _one_line_error(cli("run", "--model", text_model_dir, "hi", "--save", "layers.9.linear_attn.betas", "--out", tmp_path / "x"),
                    "out of range")

    truncated = tmp_path / "truncated"
    shutil.copytree(text_model_dir, truncated)
    st = truncated / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    _one_line_error(cli("generate", "--model", truncated, "hi", "--max-new-tokens", 2), "model.safetensors")

    unknown = tmp_path / "unknown_type"
    shutil.copytree(text_model_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_type"] = "falcon_mamba_x"
    (unknown / "config.json").write_text(json.dumps(cfg))
    _one_line_error(cli("inspect", "--model", unknown), "model_type 'falcon_mamba_x'", "not supported")

    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(text_model_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    _one_line_error(cli("tokenize", "--model", no_tok, "hi"), "tokenizer.json")

    _one_line_error(cli("generate", "--model", text_model_dir, "hi"), "--max-new-tokens")
    _one_line_error(cli("generate", "--model", text_model_dir, "hi", "--max-new-tokens", "x"), "expects a number")
    _one_line_error(cli("frobnicate"), "unknown command")
    _one_line_error(cli("run", "--model", text_model_dir, "--ids", "5,99999999", "--save", "logits", "--out", tmp_path / "y"),
                    "outside the vocabulary")


def test_run_saves_the_state_after_one_token(tmp_path, text_model_dir, torch_model, prompt_ids):
    """`--save layers.1.linear_attn.state@t2` (and @t-1) writes transformers' state after that token."""
    from safetensors.numpy import load_file

    out = tmp_path / "state.safetensors"
    paths = ["layers.1.linear_attn.state@t2", "layers.1.linear_attn.state@t-1"]
    r = cli("run", "--model", text_model_dir, PROMPT, *sum((["--save", p] for p in paths), []), "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert set(got) == set(paths) | {"input_ids", "attention_mask"}  # --out also carries the batch
    assert (f"mixlens: wrote 4 tensors to {out}: layers.1.linear_attn.state@t2, layers.1.linear_attn.state@t-1, "
            "input_ids, attention_mask") in r.stderr  # the message counts and names what the file holds
    states = om.run(torch_model, [prompt_ids], 1)[om.key("layers.1.linear_attn.states", 0)]
    assert rel_rms(got[paths[0]], states[:, 2]) <= 1e-5
    assert rel_rms(got[paths[1]], states[:, -1]) <= 1e-5


def test_generate_saves_the_prompts_state_at_t_and_every_steps_last(tmp_path, text_model_dir, torch_model, prompt_ids):
    """`generate --save ...state@t3`: t indexes the tokens of each call, so it is the prompt's state after
    token 3 (saved at step 0; decode steps have one token and no t3); `state@t-1` is saved at every step."""
    from safetensors.numpy import load_file

    n, out = 3, tmp_path / "gen_state.safetensors"
    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--greedy",
            "--save", "layers.1.linear_attn.state@t3", "--save", "layers.1.linear_attn.state@t-1", "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    want = {"layers.1.linear_attn.state@t3@step0"} | {f"layers.1.linear_attn.state@t-1@step{k}" for k in range(n)}
    assert set(got) == want | {"input_ids", "attention_mask"}
    ref = om.run(torch_model, [prompt_ids], n)
    assert rel_rms(got["layers.1.linear_attn.state@t3@step0"], ref[om.key("layers.1.linear_attn.states", 0)][:, 3]) <= 1e-5
    for k in range(n):
        assert rel_rms(got[f"layers.1.linear_attn.state@t-1@step{k}"],
                       ref[om.key("layers.1.linear_attn.state_output", k)]) <= 1e-5, k
    r = cli("generate", "--model", text_model_dir, "Once", "--max-new-tokens", 2,
            "--save", "layers.1.linear_attn.state@t3", "--out", out)  # a prompt without token 3: an error
    assert r.returncode == 1 and "out of range" in r.stderr, r.stderr


def test_a_missing_relative_model_folder_is_reported_as_a_folder_and_as_a_hub_id(tmp_path):
    r = subprocess.run([find_cli(), "inspect", "--model", "models/no-such-model"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 1
    where = os.path.realpath(tmp_path)
    assert f"model folder 'models/no-such-model' does not exist (no directory {where}/models/no-such-model)" in r.stderr
    assert "as a hub id 'models/no-such-model' is not in the local HuggingFace cache" in r.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-2", "3x"])
def test_a_bad_thread_count_is_refused_not_ignored(value):
    """MIXLENS_NUM_THREADS=abc once ran silently on every core."""
    r = cli("generate", "hi", "--max-new-tokens", "1", env={**os.environ, "MIXLENS_NUM_THREADS": value})
    assert r.returncode == 1 and f"MIXLENS_NUM_THREADS='{value}'" in r.stderr
    ok = cli("generate", "hi", "--max-new-tokens", "1", env={**os.environ, "MIXLENS_NUM_THREADS": "1"})
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "nan"], "--temperature expects a number in range, got 'nan'"),
    (["--temperature", "0"], "temperature must be a finite number > 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--seed", "-1"], "--seed expects a number in range"),
])
def test_bad_sampling_settings_are_usage_errors(args, needle):
    """A new user found bad sampling settings exiting 1 after loading (the README says usage errors exit 2)."""
    r = cli("generate", "hi", "--max-new-tokens", "1", *args)
    assert r.returncode == 2 and needle in _one_line_error(r), r.stderr


def test_an_empty_id_entry_is_refused():
    """`--ids 1,,2` was read as two ids."""
    r = cli("generate", "--ids", "1,,2", "--max-new-tokens", "1")
    assert r.returncode == 2 and "has an empty entry" in _one_line_error(r), r.stderr


def test_a_stale_model_variable_is_named(tmp_path):
    r = cli("inspect", env={**os.environ, "MIXLENS_MODEL": str(tmp_path / "gone")})
    assert r.returncode == 1 and "the path came from $MIXLENS_MODEL" in _one_line_error(r), r.stderr


def test_flag_equals_value_and_double_dash(tmp_path, text_model_dir):
    """`--flag=value` is `--flag value`; after `--` every argument is a prompt (one may start with '-'); a flag
    that takes no value refuses one."""
    a = cli("run", "--model", text_model_dir, "--save", "logits", "--out", tmp_path / "a.safetensors", "--", "-Once upon")
    b = cli("run", f"--model={text_model_dir}", "--save=logits", f"--out={tmp_path / 'b.safetensors'}", "--", "-Once upon")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    _one_line_error(cli("generate", "--greedy=yes", "--max-new-tokens", "2", "hi"), "--greedy takes no value")


def test_a_text_field_on_a_plain_text_prompts_file_is_refused_not_ignored(tmp_path, text_model_dir):
    (tmp_path / "p.txt").write_text("hello\nworld\n")
    r = cli("extract", "--model", text_model_dir, tmp_path / "p.txt", "--values", "logits", "--out", tmp_path / "x",
            "--text-field", "body")
    _one_line_error(r, "a text field ('body') needs a .jsonl file")


def test_generate_save_takes_per_step_paths_as_python_generate_does(tmp_path, text_model_dir):
    """`--save PATH@step{k}` (issue 23's trial: refused while Python's generate(saves=...) took it): one
    parser for both (mixlens::split_step), the same numbers; a malformed suffix is a usage error, a step
    the generation never makes an error before it runs."""
    import mixlens
    from safetensors.numpy import load_file

    n, out = 3, tmp_path / "steps.safetensors"
    keys = ["layers.1.linear_attn.state@t0@step2", "layers.1.linear_attn.betas@step2", "layers.0.linear_attn.states@step0"]
    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--greedy",
            *sum((["--save", k] for k in keys), []), "--out", out)
    assert r.returncode == 0, r.stderr
    got = load_file(str(out))
    assert set(got) == set(keys) | {"input_ids", "attention_mask"}
    m = mixlens.StandardizedTransformer(str(text_model_dir), output="numpy")
    saved = m.generate(PROMPT, max_new_tokens=n, saves=keys).run().saved
    for key in keys:
        path, step = key.rsplit("@step", 1)
        np.testing.assert_array_equal(got[key], np.asarray(saved[path][int(step)]), err_msg=key)

    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--save",
            "layers.1.linear_attn.betas@stepx")
    assert r.returncode == 2, r
    _one_line_error(r, "layers.1.linear_attn.betas@stepx", "'@step<k>'")
    r = cli("generate", "--model", text_model_dir, PROMPT, "--max-new-tokens", n, "--save",
            "layers.1.linear_attn.betas@step5")
    assert r.returncode == 1, r
    _one_line_error(r, "never makes step 5")


def test_a_per_token_state_on_an_attention_layer_names_state_and_the_block(tmp_path):
    """`--save layers.1.linear_attn.state@t0` where layer 1 is softmax attention named `states`; it names
    the path asked for and says the block is attention and what it has instead (self_attn values)."""
    model = REPO / "tests" / "fixtures" / "qwen3_5" / "hv_2hk"  # layer 1 is full attention
    r = cli("run", "--model", model, "--ids", "5,6,7", "--save", "layers.1.linear_attn.state@t0", "--out", tmp_path / "x")
    assert r.returncode == 1, r
    _one_line_error(r, "'layers.1.linear_attn.state@t0'", "attention block", "use self_attn values")
    assert "states" not in r.stderr, r.stderr
