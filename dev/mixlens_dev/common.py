"""Paths and the comparison metric shared by the tests, the benches and the fixture generator."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
NEOX_TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json"
SHIPPED_MODEL = REPO / "models" / "mamba2-tinystories"


def rel_rms(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| (relative RMS error, the metric of the C++ tests); ||got - ref|| when ref is 0."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != {ref.shape}"
    num = float(np.sqrt(np.sum((got - ref) ** 2)))
    den = float(np.sqrt(np.sum(ref**2)))
    return num / den if den > 0 else num


def tolerance(key: str) -> float:
    """Relative RMS allowed against transformers: 3e-5 on values, 1e-4 on logits (float32 rounding in
    a different order compounds through the layers; why 3e-5: tests/cpp/fixture_util.h tolerance_for)."""
    return 1e-4 if "logits" in key else 3e-5


def build_mamba2(out_dir: Path, seed: int, config: dict, dt_bias=None, tokenizer: bool = False):
    """A random Mamba2ForCausalLM (perturbed like the fixtures), saved as float32 safetensors."""
    from mixlens_dev.fixtures import mamba2

    model = mamba2.build_model({"seed": seed, "config": config, "dt_bias": dt_bias})
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer:
        shutil.copy(NEOX_TOKENIZER, out_dir / "tokenizer.json")
    return model
