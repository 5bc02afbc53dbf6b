"""The guides and the API reference match the code: every option, parameter and method, every link."""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path

import msgspec
import pytest

from enginekit import Engine, EngineConfig, SamplingParams
from enginekit.core.engine_core import EngineCore
from enginekit.notebook import GenerationHandle, Viewer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = ("getting_started.md", "notebook_guide.md", "api.md")


def _section(name: str) -> str:
    """The text of api.md's ``## name`` section."""
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"api.md has no section {name!r}"
    return match.group(1)


def _table_rows(section: str) -> dict[str, str]:
    """First-column names (in backticks) of the section's tables -> their rows."""
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)`", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _doc_value(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_every_engine_option_is_documented_with_its_default() -> None:
    rows = _table_rows(_section("EngineConfig"))
    defaults = {field.name: field.default for field in msgspec.structs.fields(EngineConfig)}
    assert set(rows) == set(defaults)
    for name, default in defaults.items():
        assert f"| `{_doc_value(default)}`" in rows[name], f"{name}: default {default!r} not in {rows[name]}"


def test_every_sampling_parameter_is_documented_with_its_default() -> None:
    section = _section("SamplingParams")
    fields = msgspec.structs.fields(SamplingParams)
    assert set(_table_rows(section)) == {field.name for field in fields}
    text = re.sub(r"\s+", " ", section)
    for field in fields:
        default = field.default
        shown = (
            f"{type(default).__name__}.{default.name}" if isinstance(default, enum.Enum) else repr(default)
        )
        assert f"{field.name}={shown}" in text, field.name


@pytest.mark.parametrize(
    ("cls", "section", "internal"),
    [
        (Engine, "Engine", {"client"}),
        (Viewer, "Viewer", {"attach"}),  # attach: the generate loop's side
        (GenerationHandle, "GenerationHandle", set()),
    ],
)
def test_every_public_member_is_documented(cls: type, section: str, internal: set[str]) -> None:
    text = _section(section)
    missing = [
        name for name in sorted(_public(cls) - internal) if not re.search(rf"`(async )?{name}\b", text)
    ]
    assert missing == []


def test_every_viewer_option_is_documented() -> None:
    options = set(inspect.signature(Viewer).parameters)
    assert options <= set(_table_rows(_section("Viewer")))


def test_every_utility_is_documented() -> None:
    utilities = {name.removeprefix("utility_") for name in vars(EngineCore) if name.startswith("utility_")}
    documented = {name.split("(")[0] for name in _table_rows(_section("Engine"))}
    assert utilities <= documented


@pytest.mark.parametrize("guide", GUIDES)
def test_links_between_the_docs_resolve(guide: str) -> None:
    text = (DOCS / guide).read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        linked = DOCS / path if path else DOCS / guide
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            broken.append(target)
    assert broken == []


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_notebook_is_in_the_getting_started_next_list() -> None:
    text = (DOCS / "getting_started.md").read_text(encoding="utf-8")
    next_list = text.split("## Next", 1)[1]
    notebooks = sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and [name for name in notebooks if f"`{name}`" not in next_list] == []


def _module_map() -> str:
    """The rows of architecture.md's table of folders and files."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Folders", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_every_file_the_architecture_names_exists() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    files = [
        path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*") if path.suffix in (".py", ".c", ".h")
    ]
    named = set(re.findall(r"`([\w/.]+\.(?:py|c|h))`", text))
    missing = [name for name in sorted(named) if not any(f == name or f.endswith("/" + name) for f in files)]
    assert named and missing == []


def test_every_native_kernel_module_is_in_the_architectures_module_map() -> None:
    # the kernels' folder: every file the library is built from or that binds it, named where the map tours it
    folder = ROOT / "sdk" / "enginekit" / "model" / "kernels"
    modules = [
        p.name for p in folder.iterdir() if p.suffix in (".py", ".c", ".h") and p.name != "__init__.py"
    ]
    rows = _module_map()
    assert modules and [name for name in sorted(modules) if f"`{name}`" not in rows] == []
