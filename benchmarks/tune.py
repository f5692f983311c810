"""W-tune (docs/benchmarks.md): does the memory policy tune itself? For each workload class, from a
deliberately poor policy, serve a round over HTTP, read the engine's /metrics into a metric
window, run the operator's recommender on it and try its top recommendation as Apply mode does
(`tune_trial`): the next round serves the candidate, the operator's rule judges it against the
policy in force, a win is kept and a loss or a tie rolled back, and the field is held; repeat
(up to `--rounds`). Beside it, in the same run, a coarse grid over the same knobs.

Reports per round the policy tried, output tok/s, TTFT and ITL p99, preemptions, OOMs, reserved -
allocated and the verdict; the policy in force after each round and its score under the class's
objective; the grid's best under the same objective, and the round whose policy in force first
reached 90% of it. With `--fixtures DIR` each round's window is saved as a JSON fixture for the
rule tests (tests/operator/tuning/fixtures/). The server, the clients and /metrics are W-chat's
(`serving.py`); the window, the rules and the trial's rule are the operator's own
(`pagekeeper_operator.tuning`).

    PYTHONPATH=operator:engine:memplan:. python benchmarks/tune.py --quick --rounds 5 \\
        --json tune.json --fixtures tests/operator/tuning/fixtures/gpu
    PYTHONPATH=operator:engine:memplan:. python benchmarks/tune.py --device cpu --model-dir CKPT \\
        --classes chat --rounds 2 --scale 0.05 --num-requests 16 --no-grid
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import serving_server
from benchmarks import serving_workload as wl
from benchmarks import tune_trial as tt
from benchmarks import tune_workload as tw
from benchmarks.shapes import SHAPES
from benchmarks.tune_serve import Serve, serving
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import MAX_LOOKS, TuningSpec
from pagekeeper_operator.policy.fields import with_change
from pagekeeper_operator.tuning.proposal import Proposal
from pagekeeper_operator.tuning.rules import recommend
from pagekeeper_operator.tuning.window import MetricWindow

TARGET_SHARE = 0.9  # of the grid's best


def score(result: dict[str, Any], spec: TuningSpec) -> float:
    """Throughput under the objective: 0 for a round that failed to start, lost requests, had an
    OOM or broke its latency bound."""
    if "error" in result or result["failures"] or result["ooms"]:
        return 0.0
    bound = tt.bound_of(spec)
    p99_ms = result["ttft_p99_ms"] if spec.objective == "ThroughputUnderTTFT" else None
    if spec.objective == "ThroughputUnderITL":
        p99_ms = result["itl_p99_ms"]
    if bound is not None and (p99_ms or 0) > bound * 1e3:
        return 0.0
    return float(result["output_tok_s"])


def verdict_of(
    trials: list[dict[str, Any]], bases: list[dict[str, Any]], spec: TuningSpec
) -> dict[str, Any]:
    """The trial rule's verdict on the candidate's looks (`trials`) against those of the policy
    in force (`bases`), each side's looks pooled (`tune_trial.pooled`)."""
    if any("error" in t for t in trials):
        return {"is_win": False, "verdict": "Loss", "reason": "the candidate did not start"}
    if any(t["ooms"] or t["failures"] for t in trials):
        return {"is_win": False, "verdict": "Loss",
                "reason": "the candidate ran out of memory or lost requests"}  # fmt: skip
    trial_figures = tt.pooled([tt.RoundFigures(**t["figures"]) for t in trials], max)
    base_figures = tt.pooled([tt.RoundFigures(**b["figures"]) for b in bases], min)
    comparison = tt.judge(trial_figures, base_figures, spec)
    looks = {"looks": len(trials)}
    if comparison is None:
        return {"is_win": False, "verdict": "Inconclusive",
                "reason": "too few throughput samples to tell", **looks}  # fmt: skip
    return {"is_win": comparison.is_win, "verdict": comparison.verdict,
            "reason": comparison.reason, **looks, **comparison.evidence()}  # fmt: skip


def trial_looks(
    serve: Serve,
    candidate: MemoryPolicy,
    policy: MemoryPolicy,
    base: dict[str, Any],
    tag: str,
    spec: TuningSpec,
) -> tuple[dict[str, Any], MetricWindow | None]:
    """A trial as Apply mode runs it (`tuning.decide`): a window that cannot decide is extended,
    up to MAX_LOOKS windows, the candidate and the policy in force each serving the same
    requests once more a look, and judged over all of them; the last look that cannot decide
    ends it Inconclusive. The first look's result carries the verdict and the later looks'."""
    trial, window = serve(candidate, tag)
    trials, bases = [trial], [base]
    verdict = verdict_of(trials, bases, spec)
    while verdict["verdict"] == "Inconclusive" and len(trials) < MAX_LOOKS:
        print(f"  look {len(trials)}: {verdict['reason']}; the trial is extended")
        trials.append(serve(candidate, f"{tag}_look{len(trials) + 1}")[0])
        bases.append(serve(policy, f"{tag}_baseline_look{len(bases) + 1}")[0])
        verdict = verdict_of(trials, bases, spec)
    trial["verdict"] = verdict
    trial["later_looks"] = {"candidate": trials[1:], "baseline": bases[1:]}
    return trial, window


def change_of(proposal: Proposal) -> dict[str, str]:
    return {k: getattr(proposal, k) for k in ("field", "current", "proposed", "rule")}


def format_change(change: dict[str, str] | None) -> str:
    if change is None:
        return "none (the window supports no change, or every field was tried)"
    return f"{change['field']} {change['current']} -> {change['proposed']} ({change['rule']})"


def objective_spec(args: argparse.Namespace) -> TuningSpec:
    """`--objective` for every class, in place of each class's own."""
    return TuningSpec.model_validate({
        "objective": args.objective, "ttftP99Seconds": args.ttft_p99_seconds,
        "itlP99Seconds": args.itl_p99_seconds,
    })  # fmt: skip


def run_class(cls: tw.WorkloadClass, args: argparse.Namespace, serve: Serve) -> dict[str, Any]:
    """Round 0 serves the starting policy; each later round tries the top recommendation for the
    policy in force (held fields excluded) and keeps it only on a win. `serve(policy, tag)`
    serves one round (`serving`: an engine over HTTP) and returns its result and window."""
    spec = cls.tuning if args.objective is None else objective_spec(args)
    grid = serve_grid(cls, args, serve, spec) if args.grid_first else None
    policy, held = cls.start, set[str]()
    base, base_window = serve(policy, f"{cls.name}_round0")
    base["verdict"] = None  # round 0 measures the starting policy
    rounds: list[dict[str, Any]] = [{"round": 0, "trial": base, "in_force": policy.to_api(),
                                     "in_force_score": score(base, spec)}]  # fmt: skip
    print(format_row(f"{cls.name} round 0", rounds[0], spec))
    for index in range(1, args.rounds + 1):
        proposals = (
            [] if base_window is None
            else recommend(base_window, policy, spec, "pagekeeper", held)
        )  # fmt: skip
        rounds[-1]["next"] = change_of(proposals[0]) if proposals else None
        print(f"  next: {format_change(rounds[-1]['next'])}")
        if not proposals or index == args.rounds:
            break
        top = proposals[0]
        candidate = with_change(policy, top.field, top.proposed)
        trial, window = trial_looks(
            serve, candidate, policy, base, f"{cls.name}_round{index}", spec
        )
        held.add(top.field)  # the hold-off: whatever the verdict, not tried again in this run
        if trial["verdict"]["is_win"]:
            policy, base, base_window = candidate, trial, window
        rounds.append({"round": index, "trial": trial, "in_force": policy.to_api(),
                       "in_force_score": score(base, spec)})  # fmt: skip
        print(format_row(f"{cls.name} round {index}", rounds[-1], spec))
    if grid is None:
        grid = serve_grid(cls, args, serve, spec)
    return summarize_class(cls, spec, rounds, grid)


def serve_grid(
    cls: tw.WorkloadClass, args: argparse.Namespace, serve: Serve, spec: TuningSpec
) -> list[Any]:
    """Each grid point served anew, in the class's order or reversed (`--reverse-grid`); the
    results keep the class's order, tagged by each point's index in it."""
    points = [] if args.no_grid else list(enumerate(cls.grid))
    results: dict[int, Any] = {}
    for k, point in reversed(points) if args.reverse_grid else points:
        results[k], _ = serve(point, f"{cls.name}_grid{k}")
        print(format_row(f"{cls.name} grid", {"trial": results[k]}, spec))
    return [results[k] for k in sorted(results)]


def summarize_class(
    cls: tw.WorkloadClass, spec: TuningSpec, rounds: list[dict[str, Any]], grid: list[Any]
) -> dict[str, Any]:
    """The score: the round whose policy in force first reached 90% of the grid's best (each
    grid point served anew, never the start), and every round or trial more than 5% worse."""
    best = max((score(r, spec) for r in grid), default=0.0)
    in_force = [r["in_force_score"] for r in rounds]
    reached = next((i for i, s in enumerate(in_force) if best and s >= TARGET_SHARE * best), None)
    drops = [i for i in range(1, len(in_force)) if in_force[i] < 0.95 * in_force[i - 1]]
    worse_trials = [
        r["round"] for prev, r in pairwise(rounds)
        if score(r["trial"], spec) < 0.95 * prev["in_force_score"]
    ]  # fmt: skip
    return {
        "class": cls.name, "start_policy_why": cls.why, "objective": spec.to_api(),
        "rounds": rounds, "grid": grid, "grid_best_tok_s": best,
        "round_reaching_90pct": reached, "rounds_more_than_5pct_worse": drops,
        "trials_more_than_5pct_worse": worse_trials,
        "ooms": sum(r.get("ooms") or 0 for r in served(rounds, grid)),
    }  # fmt: skip


def served(rounds: list[dict[str, Any]], grid: list[Any]) -> list[dict[str, Any]]:
    """Every engine round's result: each round's trial and its later looks, then the grid."""
    out = []
    for r in rounds:
        later = r["trial"].get("later_looks", {})
        out += [r["trial"], *later.get("candidate", []), *later.get("baseline", [])]
    return out + list(grid)


def format_row(tag: str, entry: dict[str, Any], spec: TuningSpec) -> str:
    r = entry["trial"]
    if "error" in r:
        return f"{tag}: {json.dumps(r['policy'])} did not start: {r['error'][-200:]}"
    verdict = r.get("verdict")
    kept = (
        ""
        if not verdict
        else (
            f"; {'kept' if verdict['is_win'] else 'rolled back'} ({verdict['verdict']}): "
            f"{verdict['reason']}"
        )
    )
    return (
        f"{tag}: {r['output_tok_s']:,.0f} tok/s (score {score(r, spec):,.0f}), TTFT p99 "
        f"{r['ttft_p99_ms'] or 0:.0f} ms, ITL p99 {r['itl_p99_ms'] or 0:.1f} ms, preemptions "
        f"{r['preemptions']:.0f}, OOMs {r['ooms']:.0f}, reserved-allocated "
        f"{r['reserved_minus_allocated_peak_mib'] or 0:.0f} MiB{kept}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="W-tune: recommender rounds beside a grid")
    add = parser.add_argument
    add("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    add("--model-dir", default=None)
    add("--device", choices=["cuda", "cpu"], default="cuda")
    names = ["chat", "rag", "burst", "longout"]
    add("--classes", nargs="+", choices=names, default=names)
    add("--rounds", type=int, default=5)
    add(
        "--quick",
        action="store_true",
        help="512 chat, 384 rag and 384 long-output requests, 30 s of bursts, eager engines",
    )
    add("--scale", type=float, default=1.0, help="shrink prompt and output lengths (smoke runs)")
    add("--num-requests", type=int, default=None, help="cap each closed-loop class's requests")
    add("--objective", choices=["Throughput", "ThroughputUnderTTFT", "ThroughputUnderITL"],
        default=None, help="for every class (default: each class's own)")  # fmt: skip
    add("--ttft-p99-seconds", type=float, default=None)
    add("--itl-p99-seconds", type=float, default=None)
    add("--max-model-len", type=int, default=8192)
    add("--seed", type=int, default=0)
    add("--client-processes", type=int, default=4)
    add("--sample-interval", type=float, default=0.5)
    add("--enforce-eager", action="store_true")
    add("--no-grid", action="store_true")
    add(
        "--grid-first",
        action="store_true",
        help="serve the grid before the rounds (an order effect between engine starts shows)",
    )
    add("--reverse-grid", action="store_true", help="serve the grid's points last to first")
    add("--engine-arg", action="append", default=[])
    add("--start-timeout", type=float, default=600.0)
    add("--request-timeout", type=float, default=600.0)
    add("--fixtures", default=None, help="save each round's window here as a JSON fixture")
    add("--metrics-dir", default=None, help="save each round's /metrics before and after here")
    add("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:  # eager engines start fastest
        args.enforce_eager = True
    # what serving_server.start_server and run_online read
    args.api_server_count, args.server_cpus, args.client_cpus = None, None, None
    args.model_name, args.prompt_format = serving_server.MODEL_NAME, "ids"
    return args


def chosen_classes(args: argparse.Namespace, vocab_size: int) -> list[tw.WorkloadClass]:
    """The classes `--classes` names, in their own order, each closed-loop class's requests cut
    to `--num-requests`."""
    chosen = []
    for cls in tw.classes(
        args.seed, vocab_size, args.max_model_len, quick=args.quick, scale=args.scale
    ):
        if cls.name not in args.classes:
            continue
        if args.num_requests is not None and cls.concurrency is not None:
            n = args.num_requests
            work = wl.ChatWorkload(cls.work.prompts[:n], cls.work.output_lens[:n])
            chosen.append(dataclasses.replace(cls, work=work))
        else:
            chosen.append(cls)
    return chosen


def serve_classes(
    args: argparse.Namespace, run: Callable[[tw.WorkloadClass, Serve], dict[str, Any]]
) -> dict[str, Any]:
    """The report: `run(cls, serve)` for each class `--classes` names, served over real engines
    from one model directory, written to `--json` when given."""
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "engine_arg"}}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model_dir = serving_server.prepare_model_dir(args, tmp)
        vocab_size = serving_server.model_config(args)["vocab_size"]
        report["classes"] = [
            run(cls, serving(model_dir, cls, args, tmp)) for cls in chosen_classes(args, vocab_size)
        ]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    def run(cls: tw.WorkloadClass, serve: Serve) -> dict[str, Any]:
        print(f"# {cls.name}: from {json.dumps(cls.start.to_api())} ({cls.why})")
        return run_class(cls, args, serve)

    report = serve_classes(args, run)
    for r in report["classes"]:
        print(
            f"# {r['class']}: grid best {r['grid_best_tok_s']:,.0f} tok/s; 90% reached in round "
            f"{r['round_reaching_90pct']}; rounds >5% worse than the one before: "
            f"{r['rounds_more_than_5pct_worse']}"
        )
    return report


if __name__ == "__main__":
    main()
