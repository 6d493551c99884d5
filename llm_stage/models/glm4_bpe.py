"""GLM-4's text tokenizer read from a published directory without its remote code or tiktoken.

GLM-4 (and GLM-4-Voice) ship `tokenizer.model`, one `base64(token bytes) rank` per line (tiktoken's
format; the rank is the id), GLM-4's split pattern, 14 special tokens after the last rank
(`<|endoftext|>`, `[gMASK]`, `<sop>`, `<|system|>`, `<|user|>`, `<|assistant|>`, ...), and more
added tokens (GLM-4-Voice's `<|begin_of_audio|>`, `<|audio_N|>`) in tokenizer_config.json's
`added_tokens_decoder`. Ranks become a byte-level BPE (transformers' tiktoken converter: a merge's
priority is its result's rank, which is tiktoken's own rule). Text is encoded as plain text (a
special token's spelling in it stays text); the prompt's special ids are placed by the caller
(`llm_stage.models.glm4_voice`).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from transformers.convert_slow_tokenizer import TikTokenConverter

from core.errors import InvalidArgumentError

FIELD = "model.checkpoint_dir"
# GLM-4's special tokens, in id order after the last rank (its tokenizer's own list)
GLM4_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
)  # fmt: skip
# GLM-4's pre-tokenizer split (tiktoken's `pat_str` in its tokenizer)
GLM4_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tokenizer.model`: token bytes -> rank."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise InvalidArgumentError(FIELD, f"{path} line {number} is not 'base64 rank'") from None
    return ranks


def added_tokens(directory: Path, num_ranks: int) -> dict[str, int]:
    """GLM-4's specials after the ranks, then tokenizer_config.json's `added_tokens_decoder` (which wins)."""
    tokens = {name: num_ranks + i for i, name in enumerate(GLM4_SPECIALS)}
    path = directory / "tokenizer_config.json"
    if path.is_file():
        decoder = json.loads(path.read_text()).get("added_tokens_decoder", {})
        tokens.update({entry["content"]: int(token_id) for token_id, entry in decoder.items()})
    return tokens


class _RankConverter(TikTokenConverter):
    """transformers' converter fed ranks already read (it would load them with tiktoken)."""

    def __init__(self, ranks: dict[bytes, int]) -> None:
        super().__init__(vocab_file="", pattern=GLM4_PATTERN)
        self.ranks = ranks

    def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:  # type: ignore[override]
        return self.ranks


class GLM4Tokenizer:
    """Plain text <-> GLM-4 BPE ids; `vocab` names the special and added tokens."""

    def __init__(self, directory: Path) -> None:
        path = Path(directory) / "tokenizer.model"
        if not path.is_file():
            raise InvalidArgumentError(FIELD, f"{directory} has no tokenizer.model (GLM-4's tiktoken ranks)")
        ranks = read_ranks(path)
        self.num_ranks = len(ranks)
        self._added = added_tokens(Path(directory), self.num_ranks)
        self._tok = _RankConverter(ranks).converted()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids) if text else []

    def decode(self, ids: list[int]) -> str:
        """The text of BPE ids (special and added ids skipped)."""
        return self._tok.decode([i for i in ids if 0 <= i < self.num_ranks], skip_special_tokens=False)

    def vocab(self) -> dict[str, int]:
        """The special and added tokens -> their ids (GLM-4's and the checkpoint's)."""
        return dict(self._added)
