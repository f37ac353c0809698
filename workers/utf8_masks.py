"""Well-formed UTF-8 as a token mask: for each state of a UTF-8 decoder, the tokens whose bytes keep the output
well-formed (RFC 3629 table 3-7: no overlong forms, no surrogates, nothing past U+10FFFF).

xgrammar 0.2.9 matches a character class byte by byte and lets some ill-formed sequences through: a regex class
range that spans UTF-8 lengths (a schema `pattern`, `.`, `[^...]`) is split at E0 80 80 and F0 80 80 80, both
overlong, and a negated EBNF class (its JSON strings and object keys) admits the encoded surrogates ED A0..BF.
A grammar matcher ANDs its row of the token bitmask with the row of its decoder state (workers/grammar.py), so
whatever the grammar's classes, a constrained output decodes strictly and its characters are those the grammar
counted. A well-formed prefix always has a well-formed continuation, so the mask never empties a row that a
correct grammar left open.
"""
from __future__ import annotations

import numpy as np

# Decoder states: GROUND (between characters), then how many continuation bytes remain and, after the four lead
# bytes whose second byte is narrower (E0, ED, F0, F4), that second byte's range.
GROUND, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4, ERROR = range(9)
NUM_STATES = ERROR                   # the states a matcher can be in (ERROR is never accepted)


def _transitions() -> np.ndarray:
    """[state, byte] -> state."""
    table = np.full((ERROR + 1, 256), ERROR, dtype=np.int8)
    table[GROUND, 0x00:0x80] = GROUND
    table[GROUND, 0xC2:0xE0] = CONT1
    table[GROUND, 0xE0] = AFTER_E0
    table[GROUND, 0xE1:0xF0] = CONT2
    table[GROUND, 0xED] = AFTER_ED
    table[GROUND, 0xF0] = AFTER_F0
    table[GROUND, 0xF1:0xF4] = CONT3
    table[GROUND, 0xF4] = AFTER_F4
    table[CONT1, 0x80:0xC0] = GROUND
    table[CONT2, 0x80:0xC0] = CONT1
    table[CONT3, 0x80:0xC0] = CONT2
    table[AFTER_E0, 0xA0:0xC0] = CONT1      # E0 80..9F: overlong (U+0000..U+07FF)
    table[AFTER_ED, 0x80:0xA0] = CONT1      # ED A0..BF: surrogates U+D800..U+DFFF
    table[AFTER_F0, 0x90:0xC0] = CONT2      # F0 80..8F: overlong (below U+10000)
    table[AFTER_F4, 0x80:0x90] = CONT2      # F4 90..BF: past U+10FFFF
    return table


class Utf8Masks:
    """`next_state[state, token]`: the decoder state after the token's bytes (ERROR: ill-formed, or a padded row
    without bytes); `bitmask[state]`: those tokens as an xgrammar bitmask row (bit v set = token v allowed)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        lengths = np.fromiter(map(len, token_bytes), dtype=np.int64, count=len(token_bytes))
        starts = np.cumsum(lengths) - lengths
        flat = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
        table = _transitions()
        state = np.full((NUM_STATES, vocab_size), ERROR, dtype=np.int8)   # rows past the tokenizer's: padding
        state[:, :len(token_bytes)] = np.arange(NUM_STATES, dtype=np.int8)[:, None]
        # every token from every state at once, a byte position at a time, over the tokens that long
        for position in range(int(lengths.max(initial=0))):
            tokens = np.flatnonzero(lengths > position)
            state[:, tokens] = table[state[:, tokens], flat[starts[tokens] + position]]
        self.next_state = state
        width = (vocab_size + 31) // 32
        allowed = np.zeros((NUM_STATES, width * 32), dtype=np.uint32)
        allowed[:, :vocab_size] = state != ERROR
        words = (allowed.reshape(NUM_STATES, width, 32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        import torch   # here: the replica's front and the ingress import this module's constants, never torch
        self.bitmask = torch.from_numpy(words.view(np.int32))
