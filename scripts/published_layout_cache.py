"""The mamba2-130m-shaped random checkpoint of scripts/make_published_layout.py, built once and kept
under build/ for the tests and the benchmark (~516 MB; rebuilding takes a minute or more).

The folder name carries a hash of make_published_layout.py, so a change to that script builds a
fresh copy instead of reusing a stale one. A marker file is written last: a build interrupted
half-way is not mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_published_layout.py"
MARKER = ".complete"


def _module():
    spec = importlib.util.spec_from_file_location("make_published_layout", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cached_layout(root: Path = REPO / "build") -> Path:
    """Folder of the published-layout checkpoint (config.json, model.safetensors, tokenizer.json)."""
    digest = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:12]
    out = root / f"mamba2-130m-layout-{digest}"
    if (out / MARKER).is_file():
        return out
    for stale in root.glob("mamba2-130m-layout-*"):
        shutil.rmtree(stale, ignore_errors=True)
    _module().make(out)
    (out / MARKER).write_text(digest + "\n")
    return out
