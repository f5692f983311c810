"""What the HTTP server knows about itself: loading, serving or draining, and its load.

The server starts before the model is loaded (so probes answer during a slow load); the engine
and tokenizer are attached when ready. Admission is decided here: a request is refused with 503
while loading or draining and with 429 when the bounded queue is full, always with Retry-After.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.frontend.client import EngineClient
from pagekeeper_engine.frontend.errors import APIError
from pagekeeper_engine.frontend.metrics import ServerMetrics
from pagekeeper_engine.frontend.prompt_encoder import PromptEncoder
from pagekeeper_engine.frontend.tokenizer import Tokenizer
from pagekeeper_engine.messages import LoopStats

RETRY_AFTER_OVERLOADED_S = 1.0
RETRY_AFTER_LOADING_S = 10.0
RETRY_AFTER_DRAINING_S = 5.0  # time for the load balancer to drop this endpoint


class Phase(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"


@dataclass
class ServerState:
    """The server's phase and load; the engine and tokenizer once the model is loaded."""

    config: EngineConfig
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    engine: EngineClient | None = None
    tokenizer: Tokenizer | None = None
    encoder: PromptEncoder | None = None  # the tokenizer's prompt encoding, off the loop
    max_model_len: int = 0
    max_num_in_flight: int = 0  # sequences admitted at once (the core's limits)
    phase: Phase = Phase.LOADING
    num_in_flight: int = 0  # sequences handed to the engine and not yet answered
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (None while loading): token ids a request may name."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else None

    @property
    def is_draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def is_alive(self) -> bool:
        """The engine loop runs (not merely the web server)."""
        return self.engine is not None and self.engine.is_alive()

    def attach(self, engine: EngineClient, tokenizer: Tokenizer) -> None:
        """The core is loaded: start serving unless a drain began during the load."""
        limits = engine.ready.limits
        self.engine = engine
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self.max_model_len = limits.max_model_len
        self.max_num_in_flight = limits.max_num_in_flight
        if self.phase is Phase.LOADING:
            self.phase = Phase.SERVING

    def begin_drain(self) -> None:
        self.phase = Phase.DRAINING

    @property
    def is_serving(self) -> bool:
        return self.phase is Phase.SERVING and self.is_alive

    def read_stats(self) -> LoopStats | None:
        return self.engine.stats() if self.engine is not None else None

    def require_serving(self) -> tuple[EngineClient, Tokenizer, PromptEncoder]:
        """The engine, tokenizer and prompt encoder, or the 503 that says why requests are not
        taken now."""
        if self.phase is Phase.DRAINING:
            self.metrics.count_rejected("draining")
            raise APIError(
                503,
                "server is shutting down; retry on another replica",
                code="draining",
                retry_after_s=RETRY_AFTER_DRAINING_S,
            )
        if (
            self.phase is Phase.LOADING
            or self.engine is None
            or self.tokenizer is None
            or self.encoder is None
        ):
            self.metrics.count_rejected("loading")
            raise APIError(
                503, "model is still loading", code="loading", retry_after_s=RETRY_AFTER_LOADING_S
            )
        if not self.engine.is_alive():
            raise APIError(503, "engine loop is not running", code="engine_dead")
        return self.engine, self.tokenizer, self.encoder

    def reserve(self, num_seqs: int) -> None:
        """Count `num_seqs` sequences in flight, or raise 429 when the queue bound is reached."""
        if self.num_in_flight + num_seqs > self.max_num_in_flight:
            self.metrics.count_rejected("overloaded")
            raise APIError(
                429,
                f"server is at capacity ({self.num_in_flight} sequences in flight, at most "
                f"{self.max_num_in_flight}); retry later",
                code="overloaded",
                retry_after_s=RETRY_AFTER_OVERLOADED_S,
            )
        self.num_in_flight += num_seqs
        self._idle.clear()

    def release(self, num_seqs: int) -> None:
        assert num_seqs <= self.num_in_flight, "released more sequences than were admitted"
        self.num_in_flight -= num_seqs
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no sequence is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
