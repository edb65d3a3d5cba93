"""Recipe: activation patching. Copy the residual stream of a clean run into a corrupted run, one layer and
position at a time, and measure how much of the clean prediction comes back.

Run from anywhere: python docs/recipes/activation_patching.py
"""
import torch

import mixlens

model = mixlens.load(output="torch")
clean, corrupt = "Tom gave the ball to Sue. Then Sue gave the ball to", "Tom gave the ball to Sue. Then Tom gave the ball to"
ids_clean, ids_corrupt = model.tokenizer.encode(clean), model.tokenizer.encode(corrupt)
assert len(ids_clean) == len(ids_corrupt), "patching position by position needs prompts of equal length"
target = model.tokenizer.encode(" Tom")[0]

with model.trace(clean):
    clean_states = [model.layers_output[i].clone() for i in range(model.num_layers)]
    clean_logit = model.logits[0, -1, target].item()
corrupt_logit = model.run(corrupt)["logits"][0, -1, target].item()

T = len(ids_clean)
effect = torch.zeros(model.num_layers, T)
for layer in range(model.num_layers):
    # One batched forward per layer: row t patches position t (several invokes would do the same).
    with model.trace([corrupt] * T) as tracer:
        h = model.layers_output[layer]
        for t in range(T):
            h[t, t] = clean_states[layer][0, t]  # an in-place edit: consumed when the block moves on
        logits = model.logits
    effect[layer] = (logits[:, -1, target] - corrupt_logit) / (clean_logit - corrupt_logit + 1e-9)

print("fraction of the clean logit restored, layer x position:")
print(effect.numpy().round(2))
# Patching the whole last-layer state at the last position restores the clean prediction exactly.
assert abs(effect[-1, -1].item() - 1.0) < 1e-3
print("activation patching: ok")
