"""Section 3: what the background process costs: ``"mp"`` and ``"async"`` throughput over ``"inproc"``, on the
tiny models and the real one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import (
    Context,
    ModelSpec,
    Run,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    make_engine,
    paired_ratio,
)
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Mode overhead: mp and async against inproc"
MODES = ("inproc", "mp", "async")
CONCURRENCY = (1, 8, 32, 128)  # the quick run stops at 32
REAL_CONCURRENCY = (8, 32)  # the real model's steps are 50-100x the tiny models': no 1 or 128
# Its rounds range about 10% either way on a shared 2-core machine: six (each mode first twice) resolve a median.
REAL_ROUNDS = 6
TARGET = 0.97
# Fresh engine sets per table. Measured by hand on 2026-12-02 (built-in model, 32 concurrent, 8-10 interleaved
# rounds per pair of engines): the median mp / inproc of eight pairs of engines, the code unchanged, ranged
# 0.87-1.03, most near 1.0, one at 0.87 with 8 of its 10 rounds under 0.9. One set's median is one draw of that.
SETS = 3
STREAM_INTERVAL = 4  # the last table's engine option: a stream's tokens every 4 steps


@dataclass(frozen=True)
class ModeComparison:
    ratios: dict[tuple[str, int], Summary]  # (mode, concurrency): throughput over inproc's
    front_end_cpu_us: dict[tuple[str, int], Summary]  # (mode, concurrency): the caller's CPU per token


def run(ctx: Context, report: SectionReport) -> None:
    prompt_len, output_len = ctx.pick((16, 16), (128, 64))
    repeats = ctx.pick(2, 9)  # a tiny model's run lasts under a second: a round ranges 20% either way
    threads = ctx.threads
    report.method = f"""
The same workload (*N* requests submitted at once, {prompt_len}-token prompts, {output_len} greedy tokens each,
EOS ignored) runs through `Engine.generate` in each mode; async mode uses `await engine.agenerate(...)` on
an asyncio loop. All three engines are up at once with `num_threads={threads}` and their runs alternate, so
they see the same machine. inproc runs the engine core in the caller's thread; mp and async run it in a
background process (two IO threads there) and the caller's process receives outputs on its own thread or
task: one per request, when it ends, except in the last two tables, where every request gets a delta per step
as a stream or a viewer does (in the last one, every {STREAM_INTERVAL} steps: `stream_interval={STREAM_INTERVAL}`). Each table's rounds are split over {_sets_phrase(repeats)} of the three engines, started
one set after the other (a set's median alone ranged 0.87-1.03 here with the code unchanged, see below). The
ratio is the median of per-round ratios over all sets (min-max). The last two columns give the CPU time the
caller's threads (the front end: the calling thread, which runs the asyncio loop in async mode, and in mp mode
the client's receive thread) used per generated token, the median over rounds (each thread's CPU clock). The real model (SmolLM2-135M-Instruct, float32)
runs {ctx.pick(REAL_CONCURRENCY[:1], REAL_CONCURRENCY)} concurrent requests of
{ctx.pick((16, 8), (64, 32))[0]}-token prompts and {ctx.pick((16, 8), (64, 32))[1]} tokens each,
{ctx.pick(1, REAL_ROUNDS)} rounds.
"""
    ratios: dict[tuple[str, str, int], Summary] = {}
    for spec in ctx.models():
        measured = compare_modes(
            ctx,
            report,
            spec,
            ctx.pick(CONCURRENCY[:3], CONCURRENCY),
            (prompt_len, output_len),
            repeats,
            threads,
        )
        ratios.update(
            {(spec.key, mode, concurrency): ratio for (mode, concurrency), ratio in measured.ratios.items()}
        )
    real = ctx.model("smollm2")
    real_lengths = ctx.pick((16, 8), (64, 32))
    measured = compare_modes(
        ctx,
        report,
        real,
        ctx.pick(REAL_CONCURRENCY[:1], REAL_CONCURRENCY),
        real_lengths,
        ctx.pick(1, REAL_ROUNDS),
        threads,
        seed=9,
        title=f"{real.label}, float32: generated tokens/s by mode",
    )
    ratios.update(
        {(real.key, mode, concurrency): ratio for (mode, concurrency), ratio in measured.ratios.items()}
    )
    # What the per-step hop costs where it is still paid: every request sent a delta per step (a stream, a
    # viewer), the same workload otherwise.
    builtin = ctx.model("builtin")
    with_deltas = compare_modes(
        ctx,
        report,
        builtin,
        ctx.pick((8, 32), (8, 32, 128)),
        (prompt_len, output_len),
        repeats,
        threads,
        title=f"{builtin.label}, a delta per step for every request (as a stream or a viewer gets): "
        "generated tokens/s by mode",
        deltas=True,
    )
    # The same, with the engine's tokens for a stream sent every STREAM_INTERVAL steps.
    with_interval = compare_modes(
        ctx,
        report,
        builtin,
        (8, 32),
        (prompt_len, output_len),
        repeats,
        threads,
        title=f"{builtin.label}, a delta every {STREAM_INTERVAL} steps for every request "
        f"(`stream_interval={STREAM_INTERVAL}`): generated tokens/s by mode",
        deltas=True,
        stream_interval=STREAM_INTERVAL,
    )
    misses = []
    for (model, mode, concurrency), ratio in sorted(ratios.items()):
        if concurrency >= 8:
            verdict = "met" if ratio.median >= TARGET else "NOT met"
            if ratio.median < TARGET:
                misses.append(f"{model} {mode} at {concurrency}")
            report.targets.append(
                f"{model}, {mode} / inproc at {concurrency} concurrent >= {TARGET}: "
                f"measured {ratio.median:.3f}: {verdict}"
            )
    report.findings.append(
        "Below target: " + (", ".join(misses) if misses else "none") + ". At 1 concurrent request there is "
        "no target; the ratio there shows the fixed per-step cost of the process hop."
    )
    counts = sorted({c for _, c in with_deltas.ratios})
    report.findings.append(
        "With a delta per step for every request (the built-in model), mp / inproc is "
        + ", ".join(f"{with_deltas.ratios[('mp', c)].median:.2f}" for c in counts)
        + " and async / inproc "
        + ", ".join(f"{with_deltas.ratios[('async', c)].median:.2f}" for c in counts)
        + f" at {', '.join(str(c) for c in counts)} concurrent: what the per-step hop costs a stream or a "
        "viewer, which `generate` no longer pays."
    )
    per_token = {
        (mode, c, label): comparison.front_end_cpu_us[(mode, c)].median
        for label, comparison in (("step", with_deltas), ("interval", with_interval))
        for mode in ("mp", "async")
        for c in (8, 32)
    }
    report.findings.append(
        f"With `stream_interval={STREAM_INTERVAL}` (a stream's tokens sent every {STREAM_INTERVAL} steps), mp / "
        "inproc is "
        + ", ".join(f"{with_interval.ratios[('mp', c)].median:.2f}" for c in (8, 32))
        + " and async / inproc "
        + ", ".join(f"{with_interval.ratios[('async', c)].median:.2f}" for c in (8, 32))
        + " at 8 and 32 concurrent. The front end's CPU per generated token, a delta every step against every "
        f"{STREAM_INTERVAL} steps: "
        + "; ".join(
            f"{mode} at {c}, {per_token[(mode, c, 'step')]:.0f} against {per_token[(mode, c, 'interval')]:.0f} µs"
            for mode in ("mp", "async")
            for c in (8, 32)
        )
        + "."
    )
    report.limits = f"""
**One output per request end.** `generate` and `agenerate`, the workload of the tables above the last two,
ask the engine for each request's output once, when it ends (`EngineCoreRequest.final_only`, since
2026-12-02). Before, every step's deltas were encoded by the engine's output thread, sent over an ipc://
socket, decoded by the front end's receive thread (or the asyncio loop's reader) and routed while the next
step ran; on the tiny models at 8-32 concurrent, where a step lasts about a millisecond, mp / inproc was
0.88-0.92 in this section's run of 2026-12-02 (async 0.90-0.94). Measured by hand on the built-in model
(128-token prompts, 64 tokens, 8-10 interleaved rounds) just before and after the change: mp / inproc 0.87 to
0.99-1.05 at 32 concurrent, 0.82-0.92 to 0.86-1.03 at 8.

**One set of engines is one draw.** Measured by hand on 2026-12-02 with this code (built-in model, 32
concurrent, 128-token prompts, 64 tokens, `generate`): eight pairs of engines, an inproc and an mp one each,
started one pair after the other and run for 8-10 interleaved rounds, gave medians of mp / inproc of 0.87,
0.94, 0.99, 1.00, 1.01, 1.02, 1.02 and 1.03; in the 0.87 pair, 8 of its 10 rounds were under 0.9. The engine
process's thread governor changed no thread count in any of them, and two of the pairs ran with
`adaptive_threads=False`. So each table's rounds are spread over fresh sets of engines, one after the other.
The section has run five times since `generate` got one output per request end: with one set of engines, 7
and 4 of its 16 targets met; with three sets, 8, 4 and 8 (this run: the real model's four ratios at
0.93-1.01, the tiny models' at 0.81-1.02). Single rounds range from 0.68 to 1.45 in this run: a round is far
noisier than the 3% the target asks to resolve, and the medians move by more than that from run to run.

**A delta per step** (the second-last table): what a stream or a viewer gets by default. There the engine's output thread
and the front end's receive thread need the CPU once per step beside two torch threads that hold both cores,
and a torch worker they preempt holds up the barrier of the op it was running; in-process, the same output
work runs between steps on the main thread and preempts nothing.

**`stream_interval`** (the last table): the engine sends a stream's tokens every N steps (its first token and
its end at once), so the hop is paid every fourth step there. What it saves shows in the front end's CPU per
token (the last two columns), which this machine's noise moves much less than throughput: in this run,
49-50 µs with a delta every step against 18-20 µs with `stream_interval=4` at 8 concurrent, and 17-19
against 7 µs at 32, in both background modes. By hand on 2026-12-02 (the same workload, mp, one engine per
setting, eight runs each, twice), the engine process's CPU per token fell by 0-10% (its torch threads
dominate it). The throughput ratios of the two tables move by less than a round varies here.

**`generate`'s front end** (the other tables' last two columns): 2-8 µs of CPU per token on the tiny models at
8-128 concurrent, the submission and each request's one output. On the real model, whose runs last seconds,
mp's is 41-83 µs against async's 4-13. The mp runs are a blocking `generate`, whose wait wakes every 50 ms
to look at its requests: measured by hand on 2026-12-02, 20-22 ms of the calling thread's CPU over a 3 s wait
(0.7% of a core), the same in both modes' blocking `generate`. The async runs are an awaited `agenerate`, which
sleeps until a batch arrives.

**The OpenMP workers' wait.** With {threads} threads, inproc runs in this process, whose OpenMP runtime spins
between parallel regions as long as libgomp's default allows (300000 spins, some milliseconds); the engine
process's workers spin as long (`GOMP_SPINCOUNT=300000`, the launcher's default), then sleep, and its thread
governor drops a thread while other processes keep a core busy (thread section). A worker that has fallen
asleep is woken by a futex at the next parallel region, tens to hundreds of microseconds on this VM. Before the
engine's workers spun at all, mp / inproc here was 0.27-0.62 on the built-in model.

**The real model.** Its step is tens of milliseconds of matmuls, so the hop's fixed part hid behind it even
with a delta per step. With the previous default, a short spin (`GOMP_SPINCOUNT=10000`, about 0.3 ms), the
engine's workers still fell asleep inside a step, at gaps between parallel regions longer than that, and mp /
inproc was 0.73-0.87 at 8 concurrent (0.80 in this section's run of 2026-12-01). A round ranges about 10%
either way here: by hand, on 2026-12-02, six rounds at 32 concurrent (order alternating) gave per-round mp /
inproc from 0.88 to 1.14, median 0.98, while the engine process's two torch threads each used a full core and
its IO threads and the front end under 0.1 s of CPU per run. So the table runs six rounds.

**The long spin beside a notebook.** Workers that spin through every gap keep both cores busy while a step
runs, and JupyterLab, the kernel and a browser share them. Measured on 2026-12-02 with the real model, 16 chats
at 8 concurrent in async mode: the front end's asyncio loop woke late by the same amount with either spin (a
10 ms timer, p99 3.3-3.7 ms late with the long spin, 3.7-4.4 ms with the short one). The live viewer's browser
test had failed twice with the long spin. What it found was a viewer that counted a blocking stats call
(which waits for the engine's current step, 0.9 s behind the first prefill) as its own render time and held
the next render back 3 s, long enough to miss the first wave of chats on a slower run; with that fixed
(`notebook/viewer.py`) the test passed 4 runs of 4 with the long spin, one of them beside a busy process.

What would move the rest: a viewer that asks for a coarser interval for its own requests (it renders at most
every 0.1 s, and `stream_interval` is one setting for the whole engine today); for every mode, fewer parallel
regions per step (fused small ops, one attention kernel for the whole batch). And to resolve a 3% target,
a quieter machine or many more rounds than a section can afford here.
"""


def compare_modes(
    ctx: Context,
    report: SectionReport,
    spec: ModelSpec,
    concurrency_list: tuple[int, ...],
    lengths: tuple[int, int],
    repeats: int,
    threads: int | None,
    *,
    seed: int = 0,
    title: str | None = None,
    deltas: bool = False,
    **options: Any,
) -> ModeComparison:
    """Run equal-length batches through inproc, mp and async engines of ``spec`` (three engines up at once,
    rounds interleaved), add the table to ``report``; returns mp / inproc and async / inproc per concurrency,
    and the CPU time the front end's process used per generated token in mp and async modes.

    The rounds are split over ``engine_sets(repeats)`` fresh sets of engines, one set after the other, so each
    concurrency's rounds are spread over the section instead of bunched in one minute, and no one engine
    process decides a ratio (see ``SETS``).
    """
    prompt_len, output_len = lengths
    workload = equal_workload(max(concurrency_list), prompt_len, output_len)
    samples: dict[int, dict[str, list[Run]]] = {c: {mode: [] for mode in MODES} for c in concurrency_list}
    for set_index, rounds in enumerate(engine_sets(repeats)):
        engines = {
            mode: make_engine(
                spec, mode, num_threads=threads, num_kv_blocks=kv_blocks_for(workload), **options
            )
            for mode in MODES
        }
        try:
            for index, concurrency in enumerate(concurrency_list):
                ctx.log(f"modes: {spec.key} x{concurrency} (engine set {set_index + 1})")
                batch = equal_workload(concurrency, prompt_len, output_len)
                runners = {
                    mode: engine_batch_runner(
                        engine,
                        spec,
                        batch,
                        threads=threads if mode == "inproc" else None,
                        seed=seed + i + 10 * set_index,
                        deltas=deltas,
                    )
                    for i, (mode, engine) in enumerate(engines.items())
                }
                # Each set starts its rotation with another mode: no mode always runs first.
                order = MODES[set_index % len(MODES) :] + MODES[: set_index % len(MODES)]
                runners = {mode: runners[mode] for mode in order}
                measured = interleave(runners, repeats=rounds, warmup=1 if index == 0 else 0)
                for mode in MODES:
                    samples[concurrency][mode] += measured[mode]
        finally:
            for engine in engines.values():
                engine.shutdown()
    ratios: dict[tuple[str, int], Summary] = {}
    cpu: dict[tuple[str, int], Summary] = {}
    rows = []
    for concurrency in concurrency_list:
        rates = {mode: [run.tokens_per_s for run in samples[concurrency][mode]] for mode in MODES}
        row: list[Any] = [concurrency]
        row += [fmt(summarize(rates[mode]), "", 1, thousands=True) for mode in MODES]
        for mode in ("mp", "async"):
            ratio = paired_ratio(rates[mode], rates["inproc"])
            ratios[(mode, concurrency)] = ratio
            row.append(f"{ratio.median:.3f} ({ratio.min:.3f}-{ratio.max:.3f})")
        for mode in ("mp", "async"):
            cpu[(mode, concurrency)] = summarize(
                1e6 * run.cpu_s / run.tokens for run in samples[concurrency][mode]
            )
            row.append(f"{cpu[(mode, concurrency)].median:.1f}")
        rows.append(row)
    report.table(
        title or f"{spec.label}: generated tokens/s by mode",
        [
            "concurrent",
            "inproc tok/s",
            "mp tok/s",
            "async tok/s",
            "mp / inproc",
            "async / inproc",
            "mp: front end CPU µs/token",
            "async: front end CPU µs/token",
        ],
        rows,
        ["r", "l", "l", "l", "l", "l", "r", "r"],
    )
    return ModeComparison(ratios, cpu)


def _sets_phrase(repeats: int) -> str:
    sets = len(engine_sets(repeats))
    return "one set" if sets == 1 else f"{sets} fresh sets"


def engine_sets(repeats: int) -> list[int]:
    """How many rounds each fresh set of engines runs: ``repeats`` split over up to ``SETS`` sets."""
    sets = max(1, min(SETS, repeats // 2))
    return [repeats // sets + (1 if i < repeats % sets else 0) for i in range(sets)]
