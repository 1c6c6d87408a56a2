"""Fixtures of this plugin's tests. The helpers live in ``cutedsl_helpers`` beside this file.

``tests/test_conformance.py`` needs the core's conformance suite as a pytest plugin; it is loaded
here unless the run already has it (the repository's own test tree loads it too), so the tests run
alike from this folder, from the repository root, and from an installed copy.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from cutedsl_helpers import make_nvfp4_weights  # noqa: E402

CONFORMANCE_PLUGIN = "moe_runtime.testing.plugin"


def pytest_configure(config):
    if not config.pluginmanager.has_plugin(CONFORMANCE_PLUGIN):
        config.pluginmanager.import_plugin(CONFORMANCE_PLUGIN)


@pytest.fixture(scope="session")
def nvfp4_weights():
    return make_nvfp4_weights()
