"""Shared pieces of the Python tests: tiny random Mamba-2 checkpoints built with transformers (the
same recipe as scripts/make_fixtures.py), saved to a temp folder, and the comparison metric."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

# Values come out as numpy in the tests written against the numpy API; tests of the torch front end
# pass output="torch" (test_torch_io.py) or "auto" explicitly.
os.environ.setdefault("MIXLENS_OUTPUT", "numpy")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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
    import make_fixtures as mf

    spec = {"seed": seed, "config": config, "dt_bias": dt_bias}
    model = mf.build_model(spec)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer:
        shutil.copy(NEOX_TOKENIZER, out_dir / "tokenizer.json")
    return model


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A 2-layer random Mamba-2 with the gpt-neox tokenizer (vocab 50280), for text prompts."""
    d = tmp_path_factory.mktemp("mamba2_text")
    cfg = dict(num_hidden_layers=2, n_groups=1, chunk_size=8, tie_word_embeddings=True, vocab_size=50280,
               pad_token_id=1, bos_token_id=0, eos_token_id=0)
    build_mamba2(d, seed=5, config=cfg, tokenizer=True)
    return d
