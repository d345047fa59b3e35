"""After each round: cut every sequence's new tokens where it must stop, and turn them into a delta.

The order is fixed so that K never changes the output: first `max_tokens` (and the model length),
then after the first EOS / stop token id, then at the first stop string. Tokens a sequence sampled
past its stop inside a round are dropped here and never reach the caller.

Text is decoded from all output ids each round (byte-level tokens may split a character), and the
tail that could still be an incomplete character or the start of a stop string is held back until
the next round or the end.
"""

from __future__ import annotations

from raypipe.decode.sequence import RequestDelta, Sequence

REPLACEMENT_CHAR = "\ufffd"


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        ids = frozenset(seq.params.stop_token_ids or ())
        return ids if seq.params.ignore_eos else ids | self.eos_token_ids

    def budget(self, seq: Sequence) -> int:
        """How many more tokens `seq` may produce (max_tokens and the model length)."""
        return min(seq.params.max_tokens - len(seq.output_ids),
                   self.max_model_len - seq.prompt_len - len(seq.output_ids))

    def append(self, seq: Sequence, new_ids: list[int]) -> RequestDelta:
        """Accept `new_ids` (this round's samples) into `seq` and return what the caller sees."""
        before = len(seq.output_ids)
        budget = self.budget(seq)
        ids = new_ids[:budget]
        if len(ids) == budget:
            seq.finish_reason = "length"
        stop_ids = self.stop_ids(seq)
        for i, token in enumerate(ids):
            if token in stop_ids:
                ids = ids[: i + 1]
                seq.finish_reason = "stop"
                break
        seq.output_ids.extend(ids)
        text = self._decode(seq.output_ids)
        if seq.params.stop:
            text = self._apply_stop_strings(seq, text, before)
        return RequestDelta(seq.request_id, seq.output_ids[before:], self._emit(seq, text), seq.finish_reason)

    def finish(self, seq: Sequence, reason: str) -> RequestDelta:
        """Final delta for a sequence ended from outside (abort): flush held-back text."""
        seq.finish_reason = reason
        return RequestDelta(seq.request_id, [], self._emit(seq, self._decode(seq.output_ids)), reason)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _apply_stop_strings(self, seq: Sequence, text: str, first_new: int) -> str:
        longest = max(len(s) for s in seq.params.stop)
        start = max(seq.checked_chars - longest + 1, 0)
        hits = [(i, s) for s in seq.params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            seq.checked_chars = len(text)
            return text
        cut, stop = min(hits)
        # Keep output ids up to the token that completed the stop string.
        for n in range(first_new + 1, len(seq.output_ids) + 1):
            if self._decode(seq.output_ids[:n]).find(stop, start) >= 0:
                del seq.output_ids[n:]
                break
        seq.finish_reason = "stop"
        return text[:cut]

    def _emit(self, seq: Sequence, text: str) -> str:
        if not seq.finished:
            hold = max((len(s) for s in seq.params.stop or ()), default=1) - 1
            end = len(text) - hold
            while end > 0 and text[end - 1] == REPLACEMENT_CHAR:  # an incomplete character so far
                end -= 1
            text = text[: max(end, len(seq.text))]
        new = text[len(seq.text):]
        seq.text += new
        return new
