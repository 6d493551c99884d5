"""Where model weights come from: a local checkpoint directory, or a preset with random weights.

Every family and codec loads through `load_or_preset`, so there is one place that decides
between a published checkpoint and the built-in tiny preset (and one place to extend when
model references grow beyond local directories). Nothing here downloads: checkpoints are read
with `local_files_only`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

M = TypeVar("M")


def load_or_preset(directory: Path | str | None, *, load: Callable[[Path], M], preset: Callable[[], M], seed: int) -> M:
    """`load(directory)` when a checkpoint directory is given, else `preset()` seeded with `seed`
    (the same seed builds the same random weights in every process: the stages of one
    deployment, a test and its reference)."""
    if directory is not None:
        path = Path(directory)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        return load(path)
    torch.manual_seed(seed)
    return preset()


def hf_loader(model_cls: Any, **kwargs: Any) -> Callable[[Path], Any]:
    """A `load` for `load_or_preset` that reads a transformers checkpoint from local files only."""
    return lambda directory: model_cls.from_pretrained(str(directory), local_files_only=True, **kwargs)
