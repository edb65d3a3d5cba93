"""Resolve HuggingFace hub ids to local snapshot folders with ``huggingface_hub`` (no network).

The C++ loader already finds ``owner/name[@revision]`` in the default cache by itself
(``$HF_HUB_CACHE`` / ``$HF_HOME/hub`` / ``~/.cache/huggingface/hub``). This module is the alternative
that goes through ``huggingface_hub``'s own cache code, for a non-default ``cache_dir`` or when the
two should agree exactly::

    path = mixlens.hub.resolve("AntonV/mamba2-130m-hf", cache_dir="/data/hf")
    model = mixlens.load(path)          # or mixlens.load("AntonV/mamba2-130m-hf", cache_dir=...)

Needs the optional dependency: ``pip install 'mixlens[hub]'``.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from .errors import CheckpointError

__all__ = ["looks_like_hub_id", "resolve", "default_cache_dir"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(name: str) -> bool:
    """True for ``owner/name`` with the characters HF allows (and no ``..``)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def default_cache_dir() -> str:
    """The hub cache ``huggingface_hub`` uses by default, read from the environment now (``huggingface_hub``
    reads it once, at import): ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve(repo_id: str, *, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """The local snapshot folder of ``repo_id`` (``"owner/name"``, optionally ``"owner/name@rev"``).

    Uses ``huggingface_hub.snapshot_download(..., local_files_only=True)``, falling back to
    ``try_to_load_from_cache(repo_id, "config.json")`` for a snapshot without refs. Never downloads.
    Without `cache_dir`, the cache is :func:`default_cache_dir` (the environment as it is now).

    Raises:
        ImportError: ``huggingface_hub`` is not installed.
        CheckpointError: the id is malformed or not in the local cache (the message says where it
            looked and how to get it).
    """
    try:
        import huggingface_hub as hf
        import huggingface_hub.constants  # noqa: F401  (not imported by the package itself in 2.x)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mixlens.hub needs huggingface_hub: pip install 'mixlens[hub]'") from e

    if "@" in repo_id:
        repo_id, _, rev = repo_id.partition("@")
        if revision is not None and revision != rev:
            raise CheckpointError(f"hub id {repo_id!r}: revision given twice ({rev!r} and {revision!r})")
        revision = rev
    if not looks_like_hub_id(repo_id):
        raise CheckpointError(f"{repo_id!r} is not a hub id of the form 'owner/name'")
    # An explicit folder: huggingface_hub's own default was fixed when it was imported.
    where = cache_dir = str(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        path = hf.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        if os.path.isdir(path):
            return str(path)
    except Exception:  # huggingface_hub raises several types for "not cached"; fall through
        pass
    cached = hf.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    if isinstance(cached, str) and os.path.isfile(cached):
        return os.path.dirname(cached)
    rev = f" at revision {revision!r}" if revision else ""
    raise CheckpointError(
        f"hub id '{repo_id}'{rev} is not in the local HuggingFace cache (looked in {where}); "
        f"download it with `huggingface-cli download {repo_id}` or pass a folder"
    )
