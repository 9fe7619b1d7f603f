"""`import mxrefit` is the public API: every name in ``__all__`` resolves, and every error mxrefit
defines derives from ``MxrefitError`` (one clause catches them all), keeping its builtin base."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import mxrefit


def test_every_public_name_resolves():
    assert len(mxrefit.__all__) == len(set(mxrefit.__all__))
    for name in mxrefit.__all__:
        assert getattr(mxrefit, name) is not None, name
    assert issubclass(mxrefit.RefitError, RuntimeError) and issubclass(mxrefit.PlanMismatch, ValueError)


def test_every_mxrefit_error_derives_from_the_base():
    errors, modules = [], 0
    root = Path(mxrefit.__file__).parent
    for path in sorted(root.rglob("*.py")):  # every file, namespace folders included
        name = ".".join(("mxrefit", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        if name == "mxrefit.__main__":
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (Megatron, Ray) absent here
            continue
        modules += 1
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException) and not obj.__name__.startswith("_"):
                errors.append(obj)
    assert modules > 40 and len(errors) >= 12  # not vacuous: the walk found the package and its errors
    outside = [f"{e.__module__}.{e.__qualname__}" for e in errors if not issubclass(e, mxrefit.MxrefitError)]
    assert not outside, f"errors not beneath MxrefitError: {outside}"
