"""`pagekeeper-plan` on every example: the same plan the operator's pure code computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pagekeeper_memplan.gpus import parse_product
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.plan_cli import main
from pagekeeper_operator.policy.effective import effective_memory_policy
from pagekeeper_operator.policy.fit import decide_fit

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
EXIT = {"Fits": 0, "DoesNotFit": 1, "Unknown": 2}


def servers_of(path: Path) -> list[LLMServer]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "LLMServer"]
    return [LLMServer.model_validate(d) for d in docs]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("gpu", [None, "H100-80GB", "L4"])
def test_the_cli_prints_the_operators_plan(
    example: Path, gpu: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["-f", str(example), "--output", "json"] + (["--gpu", gpu] if gpu else [])
    code = main(argv)
    printed = json.loads(capsys.readouterr().out)
    given = None
    if gpu is not None:
        product = parse_product(gpu)
        assert product is not None
        given = (product, f"--gpu {gpu}")
    expected = [
        decide_fit(s, effective_memory_policy(s), None, gpu=given).status
        for s in servers_of(example)
    ]
    assert printed == [status.to_api() for status in expected]
    assert code == max(EXIT[status.state] for status in expected)


def test_the_70b_example_fits_at_tensor_4_on_80gb(capsys: pytest.CaptureFixture[str]) -> None:
    example = next(p for p in EXAMPLES if p.name == "llmserver-70b-tp4.yaml")
    assert main(["-f", str(example)]) == 0
    out = capsys.readouterr().out
    assert "the catalogue's llama-3.1-70b, tensor 4, on H100-80GB" in out
    assert "\n  Fits: " in out


def test_a_70b_at_tensor_1_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "llm.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "pagekeeper.dev/v1alpha1",
                "kind": "LLMServer",
                "metadata": {"name": "big"},
                "spec": {"model": {"source": "meta-llama/Llama-3.1-70B-Instruct"}},
            }
        )
    )
    assert main(["-f", str(manifest), "--gpu-memory", "80Gi"]) == 1
    out = capsys.readouterr().out
    assert "\n  DoesNotFit (weights, short by " in out
    assert "GiB): weights alone take " in out


def test_bad_input_and_unknown_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: LLMServer\nmetadata: {name: x}\nspec: {replicas: -1}\n")
    assert main(["-f", str(bad)]) == 2
    assert "pagekeeper-plan: " in capsys.readouterr().err
    small = next(p for p in EXAMPLES if p.name == "llmserver-small.yaml")
    assert main(["-f", str(small)]) == 2
    assert capsys.readouterr().err.endswith("; give --gpu or --gpu-memory\n")
    assert main(["-f", str(small), "--gpu", "RTX-9999"]) == 2
    assert "not a GPU product the plan knows" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["-f", str(small), "--gpu", "L4", "--model-config", str(config)]) == 2
    assert "missing required field 'num_attention_heads'" in capsys.readouterr().err


def test_the_host_side_is_printed_and_a_limit_below_it_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "llm.yaml"
    spec = {
        "model": {"source": "Qwen/Qwen3-8B"},
        "parallelism": {"tensor": 2},
        "resources": {"limits": {"memory": "40Gi"}},
        "memoryPolicy": {"swapSpaceGiB": 2, "kvOffload": {"size": "32Gi"}},
    }
    body = {"apiVersion": "pagekeeper.dev/v1alpha1", "kind": "LLMServer"}
    manifest.write_text(yaml.safe_dump({**body, "metadata": {"name": "chat"}, "spec": spec}))
    assert main(["-f", str(manifest), "--gpu", "H100-80GB"]) == 1
    out = capsys.readouterr().out
    assert (
        "  host memory per pod\n"
        "    kvOffload                 32.00 GiB    34,359,738,368 B\n"
        "    swapSpace                  4.00 GiB     4,294,967,296 B\n"
        "    cpuOffload                 0.00 GiB                 0 B\n"
        "    sharedMemory               2.00 GiB     2,147,483,648 B\n"
        "    processes *                7.00 GiB     7,516,192,768 B\n"
        "    total                     45.00 GiB\n"
        "    memory request            40.00 GiB\n"
        "    memory limit              40.00 GiB\n"
    ) in out
    assert "\n  DoesNotFit (kvOffload, short by 5.00 GiB): the pod's memory limit of 40.00" in out
    # Within the limit, the GPU's verdict stands; with no GPU the host side is still printed.
    manifest.write_text(manifest.read_text().replace("40Gi", "48Gi"))
    assert main(["-f", str(manifest), "--gpu", "H100-80GB"]) == 0
    assert main(["-f", str(manifest)]) == 2
    out = capsys.readouterr().out
    assert "default/chat: Unknown: no candidate node carries" in out
    assert "    memory limit              48.00 GiB\n" in out
