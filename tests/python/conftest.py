"""pytest fixtures shared by the Python tests (a tiny random Mamba-2 with a real tokenizer); the
helpers themselves (metric, paths, model builders, oracles) are in dev/mixlens_dev."""

from __future__ import annotations

import os

import pytest

# Values come out as numpy in the tests written against the numpy API; tests of the torch front end
# pass output="torch" (test_torch_io.py) or "auto" explicitly.
os.environ.setdefault("MIXLENS_OUTPUT", "numpy")

# The shared helpers live in the dev package (dev/mixlens_dev, on pytest's pythonpath: pyproject.toml).
from mixlens_dev.common import build_mamba2  # noqa: E402


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A 2-layer random Mamba-2 with the gpt-neox tokenizer (vocab 50280), for text prompts."""
    d = tmp_path_factory.mktemp("mamba2_text")
    cfg = dict(num_hidden_layers=2, n_groups=1, chunk_size=8, tie_word_embeddings=True, vocab_size=50280,
               pad_token_id=1, bos_token_id=0, eos_token_id=0)
    build_mamba2(d, seed=5, config=cfg, tokenizer=True)
    return d
