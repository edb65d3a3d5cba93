"""Recipe: steering. Add a direction to the residual stream (nnterp's model.steer) and watch the generation move.

Run from anywhere: python docs/recipes/steering.py
"""
import torch

import mixlens

model = mixlens.load(output="torch")
prompt = "Once upon a time, there was a little"

# A direction: the difference of mean layer-3 states between two contrasting prompts.
with model.trace(["The happy girl smiled and laughed", "The sad girl cried and frowned"]):
    h = model.layers_output[3]
direction = h[0].mean(0) - h[1].mean(0)

with model.generate(prompt, max_new_tokens=12) as base:
    pass
with model.generate(prompt, max_new_tokens=12) as steered:
    for step in steered.iter[:]:
        model.steer(layers=3, steering_vector=direction, factor=4.0)  # every step, every position
print("base:   ", prompt + base.text)
print("steered:", prompt + steered.text)

# steer is layers_output[l][...] += factor * v: the same by hand gives the same logits.
with model.trace(prompt) as a:
    model.steer(3, direction, factor=4.0, positions=[2, 5])
with model.trace(prompt) as b:
    model.layers_output[3][:, [2, 5]] += 4.0 * direction
assert torch.equal(a.logits, b.logits)
assert not torch.equal(a.logits, model.run(prompt)["logits"])
print("steering: ok")
