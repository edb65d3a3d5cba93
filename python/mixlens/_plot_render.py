"""Renderers of :class:`mixlens.plot.Figure`: HTML through plotly, PNG through matplotlib. The only module that
imports a plotting library (tests/python/test_plot.py checks it), and only when a file is written.

PNG goes through matplotlib rather than plotly + kaleido: kaleido 1.x drives a Chromium it starts for each
export (seconds per figure, and a browser on the machine), matplotlib draws in-process (docs/plots.md has
the timings)."""

from __future__ import annotations

import importlib

import numpy as np

EXTRA = "pip install 'mixlens[plot]'"
MAX_TICKS = 40  # a labelled tick per row up to this many rows


def _need(module: str, fmt: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"mixlens.plot: {fmt} output needs {module.split('.')[0]}, part of the optional "
                          f"extra: {EXTRA} ({e})") from e


def _is_heatmap(panel) -> bool:
    # By shape, not class: this module does not import mixlens.plot (which imports it), so no cycle.
    return not hasattr(panel, "series")


def _cells(fig):
    """(panel, row, col) 0-based, row by row."""
    return [(p, k // fig.cols, k % fig.cols) for k, p in enumerate(fig.panels)]


def write_html(fig, out: str) -> None:
    """Self-contained HTML: plotly.js embedded in the file (no CDN, no MathJax), so it opens offline."""
    go = _need("plotly.graph_objects", "HTML")
    subplots = _need("plotly.subplots", "HTML")

    pf = subplots.make_subplots(rows=fig.rows, cols=fig.cols, subplot_titles=[p.title for p in fig.panels],
                                horizontal_spacing=0.08, vertical_spacing=0.12)
    for k, (p, r, c) in enumerate(_cells(fig)):
        if _is_heatmap(p):
            pf.add_trace(go.Heatmap(z=p.z, x=list(range(len(p.x))), y=list(range(len(p.y))), text=p.text,
                                    texttemplate="%{text}" if p.text is not None else None,
                                    customdata=np.array([[f"{yy} / {xx}" for xx in p.x] for yy in p.y]),
                                    hovertemplate="%{customdata}: %{z:.3g}<extra></extra>",
                                    zmin=p.zmin, zmax=p.zmax, colorscale="Viridis", showscale=k == 0,
                                    colorbar={"title": {"text": p.zlabel}}), row=r + 1, col=c + 1)
            ticks = {"tickvals": list(range(len(p.y))), "ticktext": [str(v) for v in p.y]} if len(p.y) <= MAX_TICKS else {}
            pf.update_yaxes(autorange="reversed", row=r + 1, col=c + 1, **ticks)
        else:
            for name, v in p.series.items():
                pf.add_trace(go.Scatter(x=list(range(len(p.x))), y=np.asarray(v), mode="lines", name=name,
                                        legendgroup=name, showlegend=k == 0), row=r + 1, col=c + 1)
        pf.update_xaxes(tickvals=list(range(len(p.x))), ticktext=[str(v) for v in p.x], title_text=p.xlabel,
                        row=r + 1, col=c + 1)
        pf.update_yaxes(title_text=p.ylabel, row=r + 1, col=c + 1)
    pf.update_layout(title_text=fig.title, width=fig.width, height=fig.height, template="plotly_white")
    pf.write_html(out, include_plotlyjs=True, include_mathjax=False, full_html=True,
                  config={"displaylogo": False})


def write_png(fig, out: str) -> None:
    """PNG of exactly ``fig.width`` x ``fig.height`` pixels (100 dpi, no tight bounding box)."""
    # matplotlib.figure, not pyplot: no global backend switched and no figure left registered in the caller.
    mfig = _need("matplotlib.figure", "PNG")

    dpi = 100
    f = mfig.Figure(figsize=(fig.width / dpi, fig.height / dpi), dpi=dpi)
    axes = f.subplots(fig.rows, fig.cols, squeeze=False)
    for p, r, c in _cells(fig):
        ax = axes[r][c]
        if _is_heatmap(p):
            im = ax.imshow(p.z, aspect="auto", cmap="viridis", vmin=p.zmin, vmax=p.zmax, interpolation="nearest")
            f.colorbar(im, ax=ax, label=p.zlabel)
            if len(p.y) <= MAX_TICKS:  # else (channels) matplotlib's own numeric ticks
                ax.set_yticks(range(len(p.y)), [str(v) for v in p.y], fontsize=6)
            if p.text is not None and p.z.size <= 400:  # cell labels stay readable up to ~20 x 20
                for (yy, xx), t in np.ndenumerate(np.array(p.text, dtype=object)):
                    ax.text(xx, yy, t, ha="center", va="center", fontsize=5, color="white")
        else:
            for name, v in p.series.items():
                ax.plot(np.asarray(v), label=name, linewidth=1)
            if len(p.series) > 1:
                ax.legend(fontsize=5, ncol=2)
        ax.set_xticks(range(len(p.x)), [str(v) for v in p.x], rotation=90, fontsize=5)
        ax.set_title(p.title, fontsize=8)
        ax.set_xlabel(p.xlabel, fontsize=7)
        ax.set_ylabel(p.ylabel, fontsize=7)
    for k in range(len(fig.panels), fig.rows * fig.cols):
        axes[k // fig.cols][k % fig.cols].set_axis_off()
    f.suptitle(fig.title, fontsize=10)
    f.tight_layout()
    f.savefig(out, dpi=dpi, format="png")


WRITERS = {".html": write_html, ".png": write_png}
