"""TRT-LLM MXFP8 layouts: the folded one-pass gathers equal vLLM's steps done one by one.

References: vLLM 0.32's own pure-torch ``swap_w13_to_w31`` and ``swizzle_mxfp8_scale``, the
row maps exactly as FlashInfer 0.6.13 defines them (``srcToDstBlk32RowMap`` and
``get_reorder_rows_for_gated_act_gemm_row_indices``, written out here), and the DESIGN.md
interleave formula.
"""

from __future__ import annotations

import pytest
import torch

from mxrefit.integrations.vllm.trtllm import (
    LinearScaleLayout,
    MoeLayout,
    check_moe_alignment,
    interleave_index,
    interleaved_size,
    moe_row_permutation,
)
from tests.helpers.checks import run_under_triton_interpreter

pytest.importorskip("vllm.model_executor.layers.fused_moe", reason="needs vLLM")  # import order: avoids a cycle
vllm_fi = pytest.importorskip("vllm.model_executor.layers.quantization.utils.flashinfer_utils", reason="needs vLLM")
vllm_mx = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils", reason="needs vLLM")
pytestmark = pytest.mark.vllm

# FlashInfer 0.6.13 flashinfer/utils.py: source row s of a 32-row block goes to row MAP[s].
_FI_BLK32_MAP = [
    0,
    8,
    16,
    24,
    1,
    9,
    17,
    25,
    2,
    10,
    18,
    26,
    3,
    11,
    19,
    27,
    4,
    12,
    20,
    28,
    5,
    13,
    21,
    29,
    6,
    14,
    22,
    30,
    7,
    15,
    23,
    31,
]


def fi_shuffle_rows(m: int) -> torch.Tensor:
    old = torch.arange(m)
    new = (old // 32) * 32 + torch.tensor(_FI_BLK32_MAP)[old % 32]
    idx = torch.empty(m, dtype=torch.long)
    idx[new] = old
    return idx


def fi_gated_reorder(m: int) -> torch.Tensor:
    rows = torch.arange(m)
    out = torch.empty_like(rows)
    out[0::2] = rows[: (m + 1) // 2]
    out[1::2] = rows[(m + 1) // 2 :]
    return out


def vllm_steps(w: torch.Tensor, gated: bool, scales: bool) -> torch.Tensor:
    """vLLM 0.32's sequence for one MoE tensor [E, M, C], step by step, expert by expert."""
    if gated:
        w = vllm_fi.swap_w13_to_w31(w)
    e, m, c = w.shape
    outs = []
    for x in w:
        if gated:
            x = x[fi_gated_reorder(m)]
        x = x[fi_shuffle_rows(m)]
        if scales:
            x = vllm_mx.swizzle_mxfp8_scale(x, m, c * 32)  # same 128x4 map as block_scale_interleave
        outs.append(x.reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("e,m,c", [(3, 256, 8), (2, 128, 4), (4, 1536 // 4, 2048 // 128)])
def test_folded_moe_gathers_equal_vllm_steps(e, m, c, gated):
    g = torch.Generator().manual_seed(e * 1000 + m + c)
    values = torch.randint(0, 256, (e, m, c * 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (e, m, c), generator=g, dtype=torch.uint8)
    dev = torch.device("cpu")
    kv = torch.empty_like(values)
    MoeLayout(e, m, c * 32, gated, dev, scales=False)(values, kv)
    assert torch.equal(kv.reshape(e, -1), vllm_steps(values, gated, scales=False))
    ks = torch.zeros(e * interleaved_size(m, c), dtype=torch.uint8)
    MoeLayout(e, m, c, gated, dev, scales=True)(scales, ks)
    assert torch.equal(ks.view(e, -1), vllm_steps(scales, gated, scales=True))


def test_row_permutation_matches_design_formula():
    m = 512
    design_shuffle = torch.arange(m).view(m // 32, 8, 4).transpose(1, 2).reshape(m)
    assert torch.equal(design_shuffle, fi_shuffle_rows(m))
    swap = (torch.arange(m) + m // 2) % m
    reorder = torch.stack([torch.arange(m // 2), torch.arange(m // 2) + m // 2], 1).reshape(m)
    assert torch.equal(moe_row_permutation(m, True), swap[reorder[design_shuffle]])
    assert torch.equal(moe_row_permutation(m, False), design_shuffle)


@pytest.mark.parametrize("rows,cols", [(128, 4), (100, 3), (4096, 64), (7, 1), (200, 9)])
def test_linear_scale_swizzle_equals_vllm(rows, cols):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    sf = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    layout = LinearScaleLayout(rows, cols, torch.device("cpu"))
    kernel = torch.zeros(layout.out_bytes, dtype=torch.uint8)
    layout(sf, kernel)
    assert torch.equal(kernel, vllm_mx.swizzle_mxfp8_scale(sf, rows, cols * 32))


def test_interleave_index_is_the_design_formula_and_a_bijection_onto_data_bytes():
    rows, cols = 256, 8  # no padding: the padded row-major index of (r, c) is r*cols + c
    idx = interleave_index(rows, cols)
    padded = torch.arange(interleaved_size(rows, cols)).view(rows // 128, 4, 32, cols // 4, 4)
    reference = padded.permute(0, 3, 2, 1, 4).reshape(-1)  # DESIGN.md: view(...).permute(0,3,2,1,4)
    inverse = torch.empty_like(reference)
    inverse[reference] = torch.arange(reference.numel())
    # byte (r, c) sits at flat position r*cols + c of the unpadded matrix; its swizzled offset
    # is where the DESIGN permutation puts padded element (r, c)
    flat_padded = (torch.arange(rows).view(-1, 1) * cols + torch.arange(cols)).reshape(-1)
    assert torch.equal(idx, inverse[flat_padded])
    assert idx.unique().numel() == rows * cols


def test_moe_alignment_rules_name_the_tensor():
    check_moe_alignment("ok", 256, 2048)
    with pytest.raises(ValueError, match=r"w13.*rows=200"):
        check_moe_alignment("layers.0.w13", 200, 2048)
    with pytest.raises(ValueError, match=r"K=96"):
        check_moe_alignment("layers.0.w2", 256, 96)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from mxrefit.integrations.vllm.trtllm import LinearScaleLayout, MoeLayout, interleaved_size
from tests.integration.test_trtllm_layout import vllm_steps
import vllm.model_executor.layers.fused_moe
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import swizzle_mxfp8_scale
dev = torch.device("cpu")
for gated in (True, False):
    for e, m, c in ((3, 256, 8), (2, 128, 4)):
        g = torch.Generator().manual_seed(e + m + c)
        v = torch.randint(0, 256, (e, m, c * 32), generator=g, dtype=torch.uint8)
        s = torch.randint(0, 256, (e, m, c), generator=g, dtype=torch.uint8)
        lv, ls = MoeLayout(e, m, c * 32, gated, dev, scales=False), MoeLayout(e, m, c, gated, dev, scales=True)
        assert lv.kernels is not None and ls.kernels is not None
        kv = torch.empty_like(v); lv(v, kv)
        ks = torch.zeros(e * interleaved_size(m, c), dtype=torch.uint8); ls(s, ks)
        assert torch.equal(kv.view(e, -1), vllm_steps(v, gated, scales=False))
        assert torch.equal(ks.view(e, -1), vllm_steps(s, gated, scales=True))
for rows, cols in ((128, 4), (100, 3), (7, 1), (200, 9)):
    sf = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    layout = LinearScaleLayout(rows, cols, dev)
    out = torch.zeros(layout.out_bytes, dtype=torch.uint8); layout(sf, out)
    assert torch.equal(out, swizzle_mxfp8_scale(sf, rows, cols * 32))
print("ok")
"""


def test_triton_layout_kernels_under_the_interpreter_equal_vllm():
    pytest.importorskip("triton")
    run_under_triton_interpreter(_INTERPRETED, timeout_s=900)
