"""`PromptEncoder`: long prompts are encoded off the event loop, a burst in few tokenizer
calls, with the real tokenizer's ids; short ones inline; cancellation and errors stay per
request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pagekeeper_engine.frontend.prompt_encoder import PromptEncoder
from pagekeeper_engine.frontend.tokenizer import Tokenizer


class GatedTokenizer:
    """Word ids; `encode_batch` blocks until `gate` opens and records each batch it gets."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches: list[tuple[list[str], bool]] = []
        self.fail = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()] + ([0] if add_special_tokens else [])

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        assert self.gate.wait(30), "the test never opened the gate"
        self.batches.append((list(texts), add_special_tokens))
        if self.fail:
            raise RuntimeError("tokenizer failure")
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def words(n: int, width: int = 3) -> str:
    return " ".join("w" * width for _ in range(n))


def test_a_burst_waits_for_one_batch_while_the_loop_runs_on() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()
        encoder = PromptEncoder(tokenizer, inline_max_chars=16)
        first = asyncio.ensure_future(encoder.encode(words(10, 2)))
        await asyncio.sleep(0)  # the first batch has left for the worker thread
        later = [asyncio.ensure_future(encoder.encode(words(10 + i, 4))) for i in range(5)]
        # The loop still runs while the tokenizer is blocked: this task completes.
        assert await asyncio.wait_for(asyncio.sleep(0, result="ran"), 5) == "ran"
        assert not first.done()
        tokenizer.gate.set()
        assert await first == [2] * 10 + [0]
        assert [await f for f in later] == [[4] * (10 + i) + [0] for i in range(5)]
        assert [len(texts) for texts, _ in tokenizer.batches] == [1, 5]
        assert encoder.num_batches == 2

    asyncio.run(main())


def test_short_prompts_are_encoded_inline() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()  # closed: a call off the loop would never return
        encoder = PromptEncoder(tokenizer, inline_max_chars=16)
        assert await encoder.encode("ab c") == [2, 1, 0]
        assert await encoder.encode("ab c", add_special_tokens=False) == [2, 1]
        assert encoder.num_batches == 0 and tokenizer.batches == []

    asyncio.run(main())


def test_special_token_settings_go_in_separate_calls() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()
        encoder = PromptEncoder(tokenizer, inline_max_chars=4)
        with_bos = asyncio.ensure_future(encoder.encode(words(3)))
        without = asyncio.ensure_future(encoder.encode(words(4), add_special_tokens=False))
        tokenizer.gate.set()
        assert await with_bos == [3, 3, 3, 0]
        assert await without == [3, 3, 3, 3]
        assert sorted(flag for _, flag in tokenizer.batches) == [False, True]

    asyncio.run(main())


def test_a_cancelled_request_leaves_the_others_their_ids() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()
        encoder = PromptEncoder(tokenizer, inline_max_chars=4)
        blocker = asyncio.ensure_future(encoder.encode(words(2)))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(encoder.encode(words(5)))
        kept = asyncio.ensure_future(encoder.encode(words(6)))
        await asyncio.sleep(0)
        gone.cancel()
        tokenizer.gate.set()
        assert await blocker == [3, 3, 0]
        assert await kept == [3] * 6 + [0]
        assert gone.cancelled()
        # the cancelled prompt was dropped before its batch went to the tokenizer
        assert [texts for texts, _ in tokenizer.batches] == [[words(2)], [words(6)]]

    asyncio.run(main())


def test_a_tokenizer_error_reaches_every_waiting_request_and_the_next_batch_works() -> None:
    async def main() -> None:
        tokenizer = GatedTokenizer()
        tokenizer.fail = True
        encoder = PromptEncoder(tokenizer, inline_max_chars=4)
        waiting = [asyncio.ensure_future(encoder.encode(words(3))) for _ in range(3)]
        tokenizer.gate.set()
        for future in waiting:
            with pytest.raises(RuntimeError, match="tokenizer failure"):
                await future
        tokenizer.fail = False
        assert await encoder.encode(words(2)) == [3, 3, 0]

    asyncio.run(main())


def test_the_real_tokenizer_gives_the_same_ids_off_the_loop(tmp_path: Path) -> None:
    vocab = {f"t{i}": i for i in range(1000)}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="t0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    texts = [" ".join(f"t{(7 * i + j) % 1000}" for j in range(300 + i)) for i in range(8)]

    async def main() -> list[list[int]]:
        encoder = PromptEncoder(tokenizer)
        ids = await asyncio.gather(*(encoder.encode(t) for t in texts))
        assert 1 <= encoder.num_batches <= 2  # the first alone, the rest together
        return list(ids)

    assert asyncio.run(main()) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode_batch(texts[:2]) == [tokenizer.encode(t) for t in texts[:2]]
