"""The bench's table reads in 80-120 column terminals: no header, unit or figure cut (issue 23)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mxrefit.bench.report import _ROWS, columns, print_table, tables


def _summary(total_ms: float, transport: str | None = None) -> dict:
    out = {
        "check_s": 0.0212,
        "pack_s": total_ms * 0.6e-3,
        "wait_s": 0.016,
        "engine_s": 7.7391,
        "post_s": 2.1163,
        "total_s": total_ms * 1e-3,
        "bytes": 61_060_000_000,
        "GBps": 61.06 / total_ms * 1e3,
        "trainer_peak_extra_bytes": 2 << 30,
        "engine_peak_extra_bytes": 30 << 30,
        "check": {"mismatched": [], "parts_checked": 18, "tensors_checked": 15, "kernel_layout_params_checked": 6},
    }
    if transport:
        out["transport"] = transport
    return out


def widest_result() -> dict:
    """The widest table the CLI prints, with figures as wide as qwen3-30b-a3b's: three modes of
    `--mode all`, a fourth of `--mode checks`, the checkpoint-engine peer, and the floor."""
    return {
        "model": "qwen3-30b-a3b",
        "format": "mxfp8",
        "post": "trtllm",
        "device_name": "NVIDIA H200",
        "tensors": 18_867,
        "steps": 3,
        "warmup": 1,
        "floor_s": 0.0219,
        "trainer_bf16_bytes": 61_060_000_000,
        "engine_bytes": 32_100_000_000,
        "copy_GBps": 4258.0,
        "speedup": 117.5,
        "modes": {
            "baseline": _summary(10_353.0),
            "prequant": _summary(88.1, "direct"),
            "prequant-buffers": _summary(122.9, "cuda_ipc"),
            "prequant-transactional": _summary(103.5, "direct"),
        },
        "peers": {
            "checkpoint-engine": {
                "total_s": 2.590,
                "bytes": 31_130_000_000,
                "GBps": 12.0,
                "trainer_peak_extra_bytes": 24 << 30,
                "engine_peak_extra_bytes": 0,
                "register_s": 1.347,
                "gather_s": 0.261,
                "update_s": 0.950,
                "unregister_s": 0.01,
                "pinned_host_bytes": 29 << 30,
                "floor_s": 0.0146,
                "check": {"mismatched": [], "tensors_checked": 9435},
            }
        },
    }


def render(result: dict, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    print_table(result, console)
    return console.export_text()


def header_words(result: dict) -> list[str]:
    """Every line of every column header, every row label (each carries its unit) and the floor."""
    cols = columns(result).values()
    words = ["per refit", "copy", "floor", "x copy floor"]
    words += [label for label, key, _ in _ROWS if any(key in m for _, m in cols)]  # a row no column has is left out
    for header, _ in cols:
        words += header.splitlines()
    return words


def unreadable(text: str, words: list[str], width: int) -> list[str]:
    """What a reader at ``width`` columns would miss: cut text, a header word not whole, a long line."""
    problems = ["an ellipsis: something was cut"] if "…" in text else []
    problems += [f"{w!r} not whole" for w in words if w not in text]
    problems += [f"a line of {len(line)} columns" for line in text.splitlines() if len(line) > width]
    return problems


@pytest.mark.parametrize("width", [80, 100, 120])
def test_every_header_and_unit_reads_at(width):
    result = widest_result()
    text = render(result, width)
    assert unreadable(text, header_words(result), width) == [], text
    for unit in ("ms", "MB", "GB/s", "GiB"):
        assert f", {unit}" in text
    assert "peak+:" in text and "(peer)" in text


def test_columns_that_do_not_fit_go_to_a_second_table_not_under_the_knife():
    result = widest_result()
    assert [len(tables(result, w)) for w in (80, 100, 120)] == [2, 1, 1]
    assert render(result, 80).count("per refit") == 2


def test_the_check_catches_a_cut_header():
    """Negative control: in a terminal too narrow for even one column beside the labels, rich cuts
    the headers, and the check says so."""
    result = widest_result()
    text = render(result, 40)
    problems = unreadable(text, header_words(result), 40)
    assert "an ellipsis: something was cut" in problems, text
    assert any("not whole" in p for p in problems), problems


def test_a_peer_has_dashes_where_it_has_no_such_phase():
    text = render(widest_result(), 120)
    finite = next(line for line in text.splitlines() if "finite check, ms" in line)
    assert finite.count("—") == 1  # the peer's column; each mxrefit mode has a figure


def vllm_peer() -> dict:
    """``--peer vllm``'s figures as ``peer_vllm.run_vllm`` returns them (qwen3-30b-a3b at 24 layers' sizes)."""
    own = {
        "total_s": 1.912,
        "start_s": 0.004,
        "send_load_s": 1.530,
        "trainer_quantize_s": 0.211,
        "finish_s": 0.378,
        "bytes": 16_200_000_000,
        "GBps": 8.47,
        "trainer_peak_extra_bytes": 1 << 30,
        "device_peak_extra_bytes": 3 << 30,
    }
    mine = {**_summary(61.0, "direct"), "device_peak_extra_bytes": 1 << 29}
    del mine["check"], mine["engine_peak_extra_bytes"]
    return {
        **own,
        "mxrefit": mine,
        "speedup": 1.912 / 0.061,
        "check": {"params_checked": 531, "tensors_checked": 531, "mismatched": []},
        "engine": {"vllm": "0.26.0"},
    }


@pytest.mark.parametrize("width", [80, 120])
def test_the_vllm_peer_shows_mxrefit_into_it_and_its_own_path(width):
    result = widest_result()
    result["peers"] = {"vllm": vllm_peer()}
    text = render(result, width)
    assert unreadable(text, header_words(result), width) == [], text
    assert list(columns(result))[-2:] == ["mxrefit-into-vllm", "vllm"]
    assert "device peak+, GiB" in text and "31.3x faster than its own path" in text
    assert "send+load 1,530.0" in text and "(sha256): identical (531 params)" in text


def test_a_vllm_peer_that_differs_names_the_params():
    result = widest_result()
    result["peers"] = {"vllm": vllm_peer()}
    result["peers"]["vllm"]["check"]["mismatched"] = ["model.layers.0.mlp.experts.w13_weight"]
    assert "DIFFERENT for 1: ['model.layers.0.mlp.experts.w13_weight']" in render(result, 1000)


def test_a_vllm_peer_says_which_quantizer_its_own_path_used_and_why():
    result = widest_result()
    result["peers"] = {"vllm": vllm_peer()}
    why = "vLLM 0.26.0's mxfp8_e4m3_quantize writes other bytes than a ModelOpt MXFP8 checkpoint holds: 512 of 512 differ"
    result["peers"]["vllm"]["engine"].update(
        own_quantizer={"function": "mxrefit.formats.mxfp8.quantize", "modelopt_rule": False, "why": why},
        learned_layout="1",
    )
    text = " ".join(render(result, 1000).split())
    assert f"(trainer quantize 211.0 by mxrefit.formats.mxfp8.quantize ({why}))" in text
    assert "both columns, mxrefit's learned layout)" in text
    result["peers"]["vllm"]["engine"].update(
        own_quantizer={"function": "vLLM 0.32.0's mxfp8_e4m3_quantize", "modelopt_rule": True}, learned_layout="0"
    )
    text = " ".join(render(result, 1000).split())
    assert "(trainer quantize 211.0 by vLLM 0.32.0's mxfp8_e4m3_quantize), finish" in text
    assert "both columns, learned layout off)" in text and "mxrefit's learned layout" not in text


def test_a_vllm_peer_names_the_refits_that_settled_mxrefits_layout():
    result = widest_result()
    result["peers"] = {"vllm": vllm_peer()}
    text = " ".join(render(result, 1000).split())
    assert "settled" not in text and "NOT settle" not in text  # nothing planned again: no settling named
    settle = {"refits": 2, "total_s": 7.5313, "replans": 1, "settled": True, "steady_refits": 2}
    result["peers"]["vllm"]["mxrefit"]["settle"] = settle
    text = " ".join(render(result, 1000).split())
    assert (
        "mxrefit's first 2 refits settled its layout (1 planned again, 7,531.3 ms in all), its medians are over the 2 after;"
        in text
    )
    result["peers"]["vllm"]["mxrefit"]["settle"] = {**settle, "refits": 6, "steady_refits": 1, "settled": False}
    text = " ".join(render(result, 1000).split())
    assert "mxrefit's path did NOT settle in 7 refits (the last planned again); its medians are that last refit's;" in text
