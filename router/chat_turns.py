"""The `messages` of an OpenAI-style chat-completions body as a conversation (speech in, multi-turn): an
optional `system` message first (its text becomes the family's system turn), then earlier `user` and
`assistant` turns in the order given, the last message a `user` turn. Called by `router.chat`;
`router.jobs.job_from_fields` then checks each turn's text and clip as it checks the last one.

A user turn is its text (a string, or `text` parts joined) and at most one `input_audio` part. An
assistant turn is its answer as text: `content`, for a spoken answer its transcript. VoxRay keeps no
record of the answers it gave, so an assistant message's `audio: {id}` (how OpenAI clients hand a
spoken answer back) is refused naming `messages[i].audio.id`, never ignored: send the transcript as
`content`. Every error names the field as the client spelled it (`messages[1].role`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import InvalidArgumentError
from llm_stage.jobs import printable_name
from router.audio_input import InputAudio
from router.jobs import WireTurn, audio_from_json

ROLES = ("system", "user", "assistant")
MESSAGE_FIELDS = {"system": {"role", "content"}, "user": {"role", "content"}, "assistant": {"role", "content", "audio"}}


@dataclass(frozen=True)
class Conversation:
    """A chat's turns before checking: the system text ("" = the family's default), the earlier
    turns oldest first, and the last user turn's text and clip."""

    system: str
    history: tuple[WireTurn, ...]
    text: str
    audio: InputAudio | None


def conversation(messages: object) -> Conversation:
    """The conversation `messages` holds, or an InvalidArgumentError naming the offending field."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of messages, the last a user turn")
    roles = [message_role(message, i) for i, message in enumerate(messages)]
    system = ""
    if roles[0] == "system":
        system = content_text(messages[0].get("content"), "messages[0].content", may_hold_audio=False)[0]
    turns = [chat_turn(messages[i], role, i) for i, role in enumerate(roles) if i > 0 or role != "system"]
    if not turns or turns[-1].role != "user":
        raise InvalidArgumentError(f"messages[{len(messages) - 1}].role", "the last message must be a user turn")
    return Conversation(system, tuple(turns[:-1]), turns[-1].text, turns[-1].audio)


def message_role(message: object, index: int) -> str:
    """The message's role, after its shape: an object of the role's fields, a system message only first."""
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidArgumentError(field, "must be an object {role, content}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidArgumentError(f"{field}.role", f"must be one of: {', '.join(ROLES)}")
    if role == "system" and index > 0:
        raise InvalidArgumentError(f"{field}.role", "a system message may only come first")
    unknown = set(message) - MESSAGE_FIELDS[role]
    if unknown:
        raise InvalidArgumentError(f"{field}.{printable_name(sorted(unknown)[0])}", "unknown field")
    return role


def chat_turn(message: dict, role: str, index: int) -> WireTurn:
    """A user or assistant message as a turn; an assistant's `audio` is refused (no answers are kept)."""
    field = f"messages[{index}]"
    if role == "assistant" and "audio" in message:
        has_id = isinstance(message["audio"], dict) and "id" in message["audio"]
        raise InvalidArgumentError(
            f"{field}.audio.id" if has_id else f"{field}.audio",
            "VoxRay keeps no record of its answers; send the answer's transcript as content",
        )
    text, audio = content_text(message.get("content"), f"{field}.content", may_hold_audio=role == "user")
    return WireTurn(role, text, f"{field}.content", audio)  # type: ignore[arg-type]


def content_text(content: object, field: str, may_hold_audio: bool) -> tuple[str, InputAudio | None]:
    """(text, clip) of a message's content: a string, or a list of `text` parts (joined) and, for a
    user turn, at most one `input_audio` part."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise InvalidArgumentError(field, "must be a string or a list of parts")
    texts, audio = [], None
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and set(part) == {"type", "text"}:
            texts.append(part["text"])
        elif may_hold_audio and kind == "input_audio" and set(part) == {"type", "input_audio"} and audio is None:
            audio = audio_from_json(part["input_audio"], f"{field}[{i}].input_audio")
        else:
            allowed = "a text part or one input_audio part" if may_hold_audio else "a text part"
            raise InvalidArgumentError(f"{field}[{i}]", f"must be {allowed}")
    return "".join(texts), audio
