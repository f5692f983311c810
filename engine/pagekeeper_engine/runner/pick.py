"""The token pick on either device: the Triton kernel on CUDA (`kernels/sampling.py`), its
torch reference in fp32 on the CPU, which is also what the kernel's tests check it against."""

from __future__ import annotations

import torch

from pagekeeper_engine.kernels import NOISE_FLOOR
from pagekeeper_engine.kernels.pick_scratch import PickScratch
from pagekeeper_engine.runner.structured_output import unpack_bitmask


def pick_tokens_ref(
    scores: torch.Tensor,  # (N, V) fp32 or raw's dtype
    raw: torch.Tensor,  # (N, V) fp32, bf16 or fp16: the model's unmodified logits
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,  # (N, V) fp32 Exp(1) draws, each >= 0
    bitmask: torch.Tensor | None = None,  # (N, ceil(V / 32)) int32: the allowed tokens' bits
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sampling.pick_tokens` in plain torch, in fp32: the CPU path and the kernel's
    reference."""
    race = scores.float() * scale
    if bitmask is not None:
        race = race.masked_fill(~unpack_bitmask(bitmask, raw.shape[1]), float("-inf"))
    if noise is not None:
        race = race - noise.clamp(min=NOISE_FLOOR).log()
    token_ids = race.argmax(dim=-1)  # ties: the lowest index
    raw = raw.float()
    logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - raw.logsumexp(dim=-1)
    return token_ids, torch.stack((token_ids.double(), logprobs.double()))


def pick_tokens(
    scores: torch.Tensor,
    raw: torch.Tensor,
    *,
    scale: float = 1.0,
    noise: torch.Tensor | None = None,
    sample_key: int | None = None,  # instead of `noise`: invert the CDF at this key's draws
    scratch: PickScratch | None = None,
    bitmask: torch.Tensor | None = None,  # (N, ceil(V / 32)) int32: the allowed tokens' bits
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (N,) int64 and (2, N) float64 [ids; log-probabilities], left on the device (in
    `scratch` where given); with `bitmask`, picked as if every score whose bit is clear were
    -inf."""
    if not raw.is_cuda:
        assert sample_key is None, "a keyed pick runs in the CUDA kernel; the CPU's races"
        return pick_tokens_ref(scores, raw, scale=scale, noise=noise, bitmask=bitmask)
    # Imported on first CUDA use: a kernel module fixes interpreted or native mode
    # (`TRITON_INTERPRET`) when it is imported, and the CPU path needs no triton.
    from pagekeeper_engine.kernels import sampling  # noqa: PLC0415

    return sampling.pick_tokens(
        scores,
        raw,
        scale=scale,
        noise=noise,
        sample_key=sample_key,
        scratch=scratch,
        bitmask=bitmask,
    )
