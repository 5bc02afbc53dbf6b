"""The live viewer (widgets and plain text), background generation and the progress bar."""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Iterator

import pytest

from enginekit import Engine, EngineShutdownError
from enginekit.notebook import GenerationHandle, Viewer, in_jupyter, text_view
from enginekit.notebook import viewer as viewer_module
from enginekit.output_processor import RequestState
from enginekit.wire.messages import EngineCoreOutput, FinishReason

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
    return [RequestState(f"req-{i}", f"prompt {i}", [1, 2, 3], False) for i in range(count)]


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


# ---- what the widget shows --------------------------------------------------------------------------


def test_a_row_shows_text_tokens_speed_and_finish_reason() -> None:
    clock = FakeClock()
    viewer = _widget_viewer(clock)
    (state,) = _states(1)
    watch = viewer.attach(FakeEngine(), outputs_of([state]))
    for _ in range(4):
        _token(state, text="ab")
    clock.now += 2.0
    _token(state, text="<z>", finish=FinishReason.STOP)
    watch.close()
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "abababab&lt;z&gt;" in html
    assert "5 tokens" in html and "2.5 tok/s" in html and "stop" in html


def test_a_row_shows_only_the_tail_of_a_long_text() -> None:
    viewer = _widget_viewer(FakeClock(), max_chars=10)
    (state,) = _states(1)
    watch = viewer.attach(FakeEngine(), outputs_of([state]))
    _token(state, text="HEAD" + "-" * 50 + "0123456789")
    watch.close()
    html = viewer._view._row_widgets[id(viewer.rows[0])][2].value
    assert "…0123456789" in html and "HEAD" not in html


def test_the_final_panel_drops_the_engine_load_of_a_past_moment() -> None:
    viewer = _widget_viewer(FakeClock())
    viewer.attach(FakeEngine(), outputs_of(_states(1))).close()
    panel = viewer._view.panel.value
    assert "running 3" not in panel and "KV cache" not in panel and "prefix-cache hits 50%" in panel


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
    async def main() -> list[int]:
        handle = async_engine.generate_background(["a", "b"], greedy(32))
        seen = []
        while not handle.done():
            seen.append(sum(len(o.outputs[0].token_ids) for o in handle.outputs))
            await asyncio.sleep(0.005)
        await handle
        return seen

    seen = asyncio.run(main())
    assert len(seen) > 1 and seen == sorted(seen)  # this loop kept running and saw the tokens grow


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
        handle = async_engine.generate_background(["a", "b"], greedy(500))
        await asyncio.sleep(0.05)
        async_engine.shutdown()
        with pytest.raises(EngineShutdownError, match=r"shut down"):
            await asyncio.wait_for(handle, 30)  # a bounded wait: this used to hang

    asyncio.run(main())


def test_a_background_viewer_sees_every_request_finish(async_engine: Engine, greedy) -> None:
    async def main() -> Viewer:
        handle = async_engine.generate_background(["a", "b", "c"], greedy(5), viewer=Viewer(kind="widget"))
        await handle
        return handle.viewer

    viewer = asyncio.run(main())
    assert viewer.summary()["num_finished"] == 3 and not viewer.summary()["active"]


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
