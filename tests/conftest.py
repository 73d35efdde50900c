"""Shared test setup."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every CPU test uses tiny models: intra-op threads only contend (a 64×128 matmul was 50× slower with two
    threads than with one on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def unfrozen():
    """Objects an engine froze (`gc.freeze`, at each placement) are collected again after the test: the suite
    builds hundreds of engines, each a few cycles the collector would otherwise keep."""
    yield
    gc.unfreeze()
