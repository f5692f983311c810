"""Apply mode with real engines: a recommendation runs on a canary, is kept when it wins, and is
rolled back and held off when it loses.

The local control plane (KWOK GPU nodes), the operator as a subprocess with
PAGEKEEPER_PROMETHEUS_URL set, and a real Prometheus scraping CPU engines that stand in for the
servers' pods (`standin`), each started with the flags the operator rendered for its pod, so the
canary's engine runs the canary's policy. Every engine of a server gets the same closed-loop load
(a fixed number of requests in flight), so canary and baseline are compared under the same load
and each outcome rests on the work a step does, not on the machine's speed:

- `seqs`: maxNumSeqs 2 under 8 requests in flight, short prompts and 32 tokens each, the KV pool
  nearly empty, the cap bounded at 8. The cap binds, so the tuner proposes about the demand
  (7 or 8); the canary's engine decodes that many sequences a step where the baseline's
  decodes 2 (about 1.8x the tokens/s on 2 busy cores) -> promoted.
- `prefix`: each prompt one of four shared 255-token prefixes and a fresh 700-token suffix, so a
  quarter of the looked-up tokens hit (a fact of the token layout), under the rule's 0.3: the
  tuner proposes caching off. The canary's engine then prefills every prompt token where the
  baseline's skips a quarter (about 0.8x the tokens/s) -> rolled back, held off, not tried again.

Two more servers judge a change on latency at equal throughput, a figure a CPU engine cannot be
made to show on demand: their pods' series are synthetic (`synthetic_pod`), each pod's figures
following from the maxNumSeqs the operator rendered for it, under an open-loop load (a pod serves
its share of the arrivals whatever its cap, so tokens/s stay equal). Both show maxNumSeqs 2 held
at its cap with requests waiting, so the tuner proposes 5 (the demand):

- `ttftwin`: the queued requests wait for a slot, TTFT p99 about 10 s; at 5 none wait, about 1 s
  -> promoted on TTFT p99 with tokens/s within 5% (the throughput objective's secondary figures).
- `ttftloss`: more sequences a step hold each prompt's first token back, TTFT p99 about 1 s at 2
  and 10 s at 5 -> rolled back as a loss (its spec names TTFTP99 alone: `secondaryFigures`).

Before a trial one engine stands in for both pods of a server; once the canary runs, one stands
in for the pod the stable Deployment kept and another for the canary pod.
"""

from __future__ import annotations

import contextlib
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import stop_engine, write_tiny_checkpoint
from harness.loop import (
    OperatorProcess,
    get_server,
    install_crd,
    is_pod_ready,
    llmserver,
    restrict_namespace,
    server_events,
    server_pods,
    wait_ready_pods,
)
from harness.processes import Service
from harness.prometheus import Prometheus, pod_scrape
from pagekeeper_operator.adapters.prometheus import query_by
from pagekeeper_operator.controllers.resync import RESYNC_DONE
from tests.support.standin import ClosedLoop, flag_value, rendered_command, start_standin
from tests.support.synthetic_pod import FigureModel, Figures, start_synthetic_pod

MODEL = "tiny-llama"
NUM_BLOCKS = 512  # of 16 tokens: far more than either load holds at once
WINDOW_S = 90
# The first window, the canary's stand-in started, its window covered (at most twice WINDOW_S).
TRIAL_TIMEOUT_S = 420
LETTERS = string.ascii_lowercase + " "
PREFIXES = ["".join(random.Random(i).choice(LETTERS) for _ in range(255)) for i in range(4)]


def short_prompt(_: random.Random) -> str:
    return "tell me a long story about paged memory. "


def shared_prefix_prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + "".join(rng.choice(LETTERS) for _ in range(700))


# name -> (memoryPolicy, prompt, max_tokens, requests in flight): CPU engines, closed loop
ENGINES = {
    "seqs": ({"maxNumSeqs": 2}, short_prompt, 32, 8),
    "prefix": ({}, shared_prefix_prompt, 1, 4),
}
DEMAND = 5  # requests a synthetic pod holds at once, running or waiting
QUICK_S, SLOW_S = 0.7, 6.0  # TTFT, inside the engine's (0.5, 1] and (5, 10] buckets


def pod_figures(argv: Sequence[str], ttft_seconds: float) -> Figures:
    running = min(int(flag_value(argv, "--max-num-seqs") or 0), DEMAND)
    return Figures(200.0, 4.0, ttft_seconds, running, DEMAND - running, 0.3)


def queued(argv: Sequence[str]) -> Figures:
    """Requests the cap holds back wait for a slot: TTFT is the queue's."""
    figures = pod_figures(argv, QUICK_S)
    return pod_figures(argv, SLOW_S) if figures.num_waiting else figures


def stalled(argv: Sequence[str]) -> Figures:
    """More sequences a step hold each prompt's first token back."""
    return pod_figures(
        argv, QUICK_S if int(flag_value(argv, "--max-num-seqs") or 0) <= 2 else SLOW_S
    )


# name -> its pods' figures: synthetic pods, open loop
SYNTHETIC: dict[str, FigureModel] = {"ttftwin": queued, "ttftloss": stalled}
SERVERS = [*ENGINES, *SYNTHETIC]


def spec(name: str) -> dict[str, Any]:
    policy: dict[str, Any] = ENGINES[name][0] if name in ENGINES else {"maxNumSeqs": 2}
    # one candidate field per workload; seqs' cap may reach the 8 in flight and no further, so
    # once the trial's value runs, the headroom rule has nothing left to add
    bounds: dict[str, Any] = {"blockSizes": [16]}
    if "maxNumSeqs" in policy:
        bounds["maxNumSeqs"] = {"min": 1, "max": 8}
    named = {"secondaryFigures": ["TTFTP99"]} if name == "ttftloss" else {}
    return {
        "model": {"source": "/models/tiny-llama", "servedModelName": MODEL, "loadFormat": "dummy"},
        "replicas": 2,
        "resources": {"gpus": 1},
        "memoryPolicy": {"maxModelLen": 1024, **policy},
        "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
        "tuning": {
            "mode": "Apply", "windowSeconds": WINDOW_S, "holdOffSeconds": 3600,
            "bounds": bounds, **named,
        },
    }  # fmt: skip


def canary_pod(cluster: Cluster, namespace: str, name: str) -> str | None:
    for pod in server_pods(cluster, namespace, name):
        if (pod.metadata.labels or {}).get("pagekeeper.dev/canary") == "true":
            return str(pod.metadata.name)
    return None


def stable_pod(cluster: Cluster, namespace: str, name: str) -> str | None:
    """The one pod the stable Deployment keeps while the canary runs, once it is the only one."""
    pods = [
        p
        for p in server_pods(cluster, namespace, name)
        if (p.metadata.labels or {}).get("pagekeeper.dev/canary") != "true"
    ]
    return str(pods[0].metadata.name) if len(pods) == 1 and is_pod_ready(pods[0]) else None


def tuning(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_server(cluster, namespace, name).get("status") or {}
    return status.get("tuning") or {}


def pod_value(url: str, promql: str, pod: str) -> float | None:
    return query_by(url, promql.replace("POD", pod), "pod").get(pod)


def test_a_winning_canary_is_promoted_and_a_losing_one_rolled_back_and_held(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    apps = client.AppsV1Api(cluster.api)
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    with contextlib.ExitStack() as stack:
        prometheus = Prometheus(tmp_path / "prometheus", [], None)
        stack.callback(prometheus.stop)
        prometheus.start([])
        assert prometheus.service is not None
        url = prometheus.service.url
        operator = OperatorProcess(
            cluster.kubeconfig, namespace, tmp_path / "operator",
            extra_env={"PAGEKEEPER_PROMETHEUS_URL": url},
        )  # fmt: skip
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver(n, spec(n)) for n in SERVERS], "-n", namespace)
        # scrape job -> (its port, the pods it stands in for); engines by job, for their logs
        jobs: dict[str, tuple[int, list[str]]] = {}
        engines: dict[str, Service] = {}

        def run_standin(job: str, name: str, deployment: str, pods: list[str]) -> list[str]:
            rendered = rendered_command(apps, namespace, deployment)
            if name in SYNTHETIC:
                pod = start_synthetic_pod(SYNTHETIC[name], rendered, seed=len(jobs))
                stack.callback(pod.stop)
                jobs[job] = (pod.port, pods)
                return rendered
            engine = start_standin(rendered, checkpoint, tmp_path / job, NUM_BLOCKS)
            stack.callback(stop_engine, engine)
            _, prompt, max_tokens, num_workers = ENGINES[name]
            load = ClosedLoop(engine.url, MODEL, prompt, max_tokens, num_workers).start()
            stack.callback(load.stop)
            jobs[job], engines[job] = (engine.port, pods), engine
            return rendered

        def scrape() -> None:
            prometheus.reload([
                pod_scrape(port, *((namespace, p, job.split("-")[0]) for p in pods), job=job)
                for job, (port, pods) in jobs.items()
            ])  # fmt: skip

        for name in SERVERS:
            pods = wait_ready_pods(cluster, namespace, name, 2)
            rendered = run_standin(f"{name}-stable", name, name, pods)
            assert "--enable-prefix-caching" in rendered
        scrape()

        # Each server's trial starts; its canary's stand-in runs what the canary Deployment runs.
        canaries: dict[str, str] = {}
        trials: dict[str, dict[str, Any]] = {}
        try:
            while len(canaries) < len(SERVERS):
                name, pod = wait_for(
                    lambda: next(
                        ((n, p) for n in SERVERS if n not in canaries
                         if (p := canary_pod(cluster, namespace, n))), None,
                    ),
                    timeout=TRIAL_TIMEOUT_S, interval=2, what="a canary pod",
                )  # fmt: skip
                canaries[name] = pod
                # the trial's status write and its canary's pod race: wait for the record
                trials[name] = wait_for(
                    lambda n=name: tuning(cluster, namespace, n).get("trial"),
                    timeout=60, interval=1, what=f"{name}'s trial in status",
                )  # fmt: skip
                rendered = run_standin(f"{name}-canary", name, f"{name}-canary", [pod])
                if name in SYNTHETIC:
                    assert (trials[name]["field"], trials[name]["proposed"]) == (
                        "maxNumSeqs", str(DEMAND),
                    ), trials[name]  # fmt: skip
                    assert flag_value(rendered, "--max-num-seqs") == str(DEMAND)
                elif name == "seqs":
                    assert trials[name]["field"] == "maxNumSeqs", trials[name]
                    assert int(trials[name]["proposed"]) > 2
                    assert flag_value(rendered, "--max-num-seqs") == trials[name]["proposed"]
                else:
                    assert (trials[name]["field"], trials[name]["proposed"]) == (
                        "enablePrefixCaching", "false",
                    )  # fmt: skip
                    assert "--no-enable-prefix-caching" in rendered
                kept = wait_for(lambda n=name: stable_pod(cluster, namespace, n), timeout=60,
                                what=f"the one stable pod of {name}")  # fmt: skip
                jobs[f"{name}-stable"] = (jobs[f"{name}-stable"][0], [kept])
                scrape()

            def decided(name: str) -> dict[str, Any]:
                def last() -> dict[str, Any] | None:
                    history = tuning(cluster, namespace, name).get("history") or []
                    return history[-1] if history else None

                record = wait_for(last, timeout=TRIAL_TIMEOUT_S, interval=2,
                                  what=f"the trial of {name} decided")  # fmt: skip
                assert record is not None
                return record

            outcomes = {name: decided(name) for name in SERVERS}
        except AssertionError:
            print(operator.log_tail(8000), {j: e.log for j, e in engines.items()})
            raise
        won, lost = outcomes["seqs"], outcomes["prefix"]
        numbers = {e["name"]: e["value"] for e in won["evidence"]}
        assert won["outcome"] == "Promoted", won
        assert numbers["improvement"] > 0.03 and numbers["pValue"] < 0.05, numbers
        assert lost["outcome"] == "RolledBack", lost
        lost_numbers = {e["name"]: e["value"] for e in lost["evidence"]}
        assert min(lost_numbers["canarySamples"], lost_numbers["baselineSamples"]) >= 8, lost
        # At equal throughput the TTFT p99 decides, either way.
        for name, outcome, words in (
            ("ttftwin", "Promoted", "promoted: TTFT p99 -"),
            ("ttftloss", "RolledBack", "rolled back (loss): TTFT p99 +"),
        ):
            record = outcomes[name]
            figures = {e["name"]: e["value"] for e in record["evidence"]}
            assert record["outcome"] == outcome and words in record["message"], record
            assert abs(figures["improvement"]) < 0.05 and figures["pValue"] > 0.05, record
            slow, quick = sorted(
                (figures["canaryTtftP99Seconds"], figures["baselineTtftP99Seconds"]), reverse=True
            )
            assert slow > 5 * quick, record
        assert "tokens/s, not below -5% (p = " in outcomes["ttftwin"]["message"]

        # The canaries ran what was tried: more sequences at once; no prefix lookups.
        running = "max by (pod) (max_over_time(vllm:num_requests_running{pod='POD'}[30m]))"
        assert (pod_value(url, running, canaries["seqs"]) or 0) > 2
        queries = "max by (pod) (vllm:prefix_cache_queries_total{pod='POD'})"
        assert pod_value(url, queries, canaries["prefix"]) == 0
        shadow = "max by (pod) (pagekeeper_prefix_cache_shadow_hits_total{pod='POD'})"
        assert (pod_value(url, shadow, canaries["prefix"]) or 0) > 0

        # The win runs everywhere and status shows it; the loss left the pods as they were.
        proposed = trials["seqs"]["proposed"]
        wait_for(
            lambda: flag_value(rendered_command(apps, namespace, "seqs"), "--max-num-seqs")
            == proposed,
            timeout=60, what="every replica of seqs running the promoted change",
        )  # fmt: skip
        assert "--enable-prefix-caching" in rendered_command(apps, namespace, "prefix")
        for name in SERVERS:
            wait_for(
                lambda name=name: canary_pod(cluster, namespace, name) is None,
                timeout=90, what=f"the canary of {name} gone",
            )  # fmt: skip
        seqs = get_server(cluster, namespace, "seqs")
        assert seqs["spec"]["memoryPolicy"]["maxNumSeqs"] == 2
        assert seqs["status"]["effectiveMemoryPolicy"]["maxNumSeqs"] == int(proposed)
        for name, value in (("seqs", proposed), ("ttftwin", str(DEMAND))):
            [change] = tuning(cluster, namespace, name)["changes"]
            assert (change["field"], change["value"], change["source"]) == (
                "maxNumSeqs", value, "Promoted",
            )  # fmt: skip
            reasons = {e.reason for e in server_events(cluster, namespace, name)}
            assert {"TuningTrialStarted", "TuningPromoted"} <= reasons
        for name in ("prefix", "ttftloss"):
            assert "TuningRolledBack" in {e.reason for e in server_events(cluster, namespace, name)}
        assert flag_value(rendered_command(apps, namespace, "ttftloss"), "--max-num-seqs") == "2"

        # Within the hold-off the losing change is neither recommended nor tried again, while
        # the load that made the tuner propose it goes on.
        lost_fields = {"prefix": "enablePrefixCaching", "ttftloss": "maxNumSeqs"}
        for name, field in lost_fields.items():
            assert [h["field"] for h in tuning(cluster, namespace, name)["holdOffs"]] == [field]
        rounds = operator.log_tail(10**7).count(RESYNC_DONE)
        wait_for(
            lambda: operator.log_tail(10**7).count(RESYNC_DONE) >= rounds + 3,
            timeout=90, what="three more resync rounds",
        )  # fmt: skip
        for name, field in lost_fields.items():
            again = get_server(cluster, namespace, name)["status"]
            assert again["tuning"].get("trial") is None
            assert len(again["tuning"]["history"]) == 1
            assert all(r["field"] != field for r in again.get("recommendations", []))
