"""The fused one-token layer (`model/row_fusion.py`) against the layer it replaces.

The model runs in fp32, on the GPU where there is one, else on the CPU with its GEMVs in
Triton's interpreter: a decode step with the fused layer gives the logits of the unfused step
and of the transformers model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.model.row_fusion import RowFusion
from tests.engine.checkpoints import hf_logits, make_runner, seq, step_logits, tokens
from tests.engine.checkpoints import write_checkpoint as write_hf_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_fused_decode_step_gives_the_unfused_logits(
    arch: str, tmp_path: Path, device: torch.device
) -> None:
    hf = write_hf_checkpoint(tmp_path, arch)
    prompt = tokens(12)
    expected = hf_logits(hf, prompt)[-1]
    runner = make_runner(tmp_path, device=device.type)
    step_logits(runner, [seq("a", prompt[:-1], 0, [0, 1])])  # the prefill writes the KV
    decode = [seq("a", prompt[-1:], len(prompt) - 1, [0, 1])]

    (unfused,) = step_logits(runner, decode)
    runner.model.set_row_fusion(RowFusion())
    try:
        (fused,) = step_logits(runner, decode)
        # Each step starts its sums of squares from zero: a second step gives the same logits.
        (again,) = step_logits(runner, decode)
    finally:
        runner.model.set_row_fusion(None)

    torch.testing.assert_close(again, fused, rtol=0.0, atol=0.0)

    assert runner.model.model.row_fusion is None
    torch.testing.assert_close(fused[0], unfused[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[0].cpu(), expected, rtol=1e-4, atol=1e-4)


def test_steps_of_more_tokens_ignore_the_fusion(tmp_path: Path, device: torch.device) -> None:
    hf = write_hf_checkpoint(tmp_path, "llama")
    prompt = tokens(9)
    runner = make_runner(tmp_path, device=device.type)
    runner.model.set_row_fusion(RowFusion())
    (logits,) = step_logits(runner, [seq("a", prompt, 0, [0, 1])])
    torch.testing.assert_close(logits.cpu(), hf_logits(hf, prompt), rtol=1e-4, atol=1e-4)
