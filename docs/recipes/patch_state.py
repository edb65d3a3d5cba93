"""Recipe: patch the recurrent state at token t. Run a prompt up to token t with a cache, then continue from
a state taken from another prompt (state_input of the continuation), and see what the rest predicts.

Run from anywhere: python docs/recipes/patch_state.py
"""
import torch

import mixlens

model = mixlens.load(output="torch")
tok = model.tokenizer
clean = tok.encode("The little girl found a red ball in the park and she")
corrupt = tok.encode("The little boy found a red ball in the park and he")
assert len(clean) == len(corrupt)
t = 3  # patch the state after token t (" girl" / " boy")
layer = 2

# The states after token t in the clean run: a prefix run with a cache ends exactly there.
with model.trace(clean[: t + 1], cache=model.new_cache()) as tr:
    clean_state = [model.layers[i].linear_attn.state_output for i in range(model.num_layers)]
# ... equal to the per-token states of the full run at t (docs/values.md invariant).
with model.trace(clean):
    full_states = model.layers[layer].linear_attn.states
assert torch.allclose(full_states[:, t], clean_state[layer], atol=1e-5)

# Corrupt prefix, then the continuation starting from the clean state of one layer.
cache = model.new_cache()
model.forward(corrupt[: t + 1], cache)
with model.trace(corrupt[t + 1:], cache=cache) as patched:
    model.layers[layer].linear_attn.state_input = clean_state[layer]
# Without the patch, prefix + continuation is the corrupt run itself.
cache = model.new_cache()
model.forward(corrupt[: t + 1], cache)
with model.trace(corrupt[t + 1:], cache=cache) as plain:
    pass
full = model.run(corrupt)["logits"]
assert torch.allclose(plain.logits, full[:, t + 1:], atol=1e-4)

she, he = tok.encode(" she")[0], tok.encode(" he")[0]
def margin(logits):  # logit(" she") - logit(" he") before the last token
    return (logits[0, -2, she] - logits[0, -2, he]).item()
print(f"layer {layer} state patched at token {t}: she-he margin {margin(plain.logits):.3f} -> {margin(patched.logits):.3f}")
assert not torch.equal(patched.logits, plain.logits)
print("patch the state at token t: ok")
