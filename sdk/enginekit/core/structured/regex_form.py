"""A regex in the syntax the API documents (Rust's, llguidance's), written in the subset xgrammar reads as meant.

xgrammar's own regex reader takes less than Rust's syntax and misreads some of what it does not take: POSIX
classes (``[[:alpha:]]`` becomes a class of ``[:alph`` and a literal ``]``), ``\\d`` and ``\\w`` as ASCII,
``.`` with the newline, ``[\\^]`` as any character, ``\\A`` as the letter ``A``. So the regex is read here into
a small tree (alternatives, sequences, repetitions, anchors and one-character sets) and written back with
every character set spelled out as code point ranges (``char_classes.py`` asks llguidance what each class
holds, flags such as ``(?i)`` included), a syntax xgrammar reads exactly. What has no such spelling is refused
by name (``NotFollowed``): ``(?-u)``, and an anchor anywhere but at the start or the end.

In a JSON schema's ``pattern`` (``json_string=True``) the regex follows llguidance's reading of JSON Schema: it
may match anywhere in the string unless anchored (``^``, ``$``), and ``\\d`` and ``\\w`` are ASCII. xgrammar
matches a pattern against the string's body as written in the JSON: it leaves out the characters JSON escapes
where the pattern does not need them, and where it does, it writes them as they are (``"a"b"`` for a pattern
with a quote). So the rewritten pattern spells each of those characters as its JSON escape (``\\"``, ``\\n``,
``\\u0001``): the output is valid JSON either way, and its string matches the pattern.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import llguidance

from enginekit.core.structured.char_classes import ALL, Ranges, class_ranges, intersect, subtract

UNESCAPED_IN_JSON: Ranges = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF))
_JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_POSIX_CLASS = re.compile(r"\[:\^?[a-z]+:\]")
_FLAGS = frozenset("imsUuxR")
_CARET = 0x5E
_REPETITION = re.compile(r"\{(\d+)(,(\d*))?\}")


class NotFollowed(ValueError):
    """A feature xgrammar cannot be made to follow as llguidance does; the message names it."""


@dataclass(frozen=True)
class Chars:
    """One character of ``ranges``."""

    ranges: Ranges


@dataclass(frozen=True)
class Sequence:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alternatives:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    low: int
    high: int | None


@dataclass(frozen=True)
class Anchor:
    at_start: bool  # ``^`` or ``\A``; else ``$`` or ``\z``


Node = Chars | Sequence | Alternatives | Repeat | Anchor


@functools.lru_cache(maxsize=256)
def xgrammar_regex(regex: str, *, json_string: bool = False) -> str:
    """``regex`` as xgrammar must get it to match what llguidance matches; ``NotFollowed`` names what it
    cannot (llguidance's own compiler has already refused what is not a regex at all)."""
    # NOTE: what llguidance parses: its text with control characters escaped (a newline is a newline, also
    # under (?x)), and in JSON Schema \d and \w as ASCII.
    tree = _Reader(
        llguidance.regex_to_lark(regex, "dw" if json_string else ""), json_string=json_string
    ).read()
    _check_anchors(tree, at_start=True, at_end=True)
    if not json_string:
        return _write(tree, json_string=False) or "()"
    starts, ends = _anchored(tree, at_start=True), _anchored(tree, at_start=False)
    if starts is None or ends is None:
        raise NotFollowed("an anchor (^ or $) on some of the alternatives only")
    anything = Repeat(Chars(ALL), 0, None)
    parts = ([] if starts else [anything]) + [tree] + ([] if ends else [anything])
    return _write(Sequence(tuple(parts)), json_string=True) or "()"


def json_string_of_length(low: int, high: int | None) -> str:
    """The xgrammar pattern of a JSON string of ``low`` to ``high`` characters, none of them one JSON escapes
    (xgrammar's own length limits let control characters through unescaped). Without escapes a character is one
    unit of the pattern, which keeps its compile as quick as xgrammar's own."""
    return _write(Repeat(Chars(UNESCAPED_IN_JSON), low, high), json_string=False)


# ---- reading ---------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, text: str, *, json_string: bool) -> None:
        self.text = text
        self.pos = 0
        self.flags: set[str] = set()
        self.json_string = json_string

    def read(self) -> Node:
        node = self._alternatives()
        if self.pos < len(self.text):
            raise ValueError(f"unbalanced ')' at position {self.pos} of {self.text!r}")
        return node

    def _peek(self, count: int = 1) -> str:
        return self.text[self.pos : self.pos + count]

    def _alternatives(self) -> Node:
        options = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else Alternatives(tuple(options))

    def _sequence(self) -> Node:
        items: list[Node] = []
        while True:
            self._skip_verbose()
            if self._peek() in ("", "|", ")"):
                break
            atom = self._atom()
            if atom is not None:  # None: a flag group such as (?i), which matches nothing
                items.append(self._repetitions(atom))
        return items[0] if len(items) == 1 else Sequence(tuple(items))

    def _skip_verbose(self) -> None:
        while "x" in self.flags and self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end + 1
            elif char.isspace():
                self.pos += 1
            else:
                return

    def _atom(self) -> Node | None:
        char = self.text[self.pos]
        if char == "(":
            return self._group()
        if char == "[":
            end = self._class_end(self.pos)
            atom, self.pos = self.text[self.pos : end], end
            return self._chars(atom)
        if char == "\\":
            return self._escape()
        self.pos += 1
        if char == ".":
            removed = (
                ()
                if "s" in self.flags
                else ((0x0A, 0x0A), (0x0D, 0x0D))
                if "R" in self.flags
                else ((0x0A, 0x0A),)
            )
            return Chars(subtract(ALL, removed))
        if char in "^$":
            return Anchor(at_start=char == "^")
        return self._literal(ord(char))

    def _literal(self, code_point: int) -> Chars:
        if "i" in self.flags:
            return self._chars(f"\\x{{{code_point:X}}}")
        return Chars(((code_point, code_point),))

    def _chars(self, atom: str) -> Chars:
        flags = "".join(flag for flag in "ix" if flag in self.flags)
        ranges = class_ranges(atom, flags)
        if not ranges:
            raise NotFollowed(f"a class that matches no character ({atom})")
        return Chars(ranges)

    def _group(self) -> Node | None:
        self.pos += 1
        saved = set(self.flags)
        if self._peek() == "?":
            if self._peek(2) == "?:":
                self.pos += 2
            elif self._peek(3) == "?P<" or (self._peek(2) == "?<" and self._peek(3) not in ("?<=", "?<!")):
                self.pos = self.text.index(">", self.pos) + 1  # a name: the group is a plain group here
            else:
                end = self.pos + 1
                while end < len(self.text) and self.text[end] not in ":)":
                    end += 1
                self._set_flags(self.text[self.pos + 1 : end])
                self.pos = end + 1
                if self.text[end : end + 1] == ")":
                    return None  # (?flags): for the rest of the enclosing group
        node = self._alternatives()
        if self._peek() != ")":
            raise ValueError(f"unclosed '(' in {self.text!r}")
        self.pos += 1
        self.flags = saved
        return node

    def _set_flags(self, text: str) -> None:
        enable = True
        for flag in text:
            if flag == "-":
                enable = False
            elif flag not in _FLAGS:
                raise NotFollowed(f"the group (?{text}")
            elif enable:
                self.flags.add(flag)
            elif flag == "u":
                raise NotFollowed("(?-u) (matching bytes rather than characters)")
            else:
                self.flags.discard(flag)

    def _escape(self) -> Node:
        start, text = self.pos, self.text
        kind = text[start + 1 : start + 2]
        if not kind:
            raise ValueError(f"{text!r} ends with a lone backslash")
        if kind in "dDwWsSaftnrv":
            self.pos = start + 2
        elif kind in "pPxuU":
            if text[start + 2 : start + 3] == "{":
                self.pos = text.index("}", start) + 1
            else:
                self.pos = start + {"p": 3, "P": 3, "x": 4, "u": 6, "U": 10}[kind]
        elif kind in "Az":
            self.pos = start + 2
            return Anchor(at_start=kind == "A")
        elif kind in "bB<>":
            raise NotFollowed(f"a word boundary (\\{kind})")
        elif kind.isascii() and kind.isalnum():
            raise NotFollowed(f"the escape \\{kind}")
        else:  # an escaped punctuation character: itself
            self.pos = start + 2
            return self._literal(ord(kind))
        return self._chars(text[start : self.pos])

    def _class_end(self, start: int) -> int:
        """Where the class opening at ``start`` ends (nested classes and POSIX classes inside it)."""
        text, pos, depth = self.text, start, 0
        while pos < len(text):
            char = text[pos]
            if char == "[" and (posix := _POSIX_CLASS.match(text, pos)) is not None and depth:
                pos = posix.end()
            elif char == "[":
                depth, pos = depth + 1, pos + 1
                pos += text[pos : pos + 1] == "^"
                pos += text[pos : pos + 1] == "]"  # a ] first is a literal ]
            elif char == "]":
                depth, pos = depth - 1, pos + 1
                if depth == 0:
                    return pos
            elif char == "\\":
                pos += 2
            elif char == "#" and "x" in self.flags:
                end = text.find("\n", pos)
                pos = len(text) if end < 0 else end + 1
            else:
                pos += 1
        raise ValueError(f"unclosed '[' in {text!r}")

    def _repetitions(self, atom: Node) -> Node:
        while True:
            self._skip_verbose()
            char = self._peek()
            if char in ("*", "+", "?"):
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            elif char == "{" and (found := _REPETITION.match(self.text, self.pos)) is not None:
                self.pos = found.end()
                low = int(found.group(1))
                high = low if found.group(2) is None else int(found.group(3)) if found.group(3) else None
            else:
                return atom
            if self._peek() == "?":  # lazy: the same strings match
                self.pos += 1
            atom = Repeat(atom, low, high)


# ---- anchors -------------------------------------------------------------------------------------------
def _check_anchors(node: Node, *, at_start: bool, at_end: bool) -> None:
    """An anchor may stand only where nothing can come before it (``^``) or after it (``$``)."""
    if isinstance(node, Anchor):
        if not (at_start if node.at_start else at_end):
            raise NotFollowed("an anchor (^, $, \\A or \\z) inside the expression")
    elif isinstance(node, Sequence):
        items = node.items
        for index, item in enumerate(items):
            _check_anchors(
                item,
                at_start=at_start and all(isinstance(x, Anchor) for x in items[:index]),
                at_end=at_end and all(isinstance(x, Anchor) for x in items[index + 1 :]),
            )
    elif isinstance(node, Alternatives):
        for option in node.options:
            _check_anchors(option, at_start=at_start, at_end=at_end)
    elif isinstance(node, Repeat):
        once = node.high == 1
        _check_anchors(node.item, at_start=at_start and once, at_end=at_end and once)


def _anchored(node: Node, *, at_start: bool) -> bool | None:
    """Whether every way through ``node`` is anchored at its start (or end): ``None`` if only some are."""
    if isinstance(node, Anchor):
        return node.at_start == at_start
    if isinstance(node, Sequence):
        items = node.items if at_start else node.items[::-1]
        return _anchored(items[0], at_start=at_start) if items else False
    if isinstance(node, Alternatives):
        found = {_anchored(option, at_start=at_start) for option in node.options}
        return found.pop() if len(found) == 1 else None
    if isinstance(node, Repeat):
        inner = _anchored(node.item, at_start=at_start)
        return None if inner is not False and node.low == 0 else inner
    return False


# ---- writing -------------------------------------------------------------------------------------------
def _write(node: Node, *, json_string: bool) -> str:
    if isinstance(node, Chars):
        return _write_chars(node.ranges, json_string=json_string)
    if isinstance(node, Anchor):
        return ""
    if isinstance(node, Alternatives):
        return "|".join(_write(option, json_string=json_string) for option in node.options)
    if isinstance(node, Sequence):
        parts = (_write(item, json_string=json_string) for item in node.items)
        return "".join(
            f"({part})" if isinstance(item, Alternatives) else part for item, part in zip(node.items, parts)
        )
    inner = _write(node.item, json_string=json_string)
    if not isinstance(node.item, Chars):
        inner = f"({inner})"
    high = "" if node.high is None else str(node.high)
    return f"{inner}{{{node.low},{high}}}" if high != str(node.low) else f"{inner}{{{node.low}}}"


def _write_chars(ranges: Ranges, *, json_string: bool) -> str:
    """One character of ``ranges`` as one unit (a character, a class or a group), for a repetition to follow;
    in a JSON string, the characters JSON escapes as their escapes."""
    if not json_string:
        return _class(ranges)
    parts = [_class(plain)] if (plain := intersect(ranges, UNESCAPED_IN_JSON)) else []
    for low, high in subtract(ranges, UNESCAPED_IN_JSON):
        for code_point in range(low, high + 1):
            spelling = _JSON_ESCAPES.get(code_point, f"\\u{code_point:04x}")
            parts.append("".join(_char(ord(char)) for char in spelling))
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def _class(ranges: Ranges) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    if ranges[0][0] == _CARET:  # NOTE: xgrammar reads a class that starts with ^, even escaped, as negated
        low, high = ranges[0]
        ranges = (*ranges[1:], (low, low)) if low == high else ((low + 1, high), *ranges[1:], (low, low))
    spelled = (_char(low) if low == high else f"{_char(low)}-{_char(high)}" for low, high in ranges)
    return "[" + "".join(spelled) + "]"


def _char(code_point: int) -> str:
    """A character as xgrammar reads it anywhere (in a class or not): letters and digits as themselves, the
    rest as ``\\u{...}``."""
    char = chr(code_point)
    return char if char.isascii() and char.isalnum() else f"\\u{{{code_point:X}}}"
