import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Tests never read a user's tuned-config cache (python -m cupy_moe tune): they get an empty folder of their own.
os.environ["CUPY_MOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy_moe_test_cache_")

from cupy_moe._xp import gpu_available  # noqa: E402

# `ci` keeps the whole suite well under 10 minutes on 2 cores; `dev` digs deeper.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none found (CuPy missing or no CUDA device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    if config.option.markexpr == "not compile":
        return "compile matrix (every kernel instance, every arch, NVRTC) deselected: pytest -m compile runs it"
    return None
