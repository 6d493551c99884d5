"""Regenerate `tests/data/cosyvoice2_bistream_golden.json`: greedy speech tokens of the reference
CosyVoice 2 LM's text-streaming loop (`Qwen2LM.inference_bistream` of FunAudioLLM/CosyVoice) on the
cosyvoice2-tiny preset's weights (seed 0), text fed one id at a time as its frontend feeds it.

The reference is not installed: extract its `cosyvoice/` package OUTSIDE the repo and name that folder,

    git -C <CosyVoice clone> archive <commit> cosyvoice | tar -x -C /tmp/cv2ref
    python -m tests.data.make_cosyvoice2_bistream_golden /tmp/cv2ref <commit> tests/data/cosyvoice2_bistream_golden.json

in the repo's venv (torchaudio / onnxruntime, imported by modules the LM does not use, are stubbed).
Greedy: the reference's sampling callable is replaced by an argmax of the same scores. Its loop has no
length bound after the text ends, so each case keeps its first `num_tokens` tokens.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from collections.abc import Iterator

import torch

SEED = 0
MIX = (5, 15)  # the published mix_ratio: 5 text ids, then 15 speech tokens
CASES = [  # name, text, a voice's transcript, its speech tokens, tokens kept
    ("plain", "a longer sentence to speak.", "", [], 120),
    ("short", "hi", "", [], 30),
    ("voice", "what the voice says now", "clip", [17, 6000, 6560, 3, 3, 42, *range(100, 114)], 90),
    ("voice_whole_groups", "say it twice", "a clip's words", list(range(200, 230)), 80),
    ("voice_text_runs_out", "ok", "hey", list(range(300, 350)), 30),
]


def stub_modules() -> None:
    """Modules the reference LM imports but does not use here (audio I/O, the ONNX speech tokenizer)."""
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "onnxruntime"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    onnx = types.ModuleType("cosyvoice.utils.onnx")
    onnx.SpeechTokenExtractor, onnx.online_feature, onnx.onnx_path = None, False, ""
    sys.modules["cosyvoice.utils.onnx"] = onnx


def reference_lm(adapter):
    """The reference Qwen2LM around the preset's Qwen body, every weight loaded from the preset."""
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM

    encoder = Qwen2Encoder.__new__(Qwen2Encoder)
    torch.nn.Module.__init__(encoder)
    encoder.model = type(adapter.model.qwen)(adapter.model.qwen.config)
    hidden = adapter.model.qwen.config.hidden_size

    def greedy(scores: torch.Tensor, decoded: list, top_k: int) -> int:
        return int(scores.argmax())

    def one_step(xs, masks, cache=None):  # its loop reads `cache[0][0].size(2)` (the legacy tuple cache)
        hidden_states, new_cache = Qwen2Encoder.forward_one_step(encoder, xs, masks, cache and cache.cache)
        return hidden_states, LegacyCacheView(new_cache)

    encoder.forward_one_step = one_step
    lm = Qwen2LM(hidden, hidden, 6561, encoder, greedy, mix_ratio=list(MIX))
    lm.load_state_dict(adapter.model.state_dict(), strict=False)
    return lm.float().eval()


class LegacyCacheView:
    """A transformers 5 cache that answers `[0][0].size(2)` (the cached length) as the legacy tuples did."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def __getitem__(self, layer: int) -> list[torch.Tensor]:
        return [torch.empty(1, 1, self.cache.get_seq_length(), 1)]


def one_id_at_a_time(ids: list[int]) -> Iterator[torch.Tensor]:
    """As the reference frontend's `_extract_text_token_generator` yields text: [1, 1] per id."""
    for i in ids:
        yield torch.tensor([[i]], dtype=torch.int32)


def run_case(lm, adapter, text: str, prompt_text: str, speech: list[int], num_tokens: int) -> list[int]:
    encode = adapter.tokenizer.encode
    out = lm.inference_bistream(
        text=one_id_at_a_time(encode(text)),
        prompt_text=torch.tensor([encode(prompt_text)], dtype=torch.int32).reshape(1, -1),
        prompt_text_len=torch.tensor([len(encode(prompt_text))], dtype=torch.int32),
        prompt_speech_token=torch.tensor([speech], dtype=torch.int32).reshape(1, -1),
        prompt_speech_token_len=torch.tensor([len(speech)], dtype=torch.int32),
        embedding=torch.zeros(0, 192),
    )
    tokens = []
    for token in out:
        tokens.append(int(token))
        if len(tokens) == num_tokens:
            break
    return tokens


def main(reference_dir: str, commit: str, out_path: str) -> None:
    from core.config import ModelConfig
    from llm_stage.models.cosyvoice2 import CosyVoice2Adapter

    sys.path.insert(0, reference_dir)
    stub_modules()
    adapter = CosyVoice2Adapter.build(ModelConfig(name="cosyvoice2-tiny", seed=SEED))
    lm = reference_lm(adapter)
    cases = []
    for name, text, prompt_text, speech, num_tokens in CASES:
        with torch.inference_mode():
            tokens = run_case(lm, adapter, text, prompt_text, speech, num_tokens)
        cases.append({"name": name, "text": text, "prompt_text": prompt_text, "prompt_speech": speech,
                      "num_tokens": num_tokens, "tokens": tokens})  # fmt: skip
        print(name, len(tokens), tokens[:20])
    golden = {
        "reference": f"FunAudioLLM/CosyVoice {commit}, cosyvoice/llm/llm.py Qwen2LM.inference_bistream",
        "preset": "cosyvoice2-tiny",
        "seed": SEED,
        "cases": cases,
    }
    with open(out_path, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
