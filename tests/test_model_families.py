"""Each architecture and rope type gives transformers' greedy tokens (float32, tiny random checkpoints), and what
is not implemented is refused by name."""

import json
import random

import pytest

from enginekit import Engine, EngineStartupError, SamplingParams
from hf_checkpoints import build_checkpoint, hf_greedy

MAX_TOKENS = 20
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 2.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
# Phi-3.5-mini style: short factors within the original 64 positions, long ones past them (head_dim 16: 8 each)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
    "original_max_position_embeddings": 64,
}


def vocab_of(path) -> int:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def prompts(vocab_size: int, seed: int = 0, lengths=(1, 7, 33, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]


# Prompt lengths per case (default ""). Phi-3's longrope: the 48- and 56-token prompts cross the original 64
# positions while generating (transformers recomputes them with the long factors, and so do we; the long factors
# change their tokens), the 70-token one is past them from the start. Llama's longrope code in transformers keeps
# the keys rotated with the short factors instead: its case stays clear of that step.
LENGTHS = {"": (1, 7, 33, 70), "phi3.5-longrope": (1, 7, 33, 48, 56, 70)}

CASES = {
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "yarn-rope": ("llama", {"rope_parameters": YARN, "rope_theta": 10000.0}),
    "linear-rope": ("qwen2", {"rope_parameters": LINEAR}),
    "dynamic-rope": ("llama", {"rope_parameters": DYNAMIC}),
    "longrope": ("llama", {"rope_parameters": LONGROPE}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3.5-longrope": ("phi3", {"rope_parameters": LONGROPE, "seed": 1}),  # seed 0 ties at one step
    "qwen3-head-dim": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # sliding windows far shorter than the prompts and generations: 8 on every layer, 12 (not a multiple of the
    # block size) on qwen2's second layer while its first attends fully
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": ("qwen2", {"sliding_window": 12}),
    # Gemma 2: (1 + weight) and sandwich norms, scaled embeddings, GeLU-tanh, soft-capping, query_pre_attn_scalar;
    # layer 0 slides over 8 tokens, layer 1 attends fully
    "gemma2": ("gemma2", {"sliding_window": 8}),
    # Gemma 3: q/k norms; layers 0-4 slide with rope base 1e4, layer 5 attends fully with 1e6
    "gemma3": ("gemma3", {"sliding_window": 8, "num_layers": 6}),
    # Gemma 3's linear rope scaling: the global layer alone (the sliding ones rotate unscaled)
    "gemma3-linear-rope": ("gemma3", {"sliding_window": 8, "num_layers": 6, "rope_parameters": LINEAR}),
    # Gemma3ForConditionalGeneration (Gemma 3 4B-27B as released): its text model, under language_model.model.*
    "gemma3-multimodal": ("gemma3-mm", {"sliding_window": 8, "num_layers": 6, "tie_word_embeddings": True}),
    "gemma2-tied-gqa1": ("gemma2", {"sliding_window": 12, "num_kv_heads": 4, "tie_word_embeddings": True}),
}


def run_engine(path, batch, mode="inproc"):
    with Engine(
        str(path), mode=mode, block_size=8, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32
    ) as engine:
        outputs = engine.generate(
            batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(tmp_path, case):
    arch, options = CASES[case]
    path = build_checkpoint(tmp_path / case, arch, **options)
    batch = prompts(vocab_of(path), lengths=LENGTHS.get(case, LENGTHS[""]))
    assert run_engine(path, batch) == hf_greedy(path, batch, MAX_TOKENS)


def test_longrope_sequences_past_the_original_length_share_no_blocks_with_shorter_ones(tmp_path):
    """The same 40 leading tokens, rotated with the short factors in one sequence and the long ones in another:
    the prefix cache must not hand one's blocks to the other (each request runs alone, after the previous one
    cached its blocks)."""
    path = build_checkpoint(tmp_path / "phi3", "phi3", rope_parameters=LONGROPE, seed=1)
    short, long = prompts(vocab_of(path), lengths=(40, 70))
    batch = [short, short[:40] + long[40:], short]
    expected = hf_greedy(path, batch, MAX_TOKENS)
    with Engine(str(path), mode="inproc", block_size=8, num_kv_blocks=64, max_model_len=256) as engine:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert [engine.generate([p], params)[0].outputs[0].token_ids for p in batch] == expected


@pytest.mark.parametrize(
    ("arch", "options", "lengths"),
    [
        ("qwen3", {"head_dim": 32, "rope_parameters": LLAMA3}, LENGTHS[""]),
        ("phi3", {"rope_parameters": LONGROPE, "seed": 1}, LENGTHS["phi3.5-longrope"]),
        ("qwen2", {"sliding_window": 12}, LENGTHS[""]),
        ("gemma2", {"sliding_window": 8}, LENGTHS[""]),
        ("gemma3", {"sliding_window": 8, "num_layers": 6, "rope_parameters": LINEAR}, LENGTHS[""]),
    ],
    ids=["qwen3", "phi3", "qwen2-window", "gemma2", "gemma3"],
)
def test_background_process_matches_transformers(tmp_path, arch, options, lengths):
    path = build_checkpoint(tmp_path / arch, arch, **options)
    batch = prompts(vocab_of(path), seed=1, lengths=lengths)
    assert run_engine(path, batch, mode="mp") == hf_greedy(path, batch, MAX_TOKENS)


def test_the_rope_scaling_changes_the_tokens(tmp_path):
    """The llama3 parity case above would pass with the scaling ignored if it did not change the tokens."""
    plain = build_checkpoint(tmp_path / "plain", "llama")
    scaled = build_checkpoint(tmp_path / "scaled", "llama", rope_parameters=LLAMA3)
    batch = prompts(vocab_of(plain))
    assert hf_greedy(plain, batch, MAX_TOKENS) != hf_greedy(scaled, batch, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_the_sliding_window_changes_the_tokens(tmp_path, arch):
    """The window parity cases above would pass with the window ignored if it did not change the tokens."""
    full = build_checkpoint(tmp_path / "full", arch)
    windowed = build_checkpoint(tmp_path / "windowed", arch, sliding_window=8)
    batch = prompts(vocab_of(full))
    assert hf_greedy(full, batch, MAX_TOKENS) != hf_greedy(windowed, batch, MAX_TOKENS)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 2.0, "rope_theta": 1e4}},
            "'ntk-by-parts'",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "short_factor"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "factor"),
        ({"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),  # llama's reference rotates every dim
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, change, named):
    path = build_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(EngineStartupError, match=r"supported|needs") as error:
        Engine(str(path), mode="inproc")
    assert named in str(error.value)


@pytest.mark.parametrize(
    "option", ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"]
)
def test_each_gemma2_option_changes_the_tokens(tmp_path, option):
    """The gemma2 parity cases would pass with an option ignored if it did not change the tokens."""
    path = build_checkpoint(tmp_path / "gemma2", "gemma2", sliding_window=8)
    batch = prompts(vocab_of(path))
    expected = hf_greedy(path, batch, MAX_TOKENS)
    config = json.loads((path / "config.json").read_text())
    config[option] = None if option != "query_pre_attn_scalar" else config["head_dim"]
    (path / "config.json").write_text(json.dumps(config))
    assert hf_greedy(path, batch, MAX_TOKENS) != expected


def test_an_unknown_layer_type_is_refused_by_name(tmp_path):
    path = build_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartupError, match="full_attention, sliding_attention") as error:
        Engine(str(path), mode="inproc")
    assert "chunked_attention" in str(error.value)


# The same checkpoints as GGUF files, written as llama.cpp's converter writes them (tests/hf_to_gguf.py).

GGUF_CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "yarn-rope": ("qwen2", {"rope_parameters": YARN | {"beta_fast": 16.0}, "rope_theta": 10000.0}),
    "linear-rope": ("llama", {"rope_parameters": LINEAR}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3-head-dim": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "phi3": ("phi3", {}),
    "phi3.5-longrope": ("phi3", {"rope_parameters": LONGROPE, "seed": 1}),
    "phi3-window": ("phi3", {"sliding_window": 8}),  # phi3.attention.sliding_window: every layer
    # the file cannot carry query_pre_attn_scalar (24 in these checkpoints): llama.cpp scales by head_dim ** -0.5
    "gemma2": ("gemma2", {"sliding_window": 8, "head_dim": 24, "tie_word_embeddings": True}),
    "gemma3": ("gemma3", {"sliding_window": 8, "num_layers": 6, "head_dim": 24, "tie_word_embeddings": True}),
    "gemma3-linear-rope": (
        "gemma3",
        {
            "sliding_window": 8,
            "num_layers": 6,
            "head_dim": 24,
            "tie_word_embeddings": True,
            "rope_parameters": LINEAR,
        },
    ),
    # llama.cpp's converter reads Gemma3ForConditionalGeneration's text model (text_config, language_model.*)
    "gemma3-multimodal": (
        "gemma3-mm",
        {"sliding_window": 8, "num_layers": 6, "head_dim": 24, "tie_word_embeddings": True},
    ),
}


def round_weights_to_f16(path):
    """Store the folder's weights at float16 precision (still float32), so a file holding them as F16 carries the
    same numbers as the reference."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    save_file({k: v.half().float() for k, v in weights.items()}, path / "model.safetensors", {"format": "pt"})


def run_gguf_engine(path, batch, quantization, mode="inproc"):
    with Engine(
        str(path),
        mode=mode,
        quantization=quantization,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=32,
    ) as engine:
        outputs = engine.generate(
            batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(("weight_type", "quantization"), [("F32", "none"), ("F32", "auto"), ("F16", "auto")])
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_greedy_tokens_match_transformers(tmp_path, case, weight_type, quantization):
    from hf_to_gguf import Q, write_gguf_from_hf

    arch, options = GGUF_CASES[case]
    path = build_checkpoint(tmp_path / case, arch, **options)
    if weight_type == "F16":
        round_weights_to_f16(path)
    gguf = write_gguf_from_hf(path, tmp_path / f"{case}.gguf", Q[weight_type])
    vocab_size = vocab_of(path)
    batch = prompts(
        vocab_size, seed=2 if case != "phi3.5-longrope" else 0, lengths=LENGTHS.get(case, LENGTHS[""])
    )
    assert run_gguf_engine(gguf, batch, quantization) == hf_greedy(path, batch, MAX_TOKENS)


def test_gguf_in_the_background_process_matches_transformers(tmp_path):
    from hf_to_gguf import Q, write_gguf_from_hf

    path = build_checkpoint(tmp_path / "llama3", "llama", rope_parameters=LLAMA3)
    round_weights_to_f16(path)
    gguf = write_gguf_from_hf(path, tmp_path / "llama3.gguf", Q.F16)
    batch = prompts(vocab_of(path), seed=3)
    assert run_gguf_engine(gguf, batch, "auto", mode="mp") == hf_greedy(path, batch, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_reads_as_its_folder(tmp_path, arch):
    """What llama.cpp's file leaves unsaid (the window pattern, the sliding layers' rope base, the activation)
    comes back as the folder says it; the parity cases alone could miss a small rope difference."""
    from enginekit.model.formats.gguf import read_gguf_config
    from enginekit.model.formats.hf import read_hf_config
    from hf_to_gguf import write_gguf_from_hf

    _, options = GGUF_CASES[arch]
    path = build_checkpoint(tmp_path / arch, arch, **options)
    folder, gguf = read_hf_config(path), read_gguf_config(write_gguf_from_hf(path, tmp_path / f"{arch}.gguf"))
    fields = (
        "layer_windows",
        "rope_theta",
        "rope_local_theta",
        "hidden_act",
        "attn_logit_softcap",
        "qk_norm",
    )
    assert [getattr(gguf, f) for f in fields] == [getattr(folder, f) for f in fields]
    assert gguf.attention_scale == 0.0 and folder.attention_scale == options["head_dim"] ** -0.5


def _gemma_header(tmp_path, arch, drop=(), **metadata):
    from enginekit.model.formats.gguf_header import read_gguf_header
    from hf_to_gguf import write_gguf_from_hf

    _, options = GGUF_CASES[arch]
    path = build_checkpoint(tmp_path / arch, arch, **options)
    header = read_gguf_header(write_gguf_from_hf(path, tmp_path / f"{arch}.gguf"))
    kept = {k: v for k, v in header.metadata.items() if k.removeprefix(f"{arch}.") not in drop}
    return header._replace(metadata=kept | {f"{arch}.{k}": v for k, v in metadata.items()})


def test_a_gemma2_file_without_its_keys_reads_with_llama_cpps_defaults(tmp_path):
    """llama.cpp's Gemma 2 defaults (src/models/gemma2.cpp): a 4096 window, soft-capping 50 and 30, every other
    layer sliding, the global rope base on the sliding layers."""
    from enginekit.model.formats.gguf import read_gguf_config

    drop = ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
    config = read_gguf_config(_gemma_header(tmp_path, "gemma2", drop))
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.layer_windows == (4096, 0) and config.rope_local_theta == 0.0


def test_a_gemma_files_window_pattern_and_sliding_rope_base_are_read(tmp_path):
    """``attention.sliding_window_pattern`` as a period or one flag per layer, and ``rope.freq_base_swa``."""
    from enginekit.model.formats.gguf import read_gguf_config

    header = _gemma_header(tmp_path, "gemma3")
    assert read_gguf_config(header).layer_windows == (8, 8, 8, 8, 8, 0)
    assert read_gguf_config(header).rope_local_theta == 10000.0
    period = header._replace(metadata=header.metadata | {"gemma3.attention.sliding_window_pattern": 3})
    assert read_gguf_config(period).layer_windows == (8, 8, 0, 8, 8, 0)
    flags = [True, False, True, False, False, True]
    per_layer = header._replace(metadata=header.metadata | {"gemma3.attention.sliding_window_pattern": flags})
    assert read_gguf_config(per_layer).layer_windows == (8, 0, 8, 0, 0, 8)
    base = header._replace(metadata=header.metadata | {"gemma3.rope.freq_base_swa": 20000.0})
    assert read_gguf_config(base).rope_local_theta == 20000.0
    # without the key, llama.cpp's 10000; without a window, every layer global
    unsaid = {k: v for k, v in header.metadata.items() if k != "gemma3.rope.freq_base_swa"}
    assert read_gguf_config(header._replace(metadata=unsaid)).rope_local_theta == 10000.0
    no_window = {k: v for k, v in header.metadata.items() if k != "gemma3.attention.sliding_window"}
    assert read_gguf_config(header._replace(metadata=no_window)).layer_windows == ()
    bad = header._replace(metadata=header.metadata | {"gemma3.attention.sliding_window_pattern": [True]})
    with pytest.raises(EngineStartupError, match="one flag per layer"):
        read_gguf_config(bad)


def test_gemma3_multimodal_text_weights_under_either_prefix_and_no_vision_read(tmp_path, caplog):
    """transformers has saved the language model as language_model.model.* (the hub's originals) and as
    model.language_model.*; both load, the vision tower and projector are left unread (logged), and the scaling
    test below shows the linear rope scaling changes these tokens."""
    import logging

    from safetensors.torch import load_file, save_file

    path = build_checkpoint(
        tmp_path / "mm", "gemma3-mm", sliding_window=8, num_layers=6, tie_word_embeddings=True
    )
    batch = prompts(vocab_of(path), seed=4)
    expected = hf_greedy(path, batch, MAX_TOKENS)
    weights = load_file(path / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in weights)
    renamed = {
        k.replace("language_model.model.", "model.language_model.")
        .replace("vision_tower.", "model.vision_tower.")
        .replace("multi_modal_projector.", "model.multi_modal_projector."): v
        for k, v in weights.items()
    }
    save_file(renamed, path / "model.safetensors", {"format": "pt"})
    with caplog.at_level(logging.INFO, logger="enginekit.model"):
        assert run_engine(path, batch) == expected
    assert "vision tower and projector are not used" in caplog.text


def test_gemma3_linear_rope_scaling_changes_the_tokens(tmp_path):
    """The gemma3-linear-rope cases would pass with the scaling ignored if it did not change the tokens."""
    plain = build_checkpoint(tmp_path / "plain", "gemma3", sliding_window=8, num_layers=6)
    scaled = build_checkpoint(
        tmp_path / "scaled", "gemma3", sliding_window=8, num_layers=6, rope_parameters=LINEAR
    )
    batch = prompts(vocab_of(plain))
    assert hf_greedy(plain, batch, MAX_TOKENS) != hf_greedy(scaled, batch, MAX_TOKENS)


def test_a_released_gemma3_multimodal_config_reads_as_transformers_reads_it(tmp_path):
    """Gemma 3 4B's config.json lists few text keys and no layer_types: the rest are the config class's defaults
    (the window on five layers of six, 8 heads of 256, query_pre_attn_scalar 256, rope bases 1e6 and 1e4)."""
    from transformers import AutoConfig

    from enginekit.model.formats.hf import read_hf_config

    text = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "num_hidden_layers": 1},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = read_hf_config(tmp_path)
    theirs = AutoConfig.from_pretrained(tmp_path).text_config
    full = theirs.rope_parameters["full_attention"]
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.vocab_size,
    )
    assert ours.layer_windows == tuple(1024 if t == "sliding_attention" else 0 for t in theirs.layer_types)
    assert (ours.rope_theta, ours.rope_type, ours.rope_parameters["factor"]) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert ours.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert ours.tie_word_embeddings and ours.eos_token_ids == (1, 106)


def test_a_gemma2_config_without_layer_types_slides_every_other_layer(tmp_path):
    """Gemma 2's released configs predate layer_types: its config class slides the even layers."""
    from enginekit.model.formats.hf import read_hf_config

    path = build_checkpoint(tmp_path / "gemma2", "gemma2", sliding_window=8, num_layers=4)
    config = json.loads((path / "config.json").read_text())
    with_types = read_hf_config(path).layer_windows
    del config["layer_types"]
    (path / "config.json").write_text(json.dumps(config))
    assert read_hf_config(path).layer_windows == with_types == (8, 0, 8, 0)


# Phi-4-mini: Phi3ForCausalLM rotating 0.75 of each head (12 of 16 dims here), with and without its longrope
# (factors for the 6 rotated pairs)
PARTIAL_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
    "long_factor": [1.0, 3.0, 6.0, 10.0, 16.0, 32.0],
    "original_max_position_embeddings": 64,
}


def partial_rotary_checkpoint(path, rope_parameters=None, seed=0):
    return build_checkpoint(
        path, "phi3", rope_parameters=rope_parameters, seed=seed, partial_rotary_factor=0.75
    )


@pytest.mark.parametrize("mode", ["inproc", "mp"])
@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_partial_rotary_matches_transformers(tmp_path, rope, mode):
    path = partial_rotary_checkpoint(tmp_path / "phi4", PARTIAL_LONGROPE if rope == "longrope" else None)
    lengths = LENGTHS["phi3.5-longrope"] if rope == "longrope" else LENGTHS[""]
    batch = prompts(vocab_of(path), seed=5, lengths=lengths)
    assert run_engine(path, batch, mode) == hf_greedy(path, batch, MAX_TOKENS)


@pytest.mark.parametrize(("weight_type", "quantization"), [("F32", "none"), ("F32", "auto"), ("F16", "auto")])
def test_partial_rotary_gguf_matches_transformers(tmp_path, weight_type, quantization):
    from enginekit.model.formats.gguf import read_gguf_config
    from hf_to_gguf import Q, write_gguf_from_hf

    path = partial_rotary_checkpoint(tmp_path / "phi4", PARTIAL_LONGROPE)
    if weight_type == "F16":
        round_weights_to_f16(path)
    gguf = write_gguf_from_hf(path, tmp_path / "phi4.gguf", Q[weight_type])
    assert read_gguf_config(gguf).rotary_dim == 12
    batch = prompts(vocab_of(path), seed=6, lengths=LENGTHS["phi3.5-longrope"])
    assert run_gguf_engine(gguf, batch, quantization) == hf_greedy(path, batch, MAX_TOKENS)


def test_the_partial_rotary_changes_the_tokens(tmp_path):
    """The partial rotary cases would pass with every dim rotated if that did not change the tokens."""
    full = build_checkpoint(tmp_path / "full", "phi3")
    partial = partial_rotary_checkpoint(tmp_path / "partial")
    batch = prompts(vocab_of(full), seed=5)
    assert hf_greedy(full, batch, MAX_TOKENS) != hf_greedy(partial, batch, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["phi3-partial", "gemma3-mm"])
def test_the_torch_path_matches_transformers(tmp_path, arch):
    """The model's torch code (other devices and dtypes run it), here with the native layer operations off: the
    widened rotary tables of partial rotary, Gemma 3's two rotary tables and its q/k norms."""
    if arch == "phi3-partial":
        path = partial_rotary_checkpoint(tmp_path / arch, PARTIAL_LONGROPE)
    else:
        path = build_checkpoint(tmp_path / arch, arch, sliding_window=8, num_layers=6, rope_parameters=LINEAR)
    batch = prompts(vocab_of(path), seed=7, lengths=LENGTHS["phi3.5-longrope"])
    with Engine(
        str(path), mode="inproc", block_size=8, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32
    ) as engine:
        engine.client.core.runner.model.use_layer_ops(None)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in engine.generate(batch, params)]
    assert ours == hf_greedy(path, batch, MAX_TOKENS)
