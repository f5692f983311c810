"""The engine on the CPU for the alert -> roll loop (the e2e test and `make demo`).

A tiny Llama checkpoint (config and a character-level tokenizer; `--load-format dummy` builds
the weights), the server as a real subprocess with a small KV pool, and concurrent streaming
requests that keep that pool nearly full.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import string
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from openai import APIError, AsyncOpenAI
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from harness.processes import Service, free_port, stop_process, wait_http_ok
from harness.tools import REPO

logger = logging.getLogger(__name__)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
BOS_ID, EOS_ID = 1, 2
CHARACTERS = string.ascii_lowercase + string.digits + " .,!?'\n"
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
# Imports, a dummy load and the first step on a busy 2-core machine.
START_TIMEOUT_S = 180.0


def write_tiny_checkpoint(path: Path, max_positions: int = 1024) -> Path:
    """A 2-layer Llama with GQA: config.json and tokenizer files, no weights (dummy load)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_char_tokenizer(path)
    return path


def write_char_tokenizer(
    path: Path, vocab: Mapping[str, int] = VOCAB, chat_template: str | None = None
) -> None:
    """A tokenizer of one token per character of `vocab` (ids 0-2 `<unk>`, `<s>`, `</s>`; `<s>`
    begins every encoding), with its tokenizer and generation configs, in `path`."""
    tokenizer = HFTokenizer(models.WordLevel(dict(vocab), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))


@dataclass(frozen=True)
class EngineShape:
    """The engine's flags that size its KV pool: few blocks, so a handful of long requests
    fill it (num_blocks x block_size tokens in all)."""

    model_name: str = "tiny-llama"
    num_blocks: int = 32
    block_size: int = 8
    max_num_seqs: int = 4
    max_model_len: int = 240


def engine_argv(checkpoint: Path, port: int, shape: EngineShape) -> list[str]:
    return [
        sys.executable, "-m", "pagekeeper_engine.cli", "serve", str(checkpoint),
        "--served-model-name", shape.model_name,
        "--device", "cpu", "--dtype", "float32", "--load-format", "dummy",
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(shape.block_size),
        "--max-model-len", str(shape.max_model_len),
        "--max-num-seqs", str(shape.max_num_seqs),
        "--num-gpu-blocks-override", str(shape.num_blocks),
        "--num-cpu-blocks-override", "0", "--swap-space", "0",
        "--shutdown-timeout", "15",
    ]  # fmt: skip


def spawn_engine(
    checkpoint: Path,
    workdir: Path,
    shape: EngineShape,
    extra_flags: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Service:
    """Start the engine without waiting for it (`wait_engine_ready` waits)."""
    port = free_port()
    argv = [*engine_argv(checkpoint, port, shape), *extra_flags]
    return spawn_argv(argv, port, workdir, extra_env)


def spawn_argv(
    argv: Sequence[str], port: int, workdir: Path, extra_env: Mapping[str, str] | None = None
) -> Service:
    """Start the engine from its whole command line, serving on `port`."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "engine"), str(REPO / "memplan"), str(REPO)]),
        # One core for the engine leaves the other to the control plane and Prometheus.
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    log = workdir / "engine.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            list(argv), stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=workdir
        )
    return Service(name="engine", proc=proc, port=port, log=log)


def wait_engine_ready(engine: Service, timeout: float = START_TIMEOUT_S) -> None:
    try:
        wait_http_ok(f"{engine.url}/ready", timeout=timeout, proc=engine.proc)
    except (RuntimeError, TimeoutError) as exc:
        engine.stop()
        tail = engine.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"engine did not become ready: {exc}\n{tail}") from exc


def stop_engine(engine: Service) -> int:
    """SIGTERM (the engine drains), then its exit code."""
    return stop_process(engine.proc, timeout=30)


class StreamingLoad:
    """Concurrent long streaming completions against the engine, from a background thread.

    More workers than `--max-num-seqs`, each asking for many tokens with `ignore_eos`, keep the
    KV pool nearly full: running sequences grow until they preempt each other, and a finished
    request is replaced at once by a waiting one.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        num_workers: int = 8,
        max_tokens: int = 160,
        api_key: str = "unused",
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key  # an engine without --api-key takes any
        self.num_workers = num_workers
        self.max_tokens = max_tokens
        self.num_completed = 0
        self.num_failed = 0
        self.num_in_flight = 0
        self.last_error = ""
        self._no_new = threading.Event()
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streaming-load", daemon=True)

    def start(self) -> StreamingLoad:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30) -> None:
        """Abandon the requests in flight (the engine sees the clients disconnect)."""
        self._no_new.set()
        self._abort.set()
        self._thread.join(timeout)

    def stop_new(self) -> None:
        """Send no new requests; those in flight run to their end."""
        self._no_new.set()

    def join(self, timeout: float = 60) -> bool:
        """Wait for the workers to end (after `stop_new`); whether they did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0)
        try:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.num_workers)))
        finally:
            await client.close()

    async def _worker(self, client: AsyncOpenAI, index: int) -> None:
        prompt = f"request {index}: tell me a long story about paged memory. "
        while not self._no_new.is_set():
            self.num_in_flight += 1
            try:
                stream = await client.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for _ in stream:
                    if self._abort.is_set():
                        break
                await stream.close()
                if not self._abort.is_set():
                    self.num_completed += 1
            except APIError as error:
                # Counted and kept: the caller checks that load got through.
                self.num_failed += 1
                self.last_error = str(error)
                logger.warning("load request failed: %s", error)
                await asyncio.sleep(0.5)
            finally:
                self.num_in_flight -= 1
