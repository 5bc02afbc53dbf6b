"""pytest support: a shared tiny in-process engine for your own tests.

Enable it in a ``conftest.py``::

    pytest_plugins = ["enginekit.testing"]

    def test_my_prompt(enginekit_engine):
        out = enginekit_engine.generate("Hi", SamplingParams(max_tokens=4, temperature=0))

The engine is built once per test session, in-process (no background process, breakpoints work), on the
built-in tiny model; each test gets it back with no request left running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from enginekit.frontend.engine import Engine

__all__ = ["enginekit_engine", "make_test_engine"]


def make_test_engine(**options: object) -> Engine:
    """A small in-process engine on the built-in model (options as for ``Engine``)."""
    options.setdefault("num_kv_blocks", 256)
    return Engine("builtin", mode="inproc", **options)


@pytest.fixture(scope="session")
def _enginekit_session_engine() -> Iterator[Engine]:
    engine = make_test_engine()
    yield engine
    engine.shutdown()


@pytest.fixture
def enginekit_engine(_enginekit_session_engine: Engine) -> Iterator[Engine]:
    """The session's shared in-process engine; requests a test leaves running are aborted after it."""
    yield _enginekit_session_engine
    leftover = _enginekit_session_engine.call_utility("get_request_ids")
    if leftover:
        _enginekit_session_engine.abort(leftover)
        _enginekit_session_engine.client.get_output()  # flush the abort outputs
