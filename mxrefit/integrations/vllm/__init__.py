"""vLLM as an mxrefit engine, plugged in the two ways RL stacks drive vLLM; one module a job.

- ``layout``: vLLM's fused checkpoint-format parameters as mxrefit tables (pure torch);
- ``engine``: ``VllmEngine``, the live model inside a vLLM worker (tables, staging, post-load);
- ``trtllm``: FlashInfer TRT-LLM MXFP8 MoE layouts as one-pass gathers;
- ``compat``: one adapter per difference between vLLM releases; ``cpu_amx``: AMX tiles on CPU;
- ``worker``: ``RefitWorkerExtension``, the worker-extension RPCs (``collective_rpc``);
- ``transfer``: the "mxrefit" weight-transfer backend classes (imports vLLM);
- ``client``: the trainer side, ``refit_while`` and ``LLMClient`` (registers nothing);
- ``plugin``: ``register``, the ``vllm.general_plugins`` entry point, the one side effect.

Plugging in:
- ``WeightTransferConfig(backend="mxrefit")``: ``MxrefitWeightTransferEngine`` (worker side)
  and ``MxrefitTrainerEngine`` (trainer side, ``WeightTransferTrainerFactory``) follow
  vLLM's ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update``. ``register()`` is the ``vllm.general_plugins`` entry point, so
  vLLM's processes know the backend without extra imports; it never raises.
- ``worker_extension_cls="mxrefit.integrations.vllm.worker.RefitWorkerExtension"`` with
  ``collective_rpc("mxrefit_init" | "mxrefit_receive" | ...)``, methods by name. With tensor
  parallel size > 1 every worker is one rank of ``mxrefit.source.broadcast_sender.BroadcastSender``
  (``rank_endpoints``, ``refit_while(..., until_shutdown=True)``; docs/vllm.md §3).
On a CPU build ``register()`` also registers vLLM's MXFP8 emulation linear kernel, which vLLM's
CPU builds lack, so dense MXFP8 models run on CPU. No module here registers anything on import.
"""
