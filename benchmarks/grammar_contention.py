"""How long one step's grammar work takes on the grammar thread (`runner.structured_output`)
while the step loop's thread runs Python, on the CPU: the schema of `structured.py` against the
character tokenizer padded to the shape's vocabulary, one matcher a row, each step every row
taking a token its mask allows, picked uniformly among them from a seeded generator (as a
temperature-1 sample of random weights' logits nearly is: inside a string that is mostly the
tokenizer's filler words), as the engine's `GrammarMasks.start` hands the work over.

Each case times `--steps` steps, one job at a time (the next handed over once the last is
filled), with the main thread idle ("alone") or busy in a pure-Python loop that holds the GIL
between its bytecodes, as the loop that settles, schedules and packs steps does, at the
interpreter's default switch interval (5 ms), at `GRAMMAR_SWITCH_INTERVAL_S` and at each of
`--switch-ms`. The busy loop runs while a job is in flight only: the rows' token picks between
jobs run alone (beside the loop each of their torch calls would wait for the lock, and a case
of 200 steps would take minutes). It measures the host alone: the device's step and the
copies are not in it. The case alone also counts the distinct rows among each step's masks:
rows at one grammar state get one mask, so a step filling each state once would need at least
that many fills (two states may share a mask), and gives the engine's estimate of one row's
fill on one thread, which sizes its fills' threads (`fill_row_us`). Each of those cases also
reports its parts' means (`mean_parts_ms`: the hand-over to the grammar thread, then the job's
parts as the engine's histograms split it, `grammar_timing.FillParts`); beside the busy loop a
part that lets the GIL go waits up to the switch interval to get it back. `--fill-threads N ...`
instead times the main thread idle with xgrammar's batch fill on each of those thread counts (the
engine sizes each fill by its rows' work: `runner/fill_threads.py`; the other cases do too),
reporting the whole job and the batch fill in it;
`--torch-threads N ...` times the same with torch's intra-op pool at each size (torch sizes it
to every core by default; its threads spin a while after each host op large enough to wake
them), the engine's fill threads otherwise.

    PYTHONPATH=engine:memplan:. python3 benchmarks/grammar_contention.py --rows 64 --steps 200
    PYTHONPATH=engine:memplan:. python3 benchmarks/grammar_contention.py --switch-ms 0.2 0.1
    PYTHONPATH=engine:memplan:. python3 benchmarks/grammar_contention.py --fill-threads 1 2 8
    PYTHONPATH=engine:memplan:. python3 benchmarks/grammar_contention.py --torch-threads 16 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.shapes import SHAPES
from benchmarks.structured import SCHEMA, write_json_tokenizer
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.runner import structured_output as so
from pagekeeper_engine.runner.grammar_timing import FillParts

DEFAULT_SWITCH_S = 0.005


@dataclass
class Row:
    """A row's sequence as the grammars read it (`structured_output.SeqTokens`)."""

    all_token_ids: list[int]
    num_prompt_tokens: int


class Rows:
    """A step's rows (`structured_output.StepRows`): the newest token is already on the host."""

    def __init__(self, seqs: list[Row]) -> None:
        self.seqs = seqs

    def newest_token_list(self) -> list[int]:
        return [s.all_token_ids[-1] for s in self.seqs]


def next_token(mask_row: torch.Tensor, vocab_size: int, pick: random.Random) -> int:
    allowed = torch.nonzero(so.unpack_bitmask(mask_row, vocab_size)).flatten()
    return int(allowed[pick.randrange(allowed.numel())])


def busy_python(stop: threading.Event, go: threading.Event) -> None:
    """Pure Python while `go` is set (a job is in flight), until `stop`."""
    while not stop.is_set():
        go.wait()
        total = 0
        for i in range(10_000):
            total += i


def run_case(
    grammar: so.GrammarMasks,
    rows: int,
    steps: int,
    eos: int,
    busy: bool,
    fills: list[float] | None = None,  # each step's batch fill, appended here
    distinct: list[int] | None = None,  # each step's count of distinct mask rows, appended here
    parts: list[FillParts] | None = None,  # each step's job in its parts, appended here
) -> list[float]:
    """Seconds per step's grammar work, from the hand-over to the filled mask."""
    vocab = grammar.vocab_size
    stop, go = threading.Event(), threading.Event()
    loop = threading.Thread(target=busy_python, args=(stop, go), daemon=True)
    if busy:
        loop.start()
    times: list[float] = []
    pick = random.Random(0)
    try:
        params = [SamplingParams(json_schema=json.dumps(SCHEMA)) for _ in range(rows)]
        seqs = [Row([1, 2, 3], 3) for _ in range(rows)]
        for _ in range(steps):
            go.set()
            start = time.perf_counter()
            pending = grammar.start(params, Rows(seqs))
            pending.filled.result()
            times.append(time.perf_counter() - start)
            go.clear()  # the token picks below run alone
            if fills is not None:
                fills.append(pending.times.bitmask_seconds)
            if parts is not None:
                parts.append(pending.times.parts())
            if distinct is not None:
                distinct.append(len({row.numpy().tobytes() for row in pending.host}))
            for row, seq in enumerate(seqs):
                token = next_token(pending.host[row], vocab, pick)
                if token == eos:  # a match ended: the row starts a new request
                    params[row] = SamplingParams(json_schema=json.dumps(SCHEMA))
                    seqs[row] = Row([1, 2, 3], 3)
                else:
                    seq.all_token_ids.append(token)
    finally:
        stop.set()
        go.set()
        if busy:
            loop.join()
    return times


def mean_parts_ms(parts: list[FillParts]) -> dict[str, float]:
    """Each part's mean over the steps, in ms (`FillParts`: queue, then the job's four)."""
    names = ("queue", "device_wait", "accept", "bitmask", "host_ops")
    return {n: round(statistics.fmean(getattr(p, n) for p in parts) * 1e3, 3) for n in names}


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3),
    }


def idle_case(
    model_dir: Path, config: dict[str, Any], args: argparse.Namespace, fill_threads: int | None
) -> dict[str, Any]:
    """The main thread idle: the job and its batch fill, on a new grammar thread."""
    eos = config["eos_token_id"]
    grammar = so.GrammarMasks(
        model_dir, config["vocab_size"], frozenset({eos}), args.rows, torch.device("cpu"),
        fill_threads=fill_threads,
    )  # fmt: skip
    run_case(grammar, args.rows, 5, eos, busy=False)  # compiles
    fills: list[float] = []
    job = summary(run_case(grammar, args.rows, args.steps, eos, False, fills))
    return {"job": job, "batch_fill": summary(fills)}


def by_fill_threads(
    model_dir: Path, config: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The main thread idle, the batch fill on each of `args.fill_threads` thread counts."""
    report: dict[str, Any] = {}
    for threads in args.fill_threads:
        report[f"alone, fill on {threads} threads"] = case = idle_case(
            model_dir, config, args, threads
        )
        print(f"fill on {threads} threads: job {case['job']}, batch fill {case['batch_fill']}")
    return report


def by_torch_threads(
    model_dir: Path, config: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The main thread idle, torch's intra-op pool at each of `args.torch_threads` sizes (a new
    thread takes the size set when it first runs a parallel op: each case's grammar thread is
    new). The caller's size is restored after."""
    report: dict[str, Any] = {}
    before = torch.get_num_threads()
    try:
        for threads in args.torch_threads:
            torch.set_num_threads(threads)
            report[f"alone, torch on {threads} threads"] = case = idle_case(
                model_dir, config, args, None
            )
            print(f"torch on {threads} threads: job {case['job']}, batch fill {case['batch_fill']}")
    finally:
        torch.set_num_threads(before)
    return report


def by_switch_interval(
    model_dir: Path, config: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The main thread idle, then busy at the default switch interval, at the engine's and at
    each of `args.switch_ms`."""
    eos = config["eos_token_id"]
    grammar = so.GrammarMasks(
        model_dir, config["vocab_size"], frozenset({eos}), args.rows, torch.device("cpu")
    )
    intervals = [DEFAULT_SWITCH_S, so.GRAMMAR_SWITCH_INTERVAL_S]
    intervals += [ms / 1e3 for ms in args.switch_ms if ms / 1e3 not in intervals]
    cases = [("alone", False, so.GRAMMAR_SWITCH_INTERVAL_S)]
    cases += [
        (f"busy loop, {switch_s * 1e3:g} ms switch", True, switch_s) for switch_s in intervals
    ]
    report: dict[str, Any] = {}
    run_case(grammar, args.rows, 5, eos, busy=False)  # compiles, sets the interval up
    for name, busy, switch_s in cases:
        sys.setswitchinterval(switch_s)
        counts: list[int] | None = None if busy else []
        parts: list[FillParts] = []
        times = run_case(grammar, args.rows, args.steps, eos, busy, None, counts, parts)
        report[name] = summary(times)
        report[name]["mean_parts_ms"] = mean_parts_ms(parts)
        if counts:  # how many of a step's rows a fill per grammar state would have to fill
            report[name]["distinct_masks"] = {
                "median": statistics.median(counts), "max": max(counts)
            }  # fmt: skip
            # a row's fill on one thread as the engine estimates it to size its fills' threads
            row_s = grammar.fill_row_seconds
            report[name]["fill_row_us"] = None if row_s is None else round(row_s * 1e6, 2)
        print(f"{name}: {report[name]}")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--switch-ms", type=float, nargs="*", default=[],
        help="more switch intervals (ms) for the busy loop's cases",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--fill-threads", type=int, nargs="+", default=None)
    kinds.add_argument("--torch-threads", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    config = SHAPES[args.shape]
    report: dict[str, Any] = {"shape": args.shape, "rows": args.rows, "steps": args.steps}
    interval = sys.getswitchinterval()  # the grammar's set-up lowers it: the caller's again after
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_json_tokenizer(Path(tmp), config)
            cases = by_switch_interval
            if args.fill_threads is not None:
                cases = by_fill_threads
            elif args.torch_threads is not None:
                cases = by_torch_threads
            report.update(cases(Path(tmp), config, args))
    finally:
        sys.setswitchinterval(interval)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
