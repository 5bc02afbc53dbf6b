"""LoRA adapters: each adapter's greedy tokens equal transformers on the merged model, alone and mixed in one batch
with other adapters and the base model, in every mode and after a restart; bad adapters are refused by name and the
engine lives on; the pool swaps adapters through its slots; the prefix cache never shares blocks between adapters."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest
import torch

from enginekit import Engine, EngineConfig, LoRARequest, SamplingParams, UtilityCallError
from hf_checkpoints import build_checkpoint, hf_greedy
from lora_adapters import ATTENTION, build_adapter, merge_adapter

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SMALL = {"block_size": 8, "num_kv_blocks": 96, "max_model_len": 128, "max_num_batched_tokens": 32}


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 384) for _ in range(24)]
    # a prompt past the token budget (chunked), two that share three blocks, and short ones
    return [
        shared + [rng.randrange(2, 384) for _ in range(16)],
        shared + [rng.randrange(2, 384) for _ in range(3)],
        *([rng.randrange(2, 384) for _ in range(n)] for n in (1, 5, 13)),
    ]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory):
    """A llama base, three adapters (every projection, r=8; q/v with rsLoRA, r=4; attention only, a rank per
    module) and each one's reference tokens (transformers on the merged model), and the base's."""
    root = tmp_path_factory.mktemp("lora")
    base = build_checkpoint(root / "base", "llama")
    adapters = {
        "all": build_adapter(base, root / "all", seed=1),
        "qv": build_adapter(base, root / "qv", targets=["q_proj", "v_proj"], r=4, seed=2, use_rslora=True),
        "attn": build_adapter(
            base, root / "attn", targets=ATTENTION, r=8, seed=3, rank_pattern={"o_proj": 2}, alpha=4
        ),
    }
    prompts = make_prompts()
    expected = {None: hf_greedy(base, prompts, MAX_TOKENS)}
    for name, path in adapters.items():
        expected[name] = hf_greedy(merge_adapter(base, path, root / f"merged-{name}"), prompts, MAX_TOKENS)
    requests = {
        name: LoRARequest(name, index, str(path)) for index, (name, path) in enumerate(adapters.items(), 1)
    }
    return {"base": base, "root": root, "prompts": prompts, "expected": expected, "requests": requests}


def mixed_batch(case, names):
    """Every prompt once per name (None: the base model): the prompts, their lora_requests, their references."""
    prompts, adapters, expected = [], [], []
    for name in names:
        prompts += case["prompts"]
        adapters += [case["requests"][name] if name else None] * len(case["prompts"])
        expected += case["expected"][name]
    return prompts, adapters, expected


def test_the_adapters_change_the_tokens(lora_case):
    expected = lora_case["expected"]
    assert len({json.dumps(tokens) for tokens in expected.values()}) == len(expected)


def test_each_adapter_alone_and_all_mixed_with_the_base_equal_transformers_merged(lora_case):
    names = [None, "all", "qv", "attn"]
    prompts, adapters, expected = mixed_batch(lora_case, names)
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, **SMALL) as engine:
        for name in names[1:]:
            request = lora_case["requests"][name]
            outputs = engine.generate(lora_case["prompts"], GREEDY, lora_request=request)
            assert tokens(outputs) == lora_case["expected"][name], name
            assert all(o.lora_request == request for o in outputs)
        random.Random(1).shuffle(order := list(range(len(prompts))))
        outputs = engine.generate(
            [prompts[i] for i in order], GREEDY, lora_request=[adapters[i] for i in order]
        )
        assert tokens(outputs) == [expected[i] for i in order]
        stats = engine.get_stats()
    assert stats["lora_adapters_loaded"] == 3 and stats["lora_slot_loads"] == 3


def test_adapters_under_speculative_decoding_keep_transformers_tokens(lora_case):
    """Each request's proposals are verified with its own adapter: the mixed batch's greedy tokens are still the
    merged models' (the prompts' own tokens repeat, so the n-gram lookup proposes)."""
    prompts, adapters, expected = mixed_batch(lora_case, [None, "all", "qv", "attn"])
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    with Engine(
        str(lora_case["base"]), mode="inproc", enable_lora=True, speculative_config=speculative, **SMALL
    ) as engine:
        outputs = engine.generate(prompts, GREEDY, lora_request=adapters)
        stats = engine.get_stats()
    assert tokens(outputs) == expected
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("mode", ["mp", "async"])
def test_background_modes_and_a_restart_with_another_adapter(lora_case, mode):
    requests, expected = lora_case["requests"], lora_case["expected"]
    prompts, adapters, mixed = mixed_batch(lora_case, [None, "all", "qv"])
    with Engine(str(lora_case["base"]), mode=mode, enable_lora=True, max_loras=2, **SMALL) as engine:
        if mode == "async":

            async def run():
                outputs = await engine.agenerate(prompts, GREEDY, lora_request=adapters)
                streamed = [o async for o in engine.astream(prompts[0], GREEDY, lora_request=requests["qv"])]
                return outputs, streamed[-1]

            outputs, last = asyncio.run(run())
        else:
            outputs = engine.generate(prompts, GREEDY, lora_request=adapters)
            last = list(engine.stream(prompts[0], GREEDY, lora_request=requests["qv"]))[-1]
        assert tokens(outputs) == mixed
        assert last.outputs[0].token_ids == expected["qv"][0] and last.lora_request == requests["qv"]
        engine.restart()
        assert engine.list_loras() == set()  # a new engine holds none until asked
        prompts, adapters, mixed = mixed_batch(lora_case, ["attn", None])
        assert tokens(engine.generate(prompts, GREEDY, lora_request=adapters)) == mixed
        assert engine.list_loras() == {requests["attn"].lora_int_id}
        if mode == "async":

            async def manage():
                added = await engine.aadd_lora(requests["qv"])
                return (
                    added,
                    await engine.apin_lora(2),
                    await engine.aremove_lora(3),
                    await engine.alist_loras(),
                )

            assert asyncio.run(manage()) == (True, True, True, {requests["qv"].lora_int_id})


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_overlapped_steps_run_the_adapters(lora_case, mode):
    """async_scheduling=True: each step's slots are set when it is launched, before the step before it is applied,
    and its decodes (whose tokens are still on the device) run their adapters."""
    names = [None, "all", "qv", "attn"]
    prompts, adapters, expected = mixed_batch(lora_case, names)
    options = {"enable_lora": True, "async_scheduling": True, **SMALL}
    with Engine(str(lora_case["base"]), mode=mode, **options) as engine:
        if mode == "inproc":
            assert engine.client.core.async_scheduling is True
        random.Random(2).shuffle(order := list(range(len(prompts))))
        outputs = engine.generate(
            [prompts[i] for i in order], GREEDY, lora_request=[adapters[i] for i in order]
        )
        assert tokens(outputs) == [expected[i] for i in order]
        request = lora_case["requests"]["qv"]
        outputs = engine.generate(lora_case["prompts"], GREEDY, lora_request=request)
        assert tokens(outputs) == lora_case["expected"]["qv"]


def test_chat_takes_an_adapter(lora_case):
    request = lora_case["requests"]["all"]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, **SMALL) as engine:
        ids = engine.tokenizer.encode("the engine reads a prompt", add_special_tokens=False)
        chat = engine.chat(
            [{"role": "user", "content": "the engine reads a prompt"}],
            GREEDY,
            chat_template=template,
            lora_request=request,
        )
        plain = engine.generate([ids], GREEDY, lora_request=request)
    assert chat[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert chat[0].lora_request == request


def test_more_adapters_than_slots_wait_and_swap_through_the_host_cache(lora_case):
    names = [None, "all", "qv", "attn"]
    prompts, adapters, expected = mixed_batch(lora_case, names)
    with Engine(
        str(lora_case["base"]), mode="inproc", enable_lora=True, max_loras=1, max_cpu_loras=2, **SMALL
    ) as engine:
        assert tokens(engine.generate(prompts, GREEDY, lora_request=adapters)) == expected
        stats = engine.get_stats()
        # one slot for three adapters: each went into it at least once; two kept in host memory
        assert stats["lora_slot_loads"] >= 3 and stats["lora_adapters_in_slots"] == 1
        assert len(engine.list_loras()) == 2
        # the dropped one is read again from its folder when a request names it
        first = lora_case["requests"]["all"]
        again = engine.generate(lora_case["prompts"], GREEDY, lora_request=first)
        assert tokens(again) == lora_case["expected"]["all"]


def test_the_prefix_cache_shares_blocks_within_an_adapter_never_between_adapters(lora_case):
    prompt = lora_case["prompts"][0]  # 40 tokens: 4 full blocks of 8 before the last token
    requests = lora_case["requests"]
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, **SMALL) as engine:

        def cached(adapter):
            return engine.generate([prompt], GREEDY, lora_request=adapter)[0].num_cached_tokens

        assert cached(None) == 0
        assert cached(requests["all"]) == 0  # the base model's blocks are not the adapter's
        assert cached(requests["qv"]) == 0
        assert cached(requests["all"]) == 32
        assert cached(None) == 32
        # an adapter removed and loaded again is a new adapter to the cache, whatever its id
        assert engine.remove_lora(requests["qv"].lora_int_id)
        assert cached(requests["qv"]) == 0


def test_the_utilities(lora_case):
    requests = lora_case["requests"]
    with Engine(
        str(lora_case["base"]), mode="mp", enable_lora=True, max_loras=1, max_cpu_loras=1, **SMALL
    ) as engine:
        assert engine.list_loras() == set()
        assert engine.add_lora(requests["all"]) is True
        assert engine.pin_lora(requests["all"].lora_int_id) is True
        # pinned, it stays in host memory though another adapter needs the one place
        outputs = engine.generate(lora_case["prompts"], GREEDY, lora_request=requests["qv"])
        assert tokens(outputs) == lora_case["expected"]["qv"]
        assert engine.list_loras() == {requests["all"].lora_int_id, requests["qv"].lora_int_id}
        assert engine.remove_lora(requests["qv"].lora_int_id) is True
        assert engine.remove_lora(requests["qv"].lora_int_id) is False
        assert engine.list_loras() == {requests["all"].lora_int_id}
        with pytest.raises(UtilityCallError, match="no LoRA adapter with lora_int_id 99 is loaded"):
            engine.pin_lora(99)
        with pytest.raises(TypeError, match="add_lora takes a LoRARequest"):
            engine.add_lora("all")  # type: ignore[arg-type]
        assert (
            tokens(engine.generate(lora_case["prompts"], GREEDY, lora_request=requests["all"]))
            == (lora_case["expected"]["all"])
        )


def test_an_id_names_one_adapter(lora_case):
    requests = lora_case["requests"]
    impostor = LoRARequest("impostor", requests["all"].lora_int_id, str(lora_case["root"] / "qv"))
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, **SMALL) as engine:
        engine.generate("the", GREEDY, lora_request=requests["all"])
        with pytest.raises(ValueError, match=r"lora_int_id 1 is adapter 'all' .* not 'impostor'"):
            engine.generate("the", GREEDY, lora_request=impostor)


# ---- bad adapters ------------------------------------------------------------------------------------------


def test_bad_adapters_are_refused_by_name_and_the_engine_lives_on(lora_case, tmp_path):
    base, requests = lora_case["base"], lora_case["requests"]
    other = build_checkpoint(tmp_path / "other", "llama", hidden_size=32, num_heads=2, num_kv_heads=1)
    pickled = tmp_path / "pickled"
    shutil.copytree(lora_case["root"] / "all", pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    cases = {
        "rank": (
            build_adapter(base, tmp_path / "rank", r=32),
            r"'rank' .* has rank 32, above max_lora_rank=16",
        ),
        "head": (
            build_adapter(base, tmp_path / "head", targets=["q_proj", "lm_head"]),
            r"'head' .* targets 'lm_head'; enginekit applies adapters to q_proj, k_proj, v_proj, o_proj",
        ),
        "saved": (
            build_adapter(base, tmp_path / "saved", targets=["q_proj"], modules_to_save=["lm_head"]),
            r"'saved' .* sets modules_to_save=\['lm_head'\], which enginekit does not apply",
        ),
        "missing": (tmp_path / "nowhere", r"'missing' .*nowhere\): not found; a peft adapter is a folder"),
        "pickled": (pickled, r"'pickled' .* holds adapter_model.bin, a pickle, which enginekit never loads"),
        "other": (
            build_adapter(other, tmp_path / "other-adapter", targets=["q_proj"]),
            r"'other' .* maps 32 features to 32, but this model's q_proj maps 64 to 64: the adapter was trained "
            "for another base model",
        ),
    }
    with Engine(str(base), mode="mp", enable_lora=True, **SMALL) as engine:
        for index, (name, (path, message)) in enumerate(cases.items(), start=10):
            with pytest.raises(ValueError, match=message):
                engine.generate("the", GREEDY, lora_request=LoRARequest(name, index, str(path)))
            with pytest.raises(ValueError, match=message):
                engine.add_lora(LoRARequest(name, index, str(path)))
        outputs = engine.generate(lora_case["prompts"], GREEDY, lora_request=requests["qv"])
        assert tokens(outputs) == lora_case["expected"]["qv"]
        assert engine.list_loras() == {requests["qv"].lora_int_id}


def test_the_engine_refuses_a_bad_adapter_by_itself(lora_case, tmp_path):
    # what reaches the engine is checked again there (a folder changed after the front end checked it)
    from enginekit.core.engine_core import EngineCore
    from enginekit.wire.messages import EngineCoreRequest

    folder = tmp_path / "gone"
    shutil.copytree(lora_case["root"] / "all", folder)
    core = EngineCore(EngineConfig.from_options(str(lora_case["base"]), enable_lora=True, **SMALL))
    try:
        (folder / "adapter_model.safetensors").unlink()
        bad = LoRARequest("gone", 5, str(folder))
        core.handle(EngineCoreRequest("r0", [5, 6, 7], GREEDY, lora_request=bad))
        (output,) = core.step()[0].outputs
        assert output.error is not None and "'gone'" in output.error.message
        assert "has no adapter_model.safetensors" in output.error.message
        core.handle(EngineCoreRequest("r1", [5, 6, 7], GREEDY, lora_request=lora_case["requests"]["all"]))
        while core.has_work():
            core.step()
    finally:
        core.shutdown()


def test_an_adapter_needs_enable_lora(lora_case):
    request = lora_case["requests"]["all"]
    with Engine(str(lora_case["base"]), mode="inproc", **SMALL) as engine:
        with pytest.raises(
            ValueError, match=r"lora_request names adapter 'all', but LoRA is off in this engine"
        ):
            engine.generate("the", GREEDY, lora_request=request)
        with pytest.raises(ValueError, match="LoRA is off in this engine: start it with enable_lora=True"):
            engine.add_lora(request)
        with pytest.raises(ValueError, match="LoRA is off in this engine"):
            engine.list_loras()


def test_lora_request_is_checked(lora_case):
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, **SMALL) as engine:
        with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
            engine.generate(["a", "b"], GREEDY, lora_request=[lora_case["requests"]["all"]])
        with pytest.raises(TypeError, match="lora_request must be a LoRARequest, None, or a list of them"):
            engine.generate("a", GREEDY, lora_request="all")
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(TypeError, match=r"lora_path of adapter 'x' must be the adapter's folder as a string"):
        LoRARequest("x", 1, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_loras": 0}, "max_loras must be at least 1"),
        ({"max_lora_rank": 0}, "max_lora_rank must be at least 1"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras must be at least max_loras \(4\), got 2"),
        ({"batch_invariant": True}, "enable_lora=True cannot be used with batch_invariant=True"),
    ],
)
def test_the_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        Engine("builtin", mode="inproc", enable_lora=True, **options)


# ---- other bases and paths ---------------------------------------------------------------------------------


def test_a_gguf_base_kept_as_stored(tmp_path):
    from hf_to_gguf import Q, write_gguf_from_hf
    from test_model_families import round_weights_to_f16

    base = build_checkpoint(tmp_path / "base", "qwen2")
    round_weights_to_f16(base)
    gguf = write_gguf_from_hf(base, tmp_path / "base.gguf", Q.F16)
    adapter = build_adapter(base, tmp_path / "adapter", seed=4)
    prompts = make_prompts(3)
    expected = hf_greedy(merge_adapter(base, adapter, tmp_path / "merged"), prompts, MAX_TOKENS)
    request = LoRARequest("gguf", 1, str(adapter))
    with Engine(str(gguf), mode="inproc", enable_lora=True, **SMALL) as engine:
        outputs = engine.generate(
            prompts * 2, GREEDY, lora_request=[request] * len(prompts) + [None] * len(prompts)
        )
    assert tokens(outputs)[: len(prompts)] == expected
    assert tokens(outputs)[len(prompts) :] == hf_greedy(base, prompts, MAX_TOKENS)


def test_decode_graphs_run_the_steps_with_adapters(lora_case):
    # with cuda_graphs, pure-decode steps replay the padded path (run eagerly on CPU) whether or not their rows use
    # adapters: the adapters' dense product, masked per row, is part of every graph
    prompts, adapters, expected = mixed_batch(lora_case, ["all", None, "qv"])
    with Engine(str(lora_case["base"]), mode="inproc", enable_lora=True, cuda_graphs=True, **SMALL) as engine:
        lora = engine.client.core.runner.lora
        static_steps = []
        begin_step = lora.begin_step

        def spy(slots, counts, *, static=False):
            if static:
                static_steps.append(slots)
            begin_step(slots, counts, static=static)

        lora.begin_step = spy
        assert tokens(engine.generate(lora_case["prompts"], GREEDY)) == lora_case["expected"][None]
        assert static_steps and not any(static_steps)  # padded steps, none with an adapter
        static_steps.clear()
        assert tokens(engine.generate(prompts, GREEDY, lora_request=adapters)) == expected
        assert any(slots and min(slots) < 0 < max(slots) for slots in static_steps)  # adapters and the base
        assert tokens(engine.generate(lora_case["prompts"], GREEDY)) == lora_case["expected"][None]


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "padded"])
def test_two_tensor_parallel_ranks_split_the_adapters_as_the_base_layers(lora_case, cuda_graphs):
    # padded: each rank's decode steps run the dense product on its slice of the adapters
    prompts, adapters, expected = mixed_batch(lora_case, [None, "all", "attn"])
    with Engine(
        str(lora_case["base"]),
        mode="mp",
        enable_lora=True,
        tensor_parallel_size=2,
        max_loras=1,
        cuda_graphs=cuda_graphs,
        **SMALL,
    ) as engine:
        assert tokens(engine.generate(prompts, GREEDY, lora_request=adapters)) == expected


def test_data_parallel_ranks_load_the_adapters_of_the_requests_they_serve(lora_case):
    requests = lora_case["requests"]
    prompts, adapters, expected = mixed_batch(lora_case, [None, "all", "qv"])
    with Engine(str(lora_case["base"]), mode="mp", enable_lora=True, data_parallel_size=2, **SMALL) as engine:
        assert tokens(engine.generate(prompts, GREEDY, lora_request=adapters)) == expected
        assert engine.add_lora(requests["attn"]) is True  # on every rank
        ids = {request.lora_int_id for request in requests.values()}
        assert engine.list_loras() == ids
        assert [set(rank) >= {3} for rank in engine.call_utility("list_loras")] == [True, True]


# ---- the pieces ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_slots", "counts", "segments"),
    [
        ([1, -1, 3, 1, 3, -1, 3], [1] * 7, [(1, None), (3, None)]),  # scattered: gathered with an index
        ([3, -1, 1, -1], [2, 1, 3, 1], [(3, (0, 2)), (1, (3, 6))]),  # together: slices of the batch
        (
            [1, 1, -1, 3],
            [1, 3, 2, 1],
            [(1, (0, 4)), (3, (6, 7))],
        ),  # one adapter's chunks side by side: one slice
    ],
)
def test_the_batched_product_equals_each_rows_own_adapter(chunk_slots, counts, segments):
    from enginekit.model.lora.slots import LoRASlots, LoRAStep

    torch.manual_seed(0)
    step, parts, cpu = LoRAStep(), [6, 4, 4], torch.device("cpu")
    slots = LoRASlots(5, parts, max_loras=4, max_rank=3, step=step, device=cpu, dtype=torch.float32)
    weights = {}
    for slot, r in ((1, 3), (3, 2)):  # rank 2 below the slots' 3
        a, b = torch.randn(3 * r, 5), torch.randn(14, r)
        slots.write(slot, a, b)
        weights[slot] = (a, b, r)
    row_slots = [slot for slot, count in zip(chunk_slots, counts) for _ in range(count)]
    x, base = torch.randn(7, 5), torch.randn(7, 14)
    step.begin(chunk_slots, counts, cpu)
    found = [(s.slot, None if s.rows is not None else (s.start, s.end)) for s in step.segments]
    assert found == segments
    out = base.clone()
    slots(x, out)
    expected = base.clone()
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        a, b, r = weights[slot]
        for part, (start, end) in enumerate([(0, 6), (6, 10), (10, 14)]):
            expected[row, start:end] += b[start:end] @ (a[part * r : (part + 1) * r] @ x[row])
    torch.testing.assert_close(out, expected)
    no_adapter = [row for row, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(out[no_adapter], base[no_adapter])  # the base layer's rows, exactly

    # a graph's step: the dense product over every slot, masked per row, on 9 rows (two of padding), after a step
    # that set more rows than this one (its mask rows must not linger)
    step.allow_static(10, 4, cpu, torch.float32)
    step.begin_static([1] * 10, [1] * 10)
    step.begin_static(chunk_slots, counts)
    assert step.active and not step.segments
    padded_x, padded_base = torch.cat([x, torch.randn(2, 5)]), torch.cat([base, torch.randn(2, 14)])
    dense = padded_base.clone()
    slots(padded_x, dense)
    torch.testing.assert_close(dense[:7], expected)
    untouched = [*no_adapter, 7, 8]
    assert torch.equal(dense[untouched], padded_base[untouched])
    step.begin_static(None, ())  # no row uses an adapter: the whole mask is zeros
    assert not step.mask.any()
    step.begin(chunk_slots, counts, cpu)  # an eager step after it splits its rows again
    assert not step.static and step.segments
