"""What the quantized formats share: the non-finite error, labels, destination checks, backend choice.

One ``NonFiniteError`` class serves every format, so a refit can catch one type whatever the
engine's format is.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

import torch

from mxrefit.errors import MxrefitError

Backend = Literal["auto", "torch", "triton"]


class NonFiniteError(MxrefitError, ValueError):
    """The input holds NaN or Inf; raised before any byte is returned as valid."""


def label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "input"


def check_out(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, role: str, what: str) -> None:
    """A destination must be exactly the part it receives: shape, dtype, device, contiguous."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{what}: {role} must be {dtype} of shape {tuple(shape)}, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{what}: {role} is on {t.device} but the input is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: {role} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def destinations(
    x: torch.Tensor,
    vshape: tuple[int, ...],
    sshape: tuple[int, ...],
    value_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and scales to write: the caller's (checked to be exactly the part) or new ones."""
    if out is None:
        out = torch.empty(vshape, dtype=value_dtype, device=x.device)
    else:
        check_out(out, vshape, value_dtype, x.device, "out", what)
    if scale_out is None:
        scale_out = torch.empty(sshape, dtype=scale_dtype, device=x.device)
    else:
        check_out(scale_out, sshape, scale_dtype, x.device, "scale_out", what)
    return out, scale_out


NO_BAD = 2**31 - 1  # int32 max: no non-finite unit recorded


def bad_flag(device: torch.device) -> torch.Tensor:
    """The int32 [1] cell kernels ``atomic_min`` the first non-finite unit (block, tile, tensor) index into."""
    return torch.full((1,), NO_BAD, dtype=torch.int32, device=device)


def first_bad(flag: torch.Tensor) -> int | None:
    """The index recorded in ``flag``, or None (one synchronization on a GPU)."""
    first = int(flag.item())
    return None if first == NO_BAD else first


def kernel_module(name: str) -> ModuleType | None:
    """``mxrefit.formats.<name>`` (a Triton kernel module), or None where triton is not installed."""
    try:
        return importlib.import_module(f"mxrefit.formats.{name}")
    except ImportError:
        return None


def choose_backend(x: torch.Tensor, backend: Backend, kernels: ModuleType | None) -> str:
    """``"triton"`` or ``"torch"``: auto takes the kernel for inputs it supports on CUDA."""
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if kernels is None or not kernels.supports(x):
            raise ValueError(
                f"backend='triton' needs triton and a bfloat16/float16 input on CUDA (or TRITON_INTERPRET=1 "
                f"on CPU), got {x.dtype} on {x.device}"
            )
        return "triton"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return "triton" if x.is_cuda and kernels is not None and kernels.supports(x) else "torch"
