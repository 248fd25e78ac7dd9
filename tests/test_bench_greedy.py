"""`flare.plugins.bench.greedy`: the phases of a language-model request, timed inside it."""
from __future__ import annotations

import numpy as np

from flare.plugins.bench.greedy import greedy_request, phase_times


class _Counting:
    """A model whose next token's logits peak at (previous + 1) mod 5, and which records its calls."""

    def __init__(self):
        self.calls = []

    def prefill(self, seq, ids):
        self.calls.append(("prefill", seq, list(ids)))
        return np.eye(5, dtype=np.float32)[(ids[-1] + 1) % 5]

    def decode(self, seqs, tokens, positions):
        self.calls.append(("decode", list(seqs), list(tokens), list(positions)))
        return [np.eye(5, dtype=np.float32)[(tokens[0] + 1) % 5]]


def test_greedy_request_feeds_each_argmax_back_at_the_next_position():
    model = _Counting()
    logits, extras = greedy_request(model, [3, 0], 4)
    assert logits.shape == (4, 5) and list(logits.argmax(axis=1)) == [1, 2, 3, 4]
    assert model.calls == [("prefill", 0, [3, 0]), ("decode", [0], [1], [2]), ("decode", [0], [2], [3]),
                           ("decode", [0], [3], [4])]
    assert set(extras) == {"prefill ms", "decode ms/token"} and min(extras.values()) >= 0


def test_phase_times_split_the_request_at_its_first_token():
    assert phase_times(1.0, 1.5, 2.5, 5) == {"prefill ms": 500.0, "decode ms/token": 250.0}
    assert phase_times(1.0, 1.5, 1.5, 1) == {"prefill ms": 500.0}     # one token: no decode phase
