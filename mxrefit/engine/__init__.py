"""Engine side: the ``Engine`` contract (``base``), ``TorchEngine``, the layout engine and the
landing helpers (staging, shards, TRT-LLM layout), and the vLLM engine (``vllm``)."""
