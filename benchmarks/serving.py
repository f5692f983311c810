"""W-chat online serving (BENCHMARKS.md): streaming completions over HTTP from client processes,
beside the same requests at the same concurrency through the offline engine in the same run.

The server (`pagekeeper_engine.cli serve`, random weights at the real shape) runs as a
subprocess, or `--url` names one already running. Each `--concurrency` level keeps C streams in
flight across `--client-processes` processes (closed loop); each `--request-rate` level sends on
seeded Poisson arrivals (open loop). /metrics is read after each level. Then the server is
stopped (its GPU memory freed) and each closed-loop level's requests run through the offline
engine (`offline_engine.build_engine`, with the server's engine settings), which also times the
decode step at that batch. torch is imported only by the offline part and by writing a shape's
checkpoint; the client processes never import it.

    PYTHONPATH=engine:. python benchmarks/serving.py --shape qwen3-0.6b --concurrency 32 128
    PYTHONPATH=engine:. python benchmarks/serving.py --device cpu --model-dir CKPT \\
        --concurrency 4 --num-requests 16 --prompt-max 64 --output-max 16 --no-offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_workload as wl
from benchmarks.shapes import SHAPES, prefill_flops

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


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


async def stream_completion(
    session: aiohttp.ClientSession, plan: wl.ClientPlan, index: int, prompt: list[int], n: int
) -> wl.RequestRecord:
    body = wl.completion_body(plan.model, prompt, n, stream=plan.stream, as_text=plan.as_text)
    record = wl.RequestRecord(index, n, send_s=time.monotonic())
    try:
        async with session.post(f"{plan.url}/v1/completions", json=body) as response:
            record.status = response.status
            if response.status != 200:
                record.error = await response.text()
            elif not plan.stream:
                text = await response.text()
                record.end_s = time.monotonic()
                record.on_body(text)
            else:
                async for line in response.content:
                    if line.startswith(b"data: "):
                        record.on_event(line[6:].decode().strip(), time.monotonic())
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_s = record.end_s or time.monotonic()
    return record


async def run_client(
    worker: int, plan: wl.ClientPlan, next_index: Any, go: Any, messages: Any
) -> list[wl.RequestRecord]:
    connector = aiohttp.TCPConnector(limit=0)  # the default limit (100) would cap concurrency
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=plan.timeout_s)
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else None
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        warm_ups = (stream_completion(session, plan, -1, p, n) for p, n in plan.warmup)
        warm = await asyncio.gather(*warm_ups)
        if failed := [r for r in warm if r.failure is not None]:
            raise RuntimeError(f"a warm-up request failed ({failed[0].failure}): {failed[0].error}")
        messages.put(("ready", worker, None))
        go.wait()  # blocks the loop, which has nothing else to do until the start

        async def closed_stream() -> list[wl.RequestRecord]:
            records: list[wl.RequestRecord] = []
            while True:
                with next_index.get_lock():  # one counter for all processes: C in flight in all
                    index = next_index.value
                    next_index.value += 1
                if index >= len(plan.prompts):
                    return records
                prompt, n = plan.prompts[index], plan.output_lens[index]
                records.append(await stream_completion(session, plan, index, prompt, n))

        async def at(index: int, offset_s: float) -> wl.RequestRecord:
            await asyncio.sleep(max(0.0, start + offset_s - time.monotonic()))
            prompt, n = plan.prompts[index], plan.output_lens[index]
            return await stream_completion(session, plan, index, prompt, n)

        start = time.monotonic()
        if plan.num_streams:
            streams = await asyncio.gather(*(closed_stream() for _ in range(plan.num_streams)))
            return [record for records in streams for record in records]
        return list(await asyncio.gather(*(at(i, t) for i, t in plan.arrivals)))


def client_process(
    worker: int, plan: wl.ClientPlan, next_index: Any, go: Any, messages: Any
) -> None:
    if plan.cpus:
        os.sched_setaffinity(0, plan.cpus)
    try:
        records = asyncio.run(run_client(worker, plan, next_index, go, messages))
    except Exception:  # handed to the parent, which fails the run with it
        messages.put(("failed", worker, traceback.format_exc()))
    else:
        messages.put(("done", worker, records))


def collect(procs: list[Any], messages: Any, kind: str) -> list[Any]:
    """One `kind` message from every client process, in process order; a failure raises."""
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            message, worker, payload = messages.get(timeout=1.0)
        except queue.Empty:
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process died (exit codes {dead})") from None
            continue
        if message == "failed":
            raise RuntimeError(f"client process {worker} failed:\n{payload}")
        assert message == kind, f"expected {kind!r} from client {worker}, got {message!r}"
        got[worker] = payload
    return [got[w] for w in sorted(got)]


def run_online(
    url: str, level: wl.Level, requests: wl.LevelRequests, args: argparse.Namespace
) -> list[wl.RequestRecord]:
    """One level through the server from `--client-processes` spawned processes."""
    plans = wl.client_plans(
        level, requests, args.seed, url=url, model=args.model_name,
        timeout_s=args.request_timeout, num_processes=args.client_processes,
        as_text=args.prompt_format == "text", cpus=parse_cpus(args.client_cpus),
        api_key=getattr(args, "api_key", None),
    )  # fmt: skip
    return run_plans(plans)


def run_plans(plans: list[wl.ClientPlan]) -> list[wl.RequestRecord]:
    """Each plan in its own spawned client process, all started together after their warm-ups;
    the plans index one shared request counter (closed loop) or their own arrivals."""
    ctx = mp.get_context("spawn")
    next_index, go, messages = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=client_process, args=(w, plan, next_index, go, messages))
        for w, plan in enumerate(plans)
    ]
    for proc in procs:
        proc.start()
    try:
        collect(procs, messages, "ready")
        go.set()
        records = [r for rs in collect(procs, messages, "done") for r in rs]
    finally:
        for proc in procs:
            if proc.is_alive():  # only after a failure: a done process exits by itself
                proc.terminate()
            proc.join()
    return sorted(records, key=lambda r: r.index)


def run_offline(
    model_dir: Path | None,
    settings: wl.EngineSettings,
    runs: list[tuple[wl.Level, wl.LevelRequests]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each level's requests through one in-process engine, after an untimed warm-up."""
    assert model_dir is not None, "the offline engine runs on a checkpoint prepared here"
    import torch  # noqa: PLC0415

    from benchmarks import offline_engine  # noqa: PLC0415

    fields = asdict(settings)
    # the server's settings, not W-nano's (max_model_len 2048, CUDA, no prefix caching)
    args = argparse.Namespace(**fields, async_scheduling=None, safety="on")
    engine, start = offline_engine.build_engine(model_dir, args, **fields)
    env = {"torch": torch.__version__, **start}
    if settings.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    print(f"# offline engine: torch {env['torch']}, {env.get('gpu', 'CPU')}")
    results = []
    for level, (work, warm) in runs:
        assert level.concurrency is not None, "offline runs are closed-loop"
        run_closed(engine, warm, level.concurrency, f"warm-{level.label}")
        results.append(run_closed(engine, work, level.concurrency, level.label))
    return env, results


def measure_matmul_rate() -> float:
    """The bf16 matmul rate (FLOP/s), measured with the GPU free (the server stopped)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kernels import measure_matmul_rate as measure  # noqa: PLC0415 (imports torch)

    return float(measure())


def first_wave_floor_ms(
    config: dict[str, Any], work: wl.ChatWorkload, c: int, rate: float, num_gpus: int = 1
) -> float:
    """The least TTFT the last of a closed loop's first C requests can see: all C prompts
    arrive at once, so the last first token waits for every one of their prefills, split
    evenly over the `num_gpus` GPUs of a tensor-parallel server, each at `rate` FLOP/s."""
    flops = prefill_flops(config, (len(p) for p in work.prompts[:c]))
    return flops / (rate * num_gpus) * 1e3


def server_num_gpus(engine_args: list[str]) -> int:
    """The GPUs the server's `--engine-arg`s split the model over, read by the engine's own
    parser."""
    from pagekeeper_engine.config import build_parser  # noqa: PLC0415 (no torch)

    namespace, _ = build_parser().parse_known_args(["model", *engine_args])
    return int(namespace.tensor_parallel_size)


def run_closed(engine: Any, work: wl.ChatWorkload, concurrency: int, tag: str) -> dict[str, Any]:
    """Keep `concurrency` requests in the engine, adding the next whenever one finishes."""
    from pagekeeper_engine.core.sampling import SamplingParams  # noqa: PLC0415

    pending = iter(range(len(work.prompts)))

    def admit() -> None:
        if (i := next(pending, None)) is not None:
            n = work.output_lens[i]
            params = SamplingParams(max_tokens=n, temperature=wl.TEMPERATURE, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", work.prompts[i], params)

    steps, num_output, num_finished, num_failed = [], 0, 0, 0
    start = time.perf_counter()
    for _ in range(concurrency):
        admit()
    while engine.has_work():
        tokens_before, step_start = engine.num_batched_tokens_total, time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_start
        scheduled = engine.num_batched_tokens_total - tokens_before
        steps.append(wl.StepSample(seconds, sum(bool(o.new_token_ids) for o in outputs), scheduled))
        for out in outputs:
            num_output += len(out.new_token_ids)
            num_failed += out.error is not None
            if out.finished:
                num_finished += 1
                admit()
    seconds = time.perf_counter() - start
    step_s, num_steps = wl.decode_step_time(steps, concurrency)
    return {
        "seconds": seconds,
        "num_output_tokens": num_output,
        "output_tok_s": num_output / seconds,
        "num_finished": num_finished,
        "num_failed": num_failed,
        "num_steps": len(steps),
        "decode_step_ms": None if step_s is None else step_s * 1e3,
        "num_decode_steps_timed": num_steps,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="W-chat: online serving beside the offline engine")
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    add("--model-dir", default=None, help="a checkpoint instead of --shape (gets a tokenizer.json)")
    add("--url", default=None, help="an engine server already running (not started here)")
    add("--model-name", default=MODEL_NAME, help="the served model name, with --url")
    add("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: float32, for smoke runs")
    add("--concurrency", type=int, nargs="*", default=[32, 128], help="closed-loop levels")
    add("--request-rate", type=float, nargs="*", default=[], help="Poisson levels, requests/s")
    add("--num-requests", type=int, default=None, help="per level; default 4 x C, or 512")
    for flag, default in [
        ("--prompt-min", None), ("--prompt-max", 2048), ("--output-min", None),
        ("--output-max", 512), ("--seed", 0), ("--client-processes", 4), ("--max-num-seqs", 256),
        ("--block-size", 16), ("--max-num-batched-tokens", None), ("--api-server-count", None),
    ]:  # fmt: skip
        add(flag, type=int, default=default)
    add("--prefix-sharing", action="store_true", help="groups of 16 share a 1,024-token prefix")
    add(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="text: prompts as words the server tokenizes (one token each), as most clients send",
    )
    add(
        "--modes",
        nargs="+",
        choices=["stream", "whole"],
        default=["stream"],
        help="each level streamed (SSE), and/or answered in one body (a '-whole' level)",
    )
    add("--max-model-len", type=int, default=None, help=f"default {MAX_MODEL_LEN} or the model's")
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--enforce-eager", action="store_true")
    add("--engine-arg", action="append", default=[], help="a server argument: --engine-arg=--x")
    add("--offline", action=argparse.BooleanOptionalAction, default=None, help="default: no --url")
    add("--start-timeout", type=float, default=1200.0)
    add("--request-timeout", type=float, default=600.0, help="seconds without a byte")
    add("--server-log", default=None)
    add("--server-cpus", default=None, help="CPUs the server may use (taskset's list: 0-9)")
    add("--client-cpus", default=None, help="CPUs the client processes may use (10-15)")
    add("--api-key", default=None, help="the server's --api-key: clients send it as a bearer")
    add("--json", default=None)
    args = parser.parse_args()
    for part, low in (("prompt", 64), ("output", 32)):  # an unset minimum follows a lower maximum
        given, high = getattr(args, f"{part}_min"), getattr(args, f"{part}_max")
        setattr(args, f"{part}_min", min(low, high) if given is None else given)
        if not 1 <= getattr(args, f"{part}_min") <= high:
            parser.error(f"--{part}-min must be in [1, --{part}-max]")
    args.offline = args.url is None if args.offline is None else args.offline
    return args


def main() -> None:
    args = parse_args()
    config = model_config(args)
    max_model_len = args.max_model_len or min(
        MAX_MODEL_LEN, config.get("max_position_embeddings", MAX_MODEL_LEN)
    )
    prefix = wl.PREFIX_LEN if args.prefix_sharing else 0
    if args.prompt_max + prefix + args.output_max > max_model_len:
        sys.exit(f"--prompt-max + --output-max (+ the shared prefix) exceed {max_model_len} tokens")
    settings = wl.EngineSettings(
        args.device, "bfloat16" if args.device == "cuda" else "float32", max_model_len,
        args.max_num_seqs, args.block_size, args.max_num_batched_tokens,
        args.gpu_memory_utilization, args.enable_prefix_caching, args.enforce_eager,
    )  # fmt: skip
    streams = [mode == "stream" for mode in args.modes]
    levels = [wl.Level(concurrency=c, stream=s) for c in args.concurrency for s in streams]
    levels += [wl.Level(rate=r, stream=s) for r in args.request_rate for s in streams]
    lengths = {
        "vocab_size": config["vocab_size"],
        "prompt_lens": (args.prompt_min, args.prompt_max),
        "output_lens": (args.output_min, args.output_max),
        "prefix_sharing": args.prefix_sharing,
    }
    runs = [(lv, wl.level_workloads(lv, args.seed, args.num_requests, **lengths)) for lv in levels]
    report: dict[str, Any] = {
        "model": args.model_dir or args.shape,
        "workload": {**lengths, "seed": args.seed, "client_processes": args.client_processes},
        "settings": asdict(settings),
        "engine_args": args.engine_arg,
        "levels": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = prepare_model_dir(args, Path(tmp)) if args.url is None or args.offline else None
        log = Path(args.server_log or Path(tmp) / "engine.log")
        server = None if args.url is not None else start_server(model_dir, settings, args, log)
        url = server.url if server is not None else args.url
        print(f"# W-chat {report['model']} on {args.device}, {json.dumps(report['workload'])}")
        print(f"# server {url}" + (f" ready in {server.start_s:.1f} s" if server else ""))
        try:
            for level, requests in runs:
                row: dict[str, Any] = {"level": level.label, "concurrency": level.concurrency}
                row["rate"] = level.rate
                records = run_online(url, level, requests, args)
                row["online"] = wl.summarize(records, first_wave=level.concurrency or 0)
                status, text = http_get(f"{url}/metrics")
                row["memory"] = wl.memory_metrics(text) if status == 200 else {"error": text}
                print(wl.format_online(row), flush=True)
                report["levels"].append(row)
        finally:
            if server is not None:
                report["server"] = {"start_s": server.start_s, "exit_code": server.stop()}
        if server is not None and server.proc.returncode != 0:
            print(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        if args.device == "cuda" and args.url is None:
            rate = report["matmul_flop_s"] = measure_matmul_rate()
            gpus = server_num_gpus(args.engine_arg)
            for row, (level, (work, _)) in zip(report["levels"], runs, strict=True):
                if level.concurrency is not None and level.stream:  # a TTFT needs a stream
                    floor = first_wave_floor_ms(config, work, level.concurrency, rate, gpus)
                    row["first_wave_floor_ms"] = floor
                    print(
                        f"{row['level']:>6} first wave: TTFT p99 "
                        f"{row['online']['ttft_first_wave_ms']['p99'] or 0:,.0f} ms; its prefill "
                        f"alone takes {floor:,.0f} ms at the measured {rate / 1e12:.0f} TFLOP/s "
                        f"on each of {gpus} GPU(s)"
                    )
        if args.offline:
            closed = [run for run in runs if run[0].concurrency is not None]
            report["offline_env"], results = run_offline(model_dir, settings, closed)
            rows = [row for row in report["levels"] if row["concurrency"] is not None]
            for row, result in zip(rows, results, strict=True):
                row["offline"] = result
                row.update(wl.compare(row["online"], result))
                print(wl.format_offline(row))
    print(wl.format_table(report["levels"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
