"""The benchmark sections, one question each, in the order the page shows them.

A section is a name, a question, a function ``run(quick: bool) -> dict`` that measures and returns its figures
(plain JSON values, see ``benchmarks/figures.py``), and a function ``render(figures: dict) -> str`` that
writes its part of the page from those figures alone. A section whose module is not there (``optional``), or
whose optional package is not installed (``needs``), is skipped with a note on the page; a section without a
renderer gets its figures as a generic table.

To add one: write ``benchmarks/bench_x.py`` with ``run_x_bench(quick) -> dict`` (and, better,
``render_x_bench(figures) -> str``), then add a line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Section:
    name: str  # what --only takes
    question: str  # the page's heading for it
    module: str
    run: str  # the module's function(quick: bool) -> dict of figures
    render: str = ""  # the module's function(figures) -> markdown ("": a generic table of the figures)
    optional: bool = False  # the module may be missing: skip the section with a note
    needs: str = ""  # an optional package the module imports: without it, skip the section with a note

    def load(self) -> tuple[Callable[[bool], dict[str, Any]], Callable[[dict[str, Any]], str] | None]:
        """The run and render functions; ``ModuleNotFoundError`` if an optional section's module is missing."""
        module = importlib.import_module(self.module)
        render = getattr(module, self.render, None) if self.render else None
        return getattr(module, self.run), render


SECTIONS: tuple[Section, ...] = (
    Section(
        "limits",
        "What can this machine do at most?",
        "benchmarks.bench_limits",
        "run_limits_bench",
        "render_limits_bench",
    ),
    Section(
        "real",
        "How fast is the default model against transformers, llama.cpp and the machine?",
        "benchmarks.bench_real",
        "run_real_bench",
        "render_real_bench",
    ),
    Section(
        "throughput",
        "How fast are the tiny models against transformers, with equal, mixed and staggered requests?",
        "benchmarks.bench_throughput",
        "run_throughput_bench",
        "render_throughput_bench",
    ),
    Section(
        "modes",
        "What does the background process cost, for generate and for streams?",
        "benchmarks.bench_modes",
        "run_modes_bench",
        "render_modes_bench",
    ),
    Section(
        "dp",
        "What do two engine processes give over one?",
        "benchmarks.bench_dp",
        "run_dp_bench",
        "render_dp_bench",
    ),
    Section(
        "tp",
        "What do two tensor-parallel ranks give over one on this CPU?",
        "benchmarks.bench_tp",
        "run_tp_bench",
        "render_tp_bench",
    ),
    Section(
        "ray",
        "What does placing the data-parallel ranks with Ray cost?",
        "benchmarks.bench_ray",
        "run_ray_bench",
        "render_ray_bench",
        needs="ray",
    ),
    Section(
        "threads",
        "How do the thread defaults fare on a quiet and on a loaded machine?",
        "benchmarks.bench_threads",
        "run_threads_bench",
        "render_threads_bench",
    ),
    Section(
        "ipc",
        "What does a round trip to the engine cost against raw ZeroMQ?",
        "benchmarks.bench_ipc",
        "run_ipc_bench",
        "render_ipc_bench",
    ),
    Section(
        "startup",
        "How long do a start and a restart take?",
        "benchmarks.bench_startup",
        "run_startup_bench",
        "render_startup_bench",
    ),
    Section(
        "scaling",
        "How does a decode step grow with batch size and context?",
        "benchmarks.bench_scaling",
        "run_scaling_bench",
        "render_scaling_bench",
    ),
    Section(
        "steps",
        "Where does a decode step's time go?",
        "benchmarks.bench_steps",
        "run_steps_bench",
        "render_steps_bench",
    ),
    Section(
        "hygiene",
        "Does a restart leave anything behind?",
        "benchmarks.bench_hygiene",
        "run_hygiene_bench",
        "render_hygiene_bench",
    ),
    Section(
        "quant",
        "Quantized weights against llama.cpp",
        "benchmarks.bench_quantized",
        "run_quantized_bench",
        "render_quantized_bench",
    ),
    Section(
        "invariant",
        "What does batch_invariant=True cost?",
        "benchmarks.bench_batch_invariant",
        "run_batch_invariant_bench",
        "render_batch_invariant_bench",
    ),
    Section(
        "structured",
        "What do structured outputs cost?",
        "benchmarks.bench_structured",
        "run_structured_outputs_bench",
        "render_structured_outputs_bench",
    ),
    Section(
        "speculative",
        "What does speculative decoding give?",
        "benchmarks.bench_speculative",
        "run_speculative_bench",
        "render_speculative_bench",
    ),
    Section(
        "lora",
        "What do LoRA adapters cost?",
        "benchmarks.bench_lora",
        "run_lora_bench",
        "render_lora_bench",
    ),
    Section(
        "arch",
        "How fast is a second architecture against transformers?",
        "benchmarks.bench_arch",
        "run_arch_bench",
        "render_arch_bench",
    ),
)

BY_NAME = {section.name: section for section in SECTIONS}
