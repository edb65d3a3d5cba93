#!/usr/bin/env python
"""Build the golden fixtures the C++ and Python tests compare against (every family but the tokenizer's).

    .venv/bin/python scripts/make_fixtures.py                          # every family, every case
    .venv/bin/python scripts/make_fixtures.py --family mamba2 --case g1_chunks
    .venv/bin/python scripts/make_fixtures.py --family qwen3_5 --out /tmp/q35   # somewhere else

Families: mamba2, mamba, falcon_mamba, qwen3_5, qwen3_next, olmo_hybrid, nemotron_h, bamba, falcon_h1, rwkv,
lfm2, lfm2_moe, minimax, recurrent_gemma, xlstm; each writes
tests/fixtures/<family>/<case>/ (config.json, model.safetensors, golden.safetensors, case.json).
The procedure and its checks: dev/mixlens_dev/fixtures/__init__.py; the spec tables (config, seed,
prompts, edits per case): dev/mixlens_dev/fixtures/<module>.py. A rebuild with the pinned
transformers / torch (pyproject.toml's `test` extra) reproduces the committed files byte for byte.
Tokenizer fixtures: scripts/make_tokenizer_fixtures.py.
"""

from __future__ import annotations

import argparse
import sys

from mixlens_dev import fixtures


def main(argv=None) -> int:
    fams = fixtures.families()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", choices=list(fams), help="build only these families (default: all)")
    ap.add_argument("--case", action="append", help="build only these cases (of the families chosen)")
    ap.add_argument("--out", help="output folder instead of tests/fixtures/<family> (one --family only)")
    args = ap.parse_args(argv)
    chosen = args.family or list(fams)
    if args.out and len(chosen) != 1:
        ap.error("--out needs exactly one --family")
    unknown = set(args.case or ()) - {c for f in chosen for c in fams[f].cases}
    if unknown:
        ap.error(f"no case {sorted(unknown)} in {chosen}")
    for f in chosen:
        if args.case and not set(args.case) & set(fams[f].cases):
            continue
        fixtures.build(fams[f], args.case, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
