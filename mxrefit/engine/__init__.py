"""Engine side: ``Receiver`` (serves refits), the ``Engine`` contract (``base``), ``TorchEngine``,
``LayoutEngine``, and the landing helpers (``staging``, ``shards``, ``tensor_parallel``).
Engines of other projects live in ``mxrefit.integrations`` (vLLM)."""
