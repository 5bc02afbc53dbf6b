"""The package's shape: no import cycles (deferred imports count), layers import only downwards, a small facade."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sdk" / "enginekit"

# Which parts may import which, besides the shared modules at the package root (the public types config, errors,
# sampling_params, structured_outputs, outputs, logs, lora_request; ``parallel_options``, the config's checks of its parallel
# options; ``interrupts``, Ctrl-C at safe points; ``cache``, where files are kept), which import nothing but each
# other. Every module belongs to a part named here: a new folder or root module fails
# ``test_every_module_belongs_to_a_part`` until it is placed. The entry points (``demo``, ``testing``, the
# ``cli`` command) use the public API; the front end is on top of the engine; notebook/ sits beside it, used by
# it, and uses an engine only through the public API it is handed; diagnostics/ reads processes and imports nothing of enginekit. Inside
# model/, kernels/ and text/ stand alone, formats/ reads files into the config, layers/ are the model's torch
# modules over the kernels, and the modules at model/'s root (the decoder, loader, runner, sampler) use them all.
ALLOWED = {
    "entry": {"package", "frontend", "notebook", "client", "core", "model", "runtime", "wire"},
    "frontend": {"client", "core", "model", "notebook", "runtime", "wire"},
    "notebook": set(),
    "diagnostics": set(),
    "client": {"core", "model", "runtime", "wire"},
    "runtime": {"core", "wire"},
    "core": {"model", "wire"},
    "model": {"model.formats", "model.text", "model.layers", "model.kernels"},
    "model.formats": {"model.text"},
    "model.text": set(),
    "model.layers": {"model.kernels"},
    "model.kernels": set(),
    "wire": set(),
}
SHARED = {
    "config",
    "parallel_options",
    "speculative_options",
    "errors",
    "sampling_params",
    "structured_outputs",
    "outputs",
    "logs",
    "interrupts",
    "cache",
    "lora_request",
}
ENTRY = {"demo", "testing", "cli"}
# model/'s root modules that formats/ and layers/ may use: the plain config of a model and the specs of architectures.
MODEL_BASICS = {"enginekit.model.config", "enginekit.model.architectures"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every enginekit module this one imports, anywhere in it, except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    type_checking = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            module = node.module or ""
            if node.level:  # relative: from the package this module is in (or above)
                package = module_name(path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in MODULES else module)
    return {name for name in found if name in MODULES and name != module_name(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def part(module: str) -> str:
    """The part a module belongs to (see ``ALLOWED``), or ``"unknown"``."""
    pieces = module.split(".")
    if len(pieces) == 1:
        return "package"
    if pieces[1] == "model" and len(pieces) > 2 and f"model.{pieces[2]}" in ALLOWED:
        return f"model.{pieces[2]}"
    if pieces[1] in ALLOWED:
        return pieces[1]
    if pieces[1] in SHARED:
        return "shared"
    return "entry" if pieces[1] in ENTRY else "unknown"


def test_every_module_belongs_to_a_part():
    assert [module for module in MODULES if part(module) == "unknown"] == []


def test_no_module_imports_one_that_imports_it_back():
    cycles = []
    for module, targets in GRAPH.items():
        for target in targets:
            if _reaches(target, module):
                cycles.append(f"{module} -> {target}")
    assert cycles == []


def _reaches(start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(GRAPH.get(node, ()))
    return False


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_layer_imports_only_those_below_it(module):
    layer = part(module)
    if layer == "package":
        return
    if layer == "shared":
        assert {part(target) for target in GRAPH[module]} <= {"shared"}, module
        return
    wrong = sorted(target for target in GRAPH[module] if not _may_import(layer, target))
    assert wrong == [], f"{module} ({layer}) imports {wrong}"


def _may_import(layer: str, target: str) -> bool:
    """Whether a module of ``layer`` may import ``target``: from outside model/, model/ is one layer."""
    target_part = part(target)
    if target_part in ("shared", layer) or target_part in ALLOWED[layer]:
        return True
    if layer.startswith("model."):
        return target in MODEL_BASICS
    return target_part.startswith("model.") and "model" in ALLOWED[layer]


def test_the_facade_stays_small():
    # Every public call is a few lines that hand the work to a frontend module (chat, prompts, the router).
    assert len((PACKAGE / "frontend" / "engine.py").read_text().splitlines()) <= 340


def test_the_model_layer_knows_nothing_of_the_engine_core():
    for module, targets in GRAPH.items():
        if module.startswith("enginekit.model"):
            assert not any(t.startswith(("enginekit.core", "enginekit.client")) for t in targets), module
