"""The start-up choice of the one-token layer, from its timed forwards (`decide_fusion`)."""

from __future__ import annotations

from pagekeeper_engine.model.gemv_choice import FUSION_MARGIN, decide_fusion
from pagekeeper_engine.model.row_fusion import RowFusion

FUSED, PDL = RowFusion(pdl=False), RowFusion(pdl=True)


def test_the_fastest_fused_variant_is_kept() -> None:
    assert decide_fusion({None: 708e-6, FUSED: 658e-6, PDL: 532e-6}) == PDL
    assert decide_fusion({None: 708e-6, FUSED: 600e-6, PDL: 632e-6}) == FUSED


def test_a_near_tie_goes_to_the_fused_layer() -> None:
    # The 8B's forwards at one start on an H200: unfused 17 us ahead, inside the margin.
    assert decide_fusion({None: 3729e-6, FUSED: 3880e-6, PDL: 3746e-6}) == PDL
    # The 8B with FP8 weights on an H100: unfused 32 us (1%) ahead, and it served 3% slower.
    assert decide_fusion({None: 3045e-6, FUSED: 3159e-6, PDL: 3077e-6}) == PDL
    # Exactly at the margin the fused layer stays; beyond it the unfused one is kept.
    assert decide_fusion({None: FUSION_MARGIN * 1e-3, PDL: 1e-3}) == PDL
    assert decide_fusion({None: 0.96 * 1e-3, PDL: 1e-3}) is None


def test_without_a_fused_variant_the_layer_stays_unfused() -> None:
    assert decide_fusion({None: 1e-3}) is None


def test_the_choice_names_the_fused_layers_tiles() -> None:
    from pagekeeper_engine.kernels.gemv import GemvConfig  # noqa: PLC0415 (imports triton)
    from pagekeeper_engine.model.gemv_choice import FusionChoice  # noqa: PLC0415

    tiles = {"o_proj": GemvConfig(4, 4096, num_warps=8, num_stages=1), "qkv_proj": GemvConfig()}
    timed = {None: 802.0, FUSED: 757.0, PDL: 617.0}
    fused = FusionChoice(timed, PDL, tiles).describe()
    assert fused.startswith("one-token layer: fused with PDL (batch-1 step 802 us unfused")
    assert fused.endswith("; its tiles o_proj 4x4096, 8 warps, qkv_proj 8x512, 4 warps)")
    assert "tiles" not in FusionChoice(timed, None, tiles).describe()
