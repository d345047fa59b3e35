"""After each round: cut every sequence's new tokens where it must stop, and turn them into a delta.

The order is fixed so that K never changes the output: first `max_tokens` (and the model length),
then after the first EOS / stop token id, then at the first stop string, checked one token at a
time exactly as if every round were one step (so among overlapping stop strings, the one that
completes first wins). Tokens a sequence sampled past its stop inside a round are dropped here and
never reach the caller.

Detokenization is incremental (vLLM's offsets): only `output_ids[prefix_offset:]` is decoded, and
the text it adds beyond the `prefix_chars` characters of `output_ids[prefix_offset:read_offset]`
(the previous call's new text) is appended once it does not end in an incomplete character (U+FFFD:
byte-level tokens may split one). Offsets only move to character
boundaries, so the text equals decoding all ids at once, at a cost per token that does not grow
with the output. Incomplete characters are flushed when the sequence ends, and the tail that could
still be the start of a stop string is held back until the next round or the end.
"""

from __future__ import annotations

from raypipe.decode.sequence import RequestDelta, Sequence, TokenLogprob
from raypipe.errors import InvalidInput

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

    def append(self, seq: Sequence, new_ids: list[int], logprobs: list[TokenLogprob] | None = None
               ) -> RequestDelta:
        """Accept `new_ids` (this round's samples, with their log-probabilities when the request
        asked for them) into `seq` and return what the caller sees."""
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
        if seq.params.stop:
            for token in ids:
                seq.output_ids.append(token)
                if self._detokenize(seq) and self._hit_stop_string(seq):
                    seq.finish_reason = "stop"
                    break
        else:
            seq.output_ids.extend(ids)
            self._detokenize(seq)
        accepted = seq.output_ids[before:]
        prompt = None
        if before == 0 and seq.params.prompt_logprobs is not None:  # the first token's delta: the prompt's too
            prompt = [None] + [seq.prompt_logprobs[p] for p in range(1, seq.prompt_len)]
        return RequestDelta(seq.request_id, accepted, self._emit(seq), seq.finish_reason,
                            logprobs[: len(accepted)] if logprobs is not None else None, seq.num_cached_tokens or 0,
                            prompt)

    def restore(self, seq: Sequence, ids: list[int], sent_chars: int) -> None:
        """`seq` as after accepting `ids` with `sent_chars` characters of their text sent (a resume, resume.py):
        detokenized token by token as `append` does with stop strings, all of it already searched for them."""
        for token in ids:
            seq.output_ids.append(token)
            self._detokenize(seq)
        if not 0 <= sent_chars <= len(seq.text):
            raise InvalidInput(f"the resumed output's text has {len(seq.text)} complete characters, not {sent_chars}",
                               item="resume", code="invalid_value")
        seq.checked_chars, seq.emitted_chars = len(seq.text), sent_chars

    def finish(self, seq: Sequence, reason: str) -> RequestDelta:
        """Final delta for a sequence ended from outside (abort): flush held-back text."""
        seq.finish_reason = reason
        return RequestDelta(seq.request_id, [], self._emit(seq), reason, [] if seq.params.logprobs is not None else None,
                            seq.num_cached_tokens or 0)

    def _decode(self, seq: Sequence, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _detokenize(self, seq: Sequence) -> bool:
        """Append the complete characters the new ids add to `seq.text`; True if there were any."""
        full = self._decode(seq, seq.output_ids[seq.prefix_offset:])
        if full.endswith(REPLACEMENT_CHAR):  # an incomplete character so far: wait for its next bytes
            return False
        new = full[seq.prefix_chars:]
        seq.text += new
        if new:  # (ids that add nothing, e.g. skipped special tokens, leave the window where it is)
            seq.prefix_offset, seq.prefix_chars = seq.read_offset, len(new)
        seq.read_offset = len(seq.output_ids)
        return bool(new)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Search the text added since the last check; on a hit, cut the text before the stop string (after it
        with `include_stop_str_in_output`)."""
        checked, seq.checked_chars = seq.checked_chars, len(seq.text)
        if len(seq.output_ids) < seq.params.min_tokens:
            return False
        # Only occurrences that end in the new text: older ones were checked (or before min_tokens).
        hits = [(i, len(s)) for s in seq.params.stop if (i := seq.text.find(s, max(checked - len(s) + 1, 0))) >= 0]
        if not hits:
            return False
        start, length = min(hits)
        seq.text = seq.text[: start + length if seq.params.include_stop_str_in_output else start]
        return True

    def _emit(self, seq: Sequence) -> str:
        if seq.finished:
            if seq.read_offset < len(seq.output_ids):  # ended inside a character: flush it as decoded
                seq.text += self._decode(seq, seq.output_ids[seq.prefix_offset:])[seq.prefix_chars:]
                seq.read_offset = len(seq.output_ids)
            end = len(seq.text)
        else:
            hold = max((len(s) for s in seq.params.stop or ()), default=1) - 1
            end = max(len(seq.text) - hold, seq.emitted_chars)
        new, seq.emitted_chars = seq.text[seq.emitted_chars: end], end
        return new
