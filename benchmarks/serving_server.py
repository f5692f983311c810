"""W-chat's server side: a random-weight checkpoint at a shape (with a word tokenizer), the
engine server as a subprocess, started and stopped as a benchmark needs it."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_workload as wl
from benchmarks.shapes import SHAPES
from harness.processes import stop_process

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench"
MAX_MODEL_LEN = 4096


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """`vocab_size` tokens "t0".."t{n-1}" split on whitespace. Prompts go as token ids, so only
    decoding matters: one lookup per token, as cheap as a real tokenizer's, and one word per
    token, which lets a client count the tokens in each chunk."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))


def prepare_model_dir(args: argparse.Namespace, root: Path) -> Path:
    if args.model_dir is not None:
        model_dir = Path(args.model_dir)
    else:
        from benchmarks.offline_engine import write_checkpoint  # noqa: PLC0415 (imports torch)

        model_dir = write_checkpoint(args.shape, root)
    if not (model_dir / "tokenizer.json").exists():
        write_word_tokenizer(model_dir, model_config(args)["vocab_size"])
    return model_dir


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.model_dir is None:
        return SHAPES[args.shape]
    return dict(json.loads((Path(args.model_dir) / "config.json").read_text()))


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    start_s: float = 0.0  # from the spawn to /ready answering 200

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM (the server drains), then its exit code once it has gone."""
        return stop_process(self.proc, timeout=120)


def parse_cpus(text: str | None) -> set[int]:
    """A CPU list as taskset writes it ("0-7,12"); empty for None."""
    cpus: set[int] = set()
    for part in (text or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def start_server(
    model_dir: Path | None, settings: wl.EngineSettings, args: argparse.Namespace, log: Path
) -> Server:
    assert model_dir is not None, "a server is started only on a checkpoint prepared here"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(model_dir),
        "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL_NAME, *settings.server_flags(),
    ]  # fmt: skip
    if args.api_server_count is not None:
        argv += ["--api-server-count", str(args.api_server_count)]
    if getattr(args, "api_key", None):
        argv += ["--api-key", args.api_key]
    paths = [
        str(REPO / "engine"),
        str(REPO / "memplan"),
        str(REPO),
        os.environ.get("PYTHONPATH", ""),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if args.server_cpus:  # every process the server starts inherits the CPU set
        argv = ["taskset", "-c", args.server_cpus, *argv]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv + args.engine_arg, stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    started = time.monotonic()
    while time.monotonic() < started + args.start_timeout:  # a benchmark may poll (no test)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if http_get(f"{server.url}/ready")[0] == 200:
                server.start_s = time.monotonic() - started
                return server
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the server was not ready in {args.start_timeout} s:\n{server.log_tail()}")
