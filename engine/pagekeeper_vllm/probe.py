"""The launcher's probe of a running vLLM: `/health` and the progress counters of `/metrics`,
every `interval_s`, on a daemon thread, judged by `stall.StallTracker`.

It starts once vLLM said it is ready (the launcher's `OutputWatcher`) and reports a stuck child
once, to `on_stuck` on its own thread (the launcher ends the child). Where vLLM listens is read
off its command line (`--host`, `--port`, as `vllm serve` takes them); vLLM leaves `/health` and
`/metrics` open under `--api-key`.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekeeper_engine.stuck import StuckReport
from pagekeeper_vllm.stall import StallTracker, parse_progress

logger = logging.getLogger(__name__)

DEFAULT_VLLM_PORT = 8000  # `vllm serve`'s own default
ANY_ADDRESS = ("", "0.0.0.0", "::")


def _flag(argv: Sequence[str], name: str) -> str | None:
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def vllm_url(argv: Sequence[str]) -> str:
    """The base URL this pod's vLLM serves on, from its command line (loopback for any
    address)."""
    host = _flag(argv, "--host") or ""
    port = _flag(argv, "--port") or str(DEFAULT_VLLM_PORT)
    if host in ANY_ADDRESS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class ProbeSettings:
    """`stuck_timeout_s`: how long without progress or health is stuck; `interval_s`: between
    probes; `request_timeout_s`: how long one request may take (a /health slower than that
    counts as unanswered)."""

    stuck_timeout_s: float
    interval_s: float
    request_timeout_s: float


def _get(url: str, timeout_s: float) -> tuple[int, str] | None:
    """The status and body of a GET, or None where it did not answer in time or at all."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code, ""
    except (OSError, http.client.HTTPException):  # refused, reset, timed out
        return None


class ProgressProbe:
    """Probes `base_url` from `start()` until `stop()` or the first stuck verdict."""

    def __init__(
        self,
        base_url: str,
        settings: ProbeSettings,
        on_stuck: Callable[[StuckReport], None],
    ) -> None:
        self.base_url = base_url
        self.settings = settings
        self._on_stuck = on_stuck
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vllm-probe", daemon=True)

    def start(self) -> None:
        logger.info(
            "watching vLLM at %s for progress (stuck after %g s)",
            self.base_url,
            self.settings.stuck_timeout_s,
        )
        self.thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        settings = self.settings
        tracker = StallTracker(settings.stuck_timeout_s, time.monotonic())
        while not self._stopped.wait(settings.interval_s):
            health = _get(f"{self.base_url}/health", settings.request_timeout_s)
            tracker.saw_health(time.monotonic(), is_healthy=health is not None and health[0] == 200)
            metrics = _get(f"{self.base_url}/metrics", settings.request_timeout_s)
            if metrics is not None and metrics[0] == 200:
                tracker.saw_progress(time.monotonic(), parse_progress(metrics[1]))
            report = tracker.check(time.monotonic())
            if report is not None and not self._stopped.is_set():
                self._on_stuck(report)
                return
