"""Slim offload, reference swap and the phase on CPU: real transformers models, real AdamW, real FSDP2,
a real two-process refit. Pinned memory itself is exercised on the H200 (scripts/gpu_lifecycle.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mxrefit.lifecycle import (
    HostMemoryError,
    OptimizerOffloader,
    PinnedArena,
    ReferenceMismatch,
    ReferenceSwap,
    prepare_for_generation,
    prepare_for_training,
)
from mxrefit.lifecycle.arena import aligned_layout
from mxrefit.source.sender import RefitReport, Sender
from tests.helpers import models


def _bytes(t: torch.Tensor) -> bytes:
    if isinstance(t, torch.distributed.tensor.DTensor):
        t = t.to_local()
    return t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()  # .numpy() of t itself would pin its storage


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = _bytes(p)
        if p.grad is not None:
            out[name + ".grad"] = _bytes(p.grad)
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}:{key}"] = _bytes(value)
    return out


def _batch(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=gen)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trained(seed: int = 0, dtype=torch.float32, steps: int = 2):
    """A tiny Qwen3-MoE after real AdamW steps, with gradients of one more backward still in place."""
    model = models.tiny_qwen3_moe(seed, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = _batch(gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ids = _batch(gen)
    model(input_ids=ids, labels=ids).loss.backward()
    return model, opt


# ---- arena ----------------------------------------------------------------------------------


def test_layout_is_512_byte_aligned():
    assert aligned_layout([1, 513, 0, 5]) == ([0, 512, 1536, 1536], 2048)
    arena = PinnedArena(4096, pin=False)
    assert arena.data.data_ptr() % 4096 == 0 and arena.nbytes == 4096 and not arena.pinned
    with pytest.raises(IndexError, match="outside"):
        arena.view(4000, 200)


def test_short_host_memory_is_a_clear_error_before_anything_moves():
    with pytest.raises(HostMemoryError, match=r"needs 2\.00 GiB .* only 1\.00 GiB is available"):
        PinnedArena(2 << 30, what="test arena", available=lambda: 1 << 30, headroom_bytes=0)
    model, opt = _trained()
    before = _snapshot(model, opt)
    off = OptimizerOffloader(opt, available=lambda: 1 << 20)
    with pytest.raises(HostMemoryError, match=r"optimizer offload arena needs .* GiB of host memory .* available"):
        off.offload()
    assert not off.offloaded and _snapshot(model, opt) == before
    with pytest.raises(HostMemoryError, match="reference swap"):
        ReferenceSwap(
            dict(model.named_parameters()),
            dict(models.tiny_qwen3_moe(1, dtype=torch.float32).named_parameters()),
            available=lambda: 0,
        )


# ---- optimizer offload ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_frees_state_and_grads_and_reload_is_bit_exact(dtype):
    model, opt = _trained(dtype=dtype)
    params = dict(model.named_parameters())
    before = _snapshot(model, opt)
    state_objects = {n: dict(opt.state[p]) for n, p in params.items()}
    grads = {n: p.grad for n, p in params.items()}
    param_ptrs = {n: p.data_ptr() for n, p in params.items()}
    expected = sum(t.untyped_storage().nbytes() for s in state_objects.values() for t in s.values()) + sum(
        g.untyped_storage().nbytes() for g in grads.values()
    )
    off = OptimizerOffloader(opt, named_parameters=model.named_parameters())

    moved = off.offload()
    off.wait()
    assert moved == expected
    assert all(p.grad is None for p in params.values())
    assert all(t.untyped_storage().nbytes() == 0 for s in state_objects.values() for t in s.values())
    assert {n: _bytes(p) for n, p in params.items()} == {n: before[n] for n in params}  # parameters stay
    assert {n: p.data_ptr() for n, p in params.items()} == param_ptrs

    assert off.reload() == moved
    off.wait()
    assert _snapshot(model, opt) == before
    assert all(params[n].grad is grads[n] for n in params)
    assert all(opt.state[params[n]][k] is v for n, s in state_objects.items() for k, v in s.items())


def test_training_with_offload_cycles_matches_training_without():
    twins = [_trained(seed=3, steps=0) for _ in range(2)]
    off = OptimizerOffloader(twins[1][1])
    for model, opt in twins:
        gen = torch.Generator().manual_seed(9)
        opt.zero_grad()
        for _ in range(3):
            ids = _batch(gen)
            model(input_ids=ids, labels=ids).loss.backward()
            if opt is twins[1][1]:
                off.offload(), off.wait(), off.reload(), off.wait()  # grads and state
            opt.step()
            if opt is twins[1][1]:
                off.offload(), off.wait(), off.reload(), off.wait()  # state only
            opt.zero_grad()
    assert _snapshot(*twins[1]) == _snapshot(*twins[0])


def test_lazy_state_grows_the_arena_once_then_cycles_reuse_it_without_memory_growth():
    model = models.tiny_qwen3_moe(0, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = OptimizerOffloader(opt)
    assert off.offload() == 0 and off.arena is None  # before the first step there is no state
    off.reload()
    gen = torch.Generator().manual_seed(0)
    ids = _batch(gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # AdamW creates its state now
    nbytes = off.offload()
    arena = off.arena
    assert nbytes > 4 << 20 and off.arena_allocations == 1
    off.reload()
    for _ in range(2):
        off.offload(), off.reload()
    rss = _rss()
    for _ in range(10):
        assert off.offload() == nbytes
        off.reload()
    assert off.arena is arena and off.arena_allocations == 1
    assert _rss() - rss < nbytes // 2, "memory grew across offload cycles"
    opt.zero_grad()  # fewer bytes: still the same arena
    assert off.offload() < nbytes and off.arena is arena
    off.reload()


def test_step_and_new_gradients_while_offloaded_are_refused():
    model, opt = _trained()
    off = OptimizerOffloader(opt, named_parameters=model.named_parameters())
    off.offload()
    with pytest.raises(RuntimeError, match=r"offloaded to host memory; call reload\(\) before step\(\)"):
        opt.step()
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    ids = torch.randint(0, 512, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()  # gradients were detached: backward makes new ones
    with pytest.raises(RuntimeError, match=r"new gradient of 'model\.[^']+' was written while"):
        off.reload()


def test_state_that_shares_memory_with_a_parameter_is_refused():
    model, opt = _trained()
    name, p = next(iter(model.named_parameters()))
    opt.state[p]["alias"] = p.detach().view(-1)
    off = OptimizerOffloader(opt, named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match=rf"optimizer state 'alias' of '{re.escape(name)}' shares memory with parameter"):
        off.offload()
    assert not off.offloaded and p.untyped_storage().nbytes() > 0


def test_gradients_that_are_views_of_one_flat_buffer_move_once():
    model, opt = _trained()
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    start = 0
    for p in params:  # what DDP's gradient_as_bucket_view does
        view = flat[start : start + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad = view
        start += p.numel()
    before = _snapshot(model, opt)
    off = OptimizerOffloader(opt)
    expected = (
        sum(t.untyped_storage().nbytes() for p in params for t in opt.state[p].values()) + flat.numel() * flat.element_size()
    )
    assert off.offload() == expected
    assert flat.untyped_storage().nbytes() == 0
    off.reload()
    assert _snapshot(model, opt) == before
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_local_shards_round_trip_and_training_matches(one_rank_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    twins = []
    for _ in range(2):
        model = models.tiny_qwen3_moe(5, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=one_rank_group)
        fully_shard(model, mesh=one_rank_group)
        twins.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    off = OptimizerOffloader(twins[1][1], named_parameters=twins[1][0].named_parameters())
    for model, opt in twins:
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            ids = _batch(gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if opt is twins[1][1]:
                p = next(iter(model.parameters()))
                assert isinstance(p.grad, DTensor) and isinstance(opt.state[p]["exp_avg"], DTensor)
                before = _snapshot(model, opt)
                assert off.offload() > 0
                assert opt.state[p]["exp_avg"].to_local().untyped_storage().nbytes() == 0
                off.reload()
                assert _snapshot(model, opt) == before
            opt.zero_grad()
    assert _snapshot(*twins[1]) == _snapshot(*twins[0])


# ---- reference swap -------------------------------------------------------------------------


def test_reference_swap_runs_the_reference_model_in_place_and_restores_bit_exact():
    policy, reference = models.tiny_qwen3_moe(0), models.tiny_qwen3_moe(1)
    live = dict(policy.named_parameters())
    before = {n: _bytes(p) for n, p in live.items()}
    identity = {n: (id(p), p.data_ptr()) for n, p in live.items()}
    swap = ReferenceSwap(live, dict(reference.named_parameters()))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_ref, want_policy = reference(input_ids=ids).logits, policy(input_ids=ids).logits
        for _ in range(3):
            with swap.reference():
                assert {n: _bytes(p) for n, p in live.items()} == {n: _bytes(p) for n, p in reference.named_parameters()}
                assert torch.equal(policy(input_ids=ids).logits, want_ref)
            assert {n: _bytes(p) for n, p in live.items()} == before
            assert torch.equal(policy(input_ids=ids).logits, want_policy)
    assert {n: (id(p), p.data_ptr()) for n, p in policy.named_parameters()} == identity


def test_repeated_swaps_allocate_nothing():
    policy, reference = models.tiny_qwen3_moe(0), models.tiny_qwen3_moe(1)
    swap = ReferenceSwap(dict(policy.named_parameters()), dict(reference.named_parameters()))
    arena = swap.arena.data
    for _ in range(2):
        swap.swap_in(), swap.swap_out()
    rss = _rss()
    for _ in range(20):
        swap.swap_in()
        swap.swap_out()
    assert swap.arena.data is arena
    assert _rss() - rss < swap.nbytes // 4, "memory grew across swaps"


def test_swap_refuses_misuse():
    policy, reference = models.tiny_llama(0), models.tiny_llama(1)
    live = dict(policy.named_parameters())
    swap = ReferenceSwap(live, dict(reference.named_parameters()))
    with pytest.raises(RuntimeError, match="not in place"):
        swap.swap_out()
    swap.swap_in()
    with pytest.raises(RuntimeError, match="already in place"):
        swap.swap_in()
    swap.swap_out()
    name = "model.norm.weight"
    live[name].data = live[name].data.clone()
    with pytest.raises(RuntimeError, match=rf"\['{re.escape(name)}'\] were re-allocated"):
        swap.swap_in()


def test_mismatched_reference_is_refused_naming_each_tensor():
    policy = models.tiny_llama(0)
    live = dict(policy.named_parameters())
    before = {n: _bytes(p) for n, p in live.items()}
    with pytest.raises(ReferenceMismatch) as err:
        ReferenceSwap(live, dict(models.tiny_qwen3_moe(1).named_parameters()))
    assert "reference has no tensor 'model.layers.0.mlp.gate_proj.weight'" in err.value.problems
    assert "reference tensor 'model.layers.0.self_attn.q_norm.weight' has no live parameter" in err.value.problems

    ref = dict(models.tiny_llama(1).named_parameters())
    ref["model.layers.1.mlp.down_proj.weight"] = ref["model.layers.1.mlp.down_proj.weight"][:, :-1]
    with pytest.raises(
        ReferenceMismatch,
        match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight': live \(128, 256\) "
        r"torch\.bfloat16, reference \(128, 255\) torch\.bfloat16",
    ):
        ReferenceSwap(live, ref)

    with pytest.raises(ReferenceMismatch) as err:
        ReferenceSwap(live, dict(models.tiny_llama(1, dtype=torch.float32).named_parameters()))
    assert len(err.value.problems) == len(live)
    assert (
        "tensor 'model.embed_tokens.weight': live (512, 128) torch.bfloat16, reference (512, 128) torch.float32"
        in err.value.problems
    )

    tied = dict(live, **{"lm_head.alias": policy.model.embed_tokens.weight})
    with pytest.raises(ReferenceMismatch, match="share memory"):
        ReferenceSwap(tied, dict(tied))
    assert {n: _bytes(p) for n, p in live.items()} == before


# ---- the phase ------------------------------------------------------------------------------


class KVEngine:
    """A small engine with vLLM's sleep/wake semantics: its KV cache is real memory that sleep frees
    and wake_up(["kv_cache"]) allocates again; wake_up returns whether it is fully awake."""

    def __init__(self, log: list, kv_bytes: int = 1 << 20):
        self.log, self.kv_bytes = log, kv_bytes
        self.kv: torch.Tensor | None = torch.zeros(kv_bytes, dtype=torch.uint8)
        self.asleep: set[str] = set()

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))
        self.kv = None
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        tags = list(tags or ("weights", "kv_cache"))
        self.log.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)
        if "kv_cache" in tags:
            self.kv = torch.zeros(self.kv_bytes, dtype=torch.uint8)
        return not self.asleep


class LoggedOffloader(OptimizerOffloader):
    def __init__(self, log: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def offload(self) -> int:
        self.log.append("offload")
        return super().offload()

    def wait(self, *, release: bool = True) -> None:
        self.log.append("wait")
        super().wait(release=release)

    def reload(self) -> int:
        self.log.append("reload")
        return super().reload()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_phase_orders_the_parts_times_each_and_keeps_the_refit_report(overlap):
    from tests.helpers.refit_helpers import EngineProcess, engine_matches

    engine_proc = EngineProcess(model="moe")
    model, opt = _trained(seed=5, dtype=torch.bfloat16)
    before = _snapshot(model, opt)
    log: list = []
    engine = KVEngine(log)
    engine.sleep(level=1)
    trainer = LoggedOffloader(log, opt, named_parameters=model.named_parameters())
    sender = Sender(engine_proc.address, engine_proc.token, bucket_bytes=64 << 10)
    weights = {n: p.detach() for n, p in model.named_parameters()}

    def refit() -> RefitReport:
        log.append("refit")
        assert engine.asleep == {"kv_cache"} and trainer.offloaded
        return sender.refit(weights)

    try:
        log.clear()
        gen = prepare_for_generation(refit, trainer=trainer, engine=engine, overlap=overlap)
        order = ["offload", ("wake_up", ("weights",)), "refit", "wait", ("wake_up", ("kv_cache",))]
        if not overlap:
            order = ["offload", "wait", ("wake_up", ("weights",)), "refit", ("wake_up", ("kv_cache",))]
        assert log == order
        assert isinstance(gen.refit, RefitReport) and gen.refit.version == 1 and gen.refit.buckets > 1
        assert engine_matches(sender, weights) == []
        assert gen.engine_awake is True and engine.kv is not None
        parts = ("offload_s", "wake_weights_s", "refit_s", "offload_wait_s", "wake_kv_cache_s")
        assert all(getattr(gen, k) > 0 for k in parts)
        assert gen.total_s >= sum(getattr(gen, k) for k in parts) and gen.offload_bytes > 0
        assert gen.as_dict()["refit"]["version"] == 1

        log.clear()
        train = prepare_for_training(trainer=trainer, engine=engine, sleep_level=2)
        assert log == [("sleep", 2), "reload", "wait"]
        assert train.reload_bytes == gen.offload_bytes and train.sleep_s > 0 and train.reload_s > 0
        assert train.total_s >= train.sleep_s + train.reload_s + train.reload_wait_s
        assert _snapshot(model, opt) == before and engine.kv is None
    finally:
        engine_proc.stop(sender)
