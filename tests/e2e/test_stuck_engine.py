"""A hung engine is found and its pod's container restarted, and the operator counts it as
`stuck`, with real parts only.

The operator runs as a subprocess on the local control plane; an LLMServer's pod sits on a KWOK
node, and a kubelet stand-in (`tests/support/kubelet.py`) runs that pod's container as the CPU
engine, probing it with the probes the operator rendered and restarting it as a kubelet would.
The engine's step hangs (`PAGEKEEPER_INJECT_STEP_HANG`) under a request: its progress watchdog
finds it within `spec.stuckTimeoutSeconds` (rendered as `--stuck-timeout`), ends the process
with the `pagekeeper-stuck` termination message before the liveness probe would have, the
stand-in restarts it and reports the restart in the pod's status, and the operator records a
`stuck` termination in the remediation history: not an OOM, no memory step-down, MemoryHealthy
untouched.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from harness.cluster import Cluster, wait_for
from harness.cpu_engine import (
    EngineShape,
    StreamingLoad,
    spawn_engine,
    wait_engine_ready,
    write_tiny_checkpoint,
)
from harness.loop import (
    OperatorProcess,
    get_server,
    install_crd,
    llmserver,
    restrict_namespace,
    server_events,
    server_pods,
    wait_history,
    wait_ready_pods,
)
from harness.processes import Service
from pagekeeper_engine.faults import INJECT_STEP_HANG_ENV
from pagekeeper_engine.stuck import parse_stuck_message
from tests.support.kubelet import TERMINATION_LOG, HttpProbe, PodKubelet

SHAPE = EngineShape()
STUCK_TIMEOUT_S = 5
# The watchdog sleeps until the newest turn mark would be STUCK_TIMEOUT_S old and reports at
# once when it is, so the age it reports exceeds the timeout only by how late its thread woke:
# scheduling latency, which a busy 2-core machine stretches to seconds, never to half a minute.
# An age past this means the hang was found late (a watchdog that slept past a turn, or one
# that counts from the wrong mark), whatever the machine's speed.
DETECTION_SLACK_S = 30
# Bounds on conditions, not speeds: engine start-up and the restart on a busy 2-core machine.
RESTART_TIMEOUT_S = 240
SPEC: dict[str, Any] = {
    "model": {"source": "/models/tiny-llama", "servedModelName": SHAPE.model_name},
    "replicas": 1,
    "resources": {"gpus": 1},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9},
    "stuckTimeoutSeconds": STUCK_TIMEOUT_S,
}


def test_a_hung_engine_is_restarted_and_counted_as_stuck_not_oom(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    restrict_namespace(cluster, namespace)
    checkpoint = write_tiny_checkpoint(tmp_path / "tiny-llama")
    with contextlib.ExitStack() as stack:
        operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "operator")
        stack.callback(operator.stop)
        operator.wait_ready()
        cluster.apply_yaml([llmserver("hangs", SPEC)], "-n", namespace)
        [pod] = wait_ready_pods(cluster, namespace, "hangs", 1)

        def spawn(directory: Path) -> Service:
            # The same container every start, as a kubelet restarts it: the hang stays injected
            # (rank 0's third step), so only a start that gets requests hangs again. The engine
            # gets the pod's rendered --stuck-timeout (the CPU engine's own shape otherwise).
            rendered = kubelet.spec.command
            at = rendered.index("--stuck-timeout")
            flags = rendered[at : at + 2]
            flags += ["--termination-log-path", str(directory / TERMINATION_LOG)]
            env = {INJECT_STEP_HANG_ENV: "0:3"}
            return spawn_engine(checkpoint, directory, SHAPE, flags, env)

        kubelet = PodKubelet(cluster, namespace, pod, tmp_path / "kubelet", spawn)
        assert "--stuck-timeout" in kubelet.spec.command
        kubelet.start()
        stack.callback(kubelet.stop)
        # The stand-in probes as the operator rendered: liveness would need a minute of
        # failures to end the engine, far past the watchdog's timeout.
        assert kubelet.liveness == HttpProbe("/health", 10, 6, 5)
        engine = wait_for(lambda: kubelet.service, timeout=30, what="the engine's first start")
        wait_engine_ready(engine)
        load = StreamingLoad(engine.url, SHAPE.model_name, num_workers=1, max_tokens=40).start()
        stack.callback(load.stop)

        wait_for(
            lambda: kubelet.restart_count >= 1 or kubelet.error,
            timeout=RESTART_TIMEOUT_S,
            what="the hung engine ended and restarted",
        )
        assert kubelet.error is None, kubelet.error
        load.stop()
        [ended] = kubelet.terminations
        assert (ended.exit_code, ended.by_liveness) == (1, False)  # the engine's watchdog
        report = parse_stuck_message(ended.message)
        assert report is not None, ended.message
        assert STUCK_TIMEOUT_S <= report.last_step_age_s < STUCK_TIMEOUT_S + DETECTION_SLACK_S
        assert (report.num_running, report.num_waiting) == (1, 0)
        assert report.detail.endswith(f"(--stuck-timeout {STUCK_TIMEOUT_S:g})")

        # The container runs again, and the pod says so as a kubelet would.
        restarted = wait_for(
            lambda: kubelet.service if kubelet.service is not engine else None,
            timeout=30,
            what="the second start",
        )
        wait_engine_ready(restarted)
        [status] = server_pods(cluster, namespace, "hangs")[0].status.container_statuses
        assert status.restart_count == 1
        assert status.last_state.terminated.exit_code == 1
        assert status.last_state.terminated.message == ended.message

        entry = wait_history(cluster, namespace, "hangs", 60, pod=pod, alert="stuck")
    assert (entry["action"], entry["outcome"]) == ("step-down", "not-applicable")
    assert entry["message"].startswith(f"EngineStuck: {report.detail}; a stuck engine is")
    assert entry["alertStartsAt"] == ended.finished_at
    status = get_server(cluster, namespace, "hangs")["status"]
    assert status["effectiveMemoryPolicy"]["gpuMemoryUtilization"] == 0.9  # no step-down
    assert "lastOutOfMemory" not in status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["MemoryHealthy"]["reason"] == "NoMemoryEvents"
    reasons = [e.reason for e in server_events(cluster, namespace, "hangs")]
    assert reasons.count("EngineStuck") == 1 and "PolicySteppedDown" not in reasons
