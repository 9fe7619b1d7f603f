import os

import pytest


def pytest_sessionstart(session):
    """In CI (MXREFIT_REQUIRE_VLLM=1) a missing vLLM is a failure, never a silent skip."""
    if os.environ.get("MXREFIT_REQUIRE_VLLM") == "1":
        try:
            import vllm  # noqa: F401
        except Exception as err:  # pragma: no cover - only on a broken CI install
            raise pytest.UsageError(f"MXREFIT_REQUIRE_VLLM=1 but vllm does not import: {err!r}") from err
