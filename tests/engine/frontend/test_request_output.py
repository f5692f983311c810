"""`RequestOutput.merged`: what a consumer that fell behind by several steps receives at once."""

from __future__ import annotations

from pagekeeper_engine.frontend.client import RequestOutput


def out(ids: list[int], text: str, *, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r", new_token_ids=ids, new_text=text, finished=finished,
        finish_reason="length" if finished else None, num_prompt_tokens=5, num_output_tokens=n,
        num_cached_tokens=2, logprobs=[-0.5 * i for i in ids],
        top_logprobs=[[(i, -0.5 * i)] for i in ids],
    )  # fmt: skip


def test_one_output_is_returned_as_it_is() -> None:
    only = out([7], "a", n=1)
    assert RequestOutput.merged([only]) is only


def test_several_outputs_keep_every_token_in_order_and_the_last_ones_ending() -> None:
    merged = RequestOutput.merged(
        [out([7], "a", n=1), out([8, 9], "bc", n=3), out([], "", n=3, finished=True)]
    )
    assert merged.new_token_ids == [7, 8, 9]
    assert merged.new_text == "abc"
    assert merged.logprobs == [-3.5, -4.0, -4.5]
    assert merged.top_logprobs == [[(7, -3.5)], [(8, -4.0)], [(9, -4.5)]]
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens) == (True, "length", 3)
    assert (merged.num_prompt_tokens, merged.num_cached_tokens) == (5, 2)
