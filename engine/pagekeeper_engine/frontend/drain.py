"""Graceful shutdown: stop taking work, let running requests finish, then stop.

On SIGTERM Kubernetes removes the pod from its Service while the grace period runs; until then
the server keeps answering: /ready fails at once, new requests get 503 with Retry-After, and
requests already running finish (or are aborted at `--shutdown-timeout`).
"""

from __future__ import annotations

import logging
import time

from pagekeeper_engine.frontend.state import ServerState

logger = logging.getLogger(__name__)

# After the engine has finished (or aborted) every request, handlers still write their last
# events; this bounds that, so a stuck client cannot hold the shutdown.
FLUSH_TIMEOUT_S = 5.0


async def drain(state: ServerState, timeout_s: float) -> bool:
    """Drain the server; True when every request finished on its own within `timeout_s`."""
    started_s = time.monotonic()
    state.begin_drain()
    logger.info(
        "draining: %d sequences in flight, up to %.1f s to finish", state.num_in_flight, timeout_s
    )
    is_clean = True
    if state.engine is not None:
        is_clean = await state.engine.drain(timeout_s)
    is_flushed = await state.wait_idle(FLUSH_TIMEOUT_S)
    if not is_flushed:
        logger.warning("%d sequences were still being answered at shutdown", state.num_in_flight)
    logger.info(
        "drained in %.1f s (%s)",
        time.monotonic() - started_s,
        "all requests finished" if is_clean and is_flushed else "some requests were aborted",
    )
    return is_clean and is_flushed
