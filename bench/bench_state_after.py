#!/usr/bin/env python
"""Cost of per-token states (issue 7 item 3 and its speed section): mixlens against its own plain
forward, and against transformers' token-by-token kernel producing the same per-token states.

Run (the lead's command, on a quiet machine; `make bench-state-after` runs the same):

    .venv/bin/python bench/bench_state_after.py                      # 1,024 tokens, 3 layouts, 5 repeats
    .venv/bin/python bench/bench_state_after.py --repeats 2 --hf-tokens 64 --families mamba2
    make bench-state-after BENCH_ARGS="--repeats 3"

Models: the published layouts with random weights, made locally on first use and cached under build/
(mixlens_dev/published_layout.py: mamba2-130m, mamba-130m and Qwen3.5-0.8B shapes, float32). For
each, at --tokens tokens, batch 1, it times:
  - plain: one forward (`model.run`), nothing read;
  - states, all layers: a `with model.trace(ids)` block reading `states` of every recurrent layer in
    turn, reducing it to one number (its norm) and deleting it before the next layer. Each layer's
    stack is consumed as it is served and never held together with another: mamba2-130m's states
    are 786 KB per token per layer (19 GB for 24 layers at 1,024 tokens), so holding them all is not
    a measurement anyone can run; the forward then writes each layer's stack into the dropped one;
  - states, one layer: the same block reading the middle recurrent layer's `states` only;
  - set_state_after: one pre-registered write of `state@t<T/2>` on the middle recurrent layer (the
    scan is split there and resumes from the written state);
  - state_after: one pre-registered read of `state@t<T/2>` on the middle recurrent layer;
  - transformers token loop: transformers fed the prompt one token per call over its cache (its
    token-by-token kernel, the only way it yields the state after every token), taking every
    layer's recurrent state after each token and reducing it to its norm as the mixlens block
    does. Skipped with --no-hf. transformers is loaded only after mixlens' copy of the model is
    freed. Memory: the Qwen3.5-0.8B run at 1,024 tokens peaked at 5.4 GB resident (1.7 GB of float32
    weights, a 1 GB `states` stack, the [1,1024,248320] logits of 1 GB and their Python copy); use
    --tokens 512 where 4 GiB is the limit.
Logits: by default (--logits last) every mixlens variant runs with `logits="last"` (the LM head on
the last position only: the per-token states are what is measured, and nobody reads 1,024 rows of
logits here) and the transformers loop calls the backbone without its LM head, so neither side pays
for logits nobody reads. --logits all makes every mixlens variant build logits at every position
and the transformers loop run the whole CausalLM (its LM head on each token), the earlier setting.
Targets (issue 7): states of all layers <= 3x plain; one layer's states, set_state_after and
state_after <= 1.3x plain; mixlens' all-layer states >= 20x faster than the transformers token loop.

Method: the load average is read and printed first (a machine with load above 1 has other work
running and the numbers are marked as from a busy machine). Each mixlens variant runs once as a
warm-up, then --repeats rounds, each round running every variant once, in an order rotated from
round to round (interleaved, so a load change hits every variant alike). Reported per variant:
median, min and max wall seconds, median CPU seconds of the process (all threads: on a busy machine
the steadier measure), and both medians over those of plain. The transformers loop runs --hf-repeats
times (it takes minutes), with OMP_WAIT_POLICY=PASSIVE unless set (spinning OpenMP threads made
it ~5x slower on a busy machine). Results go to --out as a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from mixlens_dev import timing

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("mamba2", "mamba", "qwen3_5")
LAYOUT_NAMES = {"mamba2": "mamba2-130m", "mamba": "mamba-130m", "qwen3_5": "Qwen3.5-0.8B"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Per-token state cost: mixlens states / state_after / set_state_after against a plain "
                    "forward and against transformers' token-by-token loop (issue 7). Writes a markdown table.",
        epilog="Full documentation: the module docstring (head -40 bench/bench_state_after.py).")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma-separated subset of {','.join(FAMILIES)} (layouts: "
                         + ", ".join(f"{k}={v}" for k, v in LAYOUT_NAMES.items()) + "; default: all)")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for mixlens (MIXLENS_NUM_THREADS) and torch (default: all cores)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds of the mixlens variants (default 5)")
    ap.add_argument("--hf-repeats", type=int, default=1, help="timed runs of the transformers token loop (default 1)")
    ap.add_argument("--hf-tokens", type=int, default=None,
                    help="run the transformers loop over the first N tokens only and scale its time to --tokens "
                         "(its cost per token is flat for Mamba; Qwen3.5's attention layers make later tokens "
                         "dearer, so the scaled time is a lower bound). Default: all --tokens")
    ap.add_argument("--logits", choices=("last", "all"), default="last",
                    help="mixlens' logits option for every variant, and whether the transformers loop runs its LM "
                         "head (all) or the backbone alone (last). Default last: neither side builds unread logits")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers token loop (it takes minutes)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "state_after.md"),
                    help="markdown results file (default bench/results/state_after.md)")
    args = ap.parse_args(argv)
    bad = [f for f in args.families.split(",") if f not in FAMILIES]
    if bad:
        ap.error(f"unknown families {bad}; choose from {','.join(FAMILIES)}")
    if args.tokens < 2 or args.repeats < 1 or args.hf_repeats < 1 or args.threads < 1:
        ap.error("--tokens must be >= 2 and --repeats, --hf-repeats, --threads >= 1")
    if args.hf_tokens is None:
        args.hf_tokens = args.tokens
    if not 1 <= args.hf_tokens <= args.tokens:
        ap.error("--hf-tokens must be in 1..--tokens")
    return args


def layout(family: str) -> Path:
    from mixlens_dev import published_layout as mpl
    from mixlens_dev import published_layout as published_layout_cache

    if family == "mamba2":
        return published_layout_cache.cached_layout(REPO / "build")
    if family == "mamba":
        return mpl.cached_mamba1_130m(REPO / "build" / "published")
    return mpl.cached_qwen3_5_0_8b(REPO / "build" / "published")


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of one call."""
    s = timing.timed(fn)
    return s.wall, s.cpu


def interleaved(fns: dict, repeats: int) -> dict:
    """(wall, cpu) per run per variant: one warm-up each, then `repeats` rounds in a rotating order."""
    for fn in fns.values():
        fn()
    names = list(fns)
    out = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names):] + names[: r % len(names)]:
            out[k].append(timed(fns[k]))
    return out


def hf_token_loop(family: str, path: Path, ids: list, threads: int, lm_head: bool) -> float:
    """transformers, one token per call over its cache, every layer's recurrent state read (and reduced
    to its norm) after each token; with lm_head=False the backbone alone (no logits). (wall, CPU)
    seconds for the whole prompt."""
    import torch
    import transformers
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    if family == "qwen3_5":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    else:
        cls = transformers.Mamba2ForCausalLM if family == "mamba2" else transformers.MambaForCausalLM
        model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    # The backbone (model.model / model.backbone) is the CausalLM without its LM head.
    net = model if lm_head else model.get_decoder()

    def feed(cache, t):
        if family == "qwen3_5":
            net(input_ids=x[:, t:t + 1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[t]]))
        else:
            net(input_ids=x[:, t:t + 1], cache_params=cache, use_cache=True)

    with torch.no_grad():  # warm-up: the first calls pay one-time costs
        warm = DynamicCache(config=model.config.get_text_config())
        for t in range(min(2, len(ids))):
            feed(warm, t)
        del warm
    cache = DynamicCache(config=model.config.get_text_config())
    n_states = 0
    with timing.Timer() as tm, torch.no_grad():
        for t in range(len(ids)):
            feed(cache, t)
            for layer in cache.layers:
                rs = getattr(layer, "recurrent_states", None)
                if rs and rs.get(0) is not None:
                    float(rs[0].norm())
                    n_states += 1
    elapsed = tm.wall, tm.cpu
    if n_states == 0:
        raise RuntimeError(f"{family}: the transformers loop exposed no recurrent state (cache API changed?)")
    del model, cache
    gc.collect()
    return elapsed


def bench(family: str, args) -> list[dict]:
    import numpy as np

    import mixlens

    path = layout(family)
    ml = mixlens.StandardizedTransformer(str(path))
    T = args.tokens
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]  # the Qwen3.5 layout has no tokenizer
    ids = np.random.default_rng(T).integers(3, min(vocab, 50000), size=T).tolist()
    rec = [i for i, k in enumerate(ml.info["layer_kinds"]) if k not in ("attention", "mlp", "moe")]
    mid = rec[len(rec) // 2]
    state_t = f"layers.{mid}.linear_attn.state@t{T // 2}"

    lg = args.logits

    def read_states(layers):
        def fn():
            with ml.trace([ids], logits=lg):
                for i in layers:
                    s = ml.layers[i].linear_attn.states  # consumed and dropped: never two stacks held
                    float(s.norm()) if hasattr(s, "norm") else float(np.linalg.norm(s))
                    del s
        return fn

    fns = {
        "plain": lambda: ml.run([ids], logits=lg),
        "states, all layers": read_states(rec),
        "states, one layer": read_states([mid]),
        "set_state_after": lambda: ml.run([ids], edits={state_t: lambda v: v * 0.5}, logits=lg),
        "state_after": lambda: ml.run([ids], saves=[state_t], logits=lg),
    }
    times = interleaved(fns, args.repeats)
    rows = [dict(family=family, what=k, times=v) for k, v in times.items()]
    plain = rows[0]
    for r in rows:
        ratios(r, plain)
    for r in rows:
        print(row_text(r), flush=True)
    if not args.no_hf:
        del ml, fns, read_states  # the closures hold the model: free it before transformers loads its copy
        gc.collect()
        n = args.hf_tokens
        hf = []
        for _ in range(args.hf_repeats):
            wall, cpu = hf_token_loop(family, path, ids[:n], args.threads, lm_head=args.logits == "all")
            hf.append((wall * T / n, cpu * T / n))
        what = "transformers token loop (every layer's state after every token" + (
            ", no LM head)" if args.logits == "last" else ", LM head on every token)")
        if n < T:
            what += f", timed over {n} tokens and scaled to {T}"
        r = dict(family=family, what=what, times=hf)
        ratios(r, plain)
        all_states = dict(times=times["states, all layers"])
        ratios(all_states, r)
        r["speedup"] = (1 / all_states["ratio"], 1 / all_states["cpu_ratio"])
        rows.append(r)
        print(row_text(r), flush=True)
    return rows


TARGETS = {"states, all layers": 3.0, "states, one layer": 1.3, "set_state_after": 1.3, "state_after": 1.3}


def ratios(r: dict, base: dict) -> None:
    """Median wall and median CPU time of `r` over those of `base`."""
    med = lambda rows, i: timing.median(x[i] for x in rows)  # noqa: E731
    r["ratio"] = med(r["times"], 0) / med(base["times"], 0)
    r["cpu_ratio"] = med(r["times"], 1) / med(base["times"], 1)


def row_text(r: dict) -> str:
    wall = [w for w, _ in r["times"]]
    cpu = [c for _, c in r["times"]]
    target = TARGETS.get(r["what"])
    verdict = "" if target is None else (
        f"<= {target}x: wall {'yes' if r['ratio'] <= target else 'NO'}, cpu {'yes' if r['cpu_ratio'] <= target else 'NO'}")
    if "speedup" in r:
        w, c = r["speedup"]
        verdict = (f"mixlens all-layer states {w:.1f}x faster by wall, {c:.1f}x by CPU "
                   f"(>= 20x: wall {'yes' if w >= 20 else 'NO'}, cpu {'yes' if c >= 20 else 'NO'})")
    return (f"| {LAYOUT_NAMES[r['family']]} | {r['what']} | {timing.median(wall):.3f} | "
            f"{min(wall):.3f} - {max(wall):.3f} | {timing.median(cpu):.3f} | {len(wall)} | "
            f"{r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {verdict} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["MIXLENS_NUM_THREADS"] = str(args.threads)
    # torch's OpenMP threads spin while waiting: on a machine with other work running that made the
    # transformers loop ~5x slower here. Passive waiting is fair to it (and changes little when quiet).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load = os.getloadavg()
    busy = load[0] > 1.0
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
          + (" - BUSY machine: indicative numbers only" if busy else ""), flush=True)
    import torch

    torch.set_num_threads(args.threads)
    import mixlens  # noqa: F401  (after MIXLENS_NUM_THREADS is set)

    rows = []
    for fam in args.families.split(","):
        rows += bench(fam, args)
    end_load = os.getloadavg()[0]
    lines = [
        "# Per-token states: cost against a plain forward and against transformers' token loop",
        "",
        f"{args.tokens} tokens, batch 1, {args.threads} threads, random-weight published layouts (float32), "
        f"logits={args.logits!r} for every mixlens variant (transformers loop "
        + ("without its LM head" if args.logits == "last" else "with its LM head on every token") + "); "
        f"{args.repeats} interleaved rounds after a warm-up (transformers: {args.hf_repeats} run(s)). "
        f"Load average {load[0]:.2f} at start, {end_load:.2f} at the end, {os.cpu_count()} cores"
        + (": a BUSY machine (other work running), so the seconds are inflated and the ratios only "
           "indicative; rerun on a quiet machine." if busy or end_load > 1.0 else " (quiet machine)."),
        "",
        "`states, all layers` reads each recurrent layer's `states` in a `with` block, reduces it to its "
        "norm and deletes it before the next layer (never two stacks held). Command: "
        f"`.venv/bin/python bench/bench_state_after.py --tokens {args.tokens} --repeats {args.repeats}"
        f" --hf-repeats {args.hf_repeats} --hf-tokens {args.hf_tokens} --logits {args.logits}"
        f"{' --no-hf' if args.no_hf else ''}"
        f" --families {args.families}`.",
        "",
        "Wall = elapsed seconds; CPU = this process's CPU seconds (all threads). On a busy machine the wall "
        "time mostly measures the other work (a run got a fifth of a core at times), so the CPU-time ratio is the "
        "steadier one there; on a quiet machine the wall ratio is the one the targets mean.",
        "",
        "| model | measurement | median wall s | min - max wall s | median CPU s | runs | wall / plain | CPU / plain | target |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ] + [row_text(r) for r in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
