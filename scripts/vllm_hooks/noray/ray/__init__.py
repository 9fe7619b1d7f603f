"""An empty stand-in for ``ray``, which the H200 image lacks: vLLM 0.26's IPC weight-transfer
module (``vllm/distributed/weight_transfer/ipc_engine.py``) imports ray at its top for its
'ray' send mode only. scripts/gpu_vllm.sh puts this folder on PYTHONPATH for the headline run
alone; the callable send mode used there never touches ray. vLLM's own probes
(``vllm/ray/lazy_utils.py``) see a Ray that is not initialized; anything else fails loudly."""


def is_initialized() -> bool:
    return False


def __getattr__(name):
    raise AttributeError(f"ray is not installed here (stand-in from scripts/vllm_hooks/noray): ray.{name}")
