"""Transfer buffers across real processes: shared memory here, CUDA IPC where a GPU exists."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import torch

from mxrefit.transport.direct import export_tensors, open_exports
from mxrefit.transport.factory import create_buffers, default_kind, open_buffers

SPAWN = multiprocessing.get_context("spawn")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for children
SHM_DIR = "/dev/shm"
needs_dev_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")

_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.integration.test_buffers import open_and_write
open_and_write(bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
"""

_OWNER = """
import json, multiprocessing, sys, time
sys.path.insert(0, sys.argv[1])
import msgpack, torch
from tests.integration.test_buffers import open_and_write, pattern
from mxrefit.transport.factory import create_buffers

bufs = create_buffers("shm", 2, 1 << 16)
desc = bufs.describe()
child = multiprocessing.get_context("spawn").Process(target=open_and_write, args=(msgpack.packb(desc), 5))
child.start()
child.join()
seen = all(torch.equal(b, pattern(b.numel(), 5 + i)) for i, b in enumerate(bufs.buffers))
print(json.dumps({"names": desc["names"], "child_exit": child.exitcode, "seen": seen}), flush=True)
time.sleep(120)
"""


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Bytes that differ per buffer and per position."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


def open_and_write(packed_desc: bytes, seed: int) -> None:
    """Child process: open the described buffers, write buffer i with pattern(seed + i), close."""
    opened = open_buffers(msgpack.unpackb(packed_desc))
    for i, buf in enumerate(opened.buffers):
        buf.copy_(pattern(buf.numel(), seed + i).to(buf.device))
    if opened.kind == "cuda_ipc":
        torch.cuda.synchronize()
    opened.close()


def _run_independent_child(packed_desc: bytes, seed: int) -> None:
    """A child that is not a multiprocessing child: it shares no resource tracker with us."""
    subprocess.run([sys.executable, "-c", _CHILD, ROOT, packed_desc.hex(), str(seed)], check=True, timeout=120)


def _run_spawned_child(packed_desc: bytes, seed: int) -> None:
    proc = SPAWN.Process(target=open_and_write, args=(packed_desc, seed))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0


def _segments_exist(names: list[str]) -> list[bool]:
    return [os.path.exists(os.path.join(SHM_DIR, name)) for name in names]


def _mapped_here(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


@needs_dev_shm
@pytest.mark.parametrize("launch", [_run_spawned_child, _run_independent_child], ids=["spawned", "independent"])
def test_shm_child_writes_owner_sees_and_segments_outlive_the_child(launch):
    bufs = create_buffers("shm", 3, 1 << 20)
    desc = bufs.describe()
    try:
        launch(msgpack.packb(desc), 11)
        for i, buf in enumerate(bufs.buffers):
            assert torch.equal(buf, pattern(buf.numel(), 11 + i))
        time.sleep(0.5)
        assert _segments_exist(desc["names"]) == [True] * 3
    finally:
        bufs.close()
    assert _segments_exist(desc["names"]) == [False] * 3


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"owner printed nothing within {timeout_s} s"
    return proc.stdout.readline()


def _wait_gone(names: list[str], timeout_s: float) -> list[bool]:
    deadline = time.monotonic() + timeout_s
    while any(_segments_exist(names)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _segments_exist(names)


@needs_dev_shm
def test_shm_owner_killed_leaves_no_segment_even_after_a_child_opened_them():
    """The opener shares the owner's resource tracker here; it must not erase the owner's registration."""
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, ROOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        report = json.loads(_read_line(proc, 120))
        assert report["child_exit"] == 0 and report["seen"]
        assert _segments_exist(report["names"]) == [True, True]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert _wait_gone(report["names"], 5.0) == [False, False]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


@needs_dev_shm
def test_shm_close_with_live_views_does_not_unmap_them():
    bufs = create_buffers("shm", 1, 1 << 16)
    name = bufs.describe()["names"][0]
    view = bufs.buffers[0][100:200]
    bufs.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    view.fill_(3)
    assert int(view.sum()) == 300
    assert _mapped_here(name)
    del view
    gc.collect()
    assert not _mapped_here(name)


@needs_dev_shm
def test_shm_open_in_same_process_shares_memory_and_close_keeps_segment():
    with create_buffers("shm", 2, 4096) as bufs:
        desc = bufs.describe()
        opened = open_buffers(desc)
        assert opened.nbytes == 4096 and opened.kind == "shm"
        opened.buffers[1][:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
        assert bufs.buffers[1][:3].tolist() == [7, 8, 9]
        opened.close()
        assert opened.buffers == []
        assert _segments_exist(desc["names"]) == [True, True]
    assert _segments_exist(desc["names"]) == [False, False]


def test_shm_buffers_are_flat_uint8_and_describe_round_trips_msgpack():
    with create_buffers("shm", 2, 12345) as bufs:
        assert bufs.kind == "shm" and bufs.nbytes == 12345
        for buf in bufs.buffers:
            assert buf.dtype == torch.uint8 and buf.shape == (12345,) and buf.is_contiguous()
        desc = bufs.describe()
        packed = msgpack.packb(desc, use_bin_type=True)
        again = msgpack.unpackb(packed, raw=False, strict_map_key=True)
        assert again == desc
        with open_buffers(again) as opened:
            assert [b.numel() for b in opened.buffers] == [12345, 12345]


def test_open_a_missing_segment_names_the_cause():
    with create_buffers("shm", 1, 4096) as bufs:
        desc = bufs.describe()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_buffers(desc)


def test_open_refuses_a_segment_smaller_than_described():
    with create_buffers("shm", 1, 4096) as bufs:
        desc = {**bufs.describe(), "nbytes": 1 << 20}
        with pytest.raises(ValueError, match="fewer than"):
            open_buffers(desc)


_GOOD_SHM = {"kind": "shm", "nbytes": 64, "names": ["psm_abc"]}
_GOOD_EXPORT = [0, b"h" * 64, 64, 0, b"/torch_1_2", 0, b"e" * 64, True]
_GOOD_CUDA = {"kind": "cuda_ipc", "nbytes": 64, "device_uuid": "GPU-x", "owner_id": "ab", "exports": [_GOOD_EXPORT]}


@pytest.mark.parametrize(
    "desc",
    [
        None,
        [1, 2],
        {},
        {**_GOOD_SHM, "kind": "nccl"},
        {**_GOOD_SHM, "nbytes": 0},
        {**_GOOD_SHM, "nbytes": -5},
        {**_GOOD_SHM, "nbytes": True},
        {**_GOOD_SHM, "nbytes": "64"},
        {**_GOOD_SHM, "nbytes": 1 << 60},
        {**_GOOD_SHM, "names": []},
        {**_GOOD_SHM, "names": "psm_abc"},
        {**_GOOD_SHM, "names": ["../etc/passwd"]},
        {**_GOOD_SHM, "names": ["a/b"]},
        {**_GOOD_SHM, "names": [""]},
        {**_GOOD_SHM, "names": [b"psm_abc"]},
        {**_GOOD_SHM, "names": ["psm_abc", "psm_abc"]},
        {**_GOOD_SHM, "names": ["p"] * 2000},
        {**_GOOD_SHM, "extra": 1},
        {"kind": "shm", "nbytes": 64},
        {**_GOOD_CUDA, "exports": []},
        {**_GOOD_CUDA, "exports": [_GOOD_EXPORT[:7]]},
        {**_GOOD_CUDA, "exports": [[*_GOOD_EXPORT[:1], "handle", *_GOOD_EXPORT[2:]]]},
        {**_GOOD_CUDA, "exports": [[*_GOOD_EXPORT[:2], 63, *_GOOD_EXPORT[3:]]]},
        {**_GOOD_CUDA, "exports": [[True, *_GOOD_EXPORT[1:]]]},
        {**_GOOD_CUDA, "exports": [[*_GOOD_EXPORT[:7], 1]]},
        {**_GOOD_CUDA, "device_uuid": 5},
        {**_GOOD_CUDA, "owner_id": ""},
        {k: v for k, v in _GOOD_CUDA.items() if k != "device_uuid"},
    ],
)
def test_bad_descriptions_are_rejected(desc):
    with pytest.raises(ValueError):
        open_buffers(desc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_valid_cuda_description_on_cpu_says_cuda_is_missing():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        open_buffers(_GOOD_CUDA)


@pytest.mark.parametrize(
    "args",
    [
        ("shm", 0, 64),
        ("shm", 1, 0),
        ("shm", 1, -1),
        ("shm", True, 64),
        ("shm", 1, 1.5),
        ("tcp", 1, 64),
        ("shm", 1, 64, "meta"),
        ("cuda_ipc", 1, 64, "cpu"),
    ],
)
def test_create_validates_its_arguments(args):
    with pytest.raises(ValueError):
        create_buffers(*args)


def test_default_kind_follows_the_device():
    assert default_kind("cpu") == "shm"
    assert default_kind(torch.device("cpu")) == "shm"
    assert default_kind("cuda:1") == "cuda_ipc"
    assert default_kind(torch.device("cuda")) == "cuda_ipc"


_TOGGLE = """
import json, torch
from mxrefit.transport.cuda_ipc import allocator_settings, ipc_shareable_allocations
seen = [allocator_settings()]
with ipc_shareable_allocations():
    seen.append(allocator_settings())
seen.append(allocator_settings())
print(json.dumps(seen))
"""


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_ipc_buffers_are_allocated_with_expandable_segments_off_then_the_setting_is_restored(var):
    """The allocator setting is process-wide and read at start-up, so each case runs in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env[var] = "max_split_size_mb:128,expandable_segments:True"
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _TOGGLE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    before, inside, after = (_settings(s) for s in json.loads(out))
    assert before == {"max_split_size_mb": "128", "expandable_segments": "True"}, before
    assert inside == {"max_split_size_mb": "128", "expandable_segments": "False"}, inside
    assert after == before, after


def _settings(text: str) -> dict[str, str]:
    """An allocator settings string as key -> value (torch may reorder or respace what it reports)."""
    pairs = (item.partition(":") for item in text.split(",") if item.strip())
    return {k.strip(): v.strip() for k, _, v in pairs}


def test_without_expandable_segments_the_allocator_is_left_alone(monkeypatch):
    from mxrefit.transport.cuda_ipc import allocator_settings, expandable_segments_setting, ipc_shareable_allocations

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert expandable_segments_setting() is None
    before = allocator_settings()
    with ipc_shareable_allocations():
        assert allocator_settings() == before


_EXPANDABLE_OWNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import msgpack, torch
from tests.integration.test_buffers import _run_spawned_child, pattern
from mxrefit.transport.factory import create_buffers
from mxrefit.transport.direct import allocate

filler = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the trainer's own memory: expandable
arena = allocate(8 << 20, "cuda")  # an engine's exportable memory (direct writes)
with create_buffers("cuda_ipc", 2, 8 << 20, "cuda") as bufs:
    segments = {s["address"]: s for s in torch.cuda.memory_snapshot()}
    def expandable(t):
        return any(a <= t.data_ptr() < a + s["total_size"] and s["is_expandable"] for a, s in segments.items())
    _run_spawned_child(msgpack.packb(bufs.describe()), 31)
    torch.cuda.synchronize()
    seen = all(torch.equal(b.cpu(), pattern(b.numel(), 31 + i)) for i, b in enumerate(bufs.buffers))
    after = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    print(json.dumps({"filler": expandable(filler), "buffers": [expandable(b) for b in bufs.buffers],
                      "arena": expandable(arena), "after": expandable(after), "seen": seen}))
"""


@needs_cuda
def test_cuda_ipc_works_for_a_trainer_with_expandable_segments():
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE_OWNER, ROOT], env=env, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    report = json.loads(out.splitlines()[-1])
    assert report == {"filler": True, "buffers": [False, False], "arena": False, "after": True, "seen": True}, report


@needs_cuda
def test_cuda_ipc_child_writes_owner_sees():
    with create_buffers("cuda_ipc", 2, 1 << 20, "cuda") as bufs:
        assert bufs.kind == "cuda_ipc"
        assert all(b.is_cuda and b.dtype == torch.uint8 and b.shape == (1 << 20,) for b in bufs.buffers)
        desc = bufs.describe()
        packed = msgpack.packb(desc, use_bin_type=True)
        assert msgpack.unpackb(packed, raw=False) == desc
        _run_spawned_child(packed, 21)
        torch.cuda.synchronize()
        for i, buf in enumerate(bufs.buffers):
            assert torch.equal(buf.cpu(), pattern(buf.numel(), 21 + i))


@needs_cuda
def test_cuda_ipc_reopened_by_a_second_engine_and_memory_released_after_close():
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    bufs = create_buffers("cuda_ipc", 2, 1 << 22, "cuda")
    _run_spawned_child(msgpack.packb(bufs.describe()), 1)
    _run_spawned_child(msgpack.packb(bufs.describe()), 2)
    torch.cuda.synchronize()
    assert torch.equal(bufs.buffers[1].cpu(), pattern(1 << 22, 3))
    bufs.close()
    gc.collect()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline


def _open_twice(packed_desc: bytes) -> None:
    """Child process: a second open of one export would release the owner's count twice."""
    desc = msgpack.unpackb(packed_desc)
    with open_buffers(desc):
        try:
            open_buffers(desc)
        except RuntimeError as err:
            assert "already opened" in str(err)
        else:
            raise AssertionError("a second open of the same description succeeded")


@needs_cuda
def test_cuda_ipc_one_description_opens_once_per_process():
    with create_buffers("cuda_ipc", 1, 4096, "cuda") as bufs:
        proc = SPAWN.Process(target=_open_twice, args=(msgpack.packb(bufs.describe()),))
        proc.start()
        proc.join(120)
        assert proc.exitcode == 0


@needs_cuda
def test_cuda_ipc_opened_in_the_owner_process_is_its_own_memory():
    """CUDA cannot open an IPC handle where it was made; a colocated trainer and engine (TRL's
    colocate mode) get the owner's own buffers instead, so a write on one side is seen on the other."""
    with create_buffers("cuda_ipc", 2, 4096, "cuda") as bufs:
        bufs.buffers[0].zero_()
        with open_buffers(bufs.describe()) as opened:
            assert [b.data_ptr() for b in opened.buffers] == [b.data_ptr() for b in bufs.buffers]
            opened.buffers[1][:16] = 7
            assert bufs.buffers[1][:16].eq(7).all() and bufs.buffers[0].eq(0).all()


@needs_cuda
def test_direct_export_opened_in_the_exporting_process_writes_the_engine_tensors():
    engine = {"a": torch.zeros(64, dtype=torch.bfloat16, device="cuda"), "b": torch.zeros(8, 8, device="cuda")}
    opened = open_exports(export_tensors(engine))
    opened.tensors["b"].view(torch.float32).fill_(2.5)
    assert engine["b"].eq(2.5).all() and engine["a"].eq(0).all()
    desc = export_tensors({"c": torch.ones(4, device="cuda")})  # its only tensor is freed before the open
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="freed in this process"):
        open_exports(desc)
