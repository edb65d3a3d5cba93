"""Narrow weights (issue 9 item 1): the shipped checkpoints cast to bfloat16 by transformers and
saved, then loaded by mixlens with ``dtype="auto"`` (so the weights stay bf16) and compared

* against transformers running the same bf16 checkpoint in bf16: argmax agreement on prompts and a
  per-position KL that does not grow with the position (bf16 activations round differently from
  our float32 ones, so the two are close, not equal);
* against our own float32 path on the same weights (``dtype="float32"`` widens the identical bf16
  values): equal to float32 rounding, since only the summation order of the kernels differs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mixlens  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODELS = ["mamba2-tinystories", "mamba-tinystories", "qwen3_5-tinystories"]
PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her",
    "Tom had a big red ball. One day he went to the garden and saw a small dog. The dog was sad because",
    # ~150 tokens: long enough to see whether the bf16 error accumulates along the sequence
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, Lily found a shiny red ball under a big tree. She was very happy and wanted to show it "
    "to her mom. Lily ran home as fast as she could. When she got home, her mom was in the kitchen making "
    "cookies. Lily said, \"Mom, look what I found!\" Her mom smiled and said, \"That is a very pretty ball, "
    "Lily. Where did you find it?\" Lily told her mom about the big tree in the park. Her mom said, \"Maybe "
    "someone lost it. We should go back and see if anyone is looking for it.\" So Lily and her mom went back "
    "to the park. They saw a little boy crying near the tree.",
]


def _bf16_checkpoint(name: str, tmp_path_factory):
    src = REPO / "models" / name
    if not (src / "config.json").is_file():
        pytest.skip(f"models/{name} is not in this checkout")
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(name + "-bf16")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    model.save_pretrained(str(out))
    for f in src.glob("tokenizer*.json"):
        (out / f.name).write_bytes(f.read_bytes())
    return out, model


def _logits(model, ids) -> np.ndarray:
    with model.trace([ids]) as tr:
        out = model.logits.save()
    del tr
    return np.asarray(out, dtype=np.float64)[0]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", MODELS)
def test_bf16_weights_vs_transformers_bf16_and_own_float32(name, tmp_path_factory):
    path, hf = _bf16_checkpoint(name, tmp_path_factory)
    narrow = mixlens.load(str(path), dtype="auto")
    assert narrow._core.info["dtype"] == "auto"
    assert narrow._core.info["weight_dtypes"] == ["bfloat16"]  # what "auto" resolved to (a bf16 checkpoint)
    wide = mixlens.load(str(path), dtype="float32")
    assert wide._core.info["weight_dtypes"] == ["float32"]
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ours = _logits(narrow, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().numpy().astype(np.float64)
        assert ours.shape == ref.shape
        # Argmax agreement with transformers in bf16 (bf16 activations flip near-ties only).
        agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
        assert agree >= 0.9, f"{name}: argmax agreement {agree:.2f} with transformers bf16"
        # Per-position KL(ref || ours): small, and not growing along the prompt.
        lp, lq = _log_softmax(ref), _log_softmax(ours)
        kl = (np.exp(lp) * (lp - lq)).sum(-1)
        assert kl.max() < 0.01, f"{name}: max KL {kl.max():.4f}"
        if len(ids) >= 100:
            # The first tokens have little context (KL ~ 0), so compare the last third with the
            # middle one (measured 2026-12: ratios 1.0-1.3, KL ~2-6e-4).
            third = len(kl) // 3
            mid, last = kl[third:2 * third].mean(), kl[2 * third:].mean()
            assert last <= 2.0 * mid + 1e-4, f"{name}: KL grows with position: middle third {mid:.2e}, last {last:.2e}"
        # Same weights through our float32 path: float32 rounding only.
        own = _logits(wide, ids)
        rel = np.sqrt(((ours - own) ** 2).sum() / (own**2).sum())
        assert rel < 2e-5, f"{name}: bf16 weights vs the same weights widened: rel RMS {rel:.2e}"
        assert (ours.argmax(-1) == own.argmax(-1)).all()


def test_dtype_argument_validation():
    with pytest.raises(ValueError, match="int4"):
        mixlens.load(str(REPO / "models" / "mamba2-tinystories"), dtype="int4")
    m = mixlens.load(str(REPO / "models" / "mamba2-tinystories"), dtype=torch.bfloat16)
    assert m._core.info["dtype"] == "bfloat16" and m._core.info["weight_dtypes"] == ["bfloat16"]
    # Served values stay float32 with narrow weights.
    with m.trace("Once upon a time") as tr:
        out = m.logits.save()
    del tr
    assert np.asarray(out).dtype == np.float32
