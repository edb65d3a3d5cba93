#!/usr/bin/env python
"""What holding values to the end of a `with` block adds per value read, split by thread.

    MIXLENS_OUTPUT=torch .venv/bin/python bench/bench_handoff_held.py [BLOCKS]
    MIXLENS_OUTPUT=torch PYTHONPATH=DIR .venv/bin/python bench/bench_handoff_held.py   # another build's package

Same model and reads as bench/bench_handoff.py `full` / `kept` (tiny 24-layer Mamba-2, 8 tokens, the first 100
small values, `model.layers[i].linear_attn.x` spelled as the user's source line), blocks of 0 reads, 100 reads
dropped at once and 100 reads held interleaved BLOCKS times (default 150). Per value = (t(100) - t(0)) / 100 for
process CPU (every thread: the forward's pool worker too) and the caller's thread alone, from the least and
from the 20th percentile of the blocks (the percentile is steadier on a loaded machine). Run it alternately
for two builds to A/B them; the load average is printed.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("MIXLENS_NUM_THREADS", "2")

import numpy as np  # noqa: E402

import bench_handoff as bh  # noqa: E402


def main() -> int:
    import mixlens

    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    model = mixlens.StandardizedTransformer(str(bh.tiny_model(bh.REPO / "build" / "bench-handoff-mamba2-24l")))
    ids = [(i * 37 + 5) % 256 for i in range(8)]
    readers = [bh.full_reader(model, p) for p in bh.small_paths(model, 100)]

    def block(rs, keep):
        c0, m0 = time.process_time(), time.thread_time()
        with model.trace([ids]):
            if keep:
                held = [r() for r in rs]
                del held
            else:
                for r in rs:
                    r()
        return time.process_time() - c0, time.thread_time() - m0

    modes = {"zero": ([], False), "dropped": (readers, False), "held": (readers, True)}
    res = {m: [] for m in modes}
    for k in range(blocks + 10):  # ten warm-up rounds
        for m, (rs, keep) in modes.items():
            t = block(rs, keep)
            if k >= 10:
                res[m].append(t)
    stats = {}
    for m in modes:
        a = np.array(res[m])
        stats[m] = (a[:, 0].min(), np.percentile(a[:, 0], 20), a[:, 1].min(), np.percentile(a[:, 1], 20))
    for m in ("dropped", "held"):
        d = [(stats[m][i] - stats["zero"][i]) / 100 * 1e6 for i in range(4)]
        print(f"{model.output_format} {m}: per value, process CPU least {d[0]:.2f} p20 {d[1]:.2f} us | caller's "
              f"thread least {d[2]:.2f} p20 {d[3]:.2f} us")
    print(f"mixlens {mixlens.__file__}, load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
