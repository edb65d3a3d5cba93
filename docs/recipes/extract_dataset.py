"""Recipe: extract a dataset. Run a list of prompts in batches and write the betas of every layer and
the last-token logits to sharded safetensors files with an index (docs/extract.md); read them back
and check them against a trace of each prompt alone. A rerun resumes: finished shards are skipped.

Run from anywhere: python docs/recipes/extract_dataset.py [OUT_DIR]
"""
import sys
import tempfile

import numpy as np

import mixlens

model = mixlens.load(output="numpy")
prompts = [
    "Once upon a time, there was a little",
    "The cat sat on the",
    "Tom and Lily went to the park to play",
    "One day, a big dog",
    "She was very happy because",
]
tmp = tempfile.TemporaryDirectory(prefix="mixlens-extract-")  # removed at exit
out = sys.argv[1] if len(sys.argv) > 1 else tmp.name

# Every token's betas of every layer; shards of ~4 KiB so this small run has several.
res = model.extract(prompts, values=["layers.*.linear_attn.betas"], out=out, batch_size=2,
                    shard_bytes=4096, progress=False)
print(f"{res['num_prompts']} prompts, {res['num_rows']} token rows, {res['num_shards']} shards, "
      f"{res['total_bytes']} bytes in {out}")

ex = mixlens.open_extraction(out)
assert ex.complete
for i, prompt in enumerate(prompts):
    got = ex.prompt(i)                                   # {value: [tokens of prompt i, heads], ...}
    with model.trace(prompt):                            # the same prompt alone, no padding
        want = [model.layers[l].linear_attn.betas[0] for l in range(model.num_layers)]
    for l in range(model.num_layers):
        np.testing.assert_allclose(got[f"layers.{l}.linear_attn.betas"], want[l], rtol=1e-4, atol=1e-5)
    assert list(got["token_ids"]) == model.tokenizer.encode(prompt)

# Running it again resumes: every shard is already complete.
again = model.extract(prompts, values=["layers.*.linear_attn.betas"], out=out, batch_size=2,
                      shard_bytes=4096, progress=False)
assert again["shards_written"] == 0 and again["shards_skipped"] == res["num_shards"]
print("extract a dataset: ok")
