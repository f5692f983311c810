"""One matcher's mask fills along random replies of `structured.py`'s schema, on the CPU: the
schema compiled as the engine compiles it (`GrammarMasks.compile`) against the character
tokenizer padded to the shape's vocabulary, each reply taking at every step a token its mask
allows, picked uniformly from a seeded generator (`grammar_contention.next_token`), until the
end token. Reports the installed xgrammar's version, the fills' median, p90, p99 and largest,
how many took over 1 ms, and the text before the slowest fills: a batch fill of 64 rows waits
for its slowest rows, so a state that fills slowly, however rare, sets the step's tail.

    PYTHONPATH=engine:memplan:. python3 benchmarks/grammar_fills.py --replies 40
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.grammar_contention import next_token
from benchmarks.shapes import SHAPES
from benchmarks.structured import SCHEMA, write_json_tokenizer
from pagekeeper_engine.runner import structured_output as so

SLOW_S = 1e-3  # a fill over this is counted as slow
MAX_REPLY_TOKENS = 400  # the schema's replies are bounded well under this
NUM_SLOWEST = 8


def quantile_us(ordered: list[float], q: float) -> float:
    return round(ordered[int(q * (len(ordered) - 1))] * 1e6, 1)


def fill_replies(
    model_dir: Path, config: dict[str, Any], replies: int, seed: int
) -> dict[str, Any]:
    """Seconds of each fill, with the text before it, over `replies` random replies."""
    import xgrammar  # noqa: PLC0415

    vocab, eos = config["vocab_size"], config["eos_token_id"]
    grammar = so.GrammarMasks(model_dir, vocab, frozenset({eos}), 1, torch.device("cpu"))
    compiled = grammar.compile(json.dumps(SCHEMA))
    words = xgrammar.allocate_token_bitmask(1, vocab)
    spell = grammar_tokens(model_dir)
    pick = random.Random(seed)
    fills: list[tuple[float, str]] = []
    lengths: list[int] = []
    for _ in range(replies):
        matcher = xgrammar.GrammarMatcher(compiled)
        text, taken = "", 0
        while taken <= MAX_REPLY_TOKENS:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(words)
            fills.append((time.perf_counter() - start, text))
            token = next_token(words[0], vocab, pick)
            if token == eos:
                break
            assert matcher.accept_token(token), f"the mask allowed token {token}"
            text += spell[token]
            taken += 1
        assert taken <= MAX_REPLY_TOKENS, f"a reply ran past {MAX_REPLY_TOKENS} tokens"
        lengths.append(taken)
    seconds = sorted(s for s, _ in fills)
    slowest = sorted(fills, key=lambda f: f[0], reverse=True)[:NUM_SLOWEST]
    return {
        "xgrammar": importlib.metadata.version("xgrammar"),
        "replies": replies,
        "reply_tokens": {
            "median": statistics.median(lengths),
            "max": max(lengths),
            "total": sum(lengths),
        },
        "fills": len(seconds),
        "fill_us": {
            "median": quantile_us(seconds, 0.5),
            "p90": quantile_us(seconds, 0.9),
            "p99": quantile_us(seconds, 0.99),
            "max": quantile_us(seconds, 1.0),
        },
        "over_1ms": sum(s > SLOW_S for s in seconds),
        "total_ms": round(sum(seconds) * 1e3, 1),
        "slowest": [{"us": round(s * 1e6, 1), "after": text[-32:]} for s, text in slowest],
    }


def grammar_tokens(model_dir: Path) -> dict[int, str]:
    """Token id -> its text, from the tokenizer file the engine reads."""
    vocab = json.loads((model_dir / so.TOKENIZER_FILE).read_text())["model"]["vocab"]
    return {int(i): str(t) for t, i in vocab.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--replies", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    config = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        write_json_tokenizer(Path(tmp), config)
        report = {"shape": args.shape, **fill_replies(Path(tmp), config, args.replies, args.seed)}
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
