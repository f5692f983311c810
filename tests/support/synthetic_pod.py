"""A KWOK pod's engine series without an engine: /metrics whose figures follow from the flags
the operator rendered for the pod, for trials whose outcome rests on a figure a CPU engine
cannot be made to show on demand (a TTFT p99 ten times apart at equal throughput).

A test gives a `FigureModel` (rendered command -> `Figures`), so a canary's synthetic pod shows
the figures of the canary's policy. The series are the engine's (vLLM's names): counters of
output tokens and finished requests, the TTFT histogram, and the running / waiting / KV gauges
the tuner's rules read. Each counter grows by a seeded amount each whole second since start
(its rate within +-JITTER), so a rate over a few seconds is near the figure and two pods with
the same figures differ only by that noise. Each second's requests land in the TTFT bucket of
that second's TTFT (within +-JITTER of the figure), so a figure well inside a bucket gives a p99
at that bucket's interpolation.
"""

from __future__ import annotations

import bisect
import http.server
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekeeper_engine.frontend.metrics import TTFT_BUCKETS

JITTER = 0.1


@dataclass(frozen=True)
class Figures:
    """What a pod shows: rates per second, the TTFT of its requests, and its gauges."""

    output_tokens_per_s: float
    requests_per_s: float
    ttft_seconds: float
    num_running: int
    num_waiting: int
    kv_usage: float


FigureModel = Callable[[Sequence[str]], Figures]  # a pod's rendered command -> its figures


class SyntheticPod:
    """An HTTP server on loopback answering /metrics with `figures`' series (see the module
    docstring); `seed` makes its noise its own."""

    def __init__(self, figures: Figures, seed: int) -> None:
        self.figures = figures
        self._seed = seed
        self._start = time.monotonic()
        self._seconds: list[tuple[float, float, int]] = []  # (tokens, requests, TTFT bucket)
        self._lock = threading.Lock()
        pod = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pod.exposition().encode() if self.path == "/metrics" else b""
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> SyntheticPod:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def _second(self, index: int) -> tuple[float, float, int]:
        rng = random.Random(self._seed * 1_000_003 + index)
        f = self.figures
        tokens = f.output_tokens_per_s * (1 + JITTER * rng.uniform(-1, 1))
        requests = f.requests_per_s * (1 + JITTER * rng.uniform(-1, 1))
        ttft = f.ttft_seconds * (1 + JITTER * rng.uniform(-1, 1))
        return tokens, requests, bisect.bisect_left(TTFT_BUCKETS, ttft)

    def exposition(self, now: float | None = None) -> str:
        """The series at `now` (monotonic seconds; default: the clock)."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        whole, part = int(elapsed), elapsed - math.floor(elapsed)
        with self._lock:
            while len(self._seconds) <= whole:
                self._seconds.append(self._second(len(self._seconds)))
            done = self._seconds[:whole]
            current = self._seconds[whole]
        tokens = sum(s[0] for s in done) + part * current[0]
        in_bucket = [0.0] * (len(TTFT_BUCKETS) + 1)
        for _, requests, bucket in [*done, (0.0, part * current[1], current[2])]:
            in_bucket[bucket] += requests
        requests_total = sum(in_bucket)
        f, labels = self.figures, 'model_name="tiny-llama"'
        lines = [
            f"vllm:generation_tokens_total{{{labels}}} {tokens:.3f}",
            f"vllm:request_success_total{{{labels}}} {requests_total:.3f}",
            f"vllm:num_preemptions_total{{{labels}}} 0",
            f"vllm:num_requests_running{{{labels}}} {f.num_running}",
            f"vllm:num_requests_waiting{{{labels}}} {f.num_waiting}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {f.kv_usage}",
        ]
        cumulative = 0.0
        for le, count in zip([*map(str, TTFT_BUCKETS), "+Inf"], in_bucket, strict=True):
            cumulative += count
            name = "vllm:time_to_first_token_seconds_bucket"
            lines.append(f'{name}{{{labels},le="{le}"}} {cumulative:.3f}')
        lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {requests_total:.3f}")
        return "\n".join(lines) + "\n"


def start_synthetic_pod(model: FigureModel, rendered: Sequence[str], seed: int) -> SyntheticPod:
    """A serving synthetic pod for a pod whose engine container runs `rendered`."""
    return SyntheticPod(model(rendered), seed).start()
