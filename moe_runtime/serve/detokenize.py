"""Incremental detokenization with stop strings, for streamed and whole responses alike."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Decodes a short window of recent tokens rather than the whole output at every step; a delta
    ending in an incomplete UTF-8 sequence (a byte-level token boundary inside one character) is
    held back until the next token completes it. Text that could be the start of a stop string is
    held back too, so a stream never shows part of a stop string; when one appears, the text before
    it is final and :attr:`stopped` is set (``include_stop``: the stop string stays in the text).
    ``skip_special_tokens`` (default, as vLLM's) leaves special tokens' text out.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (context for merge-sensitive decoding)
        self._read = 0  # tokens whose text is in self._text
        self._text = ""  # decoded so far (maybe ahead of what was emitted)
        self._emitted = 0  # characters of self._text already returned
        self._searched = 0  # characters of self._text already searched for stop strings
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once stopped

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special,
                                clean_up_tokenization_spaces=False)

    def step(self, all_ids: list[int], check_stops: bool = True) -> str:
        """Take the full list of generated ids so far; return the new text that is safe to show.

        With ``check_stops`` false (before a request's min_tokens) the new text is not searched
        for stop strings, and never will be, but for a stop string that begins in it and ends
        in text still to come."""
        if self.stopped:
            return ""
        self._ids = list(all_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT):
            self._text += window_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        if not check_stops:
            self._searched = len(self._text)
            # hold back nothing but what could begin a stop string (no search: no hit)
            return self._release(final=False, search=False)
        return self._release(final=False)

    def finish(self, check_stops: bool = True) -> str:
        """All remaining text (the generation ended); incomplete characters are shown as U+FFFD."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        self._text += window_text[len(prefix_text):]
        self._prefix = self._read = len(self._ids)
        return self._release(final=True, search=check_stops)

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._emitted]

    def _release(self, final: bool, search: bool = True) -> str:
        text = self._text
        if self._stop and search:
            longest = max(len(s) for s in self._stop)
            start = max(0, self._searched - longest + 1)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stop_string = next(s for s in self._stop if text.startswith(s, cut))
                if self._include_stop:
                    cut += len(self.stop_string)
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
