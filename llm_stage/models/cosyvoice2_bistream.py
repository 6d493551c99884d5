"""CosyVoice 2's native text streaming ("bistream"): where streamed text goes among the speech tokens.

The LM reads text and speech in a fixed mix: 5 text ids, then 15 speech tokens (a voice's prompt
speech first, then generated ones). At each 15th generated token the fill token (6563) is forced; it
is never a position, it asks for the next 5 text ids, which the request waits for. Once the text has
ended and fewer than 5 ids are left, the rest of the text and `task_id` follow and the LM speaks to
EOS. Laid out as the published loop (`Qwen2LM.inference_bistream`) lays it out when its frontend
feeds one text id at a time, quirks included: the positions of the forward that drew the last fill
are read once more before the final text, and a voice whose speech tokens fill whole groups gets 15
generated tokens more before its first fill. Pure Python: `BistreamFeed` appends to
`Request.positions`; the cosyvoice2 adapter calls it (`record_token`, `text_arrived`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_stage.models.cosyvoice2_lm import SPEECH_TOKEN_SIZE, TASK_ID, Kind
from llm_stage.request import Request, Token
from llm_stage.text_feed import NO_LIMIT, SplitText, TextFeed

MIX_TEXT, MIX_SPEECH = 5, 15  # the published mix_ratio
FILL_TOKEN = SPEECH_TOKEN_SIZE + 2  # sampled (or forced) after a group's speech: more text, please


@dataclass
class BistreamFeed(TextFeed):
    """A cosyvoice2 streaming-text request's text ids (a voice's transcript first) and its layout state."""

    end_ids: tuple[int, ...] = ()  # unused: the end is laid out here
    pad_id: int = -1  # unused
    prompt_speech: list[int] = field(default_factory=list)  # a voice's speech tokens not placed yet
    num_prompt_text: int = 0  # the first ids are a voice's transcript
    num_placed: int = 0  # text ids placed as positions
    needs_text: bool = True  # the next positions are a text group (at the start without prompt speech, after a fill)
    is_final: bool = False  # the rest of the text and task_id are placed: the LM speaks to EOS
    drawn: list[int] = field(default_factory=list)  # every draw, fills included (the published loop's
    # `out_tokens`: its fill schedule and its repetition-aware sampling count them alike)
    next_fill: int = MIX_SPEECH  # the draw that is forced to be the fill token
    span_start: int = 0  # first position of the current forward span (positions since the last draw)
    last_fill_span: tuple[int, int] = (0, 0)  # the positions of the forward that drew the last fill
    waits_from: int = 0  # the first position not to compute until text comes (NO_LIMIT: none)

    @classmethod
    def open(cls, split: SplitText, prompt_text_ids: list[int], prompt_speech: list[int]) -> BistreamFeed:
        """A feed whose text starts with a voice's transcript; its speech tokens fill the first groups."""
        feed = cls(split, prompt_speech=list(prompt_speech), num_prompt_text=len(prompt_text_ids))
        feed.ids.extend(prompt_text_ids)
        feed.needs_text = not prompt_speech
        feed.next_fill = (len(prompt_speech) // MIX_SPEECH + 1) * MIX_SPEECH - len(prompt_speech)
        return feed

    @property
    def ready_through(self) -> int:
        return self.waits_from

    @property
    def num_text(self) -> int:
        """Text ids to speak (the transcript not counted)."""
        return len(self.ids) - self.num_prompt_text

    @property
    def forces_fill(self) -> bool:
        return not self.is_final and len(self.drawn) == self.next_fill

    def take_token(self, req: Request, token: int) -> None:
        """A drawn token that did not stop `req`: a speech token is output and the next position; the
        fill token asks for the next text group (placed now if the text is there)."""
        index, position = len(self.drawn), req.num_known
        self.drawn.append(token)
        if token == FILL_TOKEN:
            self.next_fill = index + MIX_SPEECH + 1
            self.last_fill_span, self.span_start = (self.span_start, position), position
            self.needs_text = True
            self.lay_out(req)
            return
        req.output_ids.append(token)
        req.positions.append(token)  # type: ignore[union-attr]
        self.span_start = position

    def lay_out(self, req: Request) -> None:
        """Place what the text allows now: groups of a voice's prompt, a group after a fill, or the end;
        otherwise the request waits from its current span on (nothing of it is computed yet)."""
        if req.positions is None:
            req.positions = []
        while not self.is_final and (self.prompt_speech or self.needs_text):
            if len(self.ids) - self.num_placed >= MIX_TEXT:
                self._place_group(req.positions)
            elif self.is_ended:
                self._place_end(req)
            else:  # nothing of the current span, nor the position that drew the fill (a preempted
                # request prefilled again must not draw there twice), is computed until text comes
                self.waits_from = min(self.span_start, req.num_known - 1)
                return
        self.waits_from = NO_LIMIT

    def _text_positions(self, end: int) -> list[Token]:
        start, self.num_placed = self.num_placed, end
        kind = [Kind.PROMPT_TEXT if i < self.num_prompt_text else Kind.TEXT for i in range(start, end)]
        return list(zip(self.ids[start:end], kind, strict=True))

    def _place_group(self, positions: list[Token]) -> None:
        positions += self._text_positions(self.num_placed + MIX_TEXT)
        if self.prompt_speech:
            positions += self.prompt_speech[:MIX_SPEECH]
            del self.prompt_speech[:MIX_SPEECH]
        else:
            self.needs_text = False

    def _place_end(self, req: Request) -> None:
        """The published end: once anything was drawn, the last fill's forward span again; the text
        left; task_id. Prompt speech not placed by then is dropped (the text was shorter than it)."""
        positions = req.positions
        if self.drawn:
            first, end = self.last_fill_span
            positions += [req.token_at(i) for i in range(first, end)]  # type: ignore[operator]
        positions += self._text_positions(len(self.ids))  # type: ignore[operator]
        positions.append((TASK_ID, Kind.LLM))  # type: ignore[union-attr]
        self.prompt_speech.clear()
        self.is_final, self.needs_text = True, False
