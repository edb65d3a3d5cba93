"""Dataset-scale extraction: ``model.extract(...)``, :func:`extract_ray` and :func:`open_extraction`.

The plan (tokens, rows, shard boundaries, size estimate), the batched forwards, the shard files, the
index and resuming all live in the C++ library (``mixlens/extract.h``, the same code as ``mixlens
extract``); this module turns Python inputs (a list of prompts, a txt / jsonl path, a HuggingFace
``datasets.Dataset``) into its prompts, shows a tqdm progress bar, fans shards out over a Ray cluster,
and reads the result back. On-disk layout: ``docs/extract.md``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from . import _core
from ._args import check_bool, check_model, check_path, check_str, item_index
from ._convert import resolve_output
from .errors import InputError

__all__ = ["extract", "extract_ray", "open_extraction", "Extraction"]

DEFAULT_SHARD_BYTES = 256 << 20

Inputs = Union[str, "os.PathLike[str]", Sequence[str], Sequence[Sequence[int]], Any]


def _is_dataset(x: Any) -> bool:
    # HuggingFace datasets.Dataset, without importing `datasets` (an optional dependency).
    return hasattr(x, "column_names") and hasattr(x, "__getitem__") and hasattr(x, "num_rows")


def _mask_row(row, i: int) -> list:
    """Prompt i's mask as a list of 0 / 1 ints (bools and integer arrays too); InputError naming the prompt and
    the entry for anything else."""
    if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)):
        raise InputError(f"extract: the mask of prompt {i} must be a list of 0 / 1, got {type(row).__name__}")
    out = []
    for t, v in enumerate(row):
        if isinstance(v, (bool, np.bool_)):
            v = int(v)
        if not isinstance(v, (int, np.integer)) or v not in (0, 1):
            raise InputError(f"extract: mask entry {t} of prompt {i} is {v!r}; a mask holds only 0 and 1")
        out.append(int(v))
    return out


def _as_prompts(inputs: Inputs, *, masks: Optional[Sequence[Sequence[int]]], text_field: str,
                mask_field: Optional[str], positions: str) -> list:
    """[(text, ids, mask)] for the core, from every accepted input kind."""
    use_mask = positions == "mask"
    if mask_field is not None and not use_mask:
        raise InputError("mask_field is only taken with positions='mask'")
    if masks is not None and not use_mask:
        raise InputError("masks are only taken with positions='mask'")
    field = mask_field if mask_field is not None else ("mask" if use_mask else "")
    if isinstance(inputs, (str, os.PathLike)):
        if masks is not None:
            raise InputError("masks= goes with a list of prompts; a jsonl file carries them in mask_field")
        return _core.read_prompts_file(os.fspath(inputs), text_field, field)
    if _is_dataset(inputs):
        if text_field not in inputs.column_names:
            raise InputError(f"the dataset has no column {text_field!r} (columns: {inputs.column_names}); "
                             "pass text_field=")
        texts = inputs[text_field]
        if use_mask and masks is None:
            if field not in inputs.column_names:
                raise InputError(f"positions='mask': the dataset has no column {field!r}; pass mask_field= or masks=")
            masks = inputs[field]
        inputs = texts
    if not isinstance(inputs, Sequence) or isinstance(inputs, (bytes, bytearray)):
        raise InputError("extract takes a list of prompts (str or token ids), a .txt / .jsonl path, or a "
                         f"datasets.Dataset; got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise InputError("extract: no prompts")
    if masks is not None and (isinstance(masks, (str, bytes)) or not isinstance(masks, (Sequence, np.ndarray))):
        raise InputError(f"masks must be a list of 0 / 1 lists, one per prompt, got {type(masks).__name__}")
    if use_mask and (masks is None or len(masks) != len(inputs)):
        raise InputError("positions='mask' needs masks= with one 0/1 list per prompt "
                         f"({len(inputs)} prompts, {'no' if masks is None else len(masks)} masks)")
    out = []
    for i, p in enumerate(inputs):
        mask = _mask_row(masks[i], i) if use_mask else []
        if isinstance(p, str):
            if not p:
                raise InputError(f"extract: prompt {i} is an empty string")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:  # nanobind would raise a TypeError about argument types
                raise InputError(f"extract: prompt {i} is not valid Unicode: {e.reason} at character {e.start} "
                                 f"({p[e.start:e.end]!r})") from None
            out.append((p, [], mask))
        elif isinstance(p, (Sequence, np.ndarray)) and not isinstance(p, (bytes, bytearray)):
            ids = [int(t) for t in p]
            if not ids:
                raise InputError(f"extract: prompt {i} has no token ids")
            out.append(("", ids, mask))
        else:
            raise InputError(f"extract: prompt {i} is a {type(p).__name__}, not a string or a list of token ids")
    return out


def _values_list(values: Union[str, Sequence[str]]) -> list:
    if isinstance(values, str):
        values = [v for v in values.split(",") if v]
    if isinstance(values, bytes) or not isinstance(values, (Sequence, np.ndarray)):
        raise InputError(f"values= needs value paths (str), e.g. ['layers.*.linear_attn.betas', 'logits'], got "
                         f"{values!r}")
    values = list(values)
    if not values or not all(isinstance(v, str) for v in values):
        raise InputError("values= needs value paths (str), e.g. ['layers.*.linear_attn.betas', 'logits']")
    return values


def _plan(core_model, prompts: list, values: list, batch_size: int, positions: str, shard_bytes: int,
          max_bytes: Optional[int], store_prompts: bool):
    for name, v, lo in (("batch_size", batch_size, 1), ("shard_bytes", shard_bytes, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise InputError(f"{name} must be an int >= {lo}, got {v!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1):
        raise InputError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    check_str("positions", positions)
    store_prompts = check_bool("store_prompts", store_prompts)
    return _core.plan_extraction(core_model, prompts, values, batch_size, positions, shard_bytes, max_bytes or 0,
                                 store_prompts)


class _Progress:
    """tqdm bar (when tqdm is installed) or nothing; rate and ETA count only this run's forwards."""

    def __init__(self, enabled: bool, desc: str):
        self._bar = None
        self._enabled = enabled
        self._desc = desc

    def __call__(self, p: dict) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm is optional: a plain progress line, like the CLI's
                self._line(p)
                return
            # Prompts already done at the first report (resumed shards, the first batch) are the bar's
            # start, so the rate and ETA are this run's.
            self._bar = tqdm(total=p["prompts_total"], unit="prompt", desc=self._desc, file=sys.stderr,
                             initial=p["prompts_done"])
        self._bar.update(p["prompts_done"] - self._bar.n)
        self._bar.set_postfix(shard=f"{p['shards_done']}/{p['shards_total']}",
                              MiB=f"{p['bytes_done'] / 2**20:.1f}/{p['bytes_total'] / 2**20:.1f}", refresh=False)

    def _line(self, p: dict) -> None:
        fresh = p["prompts_done"] - p["prompts_skipped"]
        rate = fresh / p["elapsed_s"] if p["elapsed_s"] > 0 else 0.0
        eta = f"{(p['prompts_total'] - p['prompts_done']) / rate:.0f}s" if rate > 0 else "?"
        end = "\n" if p["shards_done"] == p["shards_total"] else ""
        print(f"\r{self._desc}: {p['prompts_done']}/{p['prompts_total']} prompts, shard "
              f"{p['shards_done']}/{p['shards_total']}, {rate:.1f} prompts/s, ETA {eta}   ", end=end,
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def extract(model, inputs: Inputs, values: Union[str, Sequence[str]], out: Union[str, "os.PathLike[str]"], *,
            batch_size: int = 8, positions: str = "all", masks: Optional[Sequence[Sequence[int]]] = None,
            text_field: str = "text", mask_field: Optional[str] = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            max_bytes: Optional[int] = None, store_prompts: bool = True, progress: bool = True,
            ray: bool = False, num_workers: int = 2) -> dict:
    """Run every prompt and write the chosen values of their real tokens to ``out`` as sharded
    safetensors + ``index.json`` (the format of ``mixlens extract``; layout in docs/extract.md).

    ``inputs``: a list of prompts (str, or token-id lists), a path (``.jsonl``: one object per line with
    a ``text_field`` string; any other name: plain text, one prompt per line), or a HuggingFace
    ``datasets.Dataset`` with a ``text_field`` column. ``values``: value paths as ``saves=`` takes them
    (``"layers.*.linear_attn.betas"``, ``"logits"``). ``positions``: ``"all"`` tokens, the ``"last"``
    one, or ``"mask"`` (a 0/1 list per prompt: ``masks=``, or the ``mask_field`` of a jsonl line /
    dataset column, default ``"mask"``). Prompts run in left-padded batches of ``batch_size``; padding is
    never stored. ``shard_bytes``: data bytes per shard. ``max_bytes``: refuse (ResourceError naming the
    estimate and the limit) before any forward when the output would be larger. ``store_prompts=False``
    keeps FNV-1a hashes instead of the texts in the index. A rerun with the same arguments resumes:
    shards already written are skipped, and the result equals an uninterrupted run.
    ``ray=True`` runs the shards on a Ray cluster (:func:`extract_ray`, ``num_workers`` actors).

    Returns {"out", "num_prompts", "num_rows", "num_shards", "total_bytes", "shards_written",
    "shards_skipped", "complete"}. Errors: InputError (bad inputs: the message names the file line or
    prompt), UnknownValueError (a value path), ResourceError (max_bytes), CheckpointError (writing).
    """
    check_model("extract: model", model)
    if check_bool("ray", ray):
        return extract_ray(model, inputs, values, out, batch_size=batch_size, positions=positions, masks=masks,
                           text_field=text_field, mask_field=mask_field, shard_bytes=shard_bytes,
                           max_bytes=max_bytes, store_prompts=store_prompts, num_workers=num_workers)
    out = check_path("out", out)
    progress = check_bool("progress", progress)
    prompts = _as_prompts(inputs, masks=masks, text_field=text_field, mask_field=mask_field, positions=positions)
    plan = _plan(model._core, prompts, _values_list(values), batch_size, positions, shard_bytes, max_bytes,
                 store_prompts)
    bar = _Progress(progress, "extract")
    try:
        summary = _core.extract(model._core, plan, out, None, True, bar)
    finally:
        bar.close()
    return _summary(plan, out, summary)


def _summary(plan, out, summary: dict) -> dict:
    return {"out": os.fspath(out), "num_prompts": plan.num_prompts, "num_rows": plan.total_rows,
            "num_shards": plan.num_shards, "total_bytes": plan.total_bytes, **summary}


class _ShardWriter:
    """Ray Data actor: loads the model once from its path (the mixlens package is the per-worker
    model) and writes the shards it is handed; the driver merges the index at the end."""

    def __init__(self, model_path: str, prompts: list, values: list, options: dict, out: str, fingerprint: str):
        self._core = _core.Model.load(model_path, "float32")  # as mixlens.load(model_path): the core is all it uses
        self._plan = _plan(self._core, prompts, values, **options)
        if self._plan.fingerprint != fingerprint:
            raise InputError(f"Ray worker: the plan differs from the driver's (fingerprint {self._plan.fingerprint} "
                             f"vs {fingerprint}): the model at {model_path!r} is another checkpoint on this node")
        self._out = out

    def __call__(self, batch: dict) -> dict:
        shards = [int(k) for k in batch["shard"]]
        res = _core.extract(self._core, self._plan, self._out, shards, False, None)
        return {"shard": np.asarray(shards, dtype=np.int64),
                "written": np.asarray([res["shards_written"]] * len(shards), dtype=np.int64)}


def extract_ray(model, inputs: Inputs, values: Union[str, Sequence[str]], out: Union[str, "os.PathLike[str]"], *,
                num_workers: int = 2, batch_size: int = 8, positions: str = "all",
                masks: Optional[Sequence[Sequence[int]]] = None, text_field: str = "text",
                mask_field: Optional[str] = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                max_bytes: Optional[int] = None, store_prompts: bool = True) -> dict:
    """:func:`extract` on a Ray cluster: Ray Data over the shards of the plan (consecutive prompts),
    ``num_workers`` actors that each load the model from its path (``model`` is a loaded model or a
    path; every node must see the same checkpoint at that path and ``out`` on a shared file system)
    and write their own shards; the driver writes ``index.json`` at the end. Same files as
    :func:`extract`; resumes the same way. Uses the running Ray cluster (``ray.init()`` first, or Ray
    starts a local one). ImportError naming the package when Ray is not installed
    (``pip install 'ray[data]'``)."""
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError(f"mixlens.extract_ray needs Ray Data: pip install 'ray[data]' ({e})") from None
    if isinstance(model, (str, os.PathLike)):
        core = _core.Model.load(os.fspath(model), "float32")  # as mixlens.load(model): the core is all it uses
    else:
        check_model("extract_ray: model", model)
        core = model._core
    if not isinstance(num_workers, int) or num_workers < 1:
        raise InputError(f"num_workers must be an int >= 1, got {num_workers!r}")
    prompts = _as_prompts(inputs, masks=masks, text_field=text_field, mask_field=mask_field, positions=positions)
    vals = _values_list(values)
    options = dict(batch_size=batch_size, positions=positions, shard_bytes=shard_bytes, max_bytes=max_bytes,
                   store_prompts=store_prompts)
    plan = _plan(core, prompts, vals, **options)
    out = os.path.abspath(os.fspath(out))
    # Checks the folder (another extraction there is refused) and writes the in-progress index.
    _core.extract(core, plan, out, [], True, None)
    ds = ray.data.from_items([{"shard": k} for k in range(plan.num_shards)])
    ds = ds.map_batches(_ShardWriter, batch_size=1, concurrency=min(num_workers, plan.num_shards), num_cpus=1,
                        fn_constructor_kwargs=dict(model_path=core.info["path"], prompts=prompts, values=vals,
                                                   options=options, out=out, fingerprint=plan.fingerprint))
    written = sum(int(r["written"]) for r in ds.take_all())
    # Every shard exists now: this only verifies them and writes the final index.
    summary = _core.extract(core, plan, out, None, True, None)
    if not summary["complete"]:
        raise InputError(f"extract_ray: some shards are missing in {out} after the Ray run (rerun to resume)")
    summary.update(shards_written=written, shards_skipped=plan.num_shards - written)
    return _summary(plan, out, summary)


# -- reading an extraction back -------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "I64": np.int64}


def _read_safetensors(path: str) -> dict:
    """{name: array} of a safetensors file, memory-mapped (numpy only; no safetensors package needed)."""
    def bad(why: str) -> InputError:
        return InputError(f"extraction shard {path}: {why}; the file is truncated or corrupt "
                          "(delete it and rerun the extraction to rewrite it)")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"the file is only {size} bytes")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise bad(f"header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise bad(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        try:
            a, b = (int(x) for x in e["data_offsets"])
            dtype = np.dtype(_ST_DTYPES[e["dtype"]])
            shape = [int(x) for x in e["shape"]]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed header entry") from None
        if not 0 <= a <= b <= data:
            raise bad(f"tensor {name!r} has data_offsets [{a}, {b}] outside the data section ({data} bytes)")
        if b - a != int(np.prod(shape)) * dtype.itemsize:
            raise bad(f"tensor {name!r} holds {b - a} bytes but shape {shape} needs {int(np.prod(shape)) * dtype.itemsize}")
        out[name] = mm[8 + n + a:8 + n + b].view(dtype).reshape(shape)
    return out


class Extraction:
    """An extraction folder read back: ``index`` (index.json as a dict), ``prompt(i)`` (the values of
    prompt i, negative i counting from the end: {name: [rows, ...] or [...]}, plus "positions" and "token_ids"), ``value(name)`` (every
    shard's rows concatenated, prompt order), ``shard(k)`` (one shard's tensors, memory-mapped
    read-only numpy arrays).

    ``output``: the type ``prompt`` and ``value`` return, as for a model (``"torch"``, ``"numpy"``,
    ``"auto"`` = torch when installed; None: ``$MIXLENS_OUTPUT``, else auto). Both are owned, writable
    copies (float32 values, int64 positions / token ids); ``shard`` stays a zero-copy view."""

    def __init__(self, out: Union[str, "os.PathLike[str]"], output: Optional[str] = None):
        self.output = resolve_output(output)
        self.out = check_path("out", out)
        path = os.path.join(self.out, "index.json")
        if not os.path.isfile(path):
            raise InputError(f"{self.out!r} has no index.json (not a mixlens extraction)")
        try:
            with open(path) as f:
                self.index = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise InputError(f"{path} is not valid JSON ({e}): the extraction index is corrupt; rerun the "
                             "extraction to rewrite it") from None
        if not isinstance(self.index, dict) or self.index.get("format") != "mixlens-extract":
            raise InputError(f"{path} is not a mixlens extraction index")
        self._cache: dict = {}

    @property
    def complete(self) -> bool:
        return bool(self.index["complete"])

    def __len__(self) -> int:
        return self.index["num_prompts"]

    def shard(self, k: int) -> dict:
        k = item_index("shard", k, len(self.index["shards"]))
        if k not in self._cache:
            self._cache[k] = _read_safetensors(os.path.join(self.out, self.index["shards"][k]["file"]))
        return self._cache[k]

    def prompt(self, i: int) -> dict:
        i = item_index("prompt", i, len(self))  # negative counts from the end, as a Python sequence does
        k = self.index["prompts"][i]["shard"]
        s = self.shard(k)
        j = i - self.index["shards"][k]["prompts"][0]
        a, b = int(s["offsets"][j]), int(s["offsets"][j + 1])
        out = {}
        for v in self.index["values"]:
            out[v["name"]] = self._convert(s[v["name"]][a:b] if v["per_token"] else s[v["name"]][j])
        out["positions"] = self._convert(s["positions"][a:b])
        out["token_ids"] = self._convert(s["token_ids"][a:b])
        return out

    def _convert(self, view):
        arr = np.array(view)  # a copy: the memory map stays read-only and the shard file may be rewritten
        if self.output == "torch":
            import torch

            return torch.from_numpy(arr)
        return arr

    def value(self, name: str) -> np.ndarray:
        names = [v["name"] for v in self.index["values"]]
        if name not in names:
            raise InputError(f"{name!r} was not extracted (values: {names})")
        return self._convert(np.concatenate([self.shard(k)[name] for k in range(len(self.index["shards"]))]))


def open_extraction(out: Union[str, "os.PathLike[str]"], output: Optional[str] = None) -> Extraction:
    """Reads an extraction folder (``mixlens extract`` / ``model.extract``) back: see :class:`Extraction`
    (``output``: torch / numpy / auto, as for a model)."""
    return Extraction(out, output)
