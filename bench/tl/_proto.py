"""The workers' line protocol (stdlib only): one JSON request per stdin line, one JSON reply per line
on the real stdout; anything the libraries print goes to stderr. Timing as the repo's
dev/mixlens_dev/timing.py (wall: perf_counter, cpu: process_time of every thread)."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def reset_peak_rss() -> None:
    try:  # Linux: writing 5 resets VmHWM (the peak RSS) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gib() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def timed(fn) -> dict:
    gc.collect()
    reset_peak_rss()
    c0, w0 = time.process_time(), time.perf_counter()
    r = fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    del r
    peak = peak_rss_gib()
    gc.collect()
    return {"wall": wall, "cpu": cpu, "peak_rss_gib": round(peak, 3)}


def serve(handlers: dict) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            out.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            res = handlers[op](**req)
            out.write(json.dumps({"ok": True, **(res or {})}) + "\n")
        except Exception as e:  # reported to the driver, the worker goes on
            traceback.print_exc()
            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
