"""Pictures (issue 26 item 4, docs/plots.md): every kind renders from the shipped models to HTML and PNG; the
HTML, opened in headless Chromium with every network request sent to a recording proxy, draws a non-blank
page and asks for nothing; the PNG has the figure's pixel size; the core never imports a plotting library;
a missing extra and a missing Python are errors that say what to install; the CLI runs the Python renderer."""

from __future__ import annotations

import ast
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import mixlens
import mixlens.plot as mp
from mixlens_dev.common import REPO
from test_import_graph import PACKAGE, _imports, _modules

MODELS = REPO / "models"
PROMPT = "Once upon a time, there was a little girl"
CORRUPT = "Once upon a time, there was a little boy"  # attribution-patching's second prompt (same length)
# model -> the kinds it serves (the others are refused: test_unserved_kind_says_why).
SERVED = {"mamba2-tinystories": ["logit-lens", "state-norm", "decay", "beta", "token-mixing", "attribution-patching"],
          "mamba-tinystories": ["logit-lens", "state-norm", "decay", "beta", "token-mixing", "attribution-patching"],
          "qwen3_5-tinystories": ["logit-lens", "state-norm", "decay", "beta", "attention", "token-mixing", "attribution-patching"]}
PLOT_LIBS = ("plotly", "matplotlib", "kaleido")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Chromium's own background services, which call home whatever page is open (the flags below silence the
# rest): left out of the page's requests. Exact hosts only, so a page asking for any other host is caught.
BROWSER_SERVICES = ("update.googleapis.com", "accounts.google.com", "clients2.google.com")


def cli(*args, env=None):
    exe = Path(sys.executable).parent / "mixlens"
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def png_size(path: Path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


_models: dict = {}


def model(name: str):
    if name not in _models:
        _models[name] = mixlens.load(str(MODELS / name), output="numpy")
    return _models[name]


class RecordingProxy:
    """A TCP listener Chromium is told to use as its proxy for every URL (loopback included): any request the
    page makes lands here and is recorded (and dropped)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.requests: list = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(1)
            try:
                data = conn.recv(4096)
                # A connection closed before sending a byte is Chromium's speculative preconnect to the
                # proxy (seen once in ~20 runs), not a request the page made.
                if data:
                    self.requests.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
            except OSError:
                self.requests.append("(connection without a request line)")
            conn.close()

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def screenshot(html: Path, out: Path, size=(1300, 760)) -> list:
    """Chromium headless renders `html` into `out` (PNG); returns the requests it made (through the proxy)."""
    proxy = RecordingProxy()
    try:
        r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", "--virtual-time-budget=15000",
                            f"--proxy-server=http://127.0.0.1:{proxy.port}", "--proxy-bypass-list=<-loopback>",
                            "--no-first-run", "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", "--disable-default-apps", "--disable-extensions", "--no-pings",
                            "--disable-domain-reliability", "--disable-client-side-phishing-detection",
                            "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,Translate,MediaRouter",
                            f"--user-data-dir={out.parent / (out.stem + '-profile')}", html.resolve().as_uri()],
                           capture_output=True, text=True, timeout=300)
    finally:
        proxy.close()
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    hosts = [re.sub(r"^(?:CONNECT |[A-Z]+ https?://)([^/:]+).*$", r"\1", r) for r in proxy.requests]
    return [r for r, h in zip(proxy.requests, hosts) if h not in BROWSER_SERVICES]


def ink(png: Path) -> float:
    """The fraction of pixels that are not the page's background (its most common colour)."""
    from PIL import Image

    px = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(px, axis=0, return_counts=True)
    return 1.0 - counts.max() / len(px)


@pytest.mark.parametrize("name,kind", [(m, k) for m, kinds in SERVED.items() for k in kinds])
def test_each_kind_renders_to_html_and_png(name, kind, tmp_path):
    fig = mp.figure(kind, model(name), PROMPT, corrupt=CORRUPT if kind in mp.TWO_PROMPT_KINDS else None)
    assert fig.panels
    for p in fig.panels:
        data = p.z if hasattr(p, "z") else np.stack(list(p.series.values()))
        assert np.isfinite(data).all() and data.size > 0, p.title
    png = mp.save(fig, tmp_path / "fig.png")
    assert png_size(Path(png)) == (fig.width, fig.height)
    html = Path(mp.save(fig, tmp_path / "fig.html")).read_text()
    # Self-contained: plotly.js is in the file, and no tag loads anything (no src / href attribute at all).
    assert "Plotly.newPlot" in html and len(html) > 1_000_000
    tags = re.findall(r"<(?:script|link|img|iframe)\b[^>]*>", html)
    assert not [t for t in tags if re.search(r"\b(?:src|href)\s*=", t)], tags
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/setup.sh installs it): the HTML cannot be checked offline")
    shot = tmp_path / "shot.png"
    requests = screenshot(tmp_path / "fig.html", shot)
    assert requests == [], f"the page made network requests: {requests}"
    assert ink(shot) > 0.02, "the screenshot is (nearly) blank"


def test_the_browser_check_sees_a_request_and_a_blank_page(tmp_path):
    """The checks above can fail: a page that loads a remote image is recorded by the proxy, and an empty
    page has no ink."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/setup.sh installs it)")
    page = tmp_path / "remote.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png"></body></html>')
    assert any("example.invalid" in r for r in screenshot(page, tmp_path / "remote.png"))
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body></body></html>")
    assert screenshot(blank, tmp_path / "blank.png") == []
    assert ink(tmp_path / "blank.png") < 0.001


def test_logit_lens_is_the_core_projection():
    """The heatmap's numbers: the top token's probability of softmax(project_on_vocab(layer_output))."""
    m = model("mamba2-tinystories")
    fig = mp.figure("logit-lens", m, PROMPT)
    (hm,) = fig.panels
    saved = m.run([PROMPT], saves=["layers.2.layer_output"])
    logits = np.asarray(m.project_on_vocab(saved["layers.2.layer_output"][0]), dtype=np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(hm.z[2], probs.max(-1), rtol=1e-5)
    assert hm.text[2] == [m.tokenizer.decode([int(t)]) for t in probs.argmax(-1)]
    assert hm.z.shape == (m.num_layers, len(m.tokenizer.encode(PROMPT)))


def test_timelines_are_the_served_values():
    m = model("qwen3_5-tinystories")
    ids = m.tokenizer.encode(PROMPT)
    out = m.run([PROMPT], saves=["layers.1.linear_attn.states", "layers.1.linear_attn.betas"])
    norm = mp.figure("state-norm", m, PROMPT, layers=[1]).panels[0]
    states = out["layers.1.linear_attn.states"][0]  # [T, HV, Dk, Dv]
    np.testing.assert_allclose(norm.series["head 3"], np.linalg.norm(states[:, 3].reshape(len(ids), -1), axis=-1),
                               rtol=1e-5)
    beta = mp.figure("beta", m, PROMPT, layers=[0, 1, 2]).panels  # layer 2 is attention: left out
    assert [p.title for p in beta] == ["layer 0 linear_attn.betas", "layer 1 linear_attn.betas"]
    np.testing.assert_array_equal(beta[1].series["head 0"], out["layers.1.linear_attn.betas"][0][:, 0])
    # Mamba-1's decays are per channel and state entry: one heatmap row per channel, the mean over the state.
    m1 = model("mamba-tinystories")
    d = m1.run([PROMPT], saves=["layers.0.linear_attn.decays"])["layers.0.linear_attn.decays"][0]
    hm = mp.figure("decay", m1, PROMPT, layers=[0]).panels[0]
    np.testing.assert_allclose(hm.z, d.mean(-1).T, rtol=1e-6)


def test_token_mixing_is_the_core_value():
    """One panel per recurrent layer: the mean over heads of model.token_mixing, causal, red-blue around 0."""
    m = model("qwen3_5-tinystories")
    (p,) = mp.figure("token-mixing", m, PROMPT, layers=[0, 2]).panels  # layer 2 is an attention block: left out
    ids = m.tokenizer.encode(PROMPT)
    mix = m.token_mixing([ids], 0)["mixing"][0]  # [H, T, T]
    np.testing.assert_allclose(p.z, mix.mean(0), rtol=1e-6)
    assert p.z.shape == (len(ids), len(ids)) and p.diverging and p.zmin == -p.zmax
    assert np.triu(p.z, 1).max() == 0 and np.triu(p.z, 1).min() == 0  # no token mixes in a later one


def test_attribution_patching_grid_is_the_estimates():
    """Each panel is one node kind's estimates (layers x positions) from model.attribution_patching with the
    logit difference of the two prompts' top next tokens; a state after the last token changes nothing."""
    m = model("qwen3_5-tinystories")
    a, b = m.tokenizer.encode(PROMPT), m.tokenizer.encode(CORRUPT)
    assert len(a) == len(b)
    last = m.run([a, b], logits="last")["logits"][:, -1]
    good, bad = int(np.argmax(last[0])), int(np.argmax(last[1]))
    if bad == good:  # both prompts agree on the next token: the metric contrasts the clean prompt's second
        bad = int(np.argsort(-last[0])[1])
    fig = mp.figure("attribution-patching", m, PROMPT, corrupt=CORRUPT)
    res = m.attribution_patching([a], [b], mixlens.metrics.LogitDiff(good, bad))
    panels = {p.title: p for p in fig.panels}
    assert set(panels) == {"layer_output", "linear_attn.attention_output", "self_attn.attention_output",
                           "mlp.output", "linear_attn.state"}
    state = panels["linear_attn.state"]
    assert state.y == [f"layer {i}" for i in range(m.num_layers) if m.support(layer=i).get("linear_attn.states") is None]
    n = res.nodes.index("layers.1.linear_attn.state")
    np.testing.assert_allclose(state.z[1], res.estimates[n, 0], rtol=1e-6)
    assert (state.z[:, -1] == 0).all() and state.diverging and state.zmin == -state.zmax
    out = panels["layer_output"]
    assert out.z.shape == (m.num_layers, len(a))
    assert [p.title for p in mp.figure("attribution-patching", m, PROMPT, layers=[2], corrupt=CORRUPT).panels] == \
        ["layer_output", "self_attn.attention_output", "mlp.output"]  # layer 2 is an attention block
    with pytest.raises(mixlens.InputError, match="corrupt prompt"):
        mp.figure("attribution-patching", m, PROMPT)
    with pytest.raises(mixlens.InputError, match="same number of tokens"):
        mp.figure("attribution-patching", m, PROMPT, corrupt="Once upon a time")
    with pytest.raises(mixlens.InputError, match="takes one prompt"):
        mp.figure("logit-lens", m, PROMPT, corrupt=CORRUPT)


def test_unserved_kind_says_why():
    with pytest.raises(mixlens.UnsupportedError, match="attention_probabilities"):
        mp.figure("attention", model("mamba2-tinystories"), PROMPT)
    with pytest.raises(mixlens.UnsupportedError, match="betas"):
        mp.figure("beta", model("qwen3_5-tinystories"), PROMPT, layers=[2])  # an attention block
    with pytest.raises(mixlens.InputError, match="the kinds are logit-lens"):
        mp.figure("token-mixing-typo", model("mamba2-tinystories"), PROMPT)
    with pytest.raises(mixlens.InputError, match=r"\.html or \.png"):
        mp.save(mp.Figure("x"), "x.svg")


def test_only_the_renderer_imports_plotting_libraries():
    """No module but _plot_render names plotly / matplotlib / kaleido, and computing every kind's figure
    (mixlens, mixlens.plot and the core at work) leaves them unimported."""
    for name, path in _modules(PACKAGE).items():
        if name == "mixlens._plot_render":
            continue
        for node in _imports(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not [m for m in mods if m.split(".")[0] in PLOT_LIBS], f"{name} imports {mods}"
    code = ("import sys, mixlens, mixlens.plot as mp\n"
            f"m = mixlens.load({str(MODELS / 'qwen3_5-tinystories')!r}, output='numpy')\n"
            f"for k in mp.KINDS: mp.figure(k, m, {PROMPT!r}, corrupt={CORRUPT!r} if k in mp.TWO_PROMPT_KINDS else None)\n"
            f"print(sorted(x for x in sys.modules if x.split('.')[0] in {PLOT_LIBS!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


def _shadow(tmp_path: Path, *packages: str) -> dict:
    """PYTHONPATH entries that make `packages` fail to import, as if they were not installed."""
    d = tmp_path / "shadow"
    for p in packages:
        (d / p).mkdir(parents=True, exist_ok=True)
        (d / p / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{p}'\", name={p!r})\n")
    return {"PYTHONPATH": str(d)}


def test_missing_extra_names_it(tmp_path):
    env = _shadow(tmp_path, "plotly", "matplotlib")
    code = ("import mixlens, mixlens.plot as mp\n"
            "f = mp.Figure('x', [mp.Lines('l', ['a', 'b'], {'h': [1.0, 2.0]})])\n"
            "for ext in ('html', 'png'):\n"
            "    try:\n        mp.save(f, 'x.' + ext)\n    except ImportError as e:\n        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all("pip install 'mixlens[plot]'" in ln for ln in lines), lines
    assert "HTML output needs plotly" in lines[0] and "PNG output needs matplotlib" in lines[1]
    r = cli("plot", "logit-lens", PROMPT, "--out", tmp_path / "lens.html", env=env)
    assert r.returncode == 1 and "pip install 'mixlens[plot]'" in r.stderr, r.stderr


def test_cli_runs_the_python_renderer(tmp_path):
    r = cli("plot", "logit-lens", "Once upon a time", "--out", tmp_path / "lens.html")
    assert r.returncode == 0, r.stderr
    assert "Plotly.newPlot" in (tmp_path / "lens.html").read_text()
    r = cli("plot", "beta", PROMPT, "--model", MODELS / "qwen3_5-tinystories", "--layers", "0,1", "--out",
            tmp_path / "betas.png")
    assert r.returncode == 0, r.stderr
    fig = mp.figure("beta", model("qwen3_5-tinystories"), PROMPT, layers=[0, 1])
    assert png_size(tmp_path / "betas.png") == (fig.width, fig.height)
    r = cli("plot", "attention", PROMPT, "--out", tmp_path / "a.html")  # the shipped Mamba-2 has no attention
    assert r.returncode == 1 and "mixlens: error: plot attention" in r.stderr, r.stderr
    r = cli("plot", "attribution-patching", PROMPT, "--corrupt", CORRUPT, "--out", tmp_path / "atp.png")
    assert r.returncode == 0 and png_size(tmp_path / "atp.png")[0] > 0, r.stderr
    r = cli("plot", "no-such-kind", PROMPT, "--out", tmp_path / "a.html")
    assert r.returncode == 2 and "invalid choice" in r.stderr, r.stderr
    assert "plot" in cli("--help").stdout and "mixlens[plot]" in cli("help", "plot").stdout


def test_cli_without_python_or_package_says_so(tmp_path):
    r = cli("plot", "logit-lens", PROMPT, "--out", tmp_path / "x.html", env={"MIXLENS_PYTHON": str(tmp_path / "nope")})
    assert r.returncode == 1 and "cannot run the Python" in r.stderr and "MIXLENS_PYTHON" in r.stderr, r.stderr
    r = cli("plot", "logit-lens", PROMPT, "--out", tmp_path / "x.html", env=_shadow(tmp_path, "mixlens"))
    assert r.returncode == 1 and "cannot import" in r.stderr and "mixlens[plot]" in r.stderr, r.stderr
