"""Streaming text: committed tokens -> text deltas that concatenate to the final text.

Used by `specdec.stream` and the server. A delta never ends in an incomplete UTF-8 character,
never contains a matched stop string, and holds back any tail that could still become one.
"""

from __future__ import annotations

import logging

log = logging.getLogger("specdec.streaming")


class TextDeltas:
    """Text deltas for streaming that always concatenate to the final (non-streamed) text."""

    def __init__(self, decode, stop_strings=()):
        self.decode = decode
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokens: list[int] = []
        self.sent = ""  # text already handed out

    def push(self, tokens: list[int]) -> str:
        """Add committed tokens; return the new text that is safe to send (may be "")."""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD
        matched = [text.find(stop) for stop in self.stop_strings if stop in text]
        if matched:  # the generation ends at the first stop string: never send it or what follows
            safe = min(safe, *matched)
        else:
            safe -= self._possible_stop_prefix(text[:safe])
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : safe]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the scheduler's text: stop string already cut off)."""
        if not final_text.startswith(self.sent):  # cannot happen with prefix-stable decoding
            log.warning("streamed text diverged from the final text")
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta

    def _possible_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
