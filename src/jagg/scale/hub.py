"""Offline-aware loading of hub weights and data: a local path or a hub id, failing fast with a clear message.

Every real model or dataset in this project (Flux, Qwen-Image, HPSv2.1, PickScore, CLIP, HPDv2, ...) is loaded
through ``load_or_explain``. The rule:
    * an existing local path is used as is;
    * a hub id is first looked up in the local cache only (no network);
    * if that misses and HF_HUB_OFFLINE is set (read at call time, not only at import), or the hub endpoint
      does not answer a TCP connect within a few seconds, raise ``WeightsUnavailableError`` naming what was
      requested and how to provide it, instead of letting huggingface_hub retry for ~25 s or hang;
    * otherwise download.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from jagg.errors import WeightsUnavailableError

T = TypeVar("T")
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set now, or huggingface_hub was imported offline."""
    if any(
        os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency of transformers/diffusers
        return False
    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub endpoint within ``timeout`` seconds? (DNS included.)"""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def looks_like_local_path(name_or_path: str) -> bool:
    """Paths start with / . ~ or have a file suffix / several components; hub ids are ``owner/name``."""
    p = str(name_or_path)
    if p.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(p)):
        return True
    return p.count("/") > 1 or p.endswith((".pt", ".pth", ".bin", ".safetensors", ".json", ".txt"))


def unavailable_message(what: str, name_or_path: str, reason: str, how: str = "") -> str:
    """The one error text used everywhere: what, which id or path, why, and how to provide it. A hub id gets the
    two ways to provide it; a local path gets what to check there (``hf download`` of a path means nothing)."""
    if looks_like_local_path(name_or_path):
        fix = (
            "It is a local path: check that it exists and holds a complete copy, or give the hub id instead."
        )
    else:
        fix = (
            f"Provide it either by downloading it on a connected machine (`hf download {name_or_path}`, then "
            "copy the cache and set HF_HOME) or by passing a local path instead of the hub id."
        )
    return f"{what}: '{name_or_path}' is not available ({reason}). {fix}{(' ' + how) if how else ''}"


def load_or_explain(
    loader: Callable[[str, bool], T],
    name_or_path: str,
    *,
    what: str,
    how: str = "",
    probe_timeout: float = 3.0,
) -> T:
    """``loader(name_or_path, local_files_only)`` with the local-path / cache / offline rule of this module.

    ``loader`` is e.g. ``lambda p, local: CLIPModel.from_pretrained(p, local_files_only=local)``. Hub misses
    surface as ``OSError`` in huggingface_hub, transformers and diffusers; those become
    ``WeightsUnavailableError``. Any other exception (a corrupt file, a wrong class) propagates unchanged.
    """
    path = os.path.expanduser(str(name_or_path))
    if os.path.exists(path):
        return loader(path, True)
    if looks_like_local_path(name_or_path):
        raise WeightsUnavailableError(
            unavailable_message(what, name_or_path, "local path does not exist", how)
        )
    try:
        return loader(name_or_path, True)  # the cache only: never touches the network
    except OSError as err:
        cache_err = err
    if hub_offline():
        reason = "not in the local hub cache and HF_HUB_OFFLINE is set"
        raise WeightsUnavailableError(unavailable_message(what, name_or_path, reason, how)) from cache_err
    if not hub_reachable(probe_timeout):
        reason = "not in the local hub cache and the hub is unreachable"
        raise WeightsUnavailableError(unavailable_message(what, name_or_path, reason, how)) from cache_err
    try:
        return loader(name_or_path, False)
    except OSError as err:
        raise WeightsUnavailableError(unavailable_message(what, name_or_path, str(err), how)) from err


def hub_file(repo_id: str, filename: str, *, what: str, repo_type: str | None = None, how: str = "") -> str:
    """Local path of one file of a hub repo (cache first; same failure rule as ``load_or_explain``)."""
    from huggingface_hub import hf_hub_download

    def get(repo: str, local: bool) -> str:
        if os.path.isdir(repo):  # a local copy of the repo
            full = os.path.join(repo, filename)
            if not os.path.exists(full):
                raise WeightsUnavailableError(
                    unavailable_message(what, full, "file missing in local copy", how)
                )
            return full
        return hf_hub_download(repo, filename, repo_type=repo_type, local_files_only=local)

    return load_or_explain(get, repo_id, what=what, how=how)
