"""The synthetic pod's series: counters at their figures' rates within the jitter, monotonic, and
every request in the TTFT bucket of its figure."""

from __future__ import annotations

from pagekeeper_engine.frontend.metrics import TTFT_BUCKETS
from tests.support.synthetic_pod import JITTER, Figures, SyntheticPod

FIGURES = Figures(200.0, 4.0, 6.0, 2, 3, 0.3)


def series(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()}


def test_rates_gauges_and_the_ttft_bucket() -> None:
    pod = SyntheticPod(FIGURES, seed=3)
    start = pod._start
    at = [series(pod.exposition(start + t)) for t in (10.5, 15.5, 16.0)]
    tokens = 'vllm:generation_tokens_total{model_name="tiny-llama"}'
    rate = (at[1][tokens] - at[0][tokens]) / 5
    assert 200 * (1 - JITTER) <= rate <= 200 * (1 + JITTER) and rate != 200
    assert at[0][tokens] < at[1][tokens] < at[2][tokens]
    requests = at[1]['vllm:request_success_total{model_name="tiny-llama"}']
    assert 15.5 * 4 * (1 - JITTER) <= requests <= 15.5 * 4 * (1 + JITTER)
    buckets = {
        le: at[1][f'vllm:time_to_first_token_seconds_bucket{{model_name="tiny-llama",le="{le}"}}']
        for le in (*map(str, TTFT_BUCKETS), "+Inf")
    }
    # 6 s +- 10% lies in (5, 10]: nothing below it, everything from it on
    assert buckets["5.0"] == 0 and buckets["10.0"] == buckets["+Inf"] == requests
    assert at[1]['vllm:num_requests_waiting{model_name="tiny-llama"}'] == 3
    assert at[1]['vllm:kv_cache_usage_perc{model_name="tiny-llama"}'] == 0.3
    pod.stop()


def test_the_same_seed_gives_the_same_series_and_another_seed_other_noise() -> None:
    one, same, other = (SyntheticPod(FIGURES, seed=s) for s in (1, 1, 2))
    text = [p.exposition(p._start + 7.25) for p in (one, same, other)]
    assert text[0] == text[1] != text[2]
    for pod in (one, same, other):
        pod.stop()
