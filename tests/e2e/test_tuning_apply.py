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

Before a trial one engine stands in for both pods of a server; once the canary runs, one stands
in for the pod the stable Deployment kept and another for the canary pod.
"""

from __future__ import annotations

import contextlib
import random
import string
from pathlib import Path
from typing import Any

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import stop_engine, write_tiny_checkpoint
from harness.loop import (
    OperatorProcess,
    Prometheus,
    get_server,
    install_crd,
    is_pod_ready,
    llmserver,
    pod_scrape,
    restrict_namespace,
    server_events,
    server_pods,
    wait_ready_pods,
)
from harness.processes import Service
from pagekeeper_operator.prometheus import query_by
from pagekeeper_operator.resync import RESYNC_DONE
from tests.support.standin import ClosedLoop, flag_value, rendered_command, start_standin

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


# name -> (memoryPolicy, prompt, max_tokens, requests in flight)
SERVERS = {
    "seqs": ({"maxNumSeqs": 2}, short_prompt, 32, 8),
    "prefix": ({}, shared_prefix_prompt, 1, 4),
}


def spec(policy: dict[str, Any]) -> dict[str, Any]:
    # one candidate field per workload; seqs' cap may reach the 8 in flight and no further, so
    # once the trial's value runs, the headroom rule has nothing left to add
    bounds: dict[str, Any] = {"blockSizes": [16]}
    if "maxNumSeqs" in policy:
        bounds["maxNumSeqs"] = {"min": 1, "max": 8}
    return {
        "model": {"source": "/models/tiny-llama", "servedModelName": MODEL, "loadFormat": "dummy"},
        "replicas": 2,
        "resources": {"gpus": 1},
        "memoryPolicy": {"maxModelLen": 1024, **policy},
        "rollout": {"canary": {"enabled": True, "replicas": 1, "analysisSeconds": 3600}},
        "tuning": {
            "mode": "Apply", "windowSeconds": WINDOW_S, "holdOffSeconds": 3600,
            "bounds": bounds,
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
        cluster.apply_yaml([llmserver(n, spec(s[0])) for n, s in SERVERS.items()], "-n", namespace)
        # scrape job -> (engine, the pods it stands in for)
        jobs: dict[str, tuple[Service, list[str]]] = {}

        def run_standin(job: str, name: str, deployment: str, pods: list[str]) -> list[str]:
            rendered = rendered_command(apps, namespace, deployment)
            engine = start_standin(rendered, checkpoint, tmp_path / job, NUM_BLOCKS)
            stack.callback(stop_engine, engine)
            _, prompt, max_tokens, num_workers = SERVERS[name]
            load = ClosedLoop(engine.url, MODEL, prompt, max_tokens, num_workers).start()
            stack.callback(load.stop)
            jobs[job] = (engine, pods)
            return rendered

        def scrape() -> None:
            prometheus.reload([
                pod_scrape(engine.port, *((namespace, p, job.split("-")[0]) for p in pods), job=job)
                for job, (engine, pods) in jobs.items()
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
                if name == "seqs":
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

            def decided(name: str) -> dict[str, Any] | None:
                history = tuning(cluster, namespace, name).get("history") or []
                return history[-1] if history else None

            won = wait_for(lambda: decided("seqs"), timeout=TRIAL_TIMEOUT_S, interval=2,
                           what="the trial of seqs decided")  # fmt: skip
            lost = wait_for(lambda: decided("prefix"), timeout=TRIAL_TIMEOUT_S, interval=2,
                            what="the trial of prefix decided")  # fmt: skip
        except AssertionError:
            print(operator.log_tail(8000), {j: e.log for j, (e, _) in jobs.items()})
            raise
        numbers = {e["name"]: e["value"] for e in won["evidence"]}
        assert won["outcome"] == "Promoted", won
        assert numbers["improvement"] > 0.03 and numbers["pValue"] < 0.05, numbers
        assert lost["outcome"] == "RolledBack", lost
        lost_numbers = {e["name"]: e["value"] for e in lost["evidence"]}
        assert min(lost_numbers["canarySamples"], lost_numbers["baselineSamples"]) >= 8, lost

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
        [change] = seqs["status"]["tuning"]["changes"]
        assert (change["field"], change["value"], change["source"]) == (
            "maxNumSeqs", proposed, "Promoted",
        )  # fmt: skip
        reasons = {e.reason for e in server_events(cluster, namespace, "seqs")}
        assert {"TuningTrialStarted", "TuningPromoted"} <= reasons
        assert "TuningRolledBack" in {e.reason for e in server_events(cluster, namespace, "prefix")}

        # Within the hold-off the losing change is neither recommended nor tried again, while
        # the load that made the tuner propose it goes on.
        held = tuning(cluster, namespace, "prefix")
        assert [h["field"] for h in held["holdOffs"]] == ["enablePrefixCaching"]
        rounds = operator.log_tail(10**7).count(RESYNC_DONE)
        wait_for(
            lambda: operator.log_tail(10**7).count(RESYNC_DONE) >= rounds + 3,
            timeout=90, what="three more resync rounds",
        )  # fmt: skip
        again = get_server(cluster, namespace, "prefix")["status"]
        assert again["tuning"].get("trial") is None
        assert len(again["tuning"]["history"]) == 1
        assert all(r["field"] != "enablePrefixCaching" for r in again.get("recommendations", []))
