#!/usr/bin/env python3
"""Train one of the small models mixlens ships (models/<family>-tinystories/).

    .venv/bin/python scripts/train.py FAMILY [--measure N | --steps N | --minutes M | --dry-run] [size args]
    .venv/bin/python scripts/train.py mamba2 --help

FAMILY: mamba2, mamba or qwen3_5. The skeleton (data, tokenizer, loop, save, model card) is
dev/mixlens_dev/train/__init__.py; each family's parts are dev/mixlens_dev/train/<family>.py. The
shipped READMEs' ``python scripts/train_<family>.py ARGS`` is ``python scripts/train.py <family> ARGS``.
"""

from __future__ import annotations

import sys

from mixlens_dev import train

if __name__ == "__main__":
    families = train.recipes()
    if len(sys.argv) < 2 or sys.argv[1] not in families:
        sys.exit(f"usage: scripts/train.py {{{','.join(families)}}} [args]  (scripts/train.py FAMILY --help)")
    sys.exit(train.main(sys.argv[1], sys.argv[2:]))
