"""W-chat (docs/benchmarks.md), its pure parts: each level's seeded requests, the engine settings
the server and the offline engine share, each client process's share of a level, and what a client
records of one stream. The summary, the /metrics figures, the offline decode-step selection and the
printed lines and table are `serving_report.py`. No I/O, no torch: `benchmarks/serving.py` does the
rest.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

PREFIX_GROUP_SIZE = 16  # requests that share one system prefix in the prefix-sharing variant
PREFIX_LEN = 1024
OPEN_LOOP_REQUESTS = 512  # per --request-rate level unless --num-requests says otherwise
TEMPERATURE = 0.6
WARMUP_TOKENS = 16  # at most, per warm-up request (drawn apart from the level's requests)


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
    gpu_memory_utilization: float | None  # None: the KV cache's size is given another way
    enable_prefix_caching: bool
    enforce_eager: bool
    swap_space: float = 0.0  # as build_engine: a preempted request is recomputed

    def server_flags(self) -> list[str]:
        flags = [
            "--device", self.device, "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--block-size", str(self.block_size),
            "--swap-space", str(self.swap_space),
            f"--{'' if self.enable_prefix_caching else 'no-'}enable-prefix-caching",
        ]  # fmt: skip
        if self.gpu_memory_utilization is not None:
            flags += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
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
        return [gap for _, gap in self.timed_inter_token_gaps()]

    def timed_inter_token_gaps(self) -> list[tuple[float, float]]:
        """(arrival of the chunk, gap) for each of `inter_token_gaps`."""
        exact = self.has_token_counts
        gaps: list[tuple[float, float]] = []
        for i in range(1, len(self.chunk_s)):
            num_tokens = self.chunk_words[i] if exact else 1
            gap = (self.chunk_s[i] - self.chunk_s[i - 1]) / num_tokens
            gaps += [(self.chunk_s[i], gap)] * num_tokens
        return gaps
