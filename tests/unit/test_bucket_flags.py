"""The sender's per-bucket non-finite cells on CUDA (skipped elsewhere; run by the device's bench part)."""

from __future__ import annotations

import pytest
import torch

from mxrefit.source.sender import _BucketFlags

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the marked path copies through pinned memory behind a CUDA event"
)


@cuda
def test_a_marked_cell_reads_its_own_bucket_and_a_reused_cell_forgets_the_mark():
    flags = _BucketFlags(torch.device("cuda"))
    flags.cell(0).fill_(7)  # bucket 0's kernels found a non-finite unit 7
    flags.mark(0)
    assert flags.first_bad(0) == 7
    # an aborted one-behind refit left bucket 2's mark behind; the next refit (a stream: no mark) reuses the cell
    flags.cell(2).fill_(5)
    flags.mark(2)
    cell = flags.cell(4)  # same parity, unmarked by cell()
    assert flags.first_bad(4) is None
    cell.fill_(3)  # negative control: an unmarked cell is read from the device, so a value there is seen
    assert flags.first_bad(4) == 3
