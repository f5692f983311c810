"""The server with `--tensor-parallel-size 2` on the CPU: the same greedy text as one process,
through the openai client; a rank's death or a step failing on either rank ends it with exit 1,
the failed rank's reason told to the front end (`Fatal`, 503 to the client) and written as the
termination message; a clean stop logs no error."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest
import requests
from openai import APIError, APIStatusError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from pagekeeper_engine.faults import INJECT_STEP_FAULT_ENV
from tests.engine.server.conftest import MODEL_NAME, Checkpoint, Server, start_server
from tests.engine.server.test_processes import core_pid, is_running, wait_gone
from tests.support import step_gate
from tests.support.step_gate import StepGate

PROMPTS = ["hello there", "the quick brown fox", "a, b, c", "1 2 3 4"]
EXIT_TIMEOUT_S = 10.0  # the bound for a dead rank to end the engine


def greedy(server: Server, prompt: str, max_tokens: int = 12) -> tuple[str, list[float]]:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return choice.text, [float(lp) for lp in choice.logprobs.token_logprobs if lp is not None]


@pytest.fixture(scope="module")
def tp_server(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Server:
    server = start_server(
        checkpoint.path, tmp_path_factory.mktemp("tp2"), "--tensor-parallel-size", "2"
    )
    yield server  # type: ignore[misc]
    assert server.stop() == 0, server.log_tail()


def test_greedy_text_equals_one_process(server: Server, tp_server: Server) -> None:
    assert set(tp_server.worker_pids(2)) == {1}
    for prompt in PROMPTS:
        single_text, single_lp = greedy(server, prompt)
        tp_text, tp_lp = greedy(tp_server, prompt)
        assert tp_text == single_text, prompt
        assert tp_lp == pytest.approx(single_lp, abs=1e-4), prompt


def test_processed_sampling_equals_one_process(server: Server, tp_server: Server) -> None:
    """A batch with penalties, a bias and top alternatives is sampled whole on rank 0."""

    def reply(target: Server) -> tuple[str | None, list[list[str]]]:
        client = OpenAI(base_url=f"{target.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "say it twice"}],
            max_completion_tokens=10,
            temperature=0,
            frequency_penalty=0.8,
            logit_bias={"7": 2},
            logprobs=True,
            top_logprobs=3,
            extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
        )
        content = out.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None
        return out.choices[0].message.content, [[t.token for t in c.top_logprobs] for c in content]

    text, tops = reply(tp_server)
    assert (text, tops) == reply(server)
    assert all(len(top) == 3 for top in tops)


def test_metrics_carry_each_ranks_blocks(tp_server: Server) -> None:
    text = requests.get(f"{tp_server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["num_gpu_blocks"] == "64"


def test_a_rank_killed_mid_stream_ends_the_engine(
    checkpoint: Checkpoint, tmp_path: Path, gate: StepGate
) -> None:
    termination = tmp_path / "termination-log"
    server = start_server(
        checkpoint.path, tmp_path, "--tensor-parallel-size", "2",
        "--termination-log-path", str(termination), module=step_gate.MODULE,
    )  # fmt: skip
    try:
        (pid,) = server.worker_pids(2).values()
        gate.allow(1)  # the stream's first token; then the gate holds it in flight
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        streaming = threading.Event()
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                for _ in client.completions.create(
                    model=MODEL_NAME,
                    prompt="tell me",
                    max_tokens=32,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    streaming.set()
            except (APIError, requests.RequestException, OSError) as exc:
                failure.append(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(60), (failure, server.log_tail())
        os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
        reader.join(30)
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    killed = f"tensor-parallel rank 1 (pid {pid}) was killed by signal 9"
    assert f"{killed}; the engine cannot run without it" in log, log[-3000:]
    assert f"the engine core gave up: {killed}\n" in log  # Fatal reached the front end
    assert termination.read_text() == f"engine core failed: {killed}\n"


def test_the_core_killed_takes_its_ranks_with_it(checkpoint: Checkpoint, tmp_path: Path) -> None:
    server = start_server(checkpoint.path, tmp_path, "--tensor-parallel-size", "2")
    (worker,) = server.worker_pids(2).values()
    try:
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
        wait_gone(worker)  # it waits on its parent's sentinel, even inside a collective
    finally:
        if is_running(worker):
            os.kill(worker, signal.SIGKILL)
        server.stop()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fatal_step_error_on_either_rank_ends_the_server(
    checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """A step failure on one rank is fatal under tensor parallelism: the request fails at once,
    the front end is told, and the server exits 1 naming the rank, rather than stepping on
    while the other rank waits inside that step's collectives."""
    monkeypatch.setenv(INJECT_STEP_FAULT_ENV, f"{rank}:3")
    termination = tmp_path / "termination-log"
    server = start_server(
        checkpoint.path, tmp_path, "--tensor-parallel-size", "2",
        "--termination-log-path", str(termination),
    )  # fmt: skip
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(APIStatusError) as failed:
            client.completions.create(
                model=MODEL_NAME,
                prompt="tell me",
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=60,
            )
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 1
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    reason = (
        f"tensor-parallel rank {rank}: a step failed (InjectedStepFaultError: rank {rank}: "
        f"fault injected in step 3 ({INJECT_STEP_FAULT_ENV})); the other ranks cannot go on "
        "without it"
    )
    # rank 0 names the rank that failed, never its own echo of a peer's dropped connection
    exited = "" if rank == 0 else r"tensor-parallel rank 1 \(pid \d+\) exited \(1\): "
    assert re.search(rf"the engine core gave up: {exited}{re.escape(reason)}\n", log), log[-3000:]
    assert failed.value.status_code == 503 and reason in failed.value.message, failed.value
    assert "step failed; failing requests" not in log, log[-3000:]  # never one failed step
    assert termination.read_text() == f"engine core failed: {reason}\n"


@pytest.mark.parametrize("size", [1, 2])
def test_a_clean_drain_logs_no_error(checkpoint: Checkpoint, tmp_path: Path, size: int) -> None:
    server = start_server(checkpoint.path, tmp_path, "--tensor-parallel-size", str(size))
    assert greedy(server, "hello there")[0]
    assert server.stop() == 0
    log = server.log.read_text(errors="replace")
    # The core's exit is logged by a daemon thread that the process's own exit may overtake, so
    # the line may be missing; where it is there, it is no error.
    exits = [line for line in log.splitlines() if "the engine core exited" in line]
    assert all(" INFO pagekeeper_engine: " in line for line in exits), exits
    assert not [line for line in log.splitlines() if " ERROR " in line], log[-3000:]
