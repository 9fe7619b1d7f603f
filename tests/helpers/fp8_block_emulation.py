"""A torch emulation of vLLM's block-FP8 linear kernel for vLLM's CPU build (tests only).

vLLM 0.32's CPU block-FP8 linear kernels need AMX (Sapphire Rapids or newer); elsewhere an
``Fp8Config`` block model fails to start with "Failed to find a kernel that can implement the
ScaledMM linear layer". This kernel subclasses vLLM's generic ``Fp8BlockScaledMMLinearKernel``,
so its post-load processing is vLLM's own (``weight``/``weight_scale_inv`` kept as loaded on
CPU), and computes ``F.linear`` on ``fp8_block.dequantize`` of them.

The registration must happen in the process that builds the model. Importing this module
registers it, so ``worker_extension_cls="tests.helpers.fp8_block_emulation.EmulatedFp8BlockRefitExtension"``
(mxrefit's worker extension, unchanged) makes a vLLM worker process register it before its
model is built; in-process engines call ``register_emulation_kernel()``.
"""

from __future__ import annotations

import torch.nn.functional as F

from mxrefit.formats import fp8_block
from mxrefit.integrations.vllm.worker import RefitWorkerExtension


def register_emulation_kernel() -> None:
    """Put the emulation kernel first among vLLM's CPU block-FP8 candidates (idempotent)."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import PlatformEnum

    candidates = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if any(k.__name__ == "EmulationFp8BlockKernel" for k in candidates):
        return

    class EmulationFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        @classmethod
        def can_implement(cls, config):
            return True, None

        def apply_weights(self, layer, x, bias=None, **kwargs):
            p = self._get_layer_params(layer)
            w = fp8_block.dequantize(p.weight, p.block_scale, x.dtype, tuple(self.weight_group_shape))
            return F.linear(x, w, bias)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError("the emulation dequantizes in apply_weights")

    # first, so AMX hosts (where vLLM's CPUFp8BlockScaledMMKernel would repack the weights) run the
    # same kernel as every other host, whose weight stays in the checkpoint layout the tests read
    candidates.insert(0, EmulationFp8BlockKernel)


class EmulatedFp8BlockRefitExtension(RefitWorkerExtension):
    """mxrefit's worker extension, from a module whose import registers the emulation kernel."""


register_emulation_kernel()
