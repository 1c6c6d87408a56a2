"""Incremental detokenization with stop strings, for streamed and whole responses alike."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Decodes a short window of recent tokens rather than the whole output at every step; a delta
    ending in an incomplete UTF-8 sequence (a byte-level token boundary inside one character) is
    held back until the next token completes it. Text that could be the start of a stop string is
    held back too, so a stream never shows part of a stop string; when one appears, the text before
    it is final and :attr:`stopped` is set.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (context for merge-sensitive decoding)
        self._read = 0  # tokens whose text is in self._text
        self._text = ""  # decoded so far (maybe ahead of what was emitted)
        self._emitted = 0  # characters of self._text already returned
        self._searched = 0  # characters of self._text already searched for stop strings
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, all_ids: list[int]) -> str:
        """Take the full list of generated ids so far; return the new text that is safe to show."""
        if self.stopped:
            return ""
        self._ids = list(all_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT):
            self._text += window_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """All remaining text (the generation ended); incomplete characters are shown as U+FFFD."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        self._text += window_text[len(prefix_text):]
        self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._emitted]

    def _release(self, final: bool) -> str:
        text = self._text
        if self._stop:
            longest = max(len(s) for s in self._stop)
            start = max(0, self._searched - longest + 1)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                self._text = text[:cut]
                out = self._text[self._emitted:]
                self._emitted = len(self._text)
                return out
            self._searched = len(text)
        end = len(text)
        if self._stop and not final:
            end -= self._held_back(text)
        out = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that starts some stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
