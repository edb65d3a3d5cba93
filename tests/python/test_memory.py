"""Issue 9 item 4 through the user-facing surfaces: the `logits=` option of run / forward / trace,
`model.prefill_chunk`, and the CLI's --prompt-file / --ids-file / stdin inputs, including a
32k-token prompt whose peak memory does not grow with its length (chunked prefill, last-position
logits)."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import mixlens
from mixlens_dev.common import SHIPPED_MODEL
from mixlens_dev.cli import find_cli

IDS = [5, 17, 300, 42, 7, 99, 1000, 3, 64, 12, 8, 2048, 77]


@pytest.fixture(scope="module")
def model():
    return mixlens.StandardizedTransformer(str(SHIPPED_MODEL))


def test_logits_last_is_the_last_row_of_all(model):
    full = model.run([IDS])["logits"]
    assert full.shape == (1, len(IDS), model.vocab_size)
    last = model.run([IDS], logits="last")["logits"]
    assert last.shape == (1, 1, model.vocab_size)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
    # A saved `logits` still gets every position.
    out = model.run([IDS], saves=["logits"], logits="last")
    assert out["logits"].shape == (1, len(IDS), model.vocab_size)
    # forward continuing a cache, and trace.
    cache = model.new_cache(1)
    model.forward([IDS[:5]], cache=cache, logits="last")
    cont = model.forward([IDS[5:]], cache=cache, logits="last")["logits"]
    np.testing.assert_allclose(cont[:, 0], full[:, -1], rtol=1e-4, atol=1e-4)
    with model.trace([IDS], logits="last") as tr:
        pass
    assert tr.logits.shape == (1, 1, model.vocab_size)
    with model.trace([IDS], logits="last") as tr:
        read = model.logits  # read in the block: every position
    assert read.shape == (1, len(IDS), model.vocab_size)
    with pytest.raises(mixlens.InputError, match="logits="):
        model.run([IDS], logits="first")


def test_prefill_chunk_property_and_equal_numbers(model):
    ids = [(i * 37 + 5) % 4096 for i in range(300)]
    assert model.prefill_chunk == 512
    model.prefill_chunk = 0
    ref = model.run([ids])["logits"]
    model.prefill_chunk = 64
    try:
        got = model.run([ids])["logits"]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
        with model.trace([ids]) as tr:
            pass
        assert [c["seq"] for c in tr.calls] == [300]  # still one call
    finally:
        model.prefill_chunk = 512
    with pytest.raises(mixlens.InputError):
        model.prefill_chunk = -1


# ---- CLI inputs ---------------------------------------------------------------------------------

def gen(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([find_cli(), "generate", "--model", str(SHIPPED_MODEL), "--max-new-tokens", "3", *args],
                          capture_output=True, text=True, timeout=300, input=stdin)


def test_ids_file_formats_and_stdin_agree_with_ids(tmp_path):
    ref = gen("--ids", ",".join(map(str, IDS)))
    assert ref.returncode == 0, ref.stderr
    spaced = tmp_path / "spaced.txt"
    spaced.write_text(" ".join(map(str, IDS[:6])) + "\n" + ",\t".join(map(str, IDS[6:])) + "\n")
    as_json = tmp_path / "ids.json"
    as_json.write_text(json.dumps(IDS))
    for args, stdin in ((["--ids-file", str(spaced)], None), (["--ids-file", str(as_json)], None),
                        (["--ids-file", "-"], json.dumps(IDS)), (["--ids", "-"], " ".join(map(str, IDS)))):
        r = gen(*args, stdin=stdin)
        assert r.returncode == 0, (args, r.stderr)
        assert r.stdout == ref.stdout, args
    # A JSON list of lists: one prompt per row, a left-padded batch like two --ids prompts.
    two = tmp_path / "two.json"
    two.write_text(json.dumps([IDS, IDS[:4]]))
    r = gen("--ids-file", str(two))
    ref2 = gen("--ids", ",".join(map(str, IDS)), "--ids", ",".join(map(str, IDS[:4])))
    assert r.returncode == 0 and r.stdout == ref2.stdout and len(r.stdout.splitlines()) == 2


def test_prompt_file_and_stdin_text(tmp_path):
    text = "Once upon a time, there was a little"
    ref = gen(text)
    assert ref.returncode == 0, ref.stderr
    f = tmp_path / "p.txt"
    f.write_text(text + "\n")  # the file's final newline is not prompt text
    assert gen("--prompt-file", str(f)).stdout == ref.stdout
    assert gen("-", stdin=text + "\n").stdout == ref.stdout
    assert gen("--prompt-file", "-", stdin=text).stdout == ref.stdout


def test_bad_prompt_inputs_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x3")
    cases = [
        (["--ids-file", str(tmp_path / "missing.txt")], None, "is not a readable file"),
        (["--ids-file", str(bad)], None, "expects a number"),
        (["--ids-file", "-"], "[1, 2.5]", "must be integers"),
        (["--ids-file", "-"], "[1, 2", "not a valid JSON list"),
        (["--ids-file", "-"], "  \n", "has no token ids"),
        (["--ids-file", "-"], "[-4]", "out of range"),
        (["--ids-file", "-", "--prompt-file", "-"], "1 2", "only one prompt"),
        (["--prompt-file", str(tmp_path / "empty.txt")], None, "is not a readable file"),
    ]
    empty = tmp_path / "empty2.txt"
    empty.write_text("\n")
    cases.append((["--prompt-file", str(empty)], None, "is empty"))
    for args, stdin, needle in cases:
        r = gen(*args, stdin=stdin)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr, (args, r.stderr)


def test_a_32k_token_prompt_runs_in_flat_memory(tmp_path):
    """32,768 ids through stdin and through --ids-file: the command works (no argument-list limit),
    and its peak RSS is within 48 MiB of a 4,096-token run (chunked prefill, last-position logits;
    unchunked, the activations and logits of 32k tokens would take over 1 GiB here)."""
    rng = np.random.default_rng(0)
    peaks = {}
    for n in (4096, 32768):
        path = tmp_path / f"ids{n}.txt"
        path.write_text(" ".join(map(str, rng.integers(3, 4096, size=n))))
        cmd = [find_cli(), "generate", "--model", str(SHIPPED_MODEL), "--max-new-tokens", "2",
               "--ids-file", "-" if n == 32768 else str(path)]
        with open(path, "rb") as fin:
            p = subprocess.Popen(cmd, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, status, ru = os.wait4(p.pid, 0)
        out, err = p.stdout.read().decode(), p.stderr.read().decode()
        assert os.waitstatus_to_exitcode(status) == 0, err
        assert out.startswith("[") and len(json.loads(out.splitlines()[0])) == 2
        peaks[n] = ru.ru_maxrss * 1024
    grew = peaks[32768] - peaks[4096]
    assert grew < 48 << 20, f"peak RSS grew by {grew / 2**20:.0f} MiB from 4k to 32k tokens ({peaks})"
