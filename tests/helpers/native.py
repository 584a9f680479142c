"""The `_testing` extension module (kernels and backend ops one by one), built with KVCMAS_TESTING_MODULE=ON.

`testing.<name>` loads it on first use; where it was not built, the test that uses it skips, saying how to build it
(CI builds it, so there they run)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from kvcmas_cpp._native import testing_module


def require_testing() -> ModuleType:
    """The `_testing` module, or a skip of the calling test (or module, at import) naming what to build."""
    try:
        return testing_module()
    except ImportError as e:
        pytest.skip(str(e), allow_module_level=True)


class _LazyTesting:
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # what pytest's collection probes (markers, __test__): no module load, no skip
            raise AttributeError(name)
        return getattr(require_testing(), name)


testing = _LazyTesting()
