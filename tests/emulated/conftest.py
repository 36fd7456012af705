"""The coverage build's gcov counts are written when a test process's session ends, not at its exit."""

from __future__ import annotations

import emulated_build
import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist tells the controller this worker is done
def pytest_sessionfinish(session):
    emulated_build.dump_coverage()
