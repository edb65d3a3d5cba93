"""Recipe: logit lens. What does each layer's residual stream predict for the next token?

Run from anywhere: python docs/recipes/logit_lens.py (uses the shipped Mamba-2 unless $MIXLENS_MODEL is set).
"""
import torch

import mixlens
from mixlens.interventions import logit_lens

model = mixlens.load(output="torch")
prompts = ["Once upon a time, there was a little", "The dog ran to the"]

# nnterp's helper: [prompts, layers, vocab] next-token probabilities from every layer's output.
probs = logit_lens(model, prompts)
for p, prompt in enumerate(prompts):
    print(prompt)
    for layer in range(model.num_layers):
        top = probs[p, layer].topk(3)
        words = [model.tokenizer.decode([int(i)]) for i in top.indices]
        print(f"  layer {layer}: " + ", ".join(f"{w!r} {v:.2f}" for w, v in zip(words, top.values.tolist())))

# The same by hand inside a trace: project each layer's last-token state through ln_final + lm_head.
with model.trace(prompts) as tracer:
    by_hand = torch.stack([model.project_on_vocab(model.layers_output[i][:, -1]) for i in range(model.num_layers)], 1)
by_hand = by_hand.softmax(-1)
assert torch.allclose(by_hand, probs, atol=1e-6)
# The last layer's lens is the model's own prediction.
assert torch.allclose(probs[:, -1], tracer.logits[:, -1].softmax(-1), atol=1e-5)
print("logit lens: ok")
