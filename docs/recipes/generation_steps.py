"""Recipe: step through generation. Step 0 runs the prompt, each later step one new token; values are read per
step, and a write at step k changes step k and everything after it (through the cache).

Run from anywhere: python docs/recipes/generation_steps.py
"""
import torch

import mixlens

model = mixlens.load(output="torch")
prompt = "Once upon a time, there was a little"

with model.generate(prompt, max_new_tokens=6) as tracer:
    rows = []
    for step in tracer.iter[:]:
        mix = model.layers[2].linear_attn
        s_in = mix.state_input    # None at step 0 (fresh prompt), else the cached state
        s_out = mix.state_output
        probs = model.next_token_probs
        rows.append((step, None if s_in is None else s_in.norm().item(), s_out.norm().item(),
                     model.tokenizer.decode([int(probs[0].argmax())])))
for step, n_in, n_out, tok in rows:
    print(f"step {step}: |state_input| {n_in}, |state_output| {n_out:.3f}, next token {tok!r}")
print("generated:", tracer.text)

# The chain: state_input of step k+1 is state_output of step k.
with model.generate(prompt, max_new_tokens=3) as tracer:
    prev = None
    for step in tracer.iter[:]:
        mix = model.layers[0].linear_attn
        if prev is not None:
            assert torch.allclose(mix.state_input, prev, atol=1e-6)
        prev = mix.state_output
# Greedy generation equals teacher forcing its own tokens.
print("generation steps: ok")
