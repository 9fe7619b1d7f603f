"""The grouped kernels' promise that aligned tables give wide memory accesses, read in their PTX.

Grouped kernels load each tensor's address from a table, and a loaded pointer carries no
alignment, so every kernel says ``tl.multiple_of(ptr, 16)`` under ``ALIGNED``. Without it every
access is scalar. That happened once without any test noticing: a jit helper returning the
table's pointers lost the hint under Triton 3.6 (the device image's) but not 3.9, and the MXFP8
kernel-layout launch ran at 159 GB/s instead of about 2.7 TB/s on an H100 (docs/benchmarks.md,
"A/B of 2026-12-06"). The kernels are compiled here for sm_90 without a GPU, with whatever
Triton is installed; to check the device's Triton, put its wheel first on the path:
``pip install --no-deps --target /tmp/tr36 triton==3.6.0`` then
``PYTHONPATH=/tmp/tr36:$PWD python -m pytest tests/unit/test_kernel_codegen.py``.
"""

from __future__ import annotations

import collections
import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels; the interpreter run has its own tests", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mxrefit.formats import _finite_check_triton, _fp8_block_triton, _mxfp8_triton, _passthrough_triton  # noqa: E402

# the permuted write's own types: its unit map is int32, its unit count a scalar
TYPED = {"local": "*i32", "units": "i32"}
I32 = {"prog_tensor", "prog_block", "prog_tile", "prog_chunk", "prog_start", "caller_index", "bad_ptr", "flag", "tiled_of"}
FLOOR = _fp8_block_triton._AMAX_FLOOR_BITS
MASK = 0x7F80  # BF16 exponent

# kernel, its constexprs (ALIGNED added per case), whether it writes bulk data (a plain scan only reads).
# A masked tail (copy, scan) stays narrow by design; the whole-chunk path must be wide.
KERNELS = {
    "mxfp8 group": (_mxfp8_triton._group_kernel, dict(MIN_BYTE=0, NB=128, ITERS=1, INT_ROUND=False, IS_BF16=True), True),
    "mxfp8 group, 4 runs": (
        _mxfp8_triton._group_kernel,
        dict(MIN_BYTE=0, NB=128, ITERS=4, INT_ROUND=False, IS_BF16=True),
        True,
    ),
    "mxfp8 kernel layout": (
        _mxfp8_triton._layout_group_kernel,
        dict(MIN_BYTE=0, NB=128, ITERS=1, INT_ROUND=False, IS_BF16=True),
        True,
    ),
    "mxfp8 permuted write (units of 4 blocks, 32 a program)": (
        _mxfp8_triton._permuted_kernel,
        dict(R=32, G=4, C=2, MIN_BYTE=0, INT_ROUND=False, IS_BF16=True),
        True,
    ),
    "fp8 block group": (
        _fp8_block_triton._group_kernel,
        dict(BN=128, BK=128, UE8M0=False, INT_ROUND=False, IS_BF16=True, AMAX_FLOOR_BITS=FLOOR),
        True,
    ),
    "passthrough copy": (
        _passthrough_triton._copy_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=16, LANES=1, CHUNK=16384, BLOCK=2048),
        True,
    ),
    "passthrough copy, BF16 pairs": (
        _passthrough_triton._copy_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=32, LANES=2, CHUNK=8192, BLOCK=1024),
        True,
    ),
    "passthrough copy, BF16 quads": (  # the library's default where sizes and addresses allow
        _passthrough_triton._copy_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=64, LANES=4, CHUNK=4096, BLOCK=1024),
        True,
    ),
    "finite scan": (
        _finite_check_triton._scan_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=16, LANES=1, CHUNK=16384, BLOCK=2048),
        False,
    ),
    "finite scan, BF16 pairs": (
        _finite_check_triton._scan_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=32, LANES=2, CHUNK=8192, BLOCK=1024),
        False,
    ),
    "finite scan, BF16 quads": (
        _finite_check_triton._scan_kernel,
        dict(EXP_MASK=MASK, WORD_BITS=64, LANES=4, CHUNK=4096, BLOCK=512),
        False,
    ),
}


def global_accesses(kernel, constexprs: dict, aligned: bool) -> collections.Counter:
    """Counts of each global load/store instruction in the kernel's sm_90 PTX. ``aligned``: the
    kernel's ALIGNED constexpr where it has one (table-loaded addresses), else 16-byte aligned
    pointer arguments (what Triton's launcher specializes for tensors from PyTorch's allocator)."""
    names = [p.name for p in kernel.params]
    consts = dict(constexprs, ALIGNED=aligned) if "ALIGNED" in names else dict(constexprs)
    typed = TYPED if kernel is _mxfp8_triton._permuted_kernel else {}
    signature = {
        p.name: "constexpr" if p.is_constexpr else typed.get(p.name, "*i32" if p.name in I32 else "*i64") for p in kernel.params
    }
    attrs = {}
    if aligned and "ALIGNED" not in names:
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name].startswith("*")}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    return collections.Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)+", compiled.asm["ptx"]))


def _wide(counts: collections.Counter, op: str) -> int:
    """Vector accesses (2 or 4 words at a time) of kind ``op`` ("ld" or "st")."""
    return sum(n for ins, n in counts.items() if ins.startswith(f"{op}.global") and (".v2." in ins or ".v4." in ins))


def _narrow_16(counts: collections.Counter) -> int:
    """16-bit scalar loads: the BF16 source read an element at a time."""
    return sum(n for ins, n in counts.items() if ins.startswith("ld.global") and ins.endswith((".b16", ".u16", ".s16")))


@pytest.mark.parametrize("name", list(KERNELS))
def test_aligned_tables_give_wide_accesses(name):
    kernel, consts, writes = KERNELS[name]
    aligned = global_accesses(kernel, consts, aligned=True)
    assert _wide(aligned, "ld") > 0, f"{name}: source read narrow when aligned: {dict(aligned)}"
    if writes:
        assert _wide(aligned, "st") > 0, f"{name}: bulk bytes written narrow when aligned: {dict(aligned)}"


@pytest.mark.parametrize(
    "name", ["mxfp8 kernel layout", "passthrough copy", "mxfp8 permuted write (units of 4 blocks, 32 a program)"]
)
def test_without_the_hint_accesses_are_narrow(name):
    """Negative control: the same kernel with ALIGNED off has no wide access, so the check above can fail."""
    kernel, consts, _ = KERNELS[name]
    unaligned = global_accesses(kernel, consts, aligned=False)
    assert _narrow_16(unaligned) > 0 and _wide(unaligned, "ld") == 0 and _wide(unaligned, "st") == 0, dict(unaligned)
