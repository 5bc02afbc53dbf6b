"""Whether this code runs in a Jupyter kernel (where widgets can be shown)."""

from __future__ import annotations

import sys


def in_jupyter() -> bool:
    """Whether this code runs in a Jupyter (IPython) kernel, where widgets can be shown."""
    ipython = sys.modules.get("IPython")  # a kernel has imported it already; never import it here
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
