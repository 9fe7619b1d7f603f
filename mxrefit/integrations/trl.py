"""TRL's ``GRPOTrainer`` with its colocated vLLM refitted through mxrefit.

``MxrefitGRPOTrainer`` is a drop-in ``trl.GRPOTrainer`` (``vllm_mode="colocate"``) whose vLLM
runs mxrefit's worker extension and whose weight sync is one mxrefit refit of TRL's own
parameter walk: BF16, or MXFP8 with vLLM started from ``save_mxfp8_checkpoint`` of the policy.

Why a subclass that starts vLLM itself: TRL 1.16 builds its ``vllm.LLM`` inside
``VLLMGeneration._init_vllm`` with a fixed set of arguments (no ``worker_extension_cls``, the
model's own path), called from ``GRPOTrainer.__init__``; nothing in ``GRPOConfig`` reaches
them. So this class runs TRL's constructor with vLLM off, then starts the generation backend
itself — TRL's ``VLLMGeneration`` (its sampling, log-probabilities and parameter walk
unchanged) with only the ``LLM`` arguments and ``sync_weights`` replaced — and hands it to the
trainer in the two attributes TRL's training loop reads (``vllm_generation``,
``_last_loaded_step``). The TRL versions this was checked against are pinned (``SUPPORTED_TRL``).

Server mode is refused: TRL 1.16's ``VLLMClient.init_communicator`` (called from
``VLLMGeneration._init_vllm``) always sets up vLLM's NCCL weight transfer, whatever backend
the server runs (docs/integrations.md, "TRL").
"""

from __future__ import annotations

import copy
import os
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from mxrefit.errors import MxrefitError
from mxrefit.integrations.vllm.client import refit_while
from mxrefit.plan.build import SourceSpec
from mxrefit.source.checkpoint import save_mxfp8_checkpoint
from mxrefit.source.sender import RefitReport, Sender

SUPPORTED_TRL = ("1.16.",)
TESTED_TRL = "1.16.0"
FORMATS = ("bf16", "mxfp8")
EXTENSION = "mxrefit.integrations.vllm.worker.RefitWorkerExtension"


class TrlIntegrationError(MxrefitError, RuntimeError):
    """TRL or its configuration is outside what this integration supports."""


def check_trl_version(found: str | None = None) -> str:
    """``found`` (default: the installed TRL's version) if supported, else TrlIntegrationError:
    the integration replaces TRL internals (vLLM start-up, weight sync) that TRL changes between
    minor versions."""
    if found is None:
        try:
            found = version("trl")
        except PackageNotFoundError as err:
            raise TrlIntegrationError(
                f"mxrefit.integrations.trl needs TRL: pip install 'mxrefit[trl]' (trl {TESTED_TRL})"
            ) from err
    if not found.startswith(SUPPORTED_TRL):
        raise TrlIntegrationError(
            f"mxrefit.integrations.trl supports trl {', '.join(v + 'x' for v in SUPPORTED_TRL)} (tested with "
            f"{TESTED_TRL}); found trl {found}. It replaces GRPOTrainer's vLLM start-up and weight sync, which "
            f"other TRL versions may do differently: install trl=={TESTED_TRL}"
        )
    return found


def check_config(args: Any, refit_format: str) -> None:
    """Refuse, by name, every GRPOConfig setting the integration does not serve."""
    if refit_format not in FORMATS:
        raise TrlIntegrationError(f"refit_format must be one of {FORMATS}, got {refit_format!r}")
    if args is None or not args.use_vllm:
        raise TrlIntegrationError(
            "MxrefitGRPOTrainer refits a vLLM engine: pass GRPOConfig(use_vllm=True, vllm_mode='colocate', ...)"
        )
    if args.vllm_mode != "colocate":
        raise TrlIntegrationError(
            f"vllm_mode={args.vllm_mode!r} is not supported: TRL {TESTED_TRL}'s server client "
            "(trl/generation/vllm_client.py, VLLMClient.init_communicator, called while GRPOTrainer is built) "
            "always opens vLLM's NCCL weight transfer, so a server started with "
            '--weight-transfer-config \'{"backend": "mxrefit"}\' cannot be driven from TRL; use '
            "vllm_mode='colocate' (docs/integrations.md, TRL)"
        )
    if args.vllm_tensor_parallel_size != 1:
        raise TrlIntegrationError(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: the colocated refit writes one whole "
            "vLLM worker; tensor-parallel vLLM is refitted over mxrefit's broadcast transport, which this "
            "integration does not drive"
        )
    if args.vllm_enable_sleep_mode:
        raise TrlIntegrationError(
            "vllm_enable_sleep_mode=True is not supported: mxrefit's staging memory is not "
            "part of vLLM's sleep pool, and this path has not been tested"
        )


def save_engine_checkpoint(model: torch.nn.Module, processing_class: Any, path: str) -> str:
    """The step-0 policy as a ModelOpt MXFP8 checkpoint (BF16 where the rules keep BF16), with
    the tokenizer beside it, so vLLM starts in the bytes every refit will send."""
    save_mxfp8_checkpoint(copy.deepcopy(model).to(torch.bfloat16), path)
    processing_class.save_pretrained(path)
    return path


def _classes() -> tuple[type, type]:
    """The TRL subclasses, defined on first use so importing this module needs neither TRL nor vLLM."""
    check_trl_version()
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM

    class MxrefitVLLMGeneration(VLLMGeneration):
        """TRL's generation backend with mxrefit's worker extension in vLLM and a refit as its weight sync."""

        def __init__(self, *args: Any, engine_path: str, llm_kwargs: dict | None = None, **kwargs: Any):
            self.engine_path = engine_path
            self.llm_kwargs = llm_kwargs or {}
            self.sender: Sender | None = None
            self.specs: list[SourceSpec] | None = None
            self.reports: list[RefitReport] = []
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            """TRL 1.16's colocated start-up (TP = 1), plus the worker extension and the engine's checkpoint."""
            accelerator = self.accelerator
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            self.llm = LLM(
                model=self.engine_path,
                tensor_parallel_size=1,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_length,
                max_num_seqs=self.max_num_seqs,
                model_impl=self.model_impl,
                distributed_executor_backend="external_launcher",
                seed=accelerator.process_index,
                max_num_batched_tokens=4096,
                logprobs_mode="processed_logprobs",
                trust_remote_code=self.trust_remote_code,
                worker_extension_cls=EXTENSION,
                **self.llm_kwargs,
            )
            self._llm_weights_sleeping = False
            accelerator.wait_for_everyone()

        def sync_weights(self) -> None:
            """One refit of TRL's parameter walk (names as vLLM expects them, PEFT merged, one gathered
            tensor at a time), served by the in-process worker while this thread sends it."""
            if self.sender is None:
                info = self.llm.collective_rpc("mxrefit_init")[0]
                self.sender = Sender(info["address"], bytes.fromhex(info["token"]), device=self.accelerator.device)
                self.specs = [SourceSpec(n, tuple(t.shape), t.dtype) for n, t in self._iter_named_params()]
            t0 = time.perf_counter()
            report = refit_while(
                lambda: self.llm.collective_rpc("mxrefit_receive"), self.sender, self._iter_named_params(), specs=self.specs
            )
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the previous weights
            report.extra["sync_s"] = time.perf_counter() - t0
            self.reports.append(report)

        def close(self) -> None:
            """Close the refit channel on both sides (the worker's socket before vLLM stops)."""
            if self.sender is not None:
                self.sender.close()
                self.llm.collective_rpc("mxrefit_close")
                self.sender = None

    class MxrefitGRPOTrainer(GRPOTrainer):
        """``trl.GRPOTrainer`` whose colocated vLLM is refitted by mxrefit at every weight sync.

        ``refit_format``: ``"bf16"`` (vLLM starts from the model's own path, as in TRL) or
        ``"mxfp8"`` (vLLM starts from ``save_mxfp8_checkpoint`` of the policy, written under
        ``engine_checkpoint_dir``, default ``<output_dir>/mxrefit-mxfp8``; refits quantize on the
        trainer). ``llm_kwargs``: further ``vllm.LLM`` arguments (e.g. ``enforce_eager=True``),
        which TRL's own start-up has no way to take. Every refit's ``RefitReport`` is in
        ``refit_reports``; the logs get ``mxrefit/version``, ``mxrefit/refit_ms`` and
        ``mxrefit/bytes``. ``vllm_generation.close()`` closes the refit channel when done.
        """

        generation_class = MxrefitVLLMGeneration

        def __init__(
            self,
            model: Any,
            reward_funcs: Any = None,
            args: Any = None,
            *rest: Any,
            refit_format: str = "bf16",
            engine_checkpoint_dir: str | None = None,
            llm_kwargs: dict | None = None,
            **kwargs: Any,
        ):
            check_config(args, refit_format)
            args.use_vllm = False  # TRL would start its own vLLM; this class starts it below
            try:
                super().__init__(model, reward_funcs, args, *rest, **kwargs)
            finally:
                args.use_vllm = True
            self.use_vllm = True
            if self.accelerator.device.type != "cpu":
                raise TrlIntegrationError(
                    f"device {self.accelerator.device}: TRL's colocated vLLM runs in the trainer's own process, and "
                    "mxrefit's device transports (CUDA IPC) cannot open memory in the process that exported it; "
                    "until mxrefit has a same-process device path this integration runs on CPU only "
                    "(docs/integrations.md, TRL)"
                )
            self.refit_format = refit_format
            self._logged_reports = 0
            policy = self.accelerator.unwrap_model(self.model)
            engine_path = policy.name_or_path
            if refit_format == "mxfp8":
                if is_peft_model(policy):
                    raise TrlIntegrationError("refit_format='mxfp8' with a PEFT model is not supported")
                engine_path = engine_checkpoint_dir or os.path.join(args.output_dir, "mxrefit-mxfp8")
                if self.accelerator.is_main_process:
                    save_engine_checkpoint(policy, self.processing_class, engine_path)
                self.accelerator.wait_for_everyone()
            # the arguments GRPOTrainer.__init__ (TRL 1.16) gives VLLMGeneration in colocate mode
            self.vllm_generation = self.generation_class(
                model=self.model,
                accelerator=self.accelerator,
                processing_class=self.processing_class,
                engine_path=engine_path,
                llm_kwargs=llm_kwargs,
                mode="colocate",
                structured_outputs_regex=args.vllm_structured_outputs_regex,
                tensor_parallel_size=1,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_length=args.vllm_max_model_length,
                max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
                enable_sleep_mode=False,
                model_impl=args.vllm_model_impl,
                trust_remote_code=args.trust_remote_code,
                repetition_penalty=self.repetition_penalty,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                max_completion_length=self.max_completion_length,
                logprobs=0,
                generation_kwargs=args.generation_kwargs,
            )
            self._last_loaded_step = -1  # TRL's tag: sync once per optimizer step

        @property
        def refit_reports(self) -> list[RefitReport]:
            """Every refit so far, in order (version, bytes, transport, phase times)."""
            return self.vllm_generation.reports

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            """TRL's logs plus the refits made since the last log."""
            new = self.refit_reports[self._logged_reports :]
            if new and self.model.training:
                logs["mxrefit/version"] = new[-1].version
                logs["mxrefit/refit_ms"] = sum(r.total_s for r in new) / len(new) * 1e3
                logs["mxrefit/bytes"] = new[-1].bytes
                self._logged_reports = len(self.refit_reports)
            super().log(logs, start_time)

    return MxrefitVLLMGeneration, MxrefitGRPOTrainer


def __getattr__(name: str) -> type:
    if name in ("MxrefitVLLMGeneration", "MxrefitGRPOTrainer"):
        generation, trainer = _classes()
        globals().update(MxrefitVLLMGeneration=generation, MxrefitGRPOTrainer=trainer)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
