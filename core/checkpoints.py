"""Where model weights come from: a model reference (a local directory or a Hugging Face repo id in
the local cache), or a preset with random weights.

Every family and codec loads through `load_or_preset`, so there is one place that decides between a
published checkpoint and the built-in tiny preset, and one place (`resolve_model_ref`) that turns a
reference into a directory. Nothing here downloads: repo ids resolve from the local Hugging Face
cache with `local_files_only`, and a missing model is an error naming the download command.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from core.errors import InvalidArgumentError

M = TypeVar("M")
ModelRef = Path | str

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SHARED: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()


def is_repo_id(ref: ModelRef) -> bool:
    """`owner/name`, as the hub spells repo ids (a path with more parts, or absolute, is not one)."""
    return bool(_REPO_ID.match(str(ref)))


def download_command(repo_id: str) -> str:
    """The command that puts `repo_id` in the local cache (huggingface_hub >= 1.0 names its CLI `hf`)."""
    return f"hf download {repo_id}"


def resolve_model_ref(ref: ModelRef, *, field: str = "model.checkpoint_dir", cache_dir: Path | None = None) -> Path:
    """A local directory as it is; a repo id -> its snapshot directory in the local HF cache.

    Raises InvalidArgumentError naming `field` (and the exact download command for a repo id) when
    the reference is neither an existing directory nor a cached repo."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    text = str(ref)
    if not is_repo_id(text):
        raise InvalidArgumentError(field, f"{text} is not a directory, nor a Hugging Face repo id (owner/name)")
    snapshot = cached_snapshot(text, cache_dir)
    if snapshot is None:
        where = cache_dir or _default_cache()
        raise InvalidArgumentError(
            field,
            f"{text} is not a local directory and is not in the Hugging Face cache ({where}); nothing is downloaded "
            f"at run time. Download it first: `{download_command(text)}` (or `huggingface-cli download {text}` "
            "with huggingface_hub < 1.0), then retry.",
        )
    return snapshot


def cached_snapshot(repo_id: str, cache_dir: Path | None = None) -> Path | None:
    """The snapshot directory of `repo_id` (its `main` revision) in the local cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_optional(ref: ModelRef | None, *, field: str, cache_dir: Path | None = None) -> Path | None:
    return None if ref is None else resolve_model_ref(ref, field=field, cache_dir=cache_dir)


def load_or_preset(
    directory: ModelRef | None,
    *,
    load: Callable[[Path], M],
    preset: Callable[[], M],
    seed: int,
    field: str = "model.checkpoint_dir",
) -> M:
    """`load(path)` when a model reference is given (resolved by `resolve_model_ref`; errors name
    `field`), else `preset()` seeded with `seed` (the same seed builds the same random weights in
    every process: the stages of one deployment, a test and its reference)."""
    if directory is not None:
        return load(resolve_model_ref(directory, field=field))
    torch.manual_seed(seed)
    return preset()


def hf_loader(model_cls: Any, **kwargs: Any) -> Callable[[Path], Any]:
    """A `load` for `load_or_preset` that reads a transformers checkpoint from local files only."""
    return lambda directory: model_cls.from_pretrained(str(directory), local_files_only=True, **kwargs)


def read_config(directory: Path) -> dict[str, Any]:
    """A checkpoint's config.json ({} when it has none)."""
    path = Path(directory) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_prefixed_state(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (prefix stripped) of a safetensors checkpoint, single file or sharded
    with `model.safetensors.index.json`; only the shards that hold them are opened."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({file for key, file in weight_map.items() if key.startswith(prefix)})
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = handle.get_tensor(key)
    return state


def shared(key: tuple, build: Callable[[], M]) -> M:
    """One object per `key` in this process while anyone holds it: a model that two users need
    (CSM's Mimi: the LM's audio encoder and the detokenizer) is loaded and held once."""
    found = _SHARED.get(key)
    if found is None:
        found = build()
        _SHARED[key] = found
    return found
