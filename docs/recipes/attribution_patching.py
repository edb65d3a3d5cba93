"""Recipe: attribution patching (gradient x activation difference) against real activation patching.

Attribution patching estimates, from one forward and one backward of the corrupted prompt, what patching the
clean residual stream into it at (layer, position) would do to a metric:
    effect(layer, t) ~= (h_clean - h_corrupt)[layer, t] . d metric / d h_corrupt[layer, t]
The gradients come from mixlens' native backward (docs/gradients.md). Real activation patching (one batched
forward per layer, as docs/recipes/activation_patching.py) gives the true effects; their correlation is
printed (a linear estimate, so it is not asserted).

Run from anywhere: python docs/recipes/attribution_patching.py
"""
import numpy as np
import torch

import mixlens

model = mixlens.load(output="torch")
clean, corrupt = "Tom gave the ball to Sue. Then Sue gave the ball to", "Tom gave the ball to Sue. Then Tom gave the ball to"
ids_clean, ids_corrupt = model.tokenizer.encode(clean), model.tokenizer.encode(corrupt)
assert len(ids_clean) == len(ids_corrupt), "patching position by position needs prompts of equal length"
tom, sue = model.tokenizer.encode(" Tom")[0], model.tokenizer.encode(" Sue")[0]
L, T = model.num_layers, len(ids_clean)
paths = [f"layers.{i}.layer_output" for i in range(L)]


def metric(logits):  # logit difference at the last position
    return logits[0, -1, tom] - logits[0, -1, sue]


clean_run = model.run(clean, saves=paths)
clean_h = [clean_run[p] for p in paths]

# One forward + one backward of the corrupted prompt gives every layer's gradient.
with model.trace(corrupt, saves=paths, grad=True) as tr:
    pass
corrupt_metric = metric(tr.logits).item()
tr.backward(metric(tr.logits))
attribution = torch.zeros(L, T)
for i, p in enumerate(paths):
    attribution[i] = ((clean_h[i][0] - tr.saved[p][0]) * tr.grad(p)[0]).sum(-1)

# Real activation patching: row t of the batch patches position t.
actual = torch.zeros(L, T)
for i in range(L):
    with model.trace([corrupt] * T):
        h = model.layers_output[i]
        for t in range(T):
            h[t, t] = clean_h[i][0, t]
        logits = model.logits
    actual[i] = (logits[:, -1, tom] - logits[:, -1, sue]) - corrupt_metric

np.set_printoptions(precision=2, suppress=True, linewidth=160)
print("attribution patching estimate (logit diff change), layer x position:")
print(attribution.numpy())
print("actual activation patching effect:")
print(actual.numpy())
corr = np.corrcoef(attribution.numpy().ravel(), actual.numpy().ravel())[0, 1]
print(f"correlation(attribution, actual) over {L} layers x {T} positions: {corr:.3f}")
assert torch.isfinite(attribution).all() and attribution.abs().sum() > 0
print("attribution patching: ok")
