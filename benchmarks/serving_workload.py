"""W-chat (BENCHMARKS.md), its pure parts: each level's seeded requests, the engine settings the
server and the offline engine share, each client process's share of a level, what a client
records of one stream, the summary, the /metrics figures, the offline decode-step selection, and
the printed lines and table. No I/O, no torch: `benchmarks/serving.py` does the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX_GROUP_SIZE = 16  # requests that share one system prefix in the prefix-sharing variant
PREFIX_LEN = 1024
OPEN_LOOP_REQUESTS = 512  # per --request-rate level unless --num-requests says otherwise
TEMPERATURE = 0.6
WARMUP_TOKENS = 16  # at most, per warm-up request (drawn apart from the level's requests)
# Share of the concurrency that a step must return tokens for to count as a decode step at
# that batch (requests finish and are replaced, so a step seldom serves exactly all of them).
DECODE_BATCH_SHARE = 0.9


@dataclass(frozen=True)
class ChatWorkload:
    prompts: list[list[int]]
    output_lens: list[int]


LevelRequests = tuple[ChatWorkload, ChatWorkload]  # a level's requests and its warm-up


@dataclass(frozen=True)
class EngineSettings:
    """What the server and the offline engine share: the server's flags and `EngineConfig`
    fields of the same names."""

    device: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    block_size: int
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enforce_eager: bool
    swap_space: float = 0.0  # as build_engine: a preempted request is recomputed

    def server_flags(self) -> list[str]:
        flags = [
            "--device", self.device, "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--block-size", str(self.block_size),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--swap-space", str(self.swap_space),
            f"--{'' if self.enable_prefix_caching else 'no-'}enable-prefix-caching",
        ]  # fmt: skip
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return [*flags, "--enforce-eager"] if self.enforce_eager else flags


@dataclass(frozen=True)
class Level:
    """One load level: a closed-loop concurrency or an open-loop request rate."""

    concurrency: int | None = None
    rate: float | None = None
    stream: bool = True  # False: each response in one body (the "-whole" levels)

    @property
    def load_label(self) -> str:
        return f"c{self.concurrency}" if self.concurrency is not None else f"r{self.rate:g}"

    @property
    def label(self) -> str:
        return self.load_label if self.stream else f"{self.load_label}-whole"

    def seed(self, seed: int, part: str) -> str:
        """Each load draws its own requests: a level draws the same ones in any run, and no
        level's prompts are in a prefix cache that another level filled. A "-whole" level
        draws its streaming twin's requests (`level_workloads` keeps them out of its cache)."""
        return f"{seed}/{part}-{self.load_label}"


@dataclass(frozen=True)
class ClientPlan:
    """One client process's share of a level."""

    url: str
    model: str
    prompts: list[list[int]]
    output_lens: list[int]
    warmup: list[tuple[list[int], int]]  # (prompt, max_tokens) of this process's warm-up
    num_streams: int  # closed loop: requests this process keeps in flight; 0 in open loop
    arrivals: list[tuple[int, float]]  # open loop: (request index, seconds after the start)
    timeout_s: float
    stream: bool = True  # the level's
    as_text: bool = False  # prompts as text for the server to tokenize, not as token ids
    cpus: set[int] = field(default_factory=set)  # the CPUs the process may use; empty: any
    api_key: str | None = None  # sent as Authorization: Bearer, for a server run with --api-key


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Prompt token ids [lo, hi): clear of the special tokens real vocabularies keep at both
    ends; a vocabulary too small for that margin is used whole."""
    return (100, vocab_size - 1000) if vocab_size >= 2100 else (0, vocab_size)


def w_chat(
    num_requests: int,
    seed: int | str,
    *,
    vocab_size: int,
    prompt_lens: tuple[int, int] = (64, 2048),
    output_lens: tuple[int, int] = (32, 512),
    prefix_sharing: bool = False,
) -> ChatWorkload:
    """The draws of `random.seed(seed)`: for each request its prompt length, then its ids;
    then every output length. Lengths are uniform over the inclusive ranges.

    Prefix sharing: each group of PREFIX_GROUP_SIZE consecutive requests shares a
    PREFIX_LEN-token prefix, drawn just before the group's first request; a prompt is that
    prefix followed by the request's own part of the drawn length (so prompts are PREFIX_LEN
    tokens longer than in the plain variant).
    """
    rng = random.Random(seed)
    lo, hi = token_id_range(vocab_size)
    prompts: list[list[int]] = []
    prefix: list[int] = []
    for i in range(num_requests):
        if prefix_sharing and i % PREFIX_GROUP_SIZE == 0:
            prefix = [rng.randrange(lo, hi) for _ in range(PREFIX_LEN)]
        own = [rng.randrange(lo, hi) for _ in range(rng.randint(*prompt_lens))]
        prompts.append(prefix + own)
    return ChatWorkload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def level_workloads(
    level: Level, seed: int, num_requests: int | None, **lengths: Any
) -> LevelRequests:
    """A level's requests (`num_requests`, else 4 x C, or OPEN_LOOP_REQUESTS at a rate) and
    its warm-up requests (one per stream, or PREFIX_GROUP_SIZE at a rate; short outputs)."""
    default = OPEN_LOOP_REQUESTS if level.concurrency is None else 4 * level.concurrency
    work = w_chat(num_requests or default, level.seed(seed, "requests"), **lengths)
    warm = w_chat(level.concurrency or PREFIX_GROUP_SIZE, level.seed(seed, "warm-up"), **lengths)
    if not level.stream:
        # The same work as the streaming twin, none of it cached by the twin: a block's cache
        # key chains every token before it, so a new first token misses every block.
        lo, hi = token_id_range(lengths["vocab_size"])
        work = ChatWorkload(
            [[lo + (p[0] - lo + 1) % (hi - lo), *p[1:]] for p in work.prompts], work.output_lens
        )
    return work, ChatWorkload(warm.prompts, [min(n, WARMUP_TOKENS) for n in warm.output_lens])


def poisson_arrivals(num_requests: int, rate: float, seed: int | str) -> list[float]:
    """Seconds after the start at which each request is sent: exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(num_requests)))


def client_plans(
    level: Level, requests: LevelRequests, seed: int, **common: Any
) -> list[ClientPlan]:
    """Each client process's share of a level (`common`: the other ClientPlan fields). In a
    closed loop the C streams split as evenly as they go (each process takes its next request
    from one shared counter); in an open loop a process sends every P-th arrival."""
    work, warm = requests
    num_procs = min(common.pop("num_processes"), level.concurrency or len(work.prompts))
    concurrency = level.concurrency or 0
    arrivals: list[tuple[int, float]] = []
    if level.rate is not None:
        offsets = poisson_arrivals(len(work.prompts), level.rate, level.seed(seed, "arrivals"))
        arrivals = list(enumerate(offsets))
    return [
        ClientPlan(
            prompts=work.prompts,
            output_lens=work.output_lens,
            warmup=list(zip(warm.prompts, warm.output_lens, strict=True))[w::num_procs],
            num_streams=concurrency // num_procs + (w < concurrency % num_procs),
            arrivals=arrivals[w::num_procs],
            stream=level.stream,
            **common,
        )
        for w in range(num_procs)
    ]


def prompt_text(prompt: list[int]) -> str:
    """The text the benchmark's word tokenizer (`serving_server.write_word_tokenizer`: token i
    is the word "t{i}") encodes to exactly these ids."""
    return " ".join(f"t{i}" for i in prompt)


def completion_body(
    model: str, prompt: list[int], max_tokens: int, *, stream: bool = True, as_text: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_text(prompt) if as_text else prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        "temperature": TEMPERATURE,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class RequestRecord:
    """What a client saw of one streamed completion. Times are `time.monotonic()` seconds,
    one clock for every process on the machine."""

    index: int
    max_tokens: int
    send_s: float
    end_s: float = 0.0
    status: int = 0  # HTTP status; 0 when no response came
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    chunk_words: list[int] = field(default_factory=list)  # whitespace-separated words in each
    num_prompt_tokens: int = 0  # from the final `usage` chunk
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    has_usage: bool = False
    error: str | None = None  # the error body, error event or exception

    def on_event(self, data: str, now_s: float) -> None:
        """Apply the data of one server-sent event that arrived at `now_s`."""
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            self.error = json.dumps(event["error"])
            return
        for choice in event.get("choices") or []:
            if choice.get("text"):
                self.chunk_s.append(now_s)
                self.chunk_words.append(len(choice["text"].split()))
        usage = event.get("usage")
        if usage:
            self.has_usage = True
            self.num_prompt_tokens = usage["prompt_tokens"]
            self.num_output_tokens = usage["completion_tokens"]
            self.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )

    def on_body(self, data: str) -> None:
        """Apply a whole (non-streaming) response body: its usage; no chunk times."""
        self.on_event(json.dumps({"usage": json.loads(data).get("usage")}), self.end_s)

    @property
    def failure(self) -> str | None:
        """Why the request counts as failed, or None."""
        if self.status == 0:
            return "no response"
        if self.status != 200:
            return f"HTTP {self.status}"
        if self.error is not None:
            return "error mid-stream"
        if not self.has_usage:
            return "no usage chunk"
        return None

    @property
    def ttft_s(self) -> float | None:
        """Seconds to the first chunk with text; None without a stream (`on_body`)."""
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def has_token_counts(self) -> bool:
        """Whether each chunk's word count is its token count: true for the benchmark's own
        word-level tokenizer (one word per token), which sums to the usage count."""
        return all(n > 0 for n in self.chunk_words) and (
            sum(self.chunk_words) == self.num_output_tokens
        )

    def inter_token_gaps(self) -> list[float]:
        """Seconds between tokens after the first chunk: a chunk's gap spread evenly over its
        tokens where they can be counted (`has_token_counts`), else one gap per chunk."""
        exact = self.has_token_counts
        gaps: list[float] = []
        for i in range(1, len(self.chunk_s)):
            num_tokens = self.chunk_words[i] if exact else 1
            gaps += [(self.chunk_s[i] - self.chunk_s[i - 1]) / num_tokens] * num_tokens
        return gaps


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between the closest ranks."""
    assert values, "a percentile of no values"
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ms = [v * 1e3 for v in values_s]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms),
    }


def summarize(records: Sequence[RequestRecord], first_wave: int = 0) -> dict[str, Any]:
    """Rates over the wall time from the first send to the last end; latencies of the requests
    that succeeded; every failure counted by kind, with the first error of each kind kept.

    `first_wave`: a closed loop's first C requests (indexes below it), sent all at once, whose
    prompts queue behind each other; their TTFT and the rest's are also given apart."""
    assert records, "a summary of no requests"
    ok = [r for r in records if r.failure is None]
    failures = Counter(r.failure for r in records if r.failure is not None)
    first_errors: dict[str, str] = {}
    for r in records:
        if r.failure is not None:
            first_errors.setdefault(r.failure, (r.error or "")[:1000])
    wall_s = max(r.end_s for r in records) - min(r.send_s for r in records)
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_events = sum(len(r.chunk_s) for r in ok)  # streamed events that carried text
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "wall_s": wall_s,
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": sum(r.num_cached_tokens for r in ok),
        "num_output_tokens": num_output,
        "num_short": sum(r.num_output_tokens < r.max_tokens for r in ok),
        "output_tok_s": num_output / wall_s,
        "total_tok_s": (num_prompt + num_output) / wall_s,
        "requests_s": len(ok) / wall_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_first_wave_ms": distribution_ms(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.index < first_wave]
        ),
        "ttft_after_first_wave_ms": distribution_ms(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.index >= first_wave]
        ),
        "first_wave": first_wave,
        "itl_ms": distribution_ms([g for r in ok for g in r.inter_token_gaps()]),
        "e2e_ms": distribution_ms([r.end_s - r.send_s for r in ok]),
        "num_itl_exact": sum(r.has_token_counts for r in ok),
        "tokens_per_event": num_output / num_events if num_events else None,
        "failures": dict(failures),
        "first_errors": first_errors,
    }


def memory_metrics(text: str) -> dict[str, float | None]:
    """The allocator and budget figures of a /metrics page (None where the page has none:
    the allocator series exist only on CUDA). Labels other than those named are ignored."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(name: str, **labels: str) -> float | None:
        found = (s.value for s in samples if s.name == name and labels.items() <= s.labels.items())
        return next(found, None)

    reserved = value("pagekeeper_allocator_reserved_bytes")
    allocated = value("pagekeeper_allocator_allocated_bytes")
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_minus_allocated_bytes": (
            None if reserved is None or allocated is None else reserved - allocated
        ),
        "fragmentation_bytes": value("pagekeeper_allocator_fragmentation_bytes"),
        "fragmentation_buffer_bytes": value(
            "pagekeeper_memory_budget_bytes", term="fragmentation_buffer"
        ),
        "num_preemptions": value("vllm:num_preemptions_total"),
    }


@dataclass(frozen=True)
class StepSample:
    """One `engine.step()` call of an offline run."""

    seconds: float
    num_outputs: int  # requests that got tokens back from this call
    num_scheduled_tokens: int  # tokens this call scheduled: one per decode, a chunk per prefill


def decode_step_time(steps: Sequence[StepSample], concurrency: int) -> tuple[float | None, int]:
    """Median seconds of the step calls that ran a pure decode batch at about `concurrency`,
    and how many there were. Kept: calls returning tokens for at least DECODE_BATCH_SHARE of
    `concurrency` requests, where this call and the one before scheduled at most one token per
    running request (no prefill chunk; with asynchronous scheduling a call returns the tokens
    of the step launched by the call before)."""
    kept = [
        step.seconds
        for before, step in itertools.pairwise(steps)
        if before.num_scheduled_tokens <= concurrency
        and step.num_scheduled_tokens <= concurrency
        and step.num_outputs >= DECODE_BATCH_SHARE * concurrency
    ]
    return (statistics.median(kept) if kept else None), len(kept)


def compare(online: dict[str, Any], offline: dict[str, Any]) -> dict[str, float | None]:
    """The level's two targets (BENCHMARKS.md): online / offline output tokens per second
    (goal >= 0.85), and ITL p50 / the offline decode step at that batch (goal <= 1.5)."""
    itl, step = online["itl_ms"]["p50"], offline["decode_step_ms"]
    return {
        "online_over_offline": online["output_tok_s"] / offline["output_tok_s"],
        "itl_p50_over_decode_step": None if itl is None or step is None else itl / step,
    }


def _ms(dist: dict[str, float | None]) -> str:
    return "/".join("-" if dist[k] is None else f"{dist[k]:,.1f}" for k in ("p50", "p90", "p99"))


def _num(value: float | None, fmt: str = ",.0f", scale: float = 1.0) -> str:
    return "-" if value is None else f"{value / scale:{fmt}}"


def format_online(row: dict[str, Any]) -> str:
    s, memory = row["online"], row["memory"]
    failures = ", ".join(f"{n} {kind}" for kind, n in s["failures"].items()) or "none"
    return (
        f"{row['level']:>6} online: {s['num_ok']}/{s['num_requests']} ok in {s['wall_s']:.1f} s,"
        f" {s['output_tok_s']:,.0f} output tok/s; failures: {failures}; {s['num_short']} short;"
        f" {s['num_cached_tokens']:,} of {s['num_prompt_tokens']:,} prompt tokens cached;"
        f" {s['num_itl_exact']} requests timed per token;"
        f" {_num(s.get('tokens_per_event'), '.2f')} tokens per SSE event\n"
        f"        TTFT p50/p90/p99 ms: all"
        f" {_ms(s['ttft_ms'])}, first wave of {s['first_wave']} {_ms(s['ttft_first_wave_ms'])},"
        f" after it {_ms(s['ttft_after_first_wave_ms'])}\n        allocator reserved - allocated"
        f" {_num(memory.get('reserved_minus_allocated_bytes'), ',.1f', 2**20)} MiB (fragmentation"
        f" gauge {_num(memory.get('fragmentation_bytes'), ',.1f', 2**20)} MiB), fragmentation"
        f" buffer {_num(memory.get('fragmentation_buffer_bytes'), ',.1f', 2**20)} MiB,"
        f" preemptions {_num(memory.get('num_preemptions'))}"
        + "".join(
            f"\n        first {kind}: {text[:300]}" for kind, text in s["first_errors"].items()
        )
    )


TABLE_HEAD = (
    "| level | ok | output tok/s | total tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms"
    " | E2E p50/p90/p99 ms | reserved - allocated MiB | offline tok/s | online / offline"
    " | decode step ms | ITL p50 / step |"
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every level in one Markdown table (the allocator column is empty on the CPU)."""
    lines = [TABLE_HEAD, "|---" * TABLE_HEAD.count(" | ") + "|---|"]
    for row in rows:
        s, off = row["online"], row.get("offline", {})
        gap = row["memory"].get("reserved_minus_allocated_bytes")
        cells = [
            row["level"], f"{s['num_ok']}/{s['num_requests']}", _num(s["output_tok_s"]),
            _num(s["total_tok_s"]), _num(s["requests_s"], ".2f"), _ms(s["ttft_ms"]),
            _ms(s["itl_ms"]), _ms(s["e2e_ms"]), _num(gap, ",.1f", 2**20),
            _num(off.get("output_tok_s")), _num(row.get("online_over_offline"), ".0%"),
            _num(off.get("decode_step_ms"), ".2f"),
            _num(row.get("itl_p50_over_decode_step"), ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_offline(row: dict[str, Any]) -> str:
    off, step_ms, step_ratio = row["offline"], row["offline"]["decode_step_ms"], None
    step = "no pure decode step at that batch"
    if step_ms is not None:
        step = f"decode step {step_ms:.2f} ms ({off['num_decode_steps_timed']} steps)"
        step_ratio = row["itl_p50_over_decode_step"]
    return (
        f"{row['level']:>6} offline: {off['output_tok_s']:,.0f} output tok/s in"
        f" {off['seconds']:.1f} s ({off['num_finished']} finished, {off['num_failed']} failed);"
        f" online / offline {row['online_over_offline']:.0%}; {step}"
        + ("" if step_ratio is None else f"; ITL p50 / decode step {step_ratio:.2f}x")
    )
