"""The arrivals burst's pure parts: what a wave holds and how each request's end is read."""

from __future__ import annotations

import json
import random

from benchmarks.arrivals import MALFORMED, Arrival, draw_wave, outcome


def test_a_wave_mixes_leavers_completers_and_malformed_text_requests() -> None:
    wave = draw_wave(random.Random(3), 400, 5000, leave_share=0.7, malformed_share=0.1)
    kinds = {k: sum(a.kind == k for a in wave) for k in ("leave", "complete", "malformed")}
    assert sum(kinds.values()) == 400
    assert 240 <= kinds["leave"] <= 320 and 20 <= kinds["malformed"] <= 60
    for arrival in wave:
        if arrival.kind == "malformed":
            assert (arrival.body, arrival.param) in MALFORMED
            continue
        body = json.loads(arrival.body)
        words = body["prompt"].split()
        assert 16 <= len(words) <= 1500 and all(w.startswith("t") for w in words)
        assert 16 <= body["max_tokens"] <= 256 and body["stream"] is True
    assert draw_wave(random.Random(3), 400, 5000, leave_share=0.7, malformed_share=0.1) == wave


def test_outcomes() -> None:
    complete, leave = Arrival("complete", "{}"), Arrival("leave", "{}")
    malformed = Arrival("malformed", "{}", "max_tokens")
    assert outcome(complete, 200, None, True) == "served"
    assert outcome(complete, 200, None, False) == "lost"
    assert outcome(complete, 200, {"message": "boom"}, False) == "lost"
    assert outcome(leave, 200, None, True) == "left"
    assert outcome(complete, 429, {}, False) == outcome(leave, 503, {}, False) == "rejected"
    assert outcome(complete, 500, {}, False) == "lost"
    assert outcome(malformed, 400, {"param": "max_tokens"}, False) == "refused"
    assert outcome(malformed, 400, {"param": "prompt"}, False) == "lost"
    assert outcome(malformed, 200, None, True) == "lost"
    assert (
        outcome(Arrival("malformed", "{", None), 400, {"message": "bad JSON"}, False) == "refused"
    )
    assert outcome(Arrival("malformed", "{", None), 400, None, False) == "lost"
