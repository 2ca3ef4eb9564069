"""Model ids on the Hugging Face hub: ``org/name`` -> a snapshot directory in the hub cache.

The cache is huggingface_hub's own (``models--org--name/snapshots/<sha>``), so
a model downloaded by transformers, vLLM or ``hf download`` is found without a
second copy. Where it lives is decided at every call, not at import:
``download_dir`` (vLLM's engine argument), else ``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``. ``HF_HUB_OFFLINE=1`` means
the cache only: no request is made, and a missing id (or revision) is an error
that names it.

A GGUF repository is selected with vLLM's ``org/name:QUANT`` (``QUANT`` is
matched against the .gguf file names, case-insensitively); only that file is
downloaded.
"""

from __future__ import annotations

import fnmatch
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pagoda.model_loader.errors import ModelLoadError, ModelNotFoundError

# What a Hugging Face checkpoint needs besides its weights: config, generation
# config, tokenizer files and chat templates. Weights are added by format.
_METADATA_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
# Hub ids as huggingface_hub validates them: an optional namespace and a name of
# letters, digits, '-', '_', '.'; pagoda adds vLLM's ':QUANT' for GGUF repos.
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+(?::[\w.-]+)?$")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class HubModelId:
    repo_id: str
    quant: str | None = None  # from "org/name:QUANT": which .gguf file of the repo

    @classmethod
    def parse(cls, text: str) -> HubModelId | None:
        """``text`` as a hub id, or None when it cannot be one (then it was meant as a path)."""
        if not _REPO_ID.match(text) or text.startswith(".") or text.endswith(".gguf") or ".." in text:
            return None
        repo_id, _, quant = text.partition(":")
        return cls(repo_id, quant or None)

    def describe(self, revision: str | None) -> str:
        name = self.repo_id + (f":{self.quant}" if self.quant else "")
        return f"{name!r}" + (f" at revision {revision!r}" if revision else "")


def hub_cache_dir(download_dir: str | Path | None = None) -> Path:
    """Where hub snapshots live, read from the environment now (huggingface_hub reads it at import)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) as set now."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def snapshot_path(model_id: HubModelId, revision: str | None, download_dir: str | Path | None) -> Path:
    """The snapshot directory of ``model_id`` at ``revision``, downloading it when allowed.

    Offline: the cache only, no request. Online: huggingface_hub checks the hub
    for the revision and fetches what is missing (it falls back to the cache by
    itself when the hub cannot be reached).
    """
    cache_dir = hub_cache_dir(download_dir)
    offline = hub_offline()
    if offline:
        return _cached_snapshot(model_id, revision, cache_dir)
    return _download(model_id, revision, cache_dir)


def _cached_snapshot(model_id: HubModelId, revision: str | None, cache_dir: Path) -> Path:
    # Read the cache layout ourselves: huggingface_hub's offline switch is fixed at its import.
    repo_dir = cache_dir / ("models--" + model_id.repo_id.replace("/", "--"))
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        where = "its revision is" if repo_dir.is_dir() else "it is"
        raise ModelNotFoundError(
            f"Model {model_id.describe(revision)} is not a local path, and HF_HUB_OFFLINE=1 forbids downloading it: "
            f"{where} not in the Hugging Face cache {cache_dir} (set HF_HUB_CACHE / HF_HOME or download_dir to the "
            "cache that holds it, or unset HF_HUB_OFFLINE to download)"
        )
    return snapshot


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why the hub's host cannot be reached (no DNS, refused, timed out), or None when it can.

    huggingface_hub retries a failed connection with backoff for tens of seconds, logging every retry; one
    connection attempt first makes an offline start fail in seconds with one clear error. Behind a proxy the
    host is not reached directly, so nothing is probed there.
    """
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    parts = urlsplit(endpoint)
    if parts.hostname is None:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _download(model_id: HubModelId, revision: str | None, cache_dir: Path) -> Path:
    from huggingface_hub import constants, list_repo_files, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    reason = _unreachable(constants.ENDPOINT)
    if reason is not None:
        try:
            return _cached_snapshot(model_id, revision, cache_dir)
        except ModelNotFoundError:
            raise ModelNotFoundError(
                f"Model {model_id.describe(revision)} is not a local path, not in the Hugging Face cache {cache_dir}, "
                f"and the hub ({constants.ENDPOINT}) cannot be reached to download it ({reason}). Without a "
                "network: copy the model to a local directory, or point HF_HUB_CACHE / HF_HOME at a cache that "
                "holds it (HF_HUB_OFFLINE=1 then skips the hub)"
            ) from None
    try:
        files = list_repo_files(model_id.repo_id, revision=revision)
        patterns = _patterns_for(model_id, files)
        path = snapshot_download(
            model_id.repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns, library_name="pagoda"
        )
    except GatedRepoError as exc:
        raise ModelLoadError(
            f"Model {model_id.describe(revision)} is gated on the Hugging Face hub: accept its terms on the hub and "
            f"log in (`hf auth login` or HF_TOKEN). {exc}"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelNotFoundError(
            f"Model {model_id.describe(revision)} is neither a local path nor a model on the Hugging Face hub: {exc}"
        ) from exc
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - transport errors: their types depend on huggingface_hub's HTTP library
        try:
            return _cached_snapshot(model_id, revision, cache_dir)
        except ModelNotFoundError:
            raise ModelNotFoundError(
                f"Cannot download model {model_id.describe(revision)} into {cache_dir}, and the cache does not "
                f"hold it: {type(exc).__name__}: {exc}"
            ) from exc
    return Path(path)


def _patterns_for(model_id: HubModelId, files: list[str]) -> list[str]:
    """The files of the repository that pagoda will read, in one format (vLLM's preference order)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if model_id.quant is not None or ("config.json" not in files and ggufs):
        return [select_gguf(model_id, ggufs)]
    for weights in ("*.safetensors", "*.bin", "*.pt"):
        if any(fnmatch.fnmatch(f, weights) for f in files):
            return [*_METADATA_PATTERNS, weights]
    raise ModelLoadError(
        f"Model {model_id.describe(None)} on the Hugging Face hub holds no safetensors, .bin or .gguf weights"
    )


def select_gguf(model_id: HubModelId, ggufs: list[str]) -> str:
    """The one .gguf file ``model_id`` names: the repository's only one, or the one matching its ``:QUANT``."""
    chosen = ggufs
    if model_id.quant is not None:
        quant = model_id.quant.lower()
        chosen = [f for f in ggufs if quant in Path(f).name.lower()]
    if len(chosen) == 1:
        return chosen[0]
    listing = ", ".join(sorted(ggufs)) or "none"
    if not chosen:
        raise ModelNotFoundError(f"Model {model_id.describe(None)}: no .gguf file matches (files: {listing})")
    raise ModelLoadError(
        f"Model {model_id.describe(None)} names {len(chosen)} .gguf files ({', '.join(sorted(chosen))}); "
        f"choose one with '{model_id.repo_id}:QUANT', e.g. '{model_id.repo_id}:Q4_K_M'"
    )
