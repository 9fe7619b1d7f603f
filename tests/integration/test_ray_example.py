"""The Ray example runs end to end (trainer and engine ranks as actors) when Ray is installed."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("ray")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ray_refit.py")


def test_ray_example_refits_tensor_parallel_engine_actors_exactly():
    spec = importlib.util.spec_from_file_location("ray_refit", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(steps=2)
    assert [r["version"] for r in results] == [1, 2]
    assert all(r["exact"] for r in results), results
