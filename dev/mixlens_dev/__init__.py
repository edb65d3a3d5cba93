"""mixlens_dev: the developer-side helpers the tests, benches and scripts share (never shipped).

Contents: the transformers oracles (``oracle_*``, ``grad_common``), the comparison metric and paths
(``common``), the golden-fixture generator and its per-family spec tables (``fixtures``), the
training skeleton and its per-family parts (``train``), the published-layout stand-ins
(``published_layout``, ``published_hybrids``), the CLI runner (``cli``) and the bench timer
(``timing``).

How it is found (one way per caller, no ``sys.path`` edits anywhere):

- pytest: ``pythonpath = ["dev"]`` in pyproject.toml's ``[tool.pytest.ini_options]``, so the tests
  work from any checkout whatever its .venv holds.
- scripts/ and bench/: ``scripts/setup.sh --dev`` (``make setup-dev``) writes ``mixlens_dev.pth``
  (the absolute path of this checkout's ``dev/``) into the .venv's site-packages. A .pth rather than
  an editable install: no second package metadata to keep, nothing to rebuild, and a checkout copied
  with its .venv is pointed at its own ``dev/`` by rerunning setup.sh --dev.
"""
