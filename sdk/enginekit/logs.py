"""Front-end logging: enginekit is quiet unless ``log_level`` asks for more."""

from __future__ import annotations

import logging


def show_logs(log_level: str) -> None:
    """``log_level="info"``/``"debug"``: let enginekit's records through and show them if logging is unset."""
    if log_level == "warning":
        return
    level = logging.INFO if log_level == "info" else logging.DEBUG
    package_logger = logging.getLogger("enginekit")
    if package_logger.getEffectiveLevel() > level:
        package_logger.setLevel(level)
    if not package_logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
