"""Every recipe in docs/recipes runs as a script from a directory outside the repository (issue 10 item 6),
and the README's Python block runs from any directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mixlens_dev.common import REPO

RECIPES = sorted((REPO / "docs" / "recipes").glob("*.py"))


def run_script(path_or_code, cwd, *args):
    env = dict(os.environ)
    env.pop("MIXLENS_OUTPUT", None)  # the default a user gets
    env.pop("MIXLENS_MODEL", None)
    cmd = [sys.executable, str(path_or_code), *args] if not isinstance(path_or_code, str) else [sys.executable, "-c", path_or_code]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{path_or_code} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_there_are_recipes():
    names = {p.stem for p in RECIPES}
    assert {"logit_lens", "activation_patching", "steering", "skip_token_betas", "generation_steps", "plots",
                     "patch_state", "extract_dataset"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs(recipe, tmp_path):
    out = run_script(recipe, tmp_path, *([str(tmp_path / "png")] if recipe.stem == "plots" else []))
    assert out.rstrip().endswith(": ok")
    if recipe.stem == "plots":
        assert (tmp_path / "png" / "decays.png").stat().st_size > 1000


def test_readme_python_block_runs_from_any_directory(tmp_path):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    script = tmp_path / "readme_example.py"  # invoke blocks read their source from a file
    script.write_text(blocks[0])
    run_script(script, tmp_path)


def test_api_reference_builds(tmp_path):
    pytest.importorskip("pdoc")
    r = subprocess.run([sys.executable, "-m", "pdoc", "mixlens", "mixlens.interventions", "-o", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "mixlens.html").read_text()
    for name in ("StandardizedTransformer", "project_on_vocab", "steer", "invoke", "Tracer"):
        assert name in page
    assert "logit_lens" in (tmp_path / "mixlens" / "interventions.html").read_text()
