"""Resolve HuggingFace hub ids to local snapshot folders (the local cache only, never the network).

There is one resolver: the C++ one behind :func:`mixlens.load` (``src/io/hub.cpp``), bound here so the
two can never disagree. It finds ``owner/name[@revision]`` in the cache as
``models--owner--name/snapshots/<commit>``, with ``<commit>`` read from ``refs/<revision or main>``,
and refuses a refs file that holds anything but a commit name (an absolute path, ``..``), so the
answer is always a folder inside the cache::

    path = mixlens.hub.resolve("AntonV/mamba2-130m-hf", cache_dir="/data/hf")
    model = mixlens.load(path)          # or mixlens.load("AntonV/mamba2-130m-hf", cache_dir=...)

``huggingface_hub`` is not needed to resolve (only to download: ``huggingface-cli download``).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from . import _core
from .errors import CheckpointError

__all__ = ["looks_like_hub_id", "resolve", "default_cache_dir"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(name: str) -> bool:
    """True for ``owner/name`` with the characters HF allows (and no ``..``)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def default_cache_dir() -> str:
    """The hub cache used when none is given, read from the environment now (as huggingface_hub
    computes it, but at call time): ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    return _core.hub_cache_dir()


def resolve(repo_id: str, *, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """The local snapshot folder of ``repo_id`` (``"owner/name"``, optionally ``"owner/name@rev"``).

    ``revision``: a branch, tag or commit (default ``main``); ``cache_dir``: the hub cache (default
    :func:`default_cache_dir`). Never downloads.

    Raises:
        CheckpointError: the id is malformed, the revision is given twice, the id is not in the local
            cache (the message says where it looked and how to get it), or a refs file points outside
            the cache.
    """
    repo_id = os.fspath(repo_id)
    if "@" in repo_id:
        repo_id, _, rev = repo_id.partition("@")
        if revision is not None and revision != rev:
            raise CheckpointError(f"hub id {repo_id!r}: revision given twice ({rev!r} and {revision!r})")
        revision = rev
    if not looks_like_hub_id(repo_id):
        raise CheckpointError(f"{repo_id!r} is not a hub id of the form 'owner/name'")
    full = f"{repo_id}@{revision}" if revision else repo_id
    return _core.resolve_hub_id(full, "" if cache_dir is None else os.fspath(cache_dir))
