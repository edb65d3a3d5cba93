"""Pictures of what a recurrent model computes (issue 26 item 4): ``mixlens.plot``, and the CLI's
``mixlens plot KIND PROMPT --out FILE`` (which runs :func:`main` of this module).

Each kind is one function ``(model, prompt, layers) -> Figure`` that computes its numbers with the core
(``model.run`` saves, ``project_on_vocab``) and describes panels (:class:`Heatmap`, :class:`Lines`) in
plain numpy; one line in :data:`KINDS` registers it. Rendering is separate (``mixlens._plot_render``):
interactive self-contained HTML through plotly (its JavaScript embedded, so the file opens offline with
no network request) and PNG through matplotlib. The plotting libraries are the optional extra
``pip install 'mixlens[plot]'``; this module and the core never import them, only :func:`save` does,
with an ImportError naming the extra when they are missing.

    import mixlens, mixlens.plot
    model = mixlens.load()
    fig = mixlens.plot.figure("logit-lens", model, "Once upon a time")   # numbers only, no plotting library
    mixlens.plot.save(fig, "lens.html")                                    # or .png

Kinds (docs/plots.md): ``logit-lens`` (layers x positions, the top next token and its probability, as
nnterp's), ``state-norm`` / ``decay`` / ``beta`` (per layer, one timeline per head: ``linear_attn.states``
norms, ``decays``, ``betas``), ``attention`` (``self_attn.attention_probabilities`` per attention layer and
head).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ._args import check_str, layer_list
from ._convert import as_float32
from ._model import load
from .errors import InputError, MixlensError, UnsupportedError

__all__ = ["Heatmap", "Lines", "Figure", "KINDS", "figure", "save", "plot", "main"]

PANEL_PX = (420, 320)  # one panel's width, height in pixels (PNG and HTML)
MAX_COLS = 3
MAX_LINES = 32  # more series than this (Mamba-1's d_inner channels) draw as a heatmap instead


@dataclass
class Heatmap:
    """z ``[len(y), len(x)]``; ``text`` (same shape, optional) is written in each cell."""

    title: str
    z: np.ndarray
    x: list
    y: list
    xlabel: str = ""
    ylabel: str = ""
    zlabel: str = ""
    text: Optional[list] = None
    zmin: Optional[float] = None
    zmax: Optional[float] = None


@dataclass
class Lines:
    """One line per entry of ``series`` (name -> values over ``x``)."""

    title: str
    x: list
    series: dict
    xlabel: str = ""
    ylabel: str = ""


@dataclass
class Figure:
    """Panels laid out row by row, :data:`MAX_COLS` a row; ``width`` x ``height`` pixels."""

    title: str
    panels: list = field(default_factory=list)

    @property
    def cols(self) -> int:
        return max(1, min(len(self.panels), MAX_COLS))

    @property
    def rows(self) -> int:
        return max(1, math.ceil(len(self.panels) / self.cols))

    @property
    def width(self) -> int:
        return self.cols * PANEL_PX[0]

    @property
    def height(self) -> int:
        return self.rows * PANEL_PX[1] + 60  # + the title


# -- the numbers, from the core ------------------------------------------------------------------

def _tokens(model, prompt: str) -> list:
    ids = model.tokenizer.encode(prompt)
    if not ids:
        raise InputError(f"plot: prompt {prompt!r} encodes to no tokens")
    return [f"{t}:{model.tokenizer.decode([i])}" for t, i in enumerate(ids)]


def _serving_layers(model, kind: str, value: str, layers) -> list:
    """The asked layers (default: all) whose blocks serve `value`; UnsupportedError with the first reason
    when none does."""
    asked = layer_list("layers", layers, model.num_layers) if layers is not None else range(model.num_layers)
    reasons = {i: model.support(layer=i).get(value, f"no value {value!r} on this model") for i in asked}
    ok = [i for i, r in reasons.items() if r is None]
    if not ok:
        first = next(iter(reasons.values()), "no layer asked")
        raise UnsupportedError(f"plot {kind}: no asked layer of this {model.info['family']} model serves {value}: "
                               f"{first}")
    return ok


def _saved(model, prompt: str, paths: list) -> dict:
    out = model.run([prompt], saves=paths)
    return {p: as_float32(out[p], p)[0] for p in paths}  # batch of one


def _per_head(value: np.ndarray, reduce: str) -> np.ndarray:
    """One prompt's value [T, heads, ...] -> [T, heads]: the norm (states) or mean (decays, betas) over the
    trailing axes. [T, n] stays as it is for a mean (n heads or channels); for a norm it is one flat state
    row (RWKV-4, xLSTM: values.md), so [T, 1]."""
    if value.ndim == 2:
        return np.linalg.norm(value, axis=-1, keepdims=True) if reduce == "norm" else value
    v = value.reshape(*value.shape[:2], -1)
    return np.linalg.norm(v, axis=-1) if reduce == "norm" else v.mean(-1)


def logit_lens(model, prompt: str, layers=None) -> Figure:
    """Layers x positions: the top next token read from each layer's output through the final norm and the
    LM head (``project_on_vocab``, the core's), coloured by its probability (nnterp's logit lens heatmap)."""
    asked = layer_list("layers", layers, model.num_layers) if layers is not None else list(range(model.num_layers))
    saved = _saved(model, prompt, [f"layers.{i}.layer_output" for i in asked])
    hidden = np.stack([saved[f"layers.{i}.layer_output"] for i in asked])  # [L, T, D]
    logits = as_float32(model.project_on_vocab(hidden), "logits")
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    top = probs.argmax(-1)  # [L, T]
    text = [[model.tokenizer.decode([int(t)]) for t in row] for row in top]
    hm = Heatmap("top next token per layer", np.take_along_axis(probs, top[..., None], -1)[..., 0],
                 _tokens(model, prompt), [f"layer {i}" for i in asked], "position", "layer", "probability",
                 text=text, zmin=0.0, zmax=1.0)
    return Figure(f"logit lens: {prompt!r}", [hm])


def _timelines(kind: str, value: str, reduce: str, ylabel: str):
    """A kind: per serving layer, one line per head of `value` over the prompt's tokens."""

    def make(model, prompt: str, layers=None) -> Figure:
        ok = _serving_layers(model, kind, value, layers)
        saved = _saved(model, prompt, [f"layers.{i}.{value}" for i in ok])
        x = _tokens(model, prompt)
        panels = []
        for i in ok:
            v = _per_head(saved[f"layers.{i}.{value}"], reduce)  # [T, heads]
            title = f"layer {i} {value}"
            if v.shape[1] > MAX_LINES:  # channels, not heads: a heatmap reads better than hundreds of lines
                panels.append(Heatmap(title, v.T, x, list(range(v.shape[1])), "position", "channel", ylabel))
            else:
                panels.append(Lines(title, x, {f"head {h}": v[:, h] for h in range(v.shape[1])}, "position", ylabel))
        return Figure(f"{kind}: {prompt!r}", panels)

    make.__doc__ = f"Per layer serving {value}: {ylabel} at every token, one line per head."
    return make


def attention(model, prompt: str, layers=None) -> Figure:
    """Per attention layer and head: ``self_attn.attention_probabilities`` (queries x keys)."""
    ok = _serving_layers(model, "attention", "self_attn.attention_probabilities", layers)
    saved = _saved(model, prompt, [f"layers.{i}.self_attn.attention_probabilities" for i in ok])
    x = _tokens(model, prompt)
    panels = [Heatmap(f"layer {i} head {h}", p[h], x, x, "key", "query", "probability", zmin=0.0, zmax=1.0)
              for i in ok for p in [saved[f"layers.{i}.self_attn.attention_probabilities"]] for h in range(p.shape[0])]
    return Figure(f"attention: {prompt!r}", panels)


# The registry: kind name -> function(model, prompt, layers) -> Figure. A new kind is a function and a line.
KINDS: dict = {
    "logit-lens": logit_lens,
    "state-norm": _timelines("state-norm", "linear_attn.states", "norm", "state norm (Frobenius, per head)"),
    "decay": _timelines("decay", "linear_attn.decays", "mean", "decay (log kept, mean per head)"),
    "beta": _timelines("beta", "linear_attn.betas", "mean", "beta (write strength, mean per head)"),
    "attention": attention,
}


def figure(kind: str, model, prompt: str, layers: Union[None, int, Sequence[int]] = None) -> Figure:
    """The :class:`Figure` of `kind` (a key of :data:`KINDS`) for one text prompt, computed by the core; no
    plotting library is imported. InputError for an unknown kind; UnsupportedError (with support()'s reason)
    when no asked layer serves the kind's value."""
    check_str("plot: kind", kind)
    if kind not in KINDS:
        raise InputError(f"plot: unknown kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return KINDS[kind](model, check_str("plot: prompt", prompt), layers)


def save(fig: Figure, out) -> str:
    """Render `fig` to `out`: ``.html`` (plotly, JavaScript embedded, opens offline) or ``.png`` (matplotlib,
    ``fig.width`` x ``fig.height`` pixels). Returns the path. InputError for another extension; ImportError
    naming ``mixlens[plot]`` when the library is missing."""
    from . import _plot_render

    out = os.fspath(out)
    ext = os.path.splitext(out)[1].lower()
    if ext not in _plot_render.WRITERS:
        raise InputError(f"plot: --out must end in {' or '.join(_plot_render.WRITERS)} (the format), got {out!r}")
    _plot_render.WRITERS[ext](fig, out)
    return out


def plot(kind: str, model, prompt: str, out, layers=None) -> str:
    """:func:`figure` then :func:`save`."""
    return save(figure(kind, model, prompt, layers), out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``mixlens plot`` / ``python -m mixlens.plot``: KIND PROMPT --out FILE [--model M] [--dtype D]
    [--layers 0,2]. Errors print ``mixlens: error: ...`` and return 1; usage errors exit 2."""
    p = argparse.ArgumentParser(prog="mixlens plot", description="Draw one kind of picture for one prompt: "
                                "HTML (interactive, self-contained) or PNG, from --out's extension.")
    p.add_argument("kind", choices=list(KINDS))
    p.add_argument("prompt")
    p.add_argument("--out", required=True, help="FILE.html or FILE.png")
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: as `mixlens run`)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    p.add_argument("--layers", default=None, help="comma-separated layer indices (default: every layer)")
    a = p.parse_args(argv)
    try:
        layers = None if a.layers is None else [int(s) for s in a.layers.split(",") if s.strip()]
    except ValueError:
        p.error(f"--layers takes comma-separated integers, got {a.layers!r}")
    try:
        model = load(a.model, output="numpy", dtype=a.dtype)
        path = plot(a.kind, model, a.prompt, a.out, layers)
    except (MixlensError, ImportError, ValueError, OSError) as e:
        print(f"mixlens: error: {e}", file=sys.stderr)
        return 1
    print(f"mixlens: wrote {a.kind} to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Run as `python -m mixlens.plot`: use the package's module, so there is one KINDS and one set of panel
    # classes (this file's __main__ copy would define its own).
    from mixlens.plot import main as _main

    sys.exit(_main())
