"""The mask-fill benchmark walks whole replies through the engine's compiled schema: every fill
is timed, every reply ends at the end token, and the report's counts agree with each other (no
figure is asserted: they are the machine's and the xgrammar release's)."""

from __future__ import annotations

import importlib.metadata

from benchmarks import grammar_fills as gf


def test_every_fill_of_every_reply_is_timed_and_counted() -> None:
    report = gf.main(["--replies", "3"])
    assert report["xgrammar"] == importlib.metadata.version("xgrammar")
    assert report["replies"] == 3
    lengths = report["reply_tokens"]
    assert 0 < lengths["median"] <= lengths["max"] < gf.MAX_REPLY_TOKENS
    # one fill per token taken, and one more for the end token of each reply
    assert report["fills"] == lengths["total"] + 3
    fill = report["fill_us"]
    assert 0 < fill["median"] <= fill["p90"] <= fill["p99"] <= fill["max"]
    assert 0 <= report["over_1ms"] <= report["fills"]
    slowest = report["slowest"]
    assert len(slowest) == gf.NUM_SLOWEST
    assert slowest[0]["us"] == fill["max"]
    assert [s["us"] for s in slowest] == sorted((s["us"] for s in slowest), reverse=True)


def test_the_walk_is_seeded() -> None:
    first, again = (gf.main(["--replies", "2", "--seed", "7"]) for _ in range(2))
    assert first["reply_tokens"] == again["reply_tokens"]
    assert first["fills"] == again["fills"]
