"""Zero-shot voices for chatterbox through the VoiceBank, in process (the bank's class without its actor
wrapper; no cluster): a clip registers once with T3's conditioning beside the S3Gen reference, an LLM
replica's lookup (`LLMVoices.ensure`) adds its rows to chatterbox-tiny's voice table, which changes the
prompt embeddings and the greedy (CFG) tokens deterministically, and the detokenizer conditions on the
bank's tensors. The cluster path is tests/deployments/test_zz_s3gen_families.py's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from core.config import CHECK_FILES, EngineConfig, ModelConfig, ServeConfig
from core.errors import InvalidArgumentError
from core.voices import VoicePrompt, voice_id_for
from deployments.voices import LLMVoices, VoiceBank, voice_conditioning
from detok_stage.codecs.s3gen_codec import S3GenCodec
from llm_stage.models.chatterbox import DEFAULT_VOICE, ChatterboxAdapter, Kind
from tests.detok_stage.test_s3gen_streaming import chunks_of
from tests.factories import adapter_engine

MODEL = ModelConfig(name="chatterbox-tiny", seed=3)
CONFIG = ServeConfig(app_name="cb-voices", engine=EngineConfig(model=MODEL))
RATE_HZ = 24_000


def clip(seconds: float, seed: int, pitch_hz: float) -> torch.Tensor:
    """A voiced tone with noise, deterministic."""
    t = torch.arange(int(RATE_HZ * seconds)) / RATE_HZ
    tone = sum(torch.sin(2 * torch.pi * k * pitch_hz * t) / k for k in (1, 2, 3))
    return (0.2 * tone + 0.03 * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))).float()


class LocalBank:
    """The bank's actor-handle surface (`handle.method.remote(...)`, awaited) over an in-process bank."""

    def __init__(self, bank) -> None:
        self.bank = bank

    def __getattr__(self, name: str):
        async def call(*args):
            return getattr(self.bank, name)(*args)

        return type("Method", (), {"remote": staticmethod(call)})


@pytest.fixture(scope="module")
def bank():
    return VoiceBank.__ray_actor_class__(CONFIG.model_dump(mode="json"))


@pytest.fixture(scope="module")
def voices(bank) -> dict[str, str]:
    return {name: bank.register(wave, RATE_HZ, "").voice_id for name, wave in
            (("a", clip(8.0, 1, 140.0)), ("b", clip(3.0, 2, 230.0)), ("long", clip(12.0, 3, 180.0)))}  # fmt: skip


def replica_adapter(bank, *voice_ids: str) -> ChatterboxAdapter:
    """chatterbox-tiny as an LLM replica builds it, with `voice_ids` looked up as its requests would."""
    adapter = ChatterboxAdapter.build(MODEL)
    llm_voices = LLMVoices(CONFIG, find_bank=lambda: asyncio.sleep(0, LocalBank(bank)))
    for voice_id in voice_ids:
        asyncio.run(llm_voices.ensure(voice_id, adapter))
    return adapter


def test_a_clip_registers_once_with_t3_conditioning(bank, voices):
    again = bank.register(clip(8.0, 1, 140.0), RATE_HZ, "")
    assert again.voice_id == voices["a"] and not again.is_new
    assert again.voice_id == voice_id_for("chatterbox-tiny", clip(8.0, 1, 140.0).numpy().tobytes(), RATE_HZ, "")
    a, long = bank.prompt(voices["a"]), bank.prompt(voices["long"])
    assert a.speaker is not None and len(a.speaker.speaker_emb) == 256
    assert abs(float(torch.tensor(a.speaker.speaker_emb).norm()) - 1.0) < 1e-5
    assert len(a.speaker.prompt_tokens) == 150 and a.speaker.prompt_tokens != a.prompt_tokens[:150]  # 6 s, cut mel
    assert len(a.prompt_tokens) == 200 and len(long.prompt_tokens) == 250  # S3Gen: the first 10 s at 25 Hz
    assert len(bank.prompt(voices["b"]).speaker.prompt_tokens) == 75  # a 3 s clip: all of it
    assert a.speaker.speaker_emb != bank.prompt(voices["b"]).speaker.speaker_emb


def _voice_rows(adapter: ChatterboxAdapter, voice: str | None, unconditional: bool = False) -> torch.Tensor:
    prompt = (adapter.unconditional_prompt if unconditional else adapter.format_prompt)("Hello there.", voice)
    with torch.no_grad():
        return adapter.embed(torch.tensor([[t for t in prompt if t[1] == Kind.VOICE]]))[0]


def test_a_registered_voice_has_its_own_t3_rows(bank, voices):
    adapter = replica_adapter(bank, voices["a"], voices["b"])
    default, a, b = (_voice_rows(adapter, v) for v in (None, voices["a"], voices["b"]))
    assert a.shape == default.shape == (33, 1024)  # speaker row + 32 perceiver rows
    assert (a - default).abs().max() > 1e-2 and (a - b).abs().max() > 1e-2
    assert torch.equal(_voice_rows(adapter, voices["a"], unconditional=True), a)  # the CFG twin's voice
    prompt = bank.prompt(voices["a"]).speaker
    with torch.no_grad():
        want = adapter.model.voice_rows(torch.tensor(prompt.speaker_emb), torch.tensor(prompt.prompt_tokens))
    torch.testing.assert_close(a, want, rtol=0, atol=0)
    assert torch.equal(_voice_rows(adapter, DEFAULT_VOICE), default)  # the built-in voice keeps its rows


def _greedy_tokens(adapter: ChatterboxAdapter, voices: list[str | None]) -> list[list[int]]:
    engine = adapter_engine(adapter, num_slots=8)
    sampling = {"temperature": 0.0, "max_tokens": 24, "guidance_scale": 0.5}
    for index, voice in enumerate(voices):
        engine.add_request(f"r{index}", "A voice from a clip.", voice=voice, sampling=sampling)
    got: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(voices))]


def test_a_registered_voice_changes_the_greedy_tokens_deterministically(bank, voices):
    default, a, b, a_again = _greedy_tokens(replica_adapter(bank, voices["a"], voices["b"]),
                                            [None, voices["a"], voices["b"], voices["a"]])  # fmt: skip
    assert a == a_again and a != default and a != b
    (fresh,) = _greedy_tokens(replica_adapter(bank, voices["a"]), [voices["a"]])  # another replica
    assert fresh == a


def test_unknown_and_foreign_voices_are_refused_naming_the_field(bank):
    adapter = replica_adapter(bank)
    unknown = voice_id_for("chatterbox-tiny", b"never registered", RATE_HZ, "")
    with pytest.raises(InvalidArgumentError) as err:
        asyncio.run(LLMVoices(CONFIG, find_bank=lambda: asyncio.sleep(0, LocalBank(bank))).ensure(unknown, adapter))
    assert err.value.field == "voice"
    with pytest.raises(InvalidArgumentError) as err:
        adapter.format_prompt("hi", unknown)
    assert err.value.field == "voice"
    with pytest.raises(InvalidArgumentError, match="speaker embedding") as err:
        adapter.add_voice_prompt(VoicePrompt(unknown, "", (1, 2)))  # a cosyvoice2 voice: no T3 conditioning
    assert err.value.field == "voice"


def test_the_detokenizer_conditions_on_the_bank_s_tensors(bank, voices):
    codec = S3GenCodec.build(MODEL)
    for voice_id in (voices["a"], voices["b"]):
        codec.add_voice(voice_conditioning(voice_id, bank.tensors[voice_id]))
    tokens = torch.randint(0, 6561, (60,), generator=torch.Generator().manual_seed(4))

    def decoded(handle: str | None) -> torch.Tensor:
        chunks = [dataclasses.replace(c, voice_handle=handle) for c in chunks_of(f"d-{handle}", tokens, 25, 25)]
        return torch.cat(codec.decode_stream(chunks))

    a, b, default = decoded(voices["a"]), decoded(voices["b"]), decoded(None)
    assert a.shape == default.shape and torch.equal(a, decoded(voices["a"]))
    assert (a - default).abs().max() > 1e-2 and (a - b).abs().max() > 1e-2


def test_a_chatterbox_directory_without_its_voice_encoder_serves_without_zero_shot_voices(tmp_path):
    from deployments.voices import check_voice_encoders

    (tmp_path / "s3gen.safetensors").write_bytes(b"")  # (only looked up, not read)
    model = ModelConfig(name="chatterbox", checkpoint_dir=tmp_path)
    config = ServeConfig.model_validate({"engine": {"model": model.model_dump()}}, context={CHECK_FILES: False})
    why = check_voice_encoders(config)
    assert why is not None and "ve.safetensors" in why and "voices.encoder_dir" in why
    (tmp_path / "ve.safetensors").write_bytes(b"")
    assert check_voice_encoders(config) is None
