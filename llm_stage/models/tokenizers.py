"""Text tokenizers: a checkpoint's own (transformers AutoTokenizer from a local dir) or the
built-in byte tokenizer used by the random-weight presets (no files, no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes -> ids `offset + byte`, preceded by `bos_id`."""

    def __init__(self, offset: int = 1000, bos_id: int | None = 128000) -> None:
        self.offset = offset
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        ids = [self.offset + b for b in text.encode("utf-8")]
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: list[int]) -> str:
        """The text of byte ids (others skipped; an incomplete UTF-8 sequence is replaced)."""
        return bytes(i - self.offset for i in ids if 0 <= i - self.offset < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer loaded from a local checkpoint directory; never touches the hub.

    `add_special_tokens=False` encodes the bare text (the caller frames it, e.g. CSM's BOS / EOS).
    `extra_special_tokens` are added after loading, in order (CosyVoice 2's markers such as `[breath]`)."""

    def __init__(
        self, directory: Path, add_special_tokens: bool = True, extra_special_tokens: tuple[str, ...] = ()
    ) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        if extra_special_tokens:
            self._tok.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
        self.add_special_tokens = add_special_tokens
        self.bos_id: int | None = self._tok.bos_token_id
        self.eos_id: int | None = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=self.add_special_tokens).input_ids)

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) -> its id."""
        return dict(self._tok.get_vocab())

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class SpaceMarkedTokenizer:
    """A `tokenizers` file whose vocabulary spells spaces as a marker token (Chatterbox's `[SPACE]`)."""

    def __init__(self, path: Path, space_token: str = "[SPACE]") -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.space_token = space_token

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text.replace(" ", self.space_token)).ids)
