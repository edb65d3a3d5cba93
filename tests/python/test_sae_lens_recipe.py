"""examples/sae_lens_recipe.py (issue 26 item 5): activations dumped by `mixlens extract` from the shipped model
train a SAELens 6.x sparse autoencoder; on a tiny budget (300 steps) its loss falls. sae-lens is an optional
dev dependency (requirements-sae.txt): without it the test is skipped, saying so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mixlens_dev.common import REPO

pytest.importorskip("sae_lens", reason="sae-lens is not installed (optional: pip install -r requirements-sae.txt)")


def test_sae_trained_on_extracted_activations_lowers_its_loss(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "examples" / "sae_lens_recipe.py"), "--steps", "300",
                        "--batch", "64", "--expansion", "2", "--prompts", "100", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("sae_lens: ok"), r.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())["losses"]
    assert len(losses) == 300
    first, last = sum(losses[:50]) / 50, sum(losses[-50:]) / 50
    assert last < 0.7 * first, (first, last)
    index = json.loads((tmp_path / "acts" / "index.json").read_text())
    assert index["complete"] and index["values"][0]["name"] == "layers.3.layer_output"
