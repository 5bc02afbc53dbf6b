"""The token embedding."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass
