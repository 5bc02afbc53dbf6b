"""The live viewer (widgets and plain text), background generation and the progress bar."""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Iterator

import pytest

from enginekit import Engine, EngineShutdownError, SamplingParams
from enginekit.frontend.output_processor import RequestState
from enginekit.notebook import GenerationHandle, Viewer, in_jupyter, text_view
from enginekit.notebook import viewer as viewer_module
from enginekit.notebook.engine_stats import EngineStats
from enginekit.wire.messages import EngineCoreOutput, FinishReason, RequestStatus
from process_support import HANG_GUARD_S

STATS = {
    "num_running_requests": 3,
    "num_waiting_requests": 1,
    "kv_cache_usage": 0.25,
    "prefix_cache_hit_rate": 0.5,
}


class FakeEngine:
    """Just what the viewer reads from an engine, recording the calls it makes."""

    mode = "inproc"
    engine_pid = 4242
    is_running = True

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.num_stats_calls = 0

    def get_stats(self) -> dict:
        self.num_stats_calls += 1
        return dict(STATS)

    async def aget_stats(self) -> dict:
        return self.get_stats()

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _states(count: int) -> list[RequestState]:
    return [RequestState(f"req-{i}", f"prompt {i}", [1, 2, 3], SamplingParams()) for i in range(count)]


def outputs_of(states: list[RequestState]) -> list:
    return [state.output for state in states]


def _token(state: RequestState, text: str = "x", finish: FinishReason | None = None) -> None:
    state.apply(EngineCoreOutput(state.output.request_id, [7], text, finish))


def _widget_viewer(clock: FakeClock, **options: object) -> Viewer:
    viewer = Viewer(kind="widget", **options)
    viewer._clock = clock
    return viewer


def _count_changes(widget, counts: dict, key: object) -> None:
    counts[key] = 0

    def bump(_change: dict) -> None:
        counts[key] += 1

    widget.observe(bump, "value")


@pytest.fixture
def async_engine() -> Iterator[Engine]:
    engine = Engine("builtin", mode="async", num_kv_blocks=128)
    yield engine
    engine.shutdown()


# ---- throttling -------------------------------------------------------------------------------------


def test_no_widget_updates_more_than_ten_times_a_second_with_64_requests() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock)
    states = _states(64)
    watch = viewer.attach(FakeEngine(), outputs_of(states))
    counts: dict = {}
    _count_changes(viewer._view.panel, counts, "panel")
    for row in viewer.rows:
        _count_changes(viewer._view._row_widgets[id(row)][2], counts, row.request_id)
    for step in range(2000):  # 2 s of tokens arriving every millisecond, each for every request
        clock.now += 0.001
        for state in states:
            _token(state, text=str(step % 10))
        watch.update()
    assert max(counts.values()) <= 21  # 2 s at 10 a second, and the first one


def test_a_render_touches_only_the_rows_whose_request_changed() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock)
    states = _states(8)
    viewer.attach(FakeEngine(), outputs_of(states))
    counts: dict = {}
    for row in viewer.rows:
        _count_changes(viewer._view._row_widgets[id(row)][2], counts, row.request_id)
    _token(states[3])
    clock.now += 1.0
    viewer.refresh()
    assert counts == {f"req-{i}": int(i == 3) for i in range(8)}


def test_close_renders_the_final_state_even_inside_the_throttle_window() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock)
    (state,) = _states(1)
    watch = viewer.attach(FakeEngine(), outputs_of([state]))
    _token(state, text="last words", finish=FinishReason.LENGTH)
    watch.close()
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "last words" in html and "length" in html


def test_engine_stats_are_requested_at_most_once_per_stats_interval() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock, stats_interval_s=0.5)
    engine = FakeEngine()
    watch = viewer.attach(engine, outputs_of(_states(4)))
    for _ in range(1000):  # 1 s of updates
        clock.now += 0.001
        watch.update()
    assert engine.num_stats_calls <= 3


def test_a_slow_stats_answer_does_not_hold_back_the_next_render() -> None:
    # A blocking generate asks for the engine's numbers itself, and the engine answers between steps: during a
    # long prefill that is a second. The next render must still come one interval later, not seconds later.
    clock = FakeClock()
    viewer = _widget_viewer(clock, min_interval_s=0.1, stats_interval_s=10.0)
    engine = FakeEngine()
    answer = engine.get_stats

    def slow_stats() -> dict:
        clock.now += 1.0
        return answer()

    engine.get_stats = slow_stats  # type: ignore[method-assign]
    (state,) = _states(1)
    watch = viewer.attach(engine, outputs_of([state]))  # renders, and asks for the numbers (1 s)
    assert engine.num_stats_calls == 1
    counts: dict = {}
    _count_changes(viewer._view._row_widgets[id(viewer.rows[0])][2], counts, "row")
    clock.now += 0.15
    _token(state, text="soon")
    watch.update()
    assert counts["row"] == 1 and engine.num_stats_calls == 1


def test_a_failing_stats_call_is_shown_not_raised_and_the_next_answer_clears_it() -> None:
    class Flaky:
        is_running = True
        calls = 0

        def get_stats(self) -> dict:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("engine busy")
            return {"num_running_requests": 1}

    engine, stats = Flaky(), EngineStats(0.5, on_late_answer=lambda: None)
    stats.maybe_refresh(engine, 0.0, blocking=True)
    assert (stats.latest, stats.error) == (None, "RuntimeError: engine busy")
    stats.maybe_refresh(engine, 0.3, blocking=True)  # within the interval: not asked again
    stats.maybe_refresh(engine, 0.6, blocking=True)
    assert (engine.calls, stats.latest, stats.error) == (2, {"num_running_requests": 1}, None)


def test_the_final_stats_question_replaces_one_still_in_flight() -> None:
    async def main() -> list:
        asked, gate = [], asyncio.Event()

        class Slow:
            is_running = True

            async def aget_stats(self) -> dict:
                asked.append(len(asked) + 1)
                number = len(asked)
                if number == 1:
                    await gate.wait()  # the first answer is late: the requests have ended meanwhile
                return {"answer": number}

        arrived: list = []
        stats = EngineStats(0.5, on_late_answer=lambda: arrived.append(stats.latest))
        stats.maybe_refresh(Slow(), 0.0, blocking=False)  # a task, on this running loop
        await asyncio.sleep(0)
        stats.refresh_final(Slow(), blocking=False)
        await stats.wait(5.0)
        gate.set()
        await asyncio.sleep(0.01)
        return arrived

    assert asyncio.run(main()) == [{"answer": 2}]  # the stale answer was cancelled, never shown


# ---- what the widget shows --------------------------------------------------------------------------


def test_a_row_shows_text_tokens_speed_and_finish_reason() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock)
    state = RequestState("req-0", "prompt", [1, 2, 3], SamplingParams(max_tokens=8))
    watch = viewer.attach(FakeEngine(), outputs_of([state]), [state.params])
    for _ in range(4):
        _token(state, text="ab")
    clock.now += 2.0
    _token(state, text="<z>", finish=FinishReason.STOP)
    watch.close()
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "abababab&lt;z&gt;" in html
    assert "5/8 tokens" in html and "2.5 tok/s" in html and "stop" in html
    assert "first token" in html and "latency" in html and "greedy" not in html


def test_a_row_shows_its_state_as_the_engine_reports_it() -> None:
    viewer = _widget_viewer(FakeClock())
    params = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, seed=3, repetition_penalty=1.2)
    state = RequestState("req-0", "prompt", [1, 2, 3], params)
    viewer.attach(FakeEngine(), outputs_of([state]), [params])

    def row() -> str:
        viewer.refresh(force=True)
        return viewer._view._row_widgets[id(viewer.rows[0])][2].value

    assert ">waiting<" in row() and "0/50 tokens" in row()
    assert "temperature 0.7 · top-p 0.9 · seed 3 · repetition penalty 1.2" in row()
    state.apply(EngineCoreOutput("req-0", [], status=RequestStatus.RUNNING, first_scheduled_time=1.0))
    assert ">running<" in row()
    _token(state)
    assert ">running<" in row() and "1/50 tokens" in row()
    state.apply(EngineCoreOutput("req-0", [], status=RequestStatus.PREEMPTED, num_preemptions=1))
    assert ">preempted<" in row() and "preemptions 1" in row()
    assert viewer.summary()["num_preempted"] == 1 and viewer.summary()["num_preemptions"] == 1
    _token(state, finish=FinishReason.LENGTH)
    assert ">length<" in row()


def test_tokens_progress_counts_tokens_not_finished_requests() -> None:
    viewer = _widget_viewer(FakeClock())
    states = [RequestState(f"r{i}", "p", [1], SamplingParams(max_tokens=10)) for i in range(4)]
    viewer.attach(FakeEngine(), outputs_of(states), [s.params for s in states])
    for state in states:
        for _ in range(3):
            _token(state)
    summary = viewer.summary()
    assert summary["num_tokens"] == 12 and summary["num_max_tokens"] == 40 and summary["num_finished"] == 0
    _token(states[0], finish=FinishReason.STOP)  # finished early: it needs no more tokens
    viewer.refresh(force=True)
    assert viewer.summary()["num_max_tokens"] == 34
    assert "13/34 tokens" in viewer._view.panel.value


def test_stop_all_ends_with_a_breakdown_by_finish_reason() -> None:
    viewer = _widget_viewer(FakeClock())
    states = [RequestState(f"r{i}", "p", [1], SamplingParams(max_tokens=10)) for i in range(3)]
    watch = viewer.attach(FakeEngine(), outputs_of(states), [s.params for s in states])
    _token(states[0], finish=FinishReason.STOP)
    viewer.abort_all()
    for state in states[1:]:  # what the engine answers to the aborts
        _token(state, finish=FinishReason.ABORT)
    watch.close()
    summary = viewer.summary()
    assert summary["finish_reasons"] == {"stop": 1, "abort": 2} and summary["state"] == "stopped"
    assert summary["num_max_tokens"] == 21  # the aborted ones never reached their max_tokens
    panel = viewer._view.panel.value
    assert "1 stop" in panel and "2 abort" in panel and "stopped" in panel


def test_a_chat_row_shows_the_conversation_as_turns() -> None:
    viewer = _widget_viewer(FakeClock())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there>"}]
    state = RequestState("req-0", "<rendered template>", [1], SamplingParams(), messages=messages)
    viewer.attach(FakeEngine(), outputs_of([state]))
    _token(state, text="Hello!")
    viewer.refresh(force=True)
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert (
        "system:</b>" in html and "Be brief." in html and "user:</b>" in html and "Hi &lt;there&gt;" in html
    )
    assert "assistant:</b>" in html and "Hello!" in html and "rendered template" not in html


def test_n_samples_show_in_one_row() -> None:
    viewer = _widget_viewer(FakeClock())
    params = SamplingParams(n=2, max_tokens=5)
    state = RequestState("r", "p", [1], params, engine_ids=["0_r", "1_r"])
    viewer.attach(FakeEngine(), outputs_of([state]), [params])
    state.apply(EngineCoreOutput("0_r", [5], "first"), 0)
    state.apply(EngineCoreOutput("1_r", [6, 7], "second"), 1)
    viewer.refresh(force=True)
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "3/10 tokens" in html and "[0]" in html and "first" in html and "[1]" in html and "second" in html


def test_the_header_wraps_between_items_only() -> None:
    viewer = _widget_viewer(FakeClock())
    viewer.attach(FakeEngine(), outputs_of(_states(2)))
    panel = viewer._view.panel.value
    assert "<span style='white-space:nowrap'>prefix-cache hits 50%</span>" in panel
    assert "<span style='white-space:nowrap'>KV cache 25%</span>" in panel


def test_the_rows_area_is_tall_and_resizable() -> None:
    viewer = _widget_viewer(FakeClock(), rows_height="900px")
    viewer.attach(FakeEngine(), outputs_of(_states(2)))
    (rows_class,) = [c for c in viewer._view.rows_box._dom_classes if c.startswith("enginekit-rows-")]
    panel = viewer._view.panel.value
    assert f".{rows_class}{{resize:vertical;overflow:auto}}" in panel and "max-height:900px" in panel
    assert "max-height:70vh" in Viewer(kind="widget")._view._style
    with pytest.raises(ValueError, match="rows_height must be a CSS length"):
        Viewer(kind="widget", rows_height="")


def test_a_row_shows_only_the_tail_of_a_long_text() -> None:
    viewer = _widget_viewer(FakeClock(), max_chars=10)
    (state,) = _states(1)
    watch = viewer.attach(FakeEngine(), outputs_of([state]))
    _token(state, text="HEAD" + "-" * 50 + "0123456789")
    watch.close()
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "…0123456789" in html and "HEAD" not in html


def test_the_final_panel_shows_the_engine_numbers_fetched_once_every_request_is_done() -> None:
    viewer = _widget_viewer(FakeClock())
    engine = FakeEngine()
    (state,) = _states(1)
    watch = viewer.attach(engine, outputs_of([state]))
    assert "running 3" in viewer._view.panel.value  # the engine's load while it runs
    STATS_AFTER = {**STATS, "num_running_requests": 0, "num_waiting_requests": 0, "kv_cache_usage": 0.0}
    engine.get_stats = lambda: dict(STATS_AFTER)
    _token(state, finish=FinishReason.LENGTH)
    watch.close()
    panel = viewer._view.panel.value
    assert "running 0" in panel and "waiting 0" in panel and "KV cache 0%" in panel
    assert viewer.summary()["stats"] == STATS_AFTER and viewer.summary()["state"] == "done"


def test_the_panel_shows_engine_mode_pid_and_stats() -> None:
    viewer = _widget_viewer(FakeClock())
    viewer.attach(FakeEngine(), outputs_of(_states(2)))
    panel = viewer._view.panel.value
    for expected in ("inproc", "4242", "running 3", "waiting 1", "KV cache 25%", "prefix-cache hits 50%"):
        assert expected in panel


def test_the_abort_button_aborts_its_own_request() -> None:
    viewer = _widget_viewer(FakeClock())
    engine = FakeEngine()
    viewer.attach(engine, outputs_of(_states(3)))
    viewer._view._row_widgets[id(viewer.rows[1])][1].click()
    assert engine.aborted == ["req-1"]


def test_stop_all_aborts_only_the_unfinished_requests() -> None:
    viewer = _widget_viewer(FakeClock())
    engine = FakeEngine()
    states = _states(3)
    viewer.attach(engine, outputs_of(states))
    _token(states[0], finish=FinishReason.LENGTH)
    viewer._view.stop_all.click()
    assert engine.aborted == ["req-1", "req-2"]


def test_a_failing_abort_is_shown_not_raised() -> None:
    viewer = _widget_viewer(FakeClock())
    engine = FakeEngine()
    engine.abort = lambda request_ids: (_ for _ in ()).throw(EngineShutdownError("the engine is shut down"))
    viewer.attach(engine, outputs_of(_states(1)))
    viewer.abort_all()
    assert "abort failed: EngineShutdownError" in viewer._view.panel.value


# ---- plain text fallback ----------------------------------------------------------------------------


def test_outside_jupyter_the_viewer_is_text() -> None:
    assert not in_jupyter()
    assert Viewer().kind == "text"


def test_without_ipywidgets_the_viewer_says_so_once_and_prints_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(viewer_module, "in_jupyter", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    monkeypatch.setattr(text_view, "_explained", set())
    stream = io.StringIO()
    for _ in range(2):
        viewer = Viewer(stream=stream)
        viewer.attach(FakeEngine(), outputs_of(_states(1))).close()
    assert viewer.kind == "text"
    assert stream.getvalue().count("ipywidgets is not installed (pip install ipywidgets)") == 1


def test_asking_for_widgets_without_ipywidgets_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ImportError, match=r"the widget viewer needs ipywidgets: pip install ipywidgets"):
        Viewer(kind="widget")


def test_text_progress_lines_are_throttled() -> None:
    clock = FakeClock()
    stream = io.StringIO()
    viewer = Viewer(kind="text", text_interval_s=2.0, stream=stream)
    viewer._clock = clock
    states = _states(4)
    watch = viewer.attach(FakeEngine(), outputs_of(states))
    for _ in range(3000):  # 3 s of updates
        clock.now += 0.001
        _token(states[0])
        watch.update()
    for state in states:
        _token(state, finish=FinishReason.LENGTH)
    watch.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 0 s, at 2 s, and the summary
    assert lines[-1].startswith("enginekit: 4/4 finished") and "(done: length 4)" in lines[-1]
    assert "4 waiting" in lines[0] and "1 running, 3 waiting" in lines[1] and "running" not in lines[-1]


def test_generate_with_a_text_viewer_returns_the_same_outputs(enginekit_engine, greedy) -> None:
    prompts = ["one", "two", "three"]
    plain = enginekit_engine.generate(prompts, greedy(6))
    watched = enginekit_engine.generate(prompts, greedy(6), viewer=Viewer(stream=io.StringIO()))
    assert [o.outputs[0].token_ids for o in watched] == [o.outputs[0].token_ids for o in plain]


def test_a_bad_viewer_argument_is_refused_before_anything_is_submitted(enginekit_engine, greedy) -> None:
    with pytest.raises(TypeError, match=r"viewer must be True, False, None or an enginekit Viewer, got str"):
        enginekit_engine.generate("hi", greedy(4), viewer="yes")
    assert enginekit_engine.call_utility("get_request_ids") == []


def test_viewer_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"kind must be 'auto', 'widget' or 'text', got 'html'"):
        Viewer(kind="html")
    with pytest.raises(ValueError, match=r"min_interval_s must be zero or positive, got -1"):
        Viewer(min_interval_s=-1)


# ---- the real engine --------------------------------------------------------------------------------


def test_widget_viewer_follows_a_real_generate_to_the_end(enginekit_engine, greedy) -> None:
    viewer = Viewer(kind="widget")
    outputs = enginekit_engine.generate([f"p{i}" for i in range(16)], greedy(5), viewer=viewer)
    summary = viewer.summary()
    assert summary["num_finished"] == 16 and summary["num_tokens"] == 80 and not summary["active"]
    first = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert outputs[0].text.replace("&", "&amp;").replace("<", "&lt;") in first
    # The final panel matches the engine once every request is done.
    engine_stats = enginekit_engine.get_stats()
    assert summary["stats"]["num_running_requests"] == engine_stats["num_running_requests"] == 0
    assert summary["stats"]["num_generated_tokens"] == engine_stats["num_generated_tokens"]
    assert summary["num_waiting"] == summary["num_running"] == 0 and summary["state"] == "done"


def test_async_mode_viewer_gets_stats_without_blocking_or_reentering_a_loop(
    async_engine: Engine, greedy, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_calls, async_calls = [], []
    real_get_stats, real_aget_stats = async_engine.get_stats, async_engine.aget_stats

    def get_stats():
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()  # a blocking stats call never runs on a loop
        sync_calls.append(True)
        return real_get_stats()

    monkeypatch.setattr(async_engine, "get_stats", get_stats)
    monkeypatch.setattr(async_engine, "aget_stats", lambda: async_calls.append(True) or real_aget_stats())
    prompts = [f"p{i}" for i in range(4)]

    async def main():
        return await async_engine.agenerate(prompts, greedy(8), viewer=Viewer(kind="widget"))

    asyncio.run(main())
    assert async_calls and not sync_calls
    async_engine.generate(prompts, greedy(8), viewer=Viewer(kind="widget"))  # no loop: a plain blocking call
    assert sync_calls


# ---- background generation --------------------------------------------------------------------------


def test_generate_background_returns_before_generation_and_gives_generates_outputs(
    async_engine: Engine, greedy
) -> None:
    prompts = [f"p{i}" for i in range(4)]
    expected = [o.outputs[0].token_ids for o in async_engine.generate(prompts, greedy(6))]

    async def main() -> tuple[bool, list]:
        handle = async_engine.generate_background(prompts, greedy(6))
        returned_early = not handle.done()
        outputs = await handle
        return returned_early, [o.outputs[0].token_ids for o in outputs]

    returned_early, tokens = asyncio.run(main())
    assert returned_early and tokens == expected


def test_other_coroutines_run_while_a_background_generation_runs(async_engine: Engine, greedy) -> None:
    async def main() -> tuple[list[int], bool]:
        handle = async_engine.generate_background(["a", "b"], greedy(2000, ignore_eos=True))
        seen: list[int] = []
        while len(set(seen)) < 3 and not handle.done():  # until it has seen the tokens grow twice
            seen.append(sum(len(o.outputs[0].token_ids) for o in handle.outputs))
            await asyncio.sleep(0.005)  # a poll: the generation runs meanwhile
        still_running = not handle.done()
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        return seen, still_running

    seen, still_running = asyncio.run(main())
    assert still_running and len(set(seen)) >= 3 and seen == sorted(seen)  # this loop ran beside it
    assert async_engine.call_utility("wait_idle", timeout=HANG_GUARD_S)["num_running_requests"] == 0


def test_cancel_aborts_the_background_requests(async_engine: Engine, greedy) -> None:
    async def main() -> GenerationHandle:
        handle = async_engine.generate_background(["a", "b"], greedy(500))
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle
        return handle

    handle = asyncio.run(main())
    assert handle.cancelled()
    assert async_engine.call_utility("wait_idle", timeout=30)["num_running_requests"] == 0


def test_shutdown_ends_a_background_generation_with_engine_shutdown_error(
    async_engine: Engine, greedy
) -> None:
    async def main() -> None:
        handle = async_engine.generate_background(["a", "b"], greedy(2000, ignore_eos=True))
        deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
        while not any(o.outputs[0].token_ids for o in handle.outputs):  # until the generation runs
            assert asyncio.get_running_loop().time() < deadline, "the generation never started"
            await asyncio.sleep(0.005)
        async_engine.shutdown()
        with pytest.raises(EngineShutdownError, match=r"shut down"):
            await asyncio.wait_for(handle, HANG_GUARD_S)  # a bounded wait: this used to hang

    asyncio.run(main())


def test_a_background_viewer_sees_every_request_finish(async_engine: Engine, greedy) -> None:
    async def main() -> Viewer:
        handle = async_engine.generate_background(["a", "b", "c"], greedy(5), viewer=Viewer(kind="widget"))
        await handle
        return handle.viewer

    viewer = asyncio.run(main())
    summary = viewer.summary()
    assert summary["num_finished"] == 3 and not summary["active"]
    assert summary["stats"]["num_running_requests"] == 0  # awaited before the handle finished
    assert summary["stats"]["num_generated_tokens"] == async_engine.get_stats()["num_generated_tokens"]


def test_generate_background_needs_async_mode(enginekit_engine, greedy) -> None:
    async def main() -> None:
        enginekit_engine.generate_background("hi", greedy(4))

    with pytest.raises(
        RuntimeError, match=r"generate_background needs mode='async'.*restart\(mode='async'\)"
    ):
        asyncio.run(main())


def test_generate_background_needs_a_running_loop(async_engine: Engine, greedy) -> None:
    with pytest.raises(RuntimeError, match=r"needs a running asyncio loop in this thread"):
        async_engine.generate_background("hi", greedy(4))


# ---- progress bar -----------------------------------------------------------------------------------


def test_a_batch_of_16_shows_a_progress_bar(enginekit_engine, greedy, capsys: pytest.CaptureFixture) -> None:
    enginekit_engine.generate([f"p{i}" for i in range(16)], greedy(2))
    assert "generate" in capsys.readouterr().err


def test_progress_false_hides_the_progress_bar(
    enginekit_engine, greedy, capsys: pytest.CaptureFixture
) -> None:
    enginekit_engine.generate([f"p{i}" for i in range(16)], greedy(2), progress=False)
    assert capsys.readouterr().err == ""
