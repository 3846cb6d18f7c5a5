"""Shared pytest configuration: the markers that select subsets of the suite.

`fast` marks the tests worth running on every GPU change (under a minute in all); `cuda` marks
tests that need a CUDA device and skip without one.
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: quick subset for routine GPU runs (under a minute)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is visible")
