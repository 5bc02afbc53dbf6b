import atexit
import os
import shutil
import signal
import tempfile

import pytest

pytest_plugins = ["enginekit.testing", "pytester"]

# Tests never reach the Hugging Face Hub: a repo id resolves from the local cache only (tests that use one populate
# a temporary cache themselves).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engine processes log into the front end's logger; keep test output readable.
os.environ.setdefault("ENGINEKIT_TEST", "1")
# Triton kernels run in Triton's interpreter, on CPU tensors (tests/test_triton_kernels.py). Set before triton is
# first imported: triton.language decorates its own helpers (tl.cdiv, tl.zeros, ...) as it loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The weight cache of this test run (engine processes and notebook kernels inherit it): tests never write into
# the user's ~/.cache, and every run starts from a clean cache.
if "ENGINEKIT_CACHE" not in os.environ:
    os.environ["ENGINEKIT_CACHE"] = tempfile.mkdtemp(prefix="ektest-weights-")
    atexit.register(shutil.rmtree, os.environ["ENGINEKIT_CACHE"], True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running (lifecycle loops, load, kernels)")
    # The Ctrl-C tests need Python's own SIGINT handler. A shell that starts the tests in the background
    # (`make test &`, `nohup ... &`) hands them SIGINT ignored, which Python keeps, and so would the front ends
    # they start: give this process, and through it theirs, the handler a terminal would.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def greedy():
    from enginekit import SamplingParams

    def make(max_tokens: int = 8, **kwargs):
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)

    return make
