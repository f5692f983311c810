"""`pagekeeper-vllm-launch -- vllm serve ...`: runs vLLM as a child and speaks for it.

- Output: the child's stdout and stderr pass through byte for byte, as they come (`pipes`); each
  line is also read (`output.OutputWatcher`) for readiness and memory errors.
- Signals: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are forwarded to the child, which
  runs in its own process group (so a terminal's Ctrl-C reaches it once); as PID 1 the launcher
  also reaps orphans.
- Exit: the child's code (128 + N when signal N killed it), except that a memory error ends it
  non-zero: vLLM exits 0 after its engine core died of a CUDA OOM. A memory error counts when the
  child ended on its own, or when it was printed after a forwarded stop signal (a drain that ran
  out of memory); one printed before a stop that vLLM survived is no cause of the exit.
- Termination message: for such an exit, the paged engine's line (`pagekeeper-oom kind=gpu
  phase=<startup|runtime> detail=...`, `memory.oom`), which the operator reads from the pod.
- Metrics: `--metrics-port` serves `/metrics` with the allocator series the plugin reports from
  each GPU process (`series`); the child gets `PAGEKEEPER_VLLM_METRICS_DIR` for them.
- Stuck: from vLLM's readiness to the first forwarded stop signal (a drain closes vLLM's
  port), `probe` watches its `/health` and progress counters. With requests
  running or waiting and no new token for `--stuck-timeout` seconds, or no 200 from `/health`
  for as long, the child's process group gets SIGTERM, then SIGKILL after `--stuck-kill-grace`;
  the launcher exits non-zero with the `pagekeeper-stuck ...` termination message (`stuck`),
  unless vLLM printed a memory error, whose OOM message is the more telling cause.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pagekeeper_engine.memory.oom import TERMINATION_LOG, write_termination_log
from pagekeeper_engine.stuck import StuckReport, write_stuck_message
from pagekeeper_vllm.metrics_http import serve_metrics
from pagekeeper_vllm.output import OOMEvent, OOMPhase, OutputWatcher
from pagekeeper_vllm.pipes import ChildPipe
from pagekeeper_vllm.probe import ProbeSettings, ProgressProbe, vllm_url
from pagekeeper_vllm.reports import METRICS_DIR_ENV, ProcessReport, read_reports
from pagekeeper_vllm.series import OOMTally, render_metrics

logger = logging.getLogger("pagekeeper_vllm.launch")

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
DEFAULT_METRICS_PORT = 8001
# How long the output pumps may run on after the child exited (an orphan can hold the pipes).
PUMP_JOIN_S = 5.0
EXEC_FAILED = 127
# --stuck-timeout's default, also read from this variable: as the paged engine's (see its
# `flags.DEFAULT_STUCK_TIMEOUT_S` for the longest legitimate step it allows for).
STUCK_TIMEOUT_ENV = "PAGEKEEPER_VLLM_STUCK_TIMEOUT"
DEFAULT_STUCK_TIMEOUT_S = 60.0
DEFAULT_PROBE_INTERVAL_S = 5.0
PROBE_REQUEST_TIMEOUT_S = 5.0  # at most; never longer than the stuck timeout itself
DEFAULT_STUCK_KILL_GRACE_S = 10.0


def served_model_name(argv: Sequence[str]) -> str:
    """The `model_name` label vLLM gives its own series: the first --served-model-name, else the
    model (`vllm serve MODEL` or --model)."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--served-model-name" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1].split()[0]
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    if "serve" in args:
        rest = args[args.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return ""


def exit_code(returncode: int, oom: OOMEvent | None, *, is_stuck: bool = False) -> int:
    """The launcher's exit code for the child's `returncode` (negative: killed by a signal);
    never 0 for a child that ran out of memory or that the launcher ended as stuck."""
    if returncode < 0:
        return 128 - returncode
    if (oom is not None or is_stuck) and returncode == 0:
        return 1
    return returncode


class Launcher:
    """One run of the child: output pumps, signal forwarding, the metrics endpoint, the probe
    that ends a stuck child (`probe`: None for none; `kill_grace_s` between SIGTERM and
    SIGKILL)."""

    def __init__(
        self,
        argv: Sequence[str],
        metrics_dir: Path | None,
        model_name: str,
        *,
        probe: ProbeSettings | None = None,
        kill_grace_s: float = DEFAULT_STUCK_KILL_GRACE_S,
    ) -> None:
        self.argv = list(argv)
        self.metrics_dir = metrics_dir
        self.model_name = model_name
        self.probe = (
            None if probe is None else ProgressProbe(vllm_url(argv), probe, self._end_stuck)
        )
        self.kill_grace_s = kill_grace_s
        self.stuck: StuckReport | None = None  # why the launcher ended the child, if it did
        self.exited = threading.Event()  # the child has been reaped
        self.watcher = OutputWatcher()
        self.tally = OOMTally()
        self.lock = threading.RLock()  # the signal handler takes it on the main thread
        self.stop_line: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.pipes: list[ChildPipe] = []

    def _read_reports(self) -> list[ProcessReport]:
        """The live processes' reports, counted into the OOM tally (which keeps the dead's)."""
        assert self.metrics_dir is not None
        reports = read_reports(self.metrics_dir)
        with self.lock:
            self.tally.update(reports)
        return reports

    def scrape(self) -> str:
        if self.metrics_dir is None:
            return ""
        reports = self._read_reports()
        with self.lock:
            return render_metrics(reports, self.tally, self.model_name)

    def _on_line(self, line: str) -> None:
        with self.lock:
            was_ready = self.watcher.is_ready
            self.watcher.feed_line(line)
            became_ready = self.watcher.is_ready and not was_ready
        if became_ready and self.probe is not None:
            self.probe.start()
        if became_ready and self.metrics_dir is not None:
            self._read_reports()
            with self.lock:
                self.tally.mark_ready()

    def _end_stuck(self, report: StuckReport) -> None:
        """End the stuck child's process group: SIGTERM, then SIGKILL after the grace."""
        assert self.child is not None
        self.stuck = report
        logger.error("vLLM is stuck, ending it: %s", report.detail)
        for signum in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signum)
            if self.exited.wait(self.kill_grace_s):
                return
            if signum == signal.SIGTERM:
                logger.error("vLLM still runs %g s after SIGTERM; killing it", self.kill_grace_s)

    def _pump(self, pipe: ChildPipe) -> None:
        """Pass one pipe on as it fills, taking under the lock (see `pipes`)."""
        while True:
            pipe.wait_readable()
            with self.lock:
                if not pipe.take(self._on_line):
                    return

    def _forward(self, signum: int, _frame: object) -> None:
        if self.child is None:
            return
        with self.lock:
            if signum in STOP_SIGNALS and self.stop_line is None:
                # what the child printed before the stop may still be in its pipes
                for pipe in self.pipes:
                    pipe.take(self._on_line)
                self.stop_line = self.watcher.num_lines
        if signum in STOP_SIGNALS and self.probe is not None:
            # a draining vLLM closes its port: no longer a sign of a hang (the kubelet's grace
            # period bounds the drain)
            self.probe.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signum)

    def cause(self) -> tuple[OOMEvent, OOMPhase] | None:
        """The memory error that ended the child, if one did (see the module docstring), and
        its phase."""
        with self.lock:
            event = self.watcher.first_after(self.stop_line or 0)
            return None if event is None else (event, self.watcher.phase_of(event))

    def run(self) -> int:
        env = dict(os.environ)
        if self.metrics_dir is not None:
            env[METRICS_DIR_ENV] = str(self.metrics_dir)
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self._forward)
        try:
            child = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                process_group=0,
            )
        except OSError as exc:
            print(f"pagekeeper-vllm-launch: cannot run {self.argv[0]}: {exc}", file=sys.stderr)
            return EXEC_FAILED
        assert child.stdout is not None and child.stderr is not None
        # the pipes before the child: a stop signal forwarded to it finds them
        self.pipes = [
            ChildPipe(child.stdout, sys.stdout.buffer),
            ChildPipe(child.stderr, sys.stderr.buffer),
        ]
        self.child = child
        pumps = [
            threading.Thread(target=self._pump, args=(pipe,), daemon=True) for pipe in self.pipes
        ]
        for pump in pumps:
            pump.start()
        returncode = self._wait_child(self.child.pid)
        self.child.returncode = returncode
        self.exited.set()
        if self.probe is not None:
            self.probe.stop()
        for pump in pumps:
            pump.join(PUMP_JOIN_S)
        return returncode

    @staticmethod
    def _wait_child(pid: int) -> int:
        """Wait for `pid`, reaping any orphan handed to this process meanwhile."""
        while True:
            try:
                reaped, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return 0
            if reaped == pid:
                return os.waitstatus_to_exitcode(status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagekeeper-vllm-launch",
        description="Run vLLM as a child: pass its output through, forward signals, export its "
        "GPU allocators, and report an out-of-memory death as one.",
        usage="%(prog)s [options] -- vllm serve MODEL [vLLM options]",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="port of the /metrics endpoint with the allocator series (0: none)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address it listens on")
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=TERMINATION_LOG,
        help="where an out-of-memory exit is reported (the kubelet's terminationMessagePath)",
    )
    parser.add_argument(
        "--stuck-timeout",
        type=float,
        default=float(os.environ.get(STUCK_TIMEOUT_ENV, DEFAULT_STUCK_TIMEOUT_S)),
        help="seconds vLLM may hold running or waiting requests without a new token, or leave "
        "/health unanswered, before it is ended as stuck; 0: never (default "
        f"${STUCK_TIMEOUT_ENV}, else {DEFAULT_STUCK_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=DEFAULT_PROBE_INTERVAL_S,
        help="seconds between probes of vLLM's /health and /metrics",
    )
    parser.add_argument(
        "--stuck-kill-grace",
        type=float,
        default=DEFAULT_STUCK_KILL_GRACE_S,
        help="seconds a stuck vLLM gets between SIGTERM and SIGKILL",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then vLLM's command line")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        build_parser().error("give vLLM's command after --, e.g. -- vllm serve MODEL")
    if args.stuck_timeout < 0 or args.probe_interval <= 0 or args.stuck_kill_grace < 0:
        build_parser().error(
            "--stuck-timeout and --stuck-kill-grace must be >= 0, --probe-interval > 0"
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s pagekeeper: %(message)s")
    metrics_dir = None
    server = None
    if args.metrics_port:
        metrics_dir = Path(tempfile.mkdtemp(prefix="pagekeeper-vllm-"))
    probe = None
    if args.stuck_timeout > 0:
        probe = ProbeSettings(
            args.stuck_timeout,
            args.probe_interval,
            min(PROBE_REQUEST_TIMEOUT_S, args.stuck_timeout),
        )
    launcher = Launcher(
        command,
        metrics_dir,
        served_model_name(command),
        probe=probe,
        kill_grace_s=args.stuck_kill_grace,
    )
    if metrics_dir is not None:
        server = serve_metrics(launcher.scrape, args.metrics_host, args.metrics_port)
    returncode = launcher.run()
    cause = launcher.cause()
    if launcher.stuck is not None and cause is None:
        write_stuck_message(launcher.stuck, args.termination_log)
        logger.error("vLLM ended as stuck (exit %d): %s", returncode, launcher.stuck.detail)
    if cause is not None:
        oom, phase = cause
        write_termination_log("gpu", phase, oom.detail, args.termination_log)
        logger.error(
            "vLLM ended by running out of GPU memory (%s, exit %d): %s",
            phase,
            returncode,
            oom.detail,
        )
    if server is not None:
        server.shutdown()
    return exit_code(
        returncode, None if cause is None else cause[0], is_stuck=launcher.stuck is not None
    )


if __name__ == "__main__":
    sys.exit(main())
