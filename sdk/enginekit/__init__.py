"""enginekit: run a real LLM engine from notebooks, scripts and unit tests.

>>> from enginekit import Engine, SamplingParams
>>> with Engine(mode="inproc") as engine:
...     print(engine.generate("Hello", SamplingParams(max_tokens=8))[0].text)
"""

from enginekit.config import EngineConfig, EngineMode
from enginekit.errors import (
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    EngineStartupError,
    UtilityCallError,
)
from enginekit.frontend.engine import Engine
from enginekit.lora_request import LoRARequest
from enginekit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from enginekit.runtime.launcher import shutdown_launcher
from enginekit.sampling_params import RequestOutputKind, SamplingParams
from enginekit.structured_outputs import StructuredOutputsParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineMode",
    "EngineShutdownError",
    "EngineStartupError",
    "LoRARequest",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "UtilityCallError",
    "shutdown_launcher",
]

__version__ = "0.1.0"
