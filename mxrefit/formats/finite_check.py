"""Find non-finite trainer tensors before any engine byte is written.

Why its own module: the screen reads every trainer byte once, so on a GPU it must run at
memory speed over tens of thousands of tensors. ``torch._foreach_norm`` costs several
launches and a reduction per tensor (76 ms for Qwen3-30B-A3B's 18,867 tensors on an H200,
against ~15 ms to read 61 GB); the Triton kernel here reads every tensor of a dtype in one
launch from a table of (tensor, chunk) built once, and only tests exponent bits. On CPU, or
for dtypes the kernel does not take, ``torch._foreach_norm`` does the job (a finite norm
proves a finite tensor; a non-finite norm is confirmed per tensor, since a norm can overflow).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mxrefit.devices import triton_kernels
from mxrefit.formats._common import NO_BAD, bad_flag, first_bad

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FiniteCheck:
    """Built once for fixed tensor specs; ``first_bad(tensors)`` returns the index of the first
    non-finite tensor, or None."""

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device | str):
        self.device = torch.device(device)
        self.n = len(specs)
        kernels = triton_kernels("mxrefit.formats._finite_check_triton", self.device)
        self._groups = []
        self._rest = list(range(self.n))
        if kernels is not None:
            for dtype in _KERNEL_DTYPES:
                idx = [i for i, (_, dt) in enumerate(specs) if dt == dtype]
                if idx:
                    numels = [int(torch.Size(specs[i][0]).numel()) for i in idx]
                    self._groups.append((idx, kernels.ScanGroup(numels, dtype, self.device)))
            grouped = {i for idx, _ in self._groups for i in idx}
            self._rest = [i for i in self._rest if i not in grouped]
        self._flag = bad_flag(self.device)

    def first_bad(self, tensors: Sequence[torch.Tensor]) -> int | None:
        candidates: list[int] = []
        if self._groups:
            self._flag.fill_(NO_BAD)
            for idx, group in self._groups:
                group([tensors[i] for i in idx], self._flag, idx)
            bad = first_bad(self._flag)
            if bad is not None:
                candidates.append(bad)
        if self._rest:
            rest = [tensors[i] for i in self._rest]
            norms = torch.stack(torch._foreach_norm(rest))
            for j in torch.nonzero(~torch.isfinite(norms)).flatten().tolist():
                if not bool(torch.isfinite(rest[j]).all()):
                    candidates.append(self._rest[j])
                    break
        return min(candidates) if candidates else None
