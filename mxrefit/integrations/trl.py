"""TRL's ``GRPOTrainer`` with its vLLM (colocated, or a server) refitted through mxrefit.

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

Server mode (``vllm_mode="server"``): the server runs mxrefit's weight-transfer backend
(``--weight-transfer-config '{"backend": "mxrefit"}'``). TRL 1.16's ``VLLMClient`` always opens
vLLM's NCCL transfer in ``init_communicator`` and broadcasts over it in
``update_named_params``; ``MxrefitVLLMClient`` replaces just those two (and
``close_communicator``) with mxrefit's trainer engine over vLLM's HTTP weight-sync client,
so TRL's generation requests and its server-mode ``sync_weights`` stay TRL's; ``check_server``
refuses a server the refit cannot drive. The refit's endpoint is a private Unix socket the
trainer makes: trainer and server on one host.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import time
from collections.abc import Iterator
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
# the server's ``model_config.quantization`` for each refit format: BF16 serves an unquantized
# checkpoint, MXFP8 one written by ``save_mxfp8_checkpoint`` (vLLM's ModelOpt MXFP8 loader)
SERVER_QUANTIZATION = {"bf16": None, "mxfp8": "modelopt_mxfp8"}
SERVER_COMMAND = (
    'VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config \'{"backend": "mxrefit"}\' '
    "--logprobs-mode processed_logprobs"
)
EXTENSION = "mxrefit.integrations.vllm.worker.RefitWorkerExtension"
log = logging.getLogger("mxrefit.trl")


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
    if args.vllm_mode not in ("colocate", "server"):
        raise TrlIntegrationError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}")
    if args.vllm_mode == "server":
        return  # the server's own settings are checked against it when the client connects (check_server)
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


def check_server(info: dict, world_size: int, refit_format: str, base_url: str) -> None:
    """Refuse, naming the fix, a vLLM server (its ``/server_info`` config and worker count) that
    mxrefit's server-mode refit cannot drive, before any weight moves."""
    transfer = info.get("weight_transfer_config") or {}
    if transfer.get("backend") != "mxrefit":
        raise TrlIntegrationError(
            f"the vLLM server at {base_url} runs weight-transfer backend {transfer.get('backend')!r}, not 'mxrefit': "
            f"mxrefit refits it through its own backend. Restart it as {SERVER_COMMAND} "
            "(the mxrefit package installed beside vLLM registers the backend); docs/integrations.md, TRL"
        )
    if world_size != 1:
        raise TrlIntegrationError(
            f"the vLLM server at {base_url} has {world_size} workers: the 'mxrefit' weight-transfer backend serves "
            "one worker (tensor and data parallel size 1); larger engines are refitted through the worker extension "
            "and mxrefit's broadcast transport (docs/vllm.md)"
        )
    quantization = (info.get("model_config") or {}).get("quantization")
    if quantization != SERVER_QUANTIZATION[refit_format]:
        fix = (
            "start the server from save_engine_checkpoint(policy, tokenizer, path) (a ModelOpt MXFP8 checkpoint)"
            if refit_format == "mxfp8"
            else "pass refit_format='mxfp8' for a server started from save_engine_checkpoint, or serve the BF16 model"
        )
        raise TrlIntegrationError(
            f"refit_format={refit_format!r} but the vLLM server at {base_url} serves quantization {quantization!r} "
            f"(expected {SERVER_QUANTIZATION[refit_format]!r}): {fix}"
        )


def save_engine_checkpoint(model: torch.nn.Module, processing_class: Any, path: str) -> str:
    """The step-0 policy as a ModelOpt MXFP8 checkpoint (BF16 where the rules keep BF16), with
    the tokenizer beside it, so vLLM starts in the bytes every refit will send."""
    save_mxfp8_checkpoint(copy.deepcopy(model).to(torch.bfloat16), path)
    processing_class.save_pretrained(path)
    return path


class TrlStream:
    """One weight sync of TRL's server client as a weight source for mxrefit's trainer engine:
    the ``(name, dtype, shape)`` list TRL announces, then the tensors it streams.

    Why not vLLM's ``ModuleSource``: TRL's walk (vLLM names, PEFT merged, ZeRO-3 gathered) is
    handed to ``update_named_params`` afresh at every sync, and only there. Every sync must
    announce the list of the first one, which the refit's plan was made from."""

    def __init__(self) -> None:
        self.announced: list[tuple[str, str, list[int]]] | None = None
        self.tensors: Iterator[tuple[str, torch.Tensor]] | None = None

    def load(self, metadata: list[tuple[str, str, list[int]]], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        metadata = [(n, d, list(shape)) for n, d, shape in metadata]
        if self.announced is None:
            self.announced = metadata
        elif metadata != self.announced:
            raise TrlIntegrationError(
                "update_named_params announced other tensors than the first weight sync, which the refit's plan was "
                "made from: mxrefit refits the whole model every time (update_model_params, or TRL's sync_weights)"
            )
        self.tensors = tensors

    def metadata(self) -> list[SourceSpec]:
        assert self.announced is not None, "load() comes first"
        return [SourceSpec(n, tuple(shape), getattr(torch, d)) for n, d, shape in self.announced]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors, self.tensors = self.tensors, None  # one pass per sync
        if tensors is None:
            raise TrlIntegrationError("a weight sync's tensors are streamed once")
        return tensors


def _classes() -> tuple[type, type, type]:
    """The TRL subclasses, defined on first use so importing this module needs neither TRL nor vLLM."""
    check_trl_version()
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from mxrefit.integrations.vllm.transfer import MxrefitTrainerEngine, MxrefitTrainerInitInfo

    class MxrefitVLLMClient(VLLMClient):
        """TRL's vLLM server client whose weight transfer is mxrefit's backend instead of NCCL.

        Generation, ``reset_prefix_cache`` and everything else are TRL's. ``init_communicator``
        checks the server (``check_server``) and hands mxrefit's endpoint (a private Unix
        socket + session token) to the server's ``/init_weight_transfer_engine``;
        ``update_named_params`` (and so ``update_model_params``) is one refit through
        ``/start_weight_update``, ``/update_weights`` (served while mxrefit sends) and
        ``/finish_weight_update``. Trainer and server must share a host. Every refit's
        ``RefitReport`` is in ``reports``.
        """

        def __init__(self, *args: Any, refit_format: str = "bf16", **kwargs: Any):
            self.refit_format = refit_format
            self.engine: Any = None  # MxrefitTrainerEngine, from init_communicator
            self.stream = TrlStream()
            self.reports: list[RefitReport] = []
            super().__init__(*args, **kwargs)

        def init_communicator(self, device: torch.device | str | int = 0) -> None:
            check_server(self.get_server_info(), self.get_world_size(), self.refit_format, self.base_url)
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            weight_sync = HTTPVLLMWeightSyncClient(self.base_url)
            try:
                self.engine = MxrefitTrainerEngine.trainer_init(
                    MxrefitTrainerInitInfo(rank=0, device=str(device)), client=weight_sync, source=self.stream
                )
            except Exception as err:
                raise TrlIntegrationError(
                    f"the vLLM server at {self.base_url} could not open mxrefit's endpoint ({err}); it listens on a "
                    "Unix socket the trainer makes, so trainer and server must run on the same host"
                ) from err
            atexit.register(self.close_communicator)

        def update_named_params(
            self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
        ) -> None:
            """One refit of the whole model from TRL's announced list and stream."""
            if self.engine is None:
                raise TrlIntegrationError("call init_communicator before updating the server's weights")
            if self._updating_weights:
                raise TrlIntegrationError(
                    "weight_update() groups per-tensor updates; mxrefit refits the whole model in one update: "
                    "call update_model_params or update_named_params with every tensor"
                )
            self.stream.load(metadata, named_params)
            self.engine.send_weights()
            self.reports.append(self.engine.last_report)

        def close_communicator(self) -> None:
            """Close the refit channel on both sides (the server's socket too, while the server is up)."""
            engine, self.engine = self.engine, None
            if engine is not None:
                engine.shutdown()
                try:
                    engine.client.shutdown_weight_transfer_engine()
                except Exception:  # noqa: BLE001 - at exit the server may be gone; its socket goes with it
                    pass

    class MxrefitVLLMGeneration(VLLMGeneration):
        """TRL's generation backend with mxrefit's worker extension in vLLM and a refit as its weight sync."""

        def __init__(
            self, *args: Any, engine_path: str, refit_format: str = "bf16", llm_kwargs: dict | None = None, **kwargs: Any
        ):
            self.engine_path = engine_path
            self.refit_format = refit_format
            self.llm_kwargs = llm_kwargs or {}
            self.sender: Sender | None = None
            self.specs: list[SourceSpec] | None = None
            self.reports: list[RefitReport] = []
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            """TRL 1.16's colocated start-up (TP = 1), plus the worker extension and the engine's checkpoint;
            or TRL's server connection through ``MxrefitVLLMClient``."""
            accelerator = self.accelerator
            if self.mode == "server":
                if accelerator.is_main_process:
                    base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = MxrefitVLLMClient(
                        base_url=base_url,
                        group_port=self.group_port,
                        connection_timeout=self.server_timeout,
                        refit_format=self.refit_format,
                    )
                    self.vllm_client.init_communicator(device=accelerator.device)
                accelerator.wait_for_everyone()
                return
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
            tensor at a time), served by the in-process worker while this thread sends it; in server
            mode TRL's own server sync, whose client refits through mxrefit."""
            if self.mode == "server":
                t0 = time.perf_counter()
                super().sync_weights()
                if self.accelerator.is_main_process:
                    report = self.vllm_client.reports[-1]
                    report.extra["sync_s"] = time.perf_counter() - t0
                    self.reports.append(report)
                return
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
            if self.mode == "server":
                if self.accelerator.is_main_process:
                    self.vllm_client.close_communicator()
                return
            if self.sender is not None:
                self.sender.close()
                self.llm.collective_rpc("mxrefit_close")
                self.sender = None

    class MxrefitGRPOTrainer(GRPOTrainer):
        """``trl.GRPOTrainer`` whose vLLM (colocated, or a server) is refitted by mxrefit at every weight sync.

        ``refit_format``: ``"bf16"`` (vLLM starts from the model's own path, as in TRL) or
        ``"mxfp8"`` (vLLM starts from ``save_mxfp8_checkpoint`` of the policy, written under
        ``engine_checkpoint_dir``, default ``<output_dir>/mxrefit-mxfp8``; refits quantize on the
        trainer). ``llm_kwargs``: further ``vllm.LLM`` arguments (e.g. ``enforce_eager=True``),
        which TRL's own start-up has no way to take. With ``vllm_mode="server"`` the server
        runs the ``mxrefit`` weight-transfer backend and was started from the model's path
        (BF16) or from ``save_engine_checkpoint`` (MXFP8); ``engine_checkpoint_dir`` and
        ``llm_kwargs`` do not apply there. Every refit's ``RefitReport`` is in
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
            self.refit_format = refit_format
            self._logged_reports = 0
            self._last_loaded_step = -1  # TRL's tag: sync once per optimizer step
            policy = self.accelerator.unwrap_model(self.model)
            # the arguments GRPOTrainer.__init__ (TRL 1.16) gives VLLMGeneration in either mode
            trl_kwargs = dict(
                model=self.model,
                accelerator=self.accelerator,
                processing_class=self.processing_class,
                refit_format=refit_format,
                structured_outputs_regex=args.vllm_structured_outputs_regex,
                max_model_length=args.vllm_max_model_length,
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
            if args.vllm_mode == "server":
                self.vllm_generation = self.generation_class(
                    **trl_kwargs,
                    engine_path=policy.name_or_path,
                    mode="server",
                    server_base_url=args.vllm_server_base_url,
                    server_host=args.vllm_server_host,
                    server_port=args.vllm_server_port,
                    group_port=args.vllm_group_port,
                    server_timeout=args.vllm_server_timeout,
                )
                if args.vllm_importance_sampling_correction and self.accelerator.is_main_process:
                    # TRL's own check in server mode: the correction needs processed log-probabilities
                    mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
                    if mode != "processed_logprobs":
                        log.warning(
                            f"The vLLM server runs with --logprobs-mode {mode}, which biases TRL's importance sampling "
                            "correction: restart it with --logprobs-mode processed_logprobs"
                        )
                return
            engine_path = policy.name_or_path
            if refit_format == "mxfp8":
                if is_peft_model(policy):
                    raise TrlIntegrationError("refit_format='mxfp8' with a PEFT model is not supported")
                engine_path = engine_checkpoint_dir or os.path.join(args.output_dir, "mxrefit-mxfp8")
                if self.accelerator.is_main_process:
                    save_engine_checkpoint(policy, self.processing_class, engine_path)
                self.accelerator.wait_for_everyone()
            self.vllm_generation = self.generation_class(
                **trl_kwargs,
                engine_path=engine_path,
                llm_kwargs=llm_kwargs,
                mode="colocate",
                tensor_parallel_size=1,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
                enable_sleep_mode=False,
            )

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

    return MxrefitVLLMClient, MxrefitVLLMGeneration, MxrefitGRPOTrainer


def __getattr__(name: str) -> type:
    if name in ("MxrefitVLLMClient", "MxrefitVLLMGeneration", "MxrefitGRPOTrainer"):
        client, generation, trainer = _classes()
        globals().update(MxrefitVLLMClient=client, MxrefitVLLMGeneration=generation, MxrefitGRPOTrainer=trainer)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
