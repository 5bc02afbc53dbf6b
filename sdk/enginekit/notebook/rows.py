"""One request as the viewer shows it: a ``RequestRow`` follows its latest output and its token rate."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginekit.frontend.engine import Engine
    from enginekit.outputs import RequestOutput
    from enginekit.sampling_params import SamplingParams


class RequestRow:
    """What the viewer knows about one request (a live ``RequestOutput`` and its settings); read by the views."""

    __slots__ = ("engine_ref", "finished_at", "output", "params", "rendered_key", "started_at")

    def __init__(
        self, output: RequestOutput, engine: Engine, now: float, params: SamplingParams | None
    ) -> None:
        self.output = output
        self.params = params
        self.engine_ref = weakref.ref(engine)
        self.started_at = now
        self.finished_at: float | None = None
        self.rendered_key: tuple[Any, ...] | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def prompt(self) -> str | None:
        return self.output.prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def text(self) -> str:
        return self.output.outputs[0].text

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far (all samples together)."""
        return sum(len(c.token_ids) for c in self.output.outputs)

    @property
    def max_tokens(self) -> int | None:
        """The most tokens the request may generate (all samples together), when its settings are known."""
        if self.params is None or self.params.max_tokens is None:
            return None
        return self.params.max_tokens * self.params.n

    @property
    def finish_reason(self) -> str | None:
        """How the request ended (for ``n > 1``: ``"abort"`` if any sample was aborted, else the first's)."""
        reasons = [c.finish_reason for c in self.output.outputs]
        if not reasons or any(r is None for r in reasons):
            return None
        return "abort" if "abort" in reasons else reasons[0]

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def state(self) -> str:
        """``waiting``, ``running``, ``preempted`` or, once finished, its finish reason."""
        if self.finished:
            return self.finish_reason or "finished"
        return self.output.status

    def tokens_per_s(self, now: float) -> float:
        elapsed = (self.finished_at if self.finished_at is not None else now) - self.started_at
        return self.num_tokens / elapsed if elapsed > 0 else 0.0

    def settings(self) -> str:
        """The sampling settings in a few words: ``greedy`` or temperature, top-p, ...; penalties; ``n``."""
        return describe_params(self.params) if self.params is not None else ""

    def observe(self, now: float) -> bool:
        """Note the request's progress; True when it changed since the last render."""
        if self.finished and self.finished_at is None:
            self.finished_at = now
        key = (self.num_tokens, self.output.status, self.finish_reason, self.finished)
        if key == self.rendered_key:
            return False
        self.rendered_key = key
        return True


def describe_params(params: SamplingParams) -> str:
    """``SamplingParams`` in a few words, leaving out what is at its default."""
    parts = ["greedy" if params.is_greedy else f"temperature {params.temperature:g}"]
    if not params.is_greedy:
        parts += [f"top-p {params.top_p:g}"] if params.top_p < 1.0 else []
        parts += [f"top-k {params.top_k}"] if params.top_k else []
        parts += [f"min-p {params.min_p:g}"] if params.min_p else []
        parts += [f"seed {params.seed}"] if params.seed is not None else []
    for name, value, default in (
        ("repetition", params.repetition_penalty, 1.0),
        ("presence", params.presence_penalty, 0.0),
        ("frequency", params.frequency_penalty, 0.0),
    ):
        if value != default:
            parts.append(f"{name} penalty {value:g}")
    if params.n > 1:
        parts.append(f"n {params.n}")
    if params.stop:
        parts.append(
            "stop " + ", ".join(repr(s) for s in params.stop[:3]) + (" …" if len(params.stop) > 3 else "")
        )
    if params.ignore_eos:
        parts.append("ignore EOS")
    return " · ".join(parts)
