"""The baselines share VoxRay's layout and weights: prompt ids, audio ids, exported SNAC, the
reference decoder's 4-frame window (Orpheus' semantics), and the Locust shape's rate steps."""

from __future__ import annotations

import torch

from core.config import ModelConfig
from detok_stage.codecs.snac_codec import SnacCodec
from llm_stage.models.orpheus import OrpheusAdapter, allowed_token_ids
from llm_stage.models.tokenizers import ByteTokenizer
from loadtest.baselines.common import ReferenceDecoder, audio_token_ids, format_prompt, load_snac_dir, token_to_code
from loadtest.baselines.export_weights import export_snac


def test_prompt_framing_matches_the_orpheus_adapter():
    adapter = OrpheusAdapter(backbone=None, tokenizer=ByteTokenizer())  # type: ignore[arg-type]
    for text, voice in [("Call me Ishmael.", "tara"), ("héllo", "leo"), ("no voice", None)]:
        assert format_prompt(text, voice) == adapter.format_prompt(text, voice)


def test_audio_ids_are_the_union_of_the_frame_slot_masks():
    union = set().union(*(allowed_token_ids(n) for n in range(1, 8)))
    assert set(audio_token_ids()) | {128258} == union
    assert token_to_code(allowed_token_ids(3)[17]) == 17


def test_exported_snac_decodes_like_the_preset_and_the_window_keeps_its_second_frame(tmp_path):
    preset = SnacCodec.build(ModelConfig(name="orpheus-tiny"))
    exported = load_snac_dir(export_snac(0, tmp_path / "snac"))
    frames = torch.randint(0, 4096, (1, 4, 7))
    want = preset.decode(frames)[0, 2048:4096]
    decoder = ReferenceDecoder(exported)
    outputs = [decoder.push(128266 + (k % 7) * 4096 + code) for k, code in enumerate(frames.flatten().tolist())]
    assert outputs[:-1] == [None] * 27 and outputs[-1] is not None
    got = torch.frombuffer(bytearray(outputs[-1]), dtype=torch.int16).float() / 32767
    assert torch.allclose(got, want.clamp(-1, 1), atol=2e-4)
