"""GLM-4-Voice 9B LM side: text or speech tokens in, interleaved text and 12.5 Hz speech tokens out.

The prompt is the published demo's (web_demo.py), as GLM-4's tokenizer ids: `[gMASK]<sop>`, then
`<|system|>\\n{system}` once, a conversation's earlier turns (`Job.history`: `<|user|>\\n{content}`,
an assistant's answer as `<|assistant|>streaming_transcription\\n{text}`), the last user turn, and
`<|assistant|>streaming_transcription\\n`. A user turn's content is its text and, for a clip, the
clip's speech tokens `<|begin_of_audio|><|audio_N|>...<|end_of_audio|>` (the published demo sends
one or the other; with both, the text comes first). The system turn is the published one for text
or speech input unless the Job sets its own. The answer interleaves 13 text tokens and 26 speech
tokens: text ids go to the client as text, `<|audio_N|>` to the detokenizer as code N, and
`<|user|>` (or `<|endoftext|>` / `<|observation|>`, the published eos ids) stops. A text-only
answer (`Job.text_only`, not a published mode: the model has none) keeps the prompt and holds its
draws to text ids and the stops. Speech in needs the WhisperVQ speech tokenizer: one seam,
`load_speech_tokenizer`. Weights and ids: `llm_stage.models.glm4_voice_lm`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Protocol

import torch
from transformers import GlmForCausalLM

from core.checkpoints import resolve_model_ref
from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import AudioClip, Job, SamplingParams
from detok_stage.codecs.glm4_voice_codec import GLM4VoiceCodec
from llm_stage.chunking import WHOLE_STREAM_FRAMES, ChunkSchedule
from llm_stage.models.base import CodeFrames, LMAdapter, ModelFamily
from llm_stage.models.clip_audio import clip_key, clip_wave_16k
from llm_stage.models.glm4_bpe import GLM4Tokenizer
from llm_stage.models.glm4_voice_lm import (
    AUDIO_CODES,
    PRESET_TEXT_IDS,
    GlmBackbone,
    SpecialIds,
    is_glm4_voice_config,
    load_glm4_voice,
)
from llm_stage.models.glm4_voice_stream import MicTokenizer
from llm_stage.models.glm4_voice_tokenizer import SpeechTokenizer as WhisperVQTokenizer
from llm_stage.models.tokenizers import ByteTokenizer, TextTokenizer
from llm_stage.request import Request, Token

# the published demo's system turns (web_demo.py), for text and for speech input (its trailing space kept)
TEXT_SYSTEM = (
    "User will provide you with a text instruction. Do it step by step. First, think about the instruction "
    "and respond in a interleaved manner, with 13 text token followed by 26 audio tokens."
)
SPEECH_SYSTEM = (
    "User will provide you with a speech instruction. Do it step by step. First, think about the instruction "
    "and respond in a interleaved manner, with 13 text token followed by 26 audio tokens. "
)
CODEC_SAMPLE_RATE_HZ = 22050  # the GLM-4-Voice decoder's HiFT
SPEECH_TOKENIZER_REPO = "THUDM/glm-4-voice-tokenizer"  # the published WhisperVQ speech tokenizer
ANSWER_OPENING = "streaming_transcription\n"  # after <|assistant|>: the interleaved answer
TOKENS_PER_S = 12.5  # WhisperVQ speech tokens per second of input audio
# [gMASK] <sop> <|system|> <|user|> <|assistant|>, "\n" x2 and "streaming_transcription\n" (~4 BPE tokens)
CHAT_MARKER_POSITIONS = 11
KEPT_CLIPS = 512  # recent clips whose speech tokens the adapter keeps (a conversation sends them again)


class SpeechTokenizer(Protocol):
    """The WhisperVQ speech tokenizer (`llm_stage.models.glm4_voice_tokenizer`): 16 kHz clips -> token ids."""

    def tokens(self, clips_16k: list[torch.Tensor]) -> list[torch.Tensor]: ...


def load_speech_tokenizer(config: ModelConfig) -> SpeechTokenizer:
    """The WhisperVQ speech tokenizer for `config`: `model.speech_tokenizer_dir` (a directory or a repo id in
    the local HF cache), the published THUDM/glm-4-voice-tokenizer for a checkpoint model, or the seeded
    preset for glm4-voice-tiny. float32 (the published dtype: a bf16 encoder could flip near-tie codes)."""
    ref = config.speech_tokenizer_dir
    if ref is None and config.checkpoint_dir is None:
        return WhisperVQTokenizer.preset(config.seed)
    field = "model.speech_tokenizer_dir"  # (the registry fills in the published repo for a checkpoint model)
    directory = resolve_model_ref(ref if ref is not None else SPEECH_TOKENIZER_REPO, field=field)
    return WhisperVQTokenizer.from_dir(directory, device=config.device)


class Glm4VoiceAdapter(LMAdapter):
    family = "glm4-voice"
    takes_audio = True
    answers_text_only = True
    takes_chat_history = True
    tokenizes_mic_audio = True  # its speech tokenizer needs the weights: run on the replica as a turn streams
    reuses_prompt_kv = True  # text and speech token ids: a conversation's next turn reuses the last prompt's KV
    no_voices_note = "none; speech in (takes audio), answers in text + speech in the decoder's voice"
    max_text_chars = 4000
    # the published demo's sampling (web_demo.py: temperature 0.2, top_p 0.8, max_new_tokens 2000)
    default_sampling = SamplingParams(temperature=0.2, top_p=0.8, max_tokens=2000)
    # the answer interleaves 13 text and 26 speech tokens: 39 steps per 26 frames of audio
    steps_per_frame = (13 + 26) / 26

    def __init__(
        self,
        model: GlmForCausalLM,
        tokenizer: TextTokenizer,
        ids: SpecialIds = SpecialIds(),
        speech_tokenizer: SpeechTokenizer | None = None,
    ) -> None:
        super().__init__(GlmBackbone(model))
        self.model, self.tokenizer, self.ids = model, tokenizer, ids
        self.speech_tokenizer = speech_tokenizer
        self.eos_token_ids = ids.stops
        self._text_only: set[str] = set()  # req_ids answering in text alone (`constrain` masks speech)
        # each recent clip's speech tokens: a conversation's next turn sends its earlier clips again
        self._clip_tokens: OrderedDict[bytes, list[int]] = OrderedDict()
        self._front_end_s = 0.0  # seconds of audio the last `job_prompt` tokenized

    @classmethod
    def build(cls, config: ModelConfig) -> Glm4VoiceAdapter:
        """The published directory (its tokenizer gives the special ids by name) or the tiny preset."""
        model = load_glm4_voice(config)
        speech = load_speech_tokenizer(config)
        if config.checkpoint_dir is None:
            return cls(model, ByteTokenizer(offset=PRESET_TEXT_IDS.start, bos_id=None), speech_tokenizer=speech)
        tokenizer = GLM4Tokenizer(resolve_model_ref(config.checkpoint_dir))
        return cls(model, tokenizer, SpecialIds.from_vocab(tokenizer.vocab()), speech)

    # prompts

    def format_prompt(self, text: str, voice: str | None) -> list[Token]:
        return self.chat_prompt([], text)

    @classmethod
    def transcription_system(cls, language: str | None) -> str:
        raise InvalidArgumentError("model", f"{cls.family} has no published transcription instruction")

    @classmethod
    def audio_prompt_positions(cls, duration_s: float) -> int:
        """The clip's speech tokens (12.5 a second) and its two audio markers."""
        return math.ceil(duration_s * TOKENS_PER_S) + 2

    @classmethod
    def estimate_prompt_positions(cls, job: Job) -> int:
        """The turns' text and audio, the system turn, the markers around them."""
        system_positions = math.ceil(len(job.system or SPEECH_SYSTEM) / cls.prompt_chars_per_position)
        turns = 3 * len(job.history)  # a role marker, "\n" and for an answer "streaming_transcription\n"
        return super().estimate_prompt_positions(job) + system_positions + CHAT_MARKER_POSITIONS + turns

    def job_prompt(self, job: Job) -> list[Token]:
        """The job's conversation in the published prompt; its clips tokenized in one call (but a streamed
        turn's, tokenized as it came: `Job.audio_tokens`)."""
        streamed = job.audio_tokens is not None
        self._front_end_s = 0.0
        clips = [turn.audio for turn in job.history if turn.audio is not None]
        clips += [job.audio] if job.audio is not None and not streamed else []
        speech = iter(self.clip_tokens(clips))
        earlier: list[tuple[str, str, list[int] | None]] = []
        for turn in job.history:
            earlier.append((turn.role, turn.text, next(speech) if turn.audio is not None else None))
        last = None
        if job.audio is not None and job.audio_tokens is not None:  # (kept for the turns after it)
            last = self._remember(clip_key(job.audio), list(job.audio_tokens))
        elif job.audio is not None:
            last = next(speech)
        system = job.system or (SPEECH_SYSTEM if job.audio is not None else TEXT_SYSTEM)
        prompt = self.chat_prompt(earlier, job.text, last, system)
        if job.text_only:
            self._text_only.add(job.req_id)
        return prompt

    def front_end_seconds(self, job: Job) -> float:
        return self._front_end_s

    def forget_kept_clips(self) -> None:
        self._clip_tokens.clear()

    def mic_tokenizer(self, sample_rate_hz: int) -> MicTokenizer | None:
        """The streamed WhisperVQ tokenizer (`glm4_voice_stream`: 4 s blocks encoded as their audio comes);
        None without a speech tokenizer, or one whose structure cannot stream (the clip is tokenized whole)."""
        if not isinstance(self.speech_tokenizer, WhisperVQTokenizer):
            return None
        try:
            return MicTokenizer(self.speech_tokenizer, sample_rate_hz)
        except ValueError:
            return None

    def clip_tokens(self, clips: list[AudioClip]) -> list[list[int]]:
        """Each clip's speech tokens (0..16383): those of a recent clip as they were, the others from the
        speech tokenizer in one batched call."""
        keys = [clip_key(clip) for clip in clips]
        new = {key: clip for key, clip in zip(keys, clips, strict=True) if key not in self._clip_tokens}
        if new and self.speech_tokenizer is None:
            raise InvalidArgumentError("input_audio", f"{self.family}'s speech tokenizer is not loaded: send text")
        if new:
            self._front_end_s += sum(clip.duration_s for clip in new.values())
            tokens = self.speech_tokenizer.tokens([clip_wave_16k(clip) for clip in new.values()])
            for key, ids in zip(new, tokens, strict=True):
                self._remember(key, [int(t) for t in ids.tolist()])
        return [self._remember(key, self._clip_tokens[key]) for key in keys]

    def _remember(self, key: bytes, tokens: list[int]) -> list[int]:
        """`tokens` as the clip's, the most recent of at most KEPT_CLIPS."""
        self._clip_tokens[key] = tokens
        self._clip_tokens.move_to_end(key)
        while len(self._clip_tokens) > KEPT_CLIPS:
            self._clip_tokens.popitem(last=False)
        return tokens

    def chat_prompt(
        self,
        earlier: list[tuple[str, str, list[int] | None]],
        text: str,
        speech: list[int] | None = None,
        system: str = TEXT_SYSTEM,
    ) -> list[Token]:
        """The published prompt: `[gMASK]<sop><|system|>\\n{system}`, the `earlier` turns (role, text, speech
        tokens or None), the last user turn (`text` and / or `speech`), the assistant's interleaved answer opened."""
        if not text and not speech:
            raise InvalidArgumentError("text", "has no tokens and no audio came with it")
        ids = self.ids
        prompt = [ids.gmask, ids.sop, ids.system, *self.tokenizer.encode(f"\n{system}")]
        for role, turn_text, turn_speech in earlier:
            if role == "user":
                prompt += self.user_turn(turn_text, turn_speech)
            else:  # the demo's history: the previous answer, its trailing whitespace stripped
                prompt += [ids.assistant, *self.tokenizer.encode(ANSWER_OPENING + turn_text.rstrip())]
        prompt += self.user_turn(text, speech)
        return prompt + [ids.assistant, *self.tokenizer.encode(ANSWER_OPENING)]

    def user_turn(self, text: str, speech: list[int] | None) -> list[int]:
        """`<|user|>\\n{text}` then, for a clip, `<|begin_of_audio|>` + its `<|audio_N|>` + `<|end_of_audio|>`."""
        ids = self.ids
        turn = [ids.user, *self.tokenizer.encode(f"\n{text}")]
        if speech is None:
            return turn
        if any(not 0 <= code < AUDIO_CODES for code in speech):
            raise InvalidArgumentError("input_audio", f"speech tokens must be in [0, {AUDIO_CODES})")
        return turn + [ids.begin_of_audio, *(ids.first_audio + code for code in speech), ids.end_of_audio]

    def forget(self, req_id: str) -> None:
        self._text_only.discard(req_id)

    # sampling and output

    def constrain(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits [B, vocab]: a text-only answer's rows may draw only text ids and the stops."""
        rows = [i for i, req in enumerate(reqs) if req.req_id in self._text_only]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            stops = torch.tensor(sorted(self.ids.stops), device=logits.device)
            kept = logits[index][:, stops]
            logits[index, self.ids.endoftext :] = float("-inf")
            logits[index[:, None], stops[None]] = kept
        return logits

    def is_stop(self, req: Request, token: Token) -> bool:
        return token in self.eos_token_ids

    def new_frame_builder(self) -> CodeFrames:
        return CodeFrames(self.ids.audio_code)

    def text_ids(self, tokens: list[int]) -> list[int]:
        """The ids among `tokens` that the client reads as text."""
        return [t for t in tokens if self.ids.is_text(t)]

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)  # type: ignore[attr-defined]


# The published demo decodes blocks of 25, 50, 100, 150, 200 speech tokens, each with every token before
# it as the flow's prompt. Ours: a 25-token first chunk (2 s of audio; with the 13 text tokens before it,
# 38 LM steps), then chunks doubling to 100 (8 s), each carrying the whole stream before it (a cold
# detokenizer rebuilds from it), and the right context the detokenizer asks for.
GLM4_VOICE_SCHEDULE = ChunkSchedule(
    first_chunk_frames=25,
    chunk_frames=100,
    left_context_frames=WHOLE_STREAM_FRAMES,
    right_context_frames=GLM4VoiceCodec.min_right_context_frames,
    adaptive=True,
)

FAMILY = ModelFamily(
    name="glm4-voice",
    description="GLM-4-Voice 9B: speech in (12.5 Hz WhisperVQ speech tokens) or text in, a ChatGLM / GLM-4-9B LM, "
    "13 text : 26 speech tokens out, decoded by its flow + HiFT decoder at 22.05 kHz",
    preset_description="GLM-4-Voice layout: the published 168960-token vocabulary and id ranges, a tiny random "
    "GLM-4 LM, a tiny random WhisperVQ speech tokenizer and a tiny random flow + HiFT decoder",
    lm=Glm4VoiceAdapter,
    codec=GLM4VoiceCodec,
    sample_rate_hz=CODEC_SAMPLE_RATE_HZ,
    frame_rate_hz=TOKENS_PER_S,
    repo_id="THUDM/glm-4-voice-9b",
    codec_repo_id="THUDM/glm-4-voice-decoder",
    speech_tokenizer_repo_id=SPEECH_TOKENIZER_REPO,
    is_checkpoint=is_glm4_voice_config,
    chunk_schedule=GLM4_VOICE_SCHEDULE,
)
