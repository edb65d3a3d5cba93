"""Recipe: train a sparse autoencoder with SAELens 6.x on activations that `mixlens extract` dumped.

`mixlens extract` writes plain safetensors shards (F32 `[rows, hidden]` per value, one row per real token) and
an index.json (docs/extract.md), so SAELens trains on them with no mixlens code in the loop: the shards are
read with `safetensors.torch.load_file` and fed to SAELens's own `SAETrainer.fit()` as its data provider
(`Iterator[Tensor]` of `[batch, d_in]`).

Run from anywhere (the shipped Mamba-2 and TinyStories lines from this repository):

    pip install 'sae-lens>=6,<7'          # optional: not a mixlens dependency
    python examples/sae_lens_recipe.py --steps 2000 --prompts 400 --layer 3 --out /tmp/sae

tests/python/test_sae_lens_recipe.py runs it on a tiny budget (300 steps) and checks the loss falls.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "text" / "tinystories" / "tinystories_sample_cs336.txt"


def mixlens_cli() -> str:
    here = Path(sys.executable).parent / "mixlens"  # the venv's CLI first
    return str(here) if here.exists() else (shutil.which("mixlens") or "mixlens")


def extract(out: Path, value: str, n_prompts: int) -> Path:
    """`mixlens extract` over the first `n_prompts` non-empty TinyStories lines: every token's `value`."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.txt"
    lines = [ln for ln in TEXT.read_text().splitlines() if ln.strip()][:n_prompts]
    prompts.write_text("\n".join(lines) + "\n")
    acts = out / "acts"
    subprocess.run([mixlens_cli(), "extract", str(prompts), "--values", value, "--out", str(acts),
                    "--positions", "all", "--batch-size", "16"], check=True)
    return acts


def load_rows(acts: Path, value: str) -> torch.Tensor:
    """Every stored row of `value`, shard after shard (index.json lists the shards)."""
    index = json.loads((acts / "index.json").read_text())
    return torch.cat([load_file(str(acts / s["file"]))[value] for s in index["shards"]])


def batches(rows: torch.Tensor, batch: int, seed: int = 0):
    """SAELens's DataProvider: endless shuffled [batch, d_in] batches (a new permutation each pass)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(rows), generator=g)
        for i in range(0, len(perm) - batch + 1, batch):
            yield rows[perm[i:i + batch]]


def train(rows: torch.Tensor, steps: int, batch: int, expansion: int, l1: float, lr: float):
    """A StandardTrainingSAE (ReLU, L1 penalty) trained by SAELens's SAETrainer.fit(); returns (sae, losses)."""
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    torch.manual_seed(0)
    d_in = rows.shape[1]
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=expansion * d_in, l1_coefficient=l1,
                                                        normalize_activations="expected_average_only_in"))
    cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=lr, lr_end=lr,
                           device="cpu", n_batches_for_norm_estimate=20)
    trainer = SAETrainer(cfg, sae, batches(rows, batch))
    losses = []
    step = trainer.step  # SAELens's public per-batch seam, which fit() calls: record each step's loss

    def recorded(b):
        out = step(b)
        losses.append(out.loss.item())
        return out

    trainer.step = recorded
    trainer.fit()
    return sae, losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--l1", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", type=Path, default=Path("sae_recipe"))
    a = p.parse_args(argv)
    value = f"layers.{a.layer}.layer_output"
    rows = load_rows(extract(a.out, value, a.prompts), value)
    print(f"{value}: {rows.shape[0]} token rows of width {rows.shape[1]} from mixlens extract")
    sae, losses = train(rows, a.steps, a.batch, a.expansion, a.l1, a.lr)
    k = max(1, min(50, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"sae loss: first {k} steps {first:.4f}, last {k} steps {last:.4f} ({len(losses)} steps)")
    json.dump({"losses": losses}, open(a.out / "losses.json", "w"))
    assert last < first, "the SAE loss did not fall"
    print("sae_lens: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
