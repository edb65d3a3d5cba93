"""Recipe: plot decays and states with matplotlib (saved as PNG). decays = log of how much state each token keeps
(<= 0); the state norm after every token shows what the mixer remembers.

Run from anywhere: python docs/recipes/plots.py [output_dir]  (writes decays.png and states.png)
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

import mixlens  # noqa: E402

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
out.mkdir(parents=True, exist_ok=True)
model = mixlens.load(output="torch")
prompt = "Once upon a time, there was a little girl who loved to play in the park"
tokens = [model.tokenizer.decode([i]) for i in model.tokenizer.encode(prompt)]

with model.trace(prompt):
    decays, norms = [], []
    for i in range(model.num_layers):
        mix = model.layers[i].linear_attn
        decays.append(mix.decays[0])  # [T, heads] (Mamba-2)
        norms.append(mix.states[0].flatten(2).norm(dim=-1))  # [T, heads]

fig, axes = plt.subplots(1, model.num_layers, figsize=(3 * model.num_layers, 4), sharey=True)
for i, ax in enumerate(axes):
    im = ax.imshow(decays[i].numpy(), aspect="auto", cmap="viridis")
    ax.set_title(f"layer {i} decays")
    ax.set_xlabel("head")
axes[0].set_yticks(range(len(tokens)), tokens, fontsize=6)
fig.colorbar(im, ax=axes)
fig.savefig(out / "decays.png", dpi=80)

fig, ax = plt.subplots(figsize=(8, 4))
for i, n in enumerate(norms):
    ax.plot(n.mean(-1).numpy(), label=f"layer {i}")
ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
ax.set_ylabel("mean |state| over heads")
ax.legend(fontsize=6)
fig.tight_layout()
fig.savefig(out / "states.png", dpi=80)
for name in ("decays.png", "states.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print("wrote", out / name)
print("plots: ok")
