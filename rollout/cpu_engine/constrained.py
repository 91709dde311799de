"""Constrained decoding for the CPU engine: the grammars SGLang puts on a chat turn whose
`tool_choice` is "required" or names a function, applied as vocabulary masks.

A grammar is a small tree of nodes (literal text, sequence, choice, a JSON value matching a
JSON schema, free text) matched against the text generated so far. `Node.match(text, i)`
answers where a match starting at `i` can end, and whether `text[i:]` is a proper prefix of a
longer match. A token may follow the output when the output's text plus the token's text is
still a prefix of some match; an end-of-sequence token only where the text is a whole match.

What SGLang (through xgrammar) builds, and what is built here:
- with a tool-call parser (`--tool-call-parser qwen25|qwen|hermes`): the parser's "structural
  tag": `begin` (e.g. `<tool_call>\\n{"name":"NAME", "arguments":`), the arguments (the
  function's `parameters` schema when the function is `strict`, any JSON value otherwise),
  `end` (`}\\n</tool_call>`), then free text. A named function allows only that function here;
- without a parser: the JSON array of calls of `get_json_schema_constraint`, then the end.
JSON is matched compactly: no whitespace but one optional space after `:` and `,` (xgrammar
allows any whitespace, with which a small random model can emit whitespace until max_tokens).
Supported schema keywords: type (and lists of types), enum, const, properties, required,
items, minItems, maxItems, anyOf, oneOf, local $ref into $defs/definitions, and
additionalProperties false on an object without properties; others are not enforced. Object
properties come in the schema's order, required ones always, undeclared ones never.

Token texts come from decoding each token on its own, which is exact for byte-level BPE
tokenizers (the ones `tether init-model`, Llama 3 and Qwen use); a token that decodes to a
partial UTF-8 character is never allowed inside a constrained span.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

_DIGITS = frozenset("0123456789")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


class Match(NamedTuple):
    ends: frozenset[int]
    """Positions where a match that started at the given position can end."""
    partial: bool
    """Whether the rest of the text is a proper prefix of a longer match."""


NO_MATCH = Match(frozenset(), False)


class Node(Protocol):
    def match(self, s: str, i: int) -> Match: ...


@dataclass(frozen=True)
class Lit:
    text: str

    def match(self, s: str, i: int) -> Match:
        rest = len(s) - i
        if rest >= len(self.text):
            return Match(frozenset({i + len(self.text)}), False) if s.startswith(self.text, i) else NO_MATCH
        return Match(frozenset(), True) if self.text.startswith(s[i:]) else NO_MATCH


@dataclass(frozen=True)
class Seq:
    nodes: tuple[Node, ...]

    def match(self, s: str, i: int) -> Match:
        positions: set[int] = {i}
        partial = False
        for node in self.nodes:
            reached: set[int] = set()
            for p in positions:
                m = node.match(s, p)
                reached |= m.ends
                partial |= m.partial
            positions = reached
            if not positions:
                break
        return Match(frozenset(positions), partial)


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]

    def match(self, s: str, i: int) -> Match:
        ends: set[int] = set()
        partial = False
        for node in self.options:
            m = node.match(s, i)
            ends |= m.ends
            partial |= m.partial
        return Match(frozenset(ends), partial)


class Free:
    """Any text at all."""

    def match(self, s: str, i: int) -> Match:
        return Match(frozenset({len(s)}), True)


@dataclass
class Ref:
    """A node resolved later (recursive schemas)."""

    target: Node | None = None

    def match(self, s: str, i: int) -> Match:
        assert self.target is not None
        return self.target.match(s, i)


WS = Alt((Lit(""), Lit(" ")))
SEP = Seq((Lit(","), WS))
COLON = Seq((Lit(":"), WS))


class JString:
    """A JSON string with any content."""

    def match(self, s: str, i: int) -> Match:
        n = len(s)
        if i >= n:
            return Match(frozenset(), True)
        if s[i] != '"':
            return NO_MATCH
        j = i + 1
        while j < n:
            c = s[j]
            if c == '"':
                return Match(frozenset({j + 1}), False)
            if c == "\\":
                if j + 1 >= n:
                    return Match(frozenset(), True)
                e = s[j + 1]
                if e not in _ESCAPES:
                    return NO_MATCH
                if e == "u":
                    digits = s[j + 2 : j + 6]
                    if any(d not in _HEX for d in digits):
                        return NO_MATCH
                    if len(digits) < 4:
                        return Match(frozenset(), True)
                    j += 6
                    continue
                j += 2
                continue
            if ord(c) < 0x20:
                return NO_MATCH
            j += 1
        return Match(frozenset(), True)


@dataclass(frozen=True)
class JNumber:
    integer: bool

    def match(self, s: str, i: int) -> Match:
        n, j = len(s), i
        if j < n and s[j] == "-":
            j += 1
        if j >= n:
            return Match(frozenset(), True)
        if s[j] == "0":
            j += 1
            more_digits = False
        elif s[j] in _DIGITS:
            while j < n and s[j] in _DIGITS:
                j += 1
            more_digits = True
        else:
            return NO_MATCH
        ends = {j}
        if j >= n:
            return Match(frozenset(ends), more_digits or not self.integer)
        if self.integer:
            return Match(frozenset(ends), False)
        if s[j] == ".":
            k = j + 1
            if k >= n:
                return Match(frozenset(ends), True)
            if s[k] not in _DIGITS:
                return Match(frozenset(ends), False)
            while k < n and s[k] in _DIGITS:
                k += 1
            ends.add(k)
            j = k
            if j >= n:
                return Match(frozenset(ends), True)
        if s[j] in "eE":
            k = j + 1
            if k < n and s[k] in "+-":
                k += 1
            if k >= n:
                return Match(frozenset(ends), True)
            if s[k] not in _DIGITS:
                return Match(frozenset(ends), False)
            while k < n and s[k] in _DIGITS:
                k += 1
            ends.add(k)
            return Match(frozenset(ends), k >= n)
        return Match(frozenset(ends), False)


@dataclass(frozen=True)
class Delimited:
    """`open` item (`,` item)* `close`, with a bounded number of items (arrays, free objects)."""

    open: str
    item: Node
    close: str
    min_items: int = 0
    max_items: int | None = None

    def match(self, s: str, i: int) -> Match:
        opened = Lit(self.open).match(s, i)
        if not opened.ends:
            return opened
        close = Lit(self.close)
        ends: set[int] = set()
        partial = False

        def closing(positions: set[int]) -> None:
            nonlocal partial
            for p in positions:
                m = close.match(s, p)
                ends.update(m.ends)
                partial |= m.partial

        frontier = set(opened.ends)
        count = 0
        if self.min_items == 0:
            closing(frontier)
        while frontier and (self.max_items is None or count < self.max_items):
            reached: set[int] = set()
            for p in frontier:
                starts = {p}
                if count:
                    sep = SEP.match(s, p)
                    partial |= sep.partial
                    starts = set(sep.ends)
                for q in starts:
                    m = self.item.match(s, q)
                    reached |= m.ends
                    partial |= m.partial
            count += 1
            frontier = reached
            if count >= self.min_items:
                closing(frontier)
        return Match(frozenset(ends), partial)


class JAny:
    """Any JSON value."""

    def __init__(self) -> None:
        self._string = JString()
        self._number = JNumber(integer=False)
        self._array = Delimited("[", self, "]")
        self._object = Delimited("{", Seq((self._string, COLON, self)), "}")
        self._literals = Alt((Lit("true"), Lit("false"), Lit("null")))

    def match(self, s: str, i: int) -> Match:
        if i >= len(s):
            return Match(frozenset(), True)
        c = s[i]
        if c == "{":
            return self._object.match(s, i)
        if c == "[":
            return self._array.match(s, i)
        if c == '"':
            return self._string.match(s, i)
        if c == "-" or c in _DIGITS:
            return self._number.match(s, i)
        return self._literals.match(s, i)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class SchemaCompiler:
    """Turns a JSON schema into a Node (see the module docstring for what is enforced)."""

    root: dict[str, Any] = field(default_factory=dict)
    _refs: dict[str, Ref] = field(default_factory=dict)

    def compile(self, schema: Any) -> Node:
        if not isinstance(schema, dict) or not schema:
            return JAny()
        if "$ref" in schema:
            return self._ref(str(schema["$ref"]))
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return Alt(tuple(Lit(_dump(v)) for v in schema["enum"]))
        if "const" in schema:
            return Lit(_dump(schema["const"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return Alt(tuple(self.compile({**schema, key: None, **branch}) for branch in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return Alt(tuple(self.compile({**schema, "type": k}) for k in kind))
        if kind is None and "properties" in schema:
            kind = "object"
        if kind == "string":
            return JString()
        if kind in ("integer", "number"):
            return JNumber(integer=kind == "integer")
        if kind == "boolean":
            return Alt((Lit("true"), Lit("false")))
        if kind == "null":
            return Lit("null")
        if kind == "array":
            return Delimited(
                "[",
                self.compile(schema.get("items")),
                "]",
                int(schema.get("minItems") or 0),
                None if schema.get("maxItems") is None else int(schema["maxItems"]),
            )
        if kind == "object":
            props = schema.get("properties")
            if not isinstance(props, dict) or not props:
                return Lit("{}") if schema.get("additionalProperties") is False else JAny()._object
            required = set(schema.get("required") or ())
            return self._object([(str(k), self.compile(v), k in required) for k, v in props.items()])
        return JAny()

    def _object(self, props: list[tuple[str, Node, bool]]) -> Node:
        memo: dict[tuple[int, bool], Node] = {}

        def rest(k: int, first: bool) -> Node:
            key = (k, first)
            if key in memo:
                return memo[key]
            if k == len(props):
                node: Node = Lit("}")
            else:
                name, value, required = props[k]
                take = Seq(
                    (
                        Lit("" if first else ","),
                        Lit("") if first else WS,
                        Lit(_dump(name)),
                        COLON,
                        value,
                        rest(k + 1, False),
                    )
                )
                node = take if required else Alt((take, rest(k + 1, first)))
            memo[key] = node
            return node

        return Seq((Lit("{"), rest(0, True)))

    def _ref(self, ref: str) -> Node:
        if ref in self._refs:
            return self._refs[ref]
        parts = ref.split("/")
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise ValueError(f"$ref={ref!r}: only local references into $defs are supported")
        target = (self.root.get(parts[1]) or {}).get(parts[2])
        if target is None:
            raise ValueError(f"$ref={ref!r}: no such definition")
        holder = Ref()
        self._refs[ref] = holder
        holder.target = self.compile(target)
        return holder


def schema_node(schema: Any) -> Node:
    """The node matching JSON documents of `schema`; ValueError names what cannot be compiled."""
    return SchemaCompiler(root=schema if isinstance(schema, dict) else {}).compile(schema)


# ----- vocabulary masks -----


class TokenConstraint(Protocol):
    def allowed(self, output: Sequence[int]) -> torch.Tensor | None:
        """The tokens that may follow `output` as a bool mask [vocab], or None for any."""
        ...


class Vocab:
    """Each token's text, decoded on its own (None for special tokens and partial characters)."""

    def __init__(self, texts: list[str | None], eos_ids: Sequence[int]) -> None:
        self.texts = texts
        self.size = len(texts)
        self.eos_ids = [t for t in eos_ids if 0 <= t < self.size]
        by_first: dict[str, list[int]] = {}
        for tid, text in enumerate(texts):
            if text:
                by_first.setdefault(text[0], []).append(tid)
        self.by_first = by_first

    @classmethod
    def from_decoder(
        cls, size: int, decode: Callable[[int], str], special: set[int], eos_ids: Sequence[int]
    ) -> Vocab:
        texts: list[str | None] = []
        for tid in range(size):
            if tid in special:
                texts.append(None)
                continue
            try:
                text = decode(tid)
            except Exception:  # an id past the tokenizer's vocabulary (padded embeddings)
                texts.append(None)
                continue
            texts.append(text if text and "\ufffd" not in text else None)
        return cls(texts, eos_ids)


@dataclass
class GrammarConstraint:
    """Masks that keep the output inside `head`, optionally followed by free text."""

    head: Node
    vocab: Vocab
    then_free: bool = False
    """After a complete `head`, any text may follow (SGLang's structural tags); otherwise only
    an end-of-sequence token."""

    def text(self, output: Sequence[int]) -> str:
        texts = self.vocab.texts
        return "".join(texts[t] or "" for t in output if 0 <= t < self.vocab.size)

    def allowed(self, output: Sequence[int]) -> torch.Tensor | None:
        text = self.text(output)
        here = self.head.match(text, 0)
        complete = len(text) in here.ends
        if self.then_free and here.ends:
            return None  # the constrained part is done: free text from here on
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        for first, ids in self.vocab.by_first.items():
            if not self._viable(text + first):
                continue
            for tid in ids:
                piece = self.vocab.texts[tid]
                assert piece is not None
                if len(piece) == 1 or self._viable(text + piece):
                    mask[tid] = True
        if complete or not bool(mask.any()):
            # A whole match may end here; a dead end (no token can continue) ends too rather
            # than sampling from nothing.
            mask[self.vocab.eos_ids] = True
        if not bool(mask.any()):
            return None  # a dead end in a model without an end-of-sequence token: unconstrained
        return mask

    def _viable(self, text: str) -> bool:
        m = self.head.match(text, 0)
        return m.partial or len(text) in m.ends or (self.then_free and bool(m.ends))


__all__ = [
    "Alt",
    "Free",
    "GrammarConstraint",
    "JAny",
    "Lit",
    "Match",
    "Node",
    "Seq",
    "TokenConstraint",
    "Vocab",
    "schema_node",
]
