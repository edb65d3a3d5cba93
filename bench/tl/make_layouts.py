#!/usr/bin/env python
"""Random-weight published layouts for the TL comparison (written under ./layouts, or the repo's
build/tl-layouts when this file is in the repo's bench/; never committed). Uses the repo's dev/mixlens_dev/published_layout.py (PYTHONPATH=<repo>/dev):

  mamba2-130m   published_layout.make(): AntonV/mamba2-130m-hf's config, random weights, float32
  qwen3_5-0.8b-text  Qwen3_5ForCausalLM with Qwen/Qwen3.5-0.8B's *text* config
                (published_layout.QWEN3_5_0_8B_TEXT_CONFIG), random weights rounded to bfloat16 once
                and saved in bf16; the published checkpoint is the VL model
                (Qwen3_5ForConditionalGeneration), whose language model is this one.

    bench/tl/venv/bin/python bench/tl/make_layouts.py  (finds dev/mixlens_dev itself) [mamba2] [qwen3_5]
"""
import sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))  # mixlens_dev, in either venv
from mixlens_dev import published_layout as mpl

_HERE = Path(__file__).resolve().parent
# in the repo's bench/: build/tl-layouts (never committed); elsewhere ./layouts
OUT = _HERE.parents[1] / "build" / "tl-layouts"


def qwen_text(out: Path, seed: int = 0):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**dict(mpl.QWEN3_5_0_8B_TEXT_CONFIG))
    torch.manual_seed(seed)
    m = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    m.save_pretrained(out)
    # No Qwen tokenizer offline; TL's boot needs one to exist: the shipped tiny model's (ids < 4096,
    # the benches pass token ids, never text).
    import shutil
    tiny = mpl.REPO / "models" / "qwen3_5-tinystories"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny / f, out / f)
    return sum(p.numel() for p in m.parameters())


if __name__ == "__main__":
    which = sys.argv[1:] or ["mamba2"]
    if "mamba2" in which:
        t = time.time()
        info = mpl.make(OUT / "mamba2-130m")
        print("mamba2-130m", info["parameters"], info["files"], round(time.time() - t, 1), "s")
    if "qwen3_5" in which:
        t = time.time()
        n = qwen_text(OUT / "qwen3_5-0.8b-text")
        print("qwen3_5-0.8b-text", n, round(time.time() - t, 1), "s")
