"""The forward pass in its preallocated workspace: same logits, fixed addresses, chunked MLP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.model.workspace import Workspace, WorkspaceShape
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import hf_logits, make_runner, seq, step_logits, tokens
from tests.engine.checkpoints import write_checkpoint as write_hf_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, ModelRunner]:
    """The transformers logits of a 20-token prompt, and a runner over the same checkpoint."""
    path: Path = tmp_path_factory.mktemp("qwen3")
    hf = write_hf_checkpoint(path, "qwen3")
    return hf_logits(hf, tokens(20)), make_runner(path, max_num_batched_tokens=32)


def test_the_runner_binds_one_workspace_at_its_token_budget(
    qwen3: tuple[torch.Tensor, ModelRunner],
) -> None:
    _, runner = qwen3
    workspace = runner.workspace
    assert runner.model.workspace is workspace and workspace.max_tokens == 32
    # the model's dtype (fp32 here) and the one-token layer's fp32 statistics
    assert workspace.nbytes == (workspace.shape.num_elements + (2 * 2 + 1) * 32) * 4
    # sampling's rows, per sequence: logits (the model's dtype: fp32 here), noise, scores, a
    # mixed batch's random rows
    rows = runner.sampler_buffers
    vocab = runner.model_config.vocab_size
    planes = runner.config.max_num_seqs * vocab * (4 + 4 + 4 + 4)
    chunk = rows.cut.num_rows
    assert rows.cut.nbytes == chunk * vocab * (4 + 8 + 4 + 4 + 1) + vocab * 8 + chunk * 4
    assert rows.nbytes == planes + rows.cut.nbytes
    assert runner.profile_target.workspace_bytes == workspace.nbytes + rows.nbytes


def test_logits_and_noise_live_in_the_sampling_rows(
    qwen3: tuple[torch.Tensor, ModelRunner],
) -> None:
    _, runner = qwen3
    out = runner.execute(
        SchedulerOutput([seq("a", tokens(5), 0, [0]), seq("b", tokens(3), 0, [1])], 8)
    )
    assert len(out.sampled_token_ids) == 2
    buffers = runner.sampler_buffers
    hidden = torch.zeros(2, runner.model_config.hidden_size)
    logits = runner.model.compute_logits(hidden, buffers.logits)
    assert logits is not None and logits.data_ptr() == buffers.logits.data_ptr()
    assert logits.shape == (2, runner.model_config.vocab_size)
    # Each path draws, masks, scales and cuts in the sampling rows: the draws land there.
    for params in (
        [SamplingParams(temperature=0.7)] * 2,
        [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.0)],
    ):
        buffers.noise.zero_()
        runner.sampler.sample(logits, params, [0, 0])
        random_rows = sum(not p.is_greedy for p in params)
        assert bool((buffers.noise[:random_rows] != 0).all())


def test_hidden_states_are_a_view_of_the_workspace(
    qwen3: tuple[torch.Tensor, ModelRunner],
) -> None:
    _, runner = qwen3
    with torch.inference_mode():
        step = runner.prepare_inputs([seq("a", tokens(5), 0, [0])])
        hidden = runner.model(step.input_ids, step.positions, step.meta)
    assert hidden.data_ptr() == runner.workspace.rows("hidden", 5).data_ptr()


@pytest.mark.parametrize("mlp_chunk", [32, 7, 1])
def test_a_chunked_mlp_gives_the_same_logits(
    qwen3: tuple[torch.Tensor, ModelRunner], mlp_chunk: int
) -> None:
    expected, runner = qwen3
    shape = WorkspaceShape.for_model(runner.model_config, 32, mlp_chunk=mlp_chunk)
    runner.model.bind_workspace(Workspace(shape, runner.dtype, runner.device))
    try:
        (logits,) = step_logits(runner, [seq("a", tokens(20), 0, [0, 1, 2])])
    finally:
        runner.model.bind_workspace(runner.workspace)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_step_beyond_the_workspace_is_refused_by_name(
    qwen3: tuple[torch.Tensor, ModelRunner],
) -> None:
    _, runner = qwen3
    shape = WorkspaceShape.for_model(runner.model_config, 4)
    runner.model.bind_workspace(Workspace(shape, runner.dtype, runner.device))
    try:
        with pytest.raises(ValueError, match=r"6 tokens does not fit the 'residual' workspace"):
            step_logits(runner, [seq("a", tokens(6), 0, [0])])
    finally:
        runner.model.bind_workspace(runner.workspace)


def test_an_unbound_model_allocates_a_workspace_per_call(
    qwen3: tuple[torch.Tensor, ModelRunner],
) -> None:
    expected, runner = qwen3
    runner.model.bind_workspace(None)
    try:
        (logits,) = step_logits(runner, [seq("a", tokens(20), 0, [0, 1, 2])])
    finally:
        runner.model.bind_workspace(runner.workspace)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_workspace_holds_at_least_one_token(qwen3: tuple[torch.Tensor, ModelRunner]) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        WorkspaceShape.for_model(qwen3[1].model_config, 0)
