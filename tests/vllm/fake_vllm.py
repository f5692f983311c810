"""Stands in for `vllm serve` in the launcher tests: prints what vLLM prints, then ends as told.

As in vLLM, uvicorn's readiness goes to stderr and vLLM's own log lines (an engine core's
traceback among them) to stdout.

Usage: fake_vllm.py SCENARIO [vLLM flags, ignored but --port]. Lines are vLLM's own (its child
processes' lines carry their prefix), and the OOM text is torch's; `main` says what each scenario
does. The stuck scenarios serve vLLM's /health and /metrics on --port, as a zombie vLLM would;
`serve` (`fake_vllm.py serve MODEL [vLLM flags]`) serves the OpenAI endpoints behind vLLM's
`--api-key` (`openai_server`).
"""

import argparse
import hashlib
import http.server
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from pagekeeper_engine.memory.allocator import AllocatorStats
from pagekeeper_vllm.reports import METRICS_DIR_ENV, ProcessReport, write_report

PREFIX = "(EngineCore_DP0 pid=4242) "
READY = "INFO:     Application startup complete."
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a "
    "total capacity of 19.53 GiB of which 329.87 MiB is free. Including non-PyTorch memory, "
    "this process has 19.19 GiB memory in use. Of the allocated memory 18.40 GiB is allocated "
    "by PyTorch, and 402.27 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
NO_CACHE = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)


# What a vLLM with two engines (data parallel) shows while it holds 1 running and 2 waiting
# requests and generates nothing.
STUCK_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_running{engine="1",model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 7.0
vllm:generation_tokens_total{engine="1",model_name="tiny"} 5.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 30.0
"""
IDLE_METRICS = STUCK_METRICS.replace("} 1.0", "} 0.0")


def serve_http(metrics: str, *, health_hangs: bool) -> None:
    """vLLM's probes on --port: /metrics answers `metrics`; /health 200, or never."""
    port = int(sys.argv[sys.argv.index("--port") + 1])
    never = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health" and health_hangs:
                never.wait()
            body = metrics.encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()


def serve_args(argv: list[str]) -> argparse.Namespace:
    """The flags of `vllm serve MODEL ...` the OpenAI server reads, parsed as vLLM parses them
    (`--api-key` and `--served-model-name` take one or more values); the others are ignored."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--api-key", nargs="+", default=None)
    args, _ = parser.parse_known_args(argv)
    return args


def is_authorized(header: str | None, tokens: list[str]) -> bool:
    """vLLM's `AuthenticationMiddleware.verify_token`: the scheme `Bearer` in any case, one space,
    then a token equal to one of `tokens` (compared as SHA-256 digests in constant time)."""
    if not header:
        return False
    scheme, _, param = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode()).digest()
    is_match = False
    for token in tokens:
        is_match |= secrets.compare_digest(digest, hashlib.sha256(token.encode()).digest())
    return is_match


def openai_server(args: argparse.Namespace) -> None:
    """vLLM's OpenAI server as far as `--api-key` goes, on --host/--port, as vLLM's source has it
    (`build_app` in `entrypoints/openai/api_server.py` and its `AuthenticationMiddleware`): the
    keys are `--api-key`'s values, else `VLLM_API_KEY`'s; with any, a request whose path starts
    with `/v1` and fails `is_authorized` gets 401 with the JSON body `{"error": "Unauthorized"}`
    (no WWW-Authenticate), while `/health` and `/metrics` stay open. (Newer vLLM guards every
    route outside its public list, `/v1` at least; `/health` and `/metrics` are on that list.)
    Behind it, `/v1/models` lists the served names and `/v1/completions` answers `max_tokens`
    tokens of "a"."""
    tokens = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
    names = args.served_model_name or [args.model]

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: object, content_type: str) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, request: dict | None) -> None:
            path = self.path.split("?")[0]
            is_locked = bool(tokens) and path.startswith("/v1")
            if is_locked and not is_authorized(self.headers.get("Authorization"), tokens):
                self._answer(401, {"error": "Unauthorized"}, "application/json")
            elif path == "/health":
                self._answer(200, "", "application/json")
            elif path == "/metrics":
                self._answer(200, IDLE_METRICS, "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/v1/models" and request is None:
                models = [{"id": n, "object": "model", "owned_by": "vllm"} for n in names]
                self._answer(200, {"object": "list", "data": models}, "application/json")
            elif path == "/v1/completions" and request is not None:
                self._complete(request)
            else:
                self._answer(404, {"detail": "Not Found"}, "application/json")

        def _complete(self, request: dict) -> None:
            if request.get("model") not in names:
                error = {"message": f"The model `{request.get('model')}` does not exist.",
                         "type": "NotFoundError", "param": None, "code": 404}  # fmt: skip
                self._answer(404, {"error": error}, "application/json")
                return
            num_tokens = int(request.get("max_tokens") or 16)
            choice = {"index": 0, "text": "a" * num_tokens, "logprobs": None,
                      "finish_reason": "length", "stop_reason": None}  # fmt: skip
            num_prompt = len(str(request.get("prompt", "")))
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                     "total_tokens": num_prompt + num_tokens}  # fmt: skip
            self._answer(
                200,
                {"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                 "model": request["model"], "choices": [choice], "usage": usage},
                "application/json",
            )  # fmt: skip

        def do_GET(self) -> None:
            self._route(None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self._route(json.loads(self.rfile.read(length) or b"{}"))

        def log_message(self, *_) -> None:
            return

    host = "127.0.0.1" if args.host in ("", "0.0.0.0") else args.host
    server = http.server.ThreadingHTTPServer((host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()


def say(text: str, stream=sys.stdout) -> None:
    stream.write(text + "\n")
    stream.flush()


def wait_for_term(on_term) -> None:
    signal.signal(signal.SIGTERM, lambda *_: on_term())
    marker = os.environ.get("FAKE_VLLM_WAITING")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def drain(code: int = 0, then: str | None = None) -> None:
    say("INFO:     Shutting down")
    if then:
        say(PREFIX + then)
    sys.exit(code)


def main(scenario: str) -> None:
    say("INFO 11-24 19:00:00 [api_server.py:1] vLLM API server version 0.11.0")
    say("Loading safetensors checkpoint shards:  50% Completed | 1/2\r", sys.stderr)
    if scenario == "runtime-oom":  # the engine core dies of an OOM; vLLM exits 0
        say(READY, sys.stderr)
        say(PREFIX + "ERROR 11-24 19:00:05 [core.py:710] EngineCore encountered a fatal error.")
        say(PREFIX + "Traceback (most recent call last):")
        say(PREFIX + OOM)
        say("INFO:     Shutting down")
        sys.exit(0)
    elif scenario == "startup-no-cache":
        say(PREFIX + NO_CACHE, sys.stderr)
        sys.exit(1)
    elif scenario == "clean":
        say(READY, sys.stderr)
        sys.exit(0)
    elif scenario == "killed":
        say(READY, sys.stderr)
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "drain":
        say(READY, sys.stderr)
        wait_for_term(drain)
    elif scenario == "oom-while-draining":
        say(READY, sys.stderr)
        wait_for_term(lambda: drain(0, then=OOM))
    elif scenario == "report":  # a GPU process's report, as the plugin writes it
        stats = AllocatorStats(8 << 30, 1 << 30, 6 << 30, 3, 0)
        write_report(Path(os.environ[METRICS_DIR_ENV]), ProcessReport(os.getpid(), 0, "0", stats))
        say(READY, sys.stderr)
        wait_for_term(drain)
    elif scenario == "stuck":  # a zombie: healthy, holding requests, no token; deaf to SIGTERM
        serve_http(STUCK_METRICS, health_hangs=False)
        say(READY, sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        marker = os.environ.get("FAKE_VLLM_WAITING")
        if marker:
            Path(marker).write_text(str(os.getpid()))
        threading.Event().wait()
    elif scenario == "health-hangs":  # idle, but /health never answers; drains on SIGTERM
        serve_http(IDLE_METRICS, health_hangs=True)
        say(READY, sys.stderr)
        wait_for_term(drain)
    elif scenario == "serve":  # `vllm serve MODEL ...`: the OpenAI endpoints, drains on SIGTERM
        openai_server(serve_args(sys.argv[2:]))
        say(READY, sys.stderr)
        wait_for_term(drain)
    elif scenario == "survived-oom-then-drain":
        say(READY, sys.stderr)
        say(PREFIX + OOM)
        wait_for_term(drain)
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main(sys.argv[1])
