"""mixlens.convert (issue 27 item 1): a float32 checkpoint's matmul weights written as bfloat16 /
float16 once, loading with dtype="auto" exactly as converting at load; errors named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mixlens

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models" / "qwen3_5-tinystories"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_converted_folder_loads_as_converting_at_load(tmp_path, dtype):
    out = tmp_path / "conv"
    rep = mixlens.convert(str(SHIPPED), out, dtype=dtype)
    assert rep["out_dir"] == str(out) and rep["converted"] > 0 and rep["kept"] > 0
    assert "config.json" in rep["copied_files"] and "tokenizer.json" in rep["copied_files"]
    src = mixlens.load(str(SHIPPED), dtype=dtype)
    conv = mixlens.load(str(out), dtype="auto")
    assert conv.info["weight_dtypes"] == [dtype]
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    narrow = {n for n, e in header.items() if n != "__metadata__" and e["dtype"] == {"bfloat16": "BF16", "float16": "F16"}[dtype]}
    assert narrow == set(src.info["matmul_weights"])
    prompt = "Once upon a time"
    a = src.run([prompt])["logits"]
    b = conv.run([prompt])["logits"]
    assert np.array_equal(np.asarray(a), np.asarray(b))
    # Text generation is the same token for token.
    tokens = [list(m.generate(prompt, max_new_tokens=5).run().tokens) for m in (src, conv)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5


def test_convert_takes_keywords_and_torch_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    rep = mixlens.convert(path=str(SHIPPED), out_dir=tmp_path / "k", dtype=torch.bfloat16)
    assert rep["converted"] > 0
    assert mixlens.load(str(tmp_path / "k"), dtype="auto").info["weight_dtypes"] == ["bfloat16"]


def test_convert_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(mixlens.InputError, match="not one of bfloat16, float16"):
        mixlens.convert(str(SHIPPED), tmp_path / "x", dtype="float32")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(mixlens.InputError, match="exists and is not an empty folder"):
        mixlens.convert(str(SHIPPED), tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(mixlens.CheckpointError):
        mixlens.convert(str(tmp_path / "nope"), tmp_path / "y")
