"""Where a WebSocket's buffered text is cut into spoken segments (`segment_end`), against a brute-force
oracle over every prefix of random text of 1- to 4-byte characters, and streamed: the segments of text
fed in random pieces are the text, in order, each within `segment_bytes`, and the cutting ends."""

from __future__ import annotations

import random
import re

import pytest

from tests import extras

extras.skip_module_without("serve")
pytestmark = pytest.mark.serve

from mstar_jax.models.streaming_tts.routes import segment_end

# 1, 2, 3 and 4 UTF-8 bytes; sentence ends, closers after them, spaces and newlines.
ALPHABET = ["a", "b", "é", "中", "😀", " ", " ", ".", "!", "?", "\n", '"', ")", "]", "\t"]


def oracle(text: str, limit: int, final: bool) -> int:
    """`segment_end` by brute force: the shortest prefix within `limit` bytes ending at a sentence's
    end; else (over `limit`) after the last space within it, or the longest prefix within it; else all
    of it when `final` or exactly at `limit`; else 0."""
    if not text:
        return 0
    room = max(k for k in range(len(text) + 1) if len(text[:k].encode()) <= limit)
    for k in range(1, room + 1):
        if re.search(r"[.!?\n][\"')\]]*\s\Z", text[:k]):
            return k
    if len(text.encode()) > limit:
        spaces = [k for k in range(1, room + 1) if text[k - 1] == " "]
        return spaces[-1] if spaces else room
    return len(text) if final or len(text.encode()) == limit else 0


def random_text(rng: random.Random, longest: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, longest)))


@pytest.mark.parametrize("limit", [4, 5, 7, 12, 32])
def test_segment_end_equals_the_brute_force_oracle(limit):
    rng = random.Random(limit)
    for _ in range(2000):
        text, final = random_text(rng, 3 * limit), rng.random() < 0.5
        assert segment_end(text, limit, final=final) == oracle(text, limit, final), (text, final)


@pytest.mark.parametrize("limit", [4, 5, 9, 32])
def test_streamed_text_is_cut_into_segments_within_the_limit_that_rejoin_it(limit):
    rng = random.Random(100 + limit)
    for _ in range(300):
        text, buffer, segments = random_text(rng, 8 * limit), "", []
        pieces = [text[i : i + rng.randint(1, 6)] for i in range(0, len(text), 6)]
        for piece, final in [(p, False) for p in pieces] + [("", True)]:
            buffer += piece
            for _ in range(len(buffer) + 1):  # each cut takes a character at least: this many end it
                cut = segment_end(buffer, limit, final=final)
                if not cut:
                    break
                segments.append(buffer[:cut])
                buffer = buffer[cut:]
            assert not cut, "a cut of nothing, or a cut that never ends"
        assert buffer == ""
        assert "".join(segments) == "".join(pieces)
        assert all(0 < len(s.encode()) <= limit for s in segments)
