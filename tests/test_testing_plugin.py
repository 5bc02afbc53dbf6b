"""The pytest plugin users enable with ``pytest_plugins = ["enginekit.testing"]``."""

import os

from enginekit import Engine, SamplingParams


def test_fixture_hands_out_a_shared_inprocess_engine(enginekit_engine):
    assert enginekit_engine.mode == "inproc"
    assert enginekit_engine.engine_pid == os.getpid()
    out = enginekit_engine.generate("fixture", SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_fixture_engine_is_the_same_object_across_tests(enginekit_engine, request):
    assert enginekit_engine is request.getfixturevalue("_enginekit_session_engine")


def test_requests_left_running_are_cleaned_after_a_test(pytester):
    pytester.makeconftest('pytest_plugins = ["enginekit.testing"]')
    pytester.makepyfile(
        """
        from enginekit import SamplingParams

        def test_leaves_a_stream_open(enginekit_engine):
            stream = enginekit_engine.stream("left open", SamplingParams(max_tokens=100))
            next(stream)

        def test_sees_no_leftover(enginekit_engine):
            assert enginekit_engine.call_utility("get_request_ids") == []
            stats = enginekit_engine.get_stats()
            assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=2)


def test_enginekit_mode_env_makes_every_engine_inprocess(monkeypatch):
    monkeypatch.setenv("ENGINEKIT_MODE", "inproc")
    with Engine("builtin") as engine:
        assert engine.mode == "inproc" and engine.engine_pid == os.getpid()
