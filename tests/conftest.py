import os

import pytest

pytest_plugins = ["enginekit.testing", "pytester"]

# Engine processes log into the front end's logger; keep test output readable.
os.environ.setdefault("ENGINEKIT_TEST", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running (lifecycle loops, load, kernels)")


@pytest.fixture
def greedy():
    from enginekit import SamplingParams

    def make(max_tokens: int = 8, **kwargs):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)

    return make
