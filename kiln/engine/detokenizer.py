"""Turns output tokens into text as they arrive, and finds stop strings in it."""

from __future__ import annotations

from kiln.loader.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop, self.include_stop = stop, include_stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped_by: str | None = None  # the stop string found, once found
        self._prefix_offset = 0  # ids before here are already text
        self._read_offset = 0

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one token; True when the text now contains a stop string (and is cut at it).
        check_stop=False: text only (before min_tokens no stop string counts)."""
        self.ids.append(token_id)
        # Decode a short window twice and keep the difference: a token may be only part
        # of a UTF-8 character, or change how the token before it renders.
        before = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self._prefix_offset:], self.skip_special_tokens)
        if after.endswith("\ufffd"):
            return False
        new = after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += new
        return check_stop and self._cut_at_stop(len(new))

    def _cut_at_stop(self, num_new: int) -> bool:
        for stop in self.stop:
            start = max(0, len(self.text) - num_new - len(stop) + 1)
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                self.stopped_by = stop
                return True
        return False
