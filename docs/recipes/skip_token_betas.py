"""Recipe: skip a token through betas. On Mamba-2, betas is the write strength dt of each token: betas[:, t] = 0
makes token t write nothing and decay nothing, so the state after t equals the state after t-1 exactly
(docs/values.md). Compare with deleting the token from the prompt.

Run from anywhere: python docs/recipes/skip_token_betas.py
"""
import torch

import mixlens

model = mixlens.load(output="torch")
prompt = "Once upon a time, there was a little"
t = 3  # the token to skip

with model.trace(prompt) as tracer:
    for i in range(model.num_layers):
        mix = model.layers[i].linear_attn
        mix.betas[:, t] = 0  # an in-place edit of the value just read: reaches the forward
        states = mix.states  # [B, T, heads, state, head_dim]
        assert torch.allclose(states[:, t], states[:, t - 1], atol=1e-6), "token t changed the state"
skipped = tracer.logits

# The mixers ignore token t; the residual stream still carries it (its embedding and MLP-free path).
full = model.run(prompt)["logits"]
print("change in the last-token logits from skipping token", t, ":", (skipped[0, -1] - full[0, -1]).norm().item())
assert not torch.equal(skipped, full)
print("skip a token through betas: ok")
