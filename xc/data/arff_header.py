"""The header of a multi-label ARFF file and the files beside it that say which attributes are labels.

An ARFF header (Weka's format, as MULAN and MEKA use it)::

    % comment lines start with '%'
    @relation 'scene: -C 6'          MEKA: -C n, the first n (n > 0) or last |n| (n < 0) attributes are labels
    @attribute Att1 numeric           numeric | real | integer
    @attribute 'Beach' {0,1}          nominal: the declared values, in order ({YES,NO}, {2,10,1,...})
    @attribute protein string         string: read past, never a feature
    @data

Keywords are case-insensitive; names and values may be quoted with ' or " (a backslash escapes the next
character). ``date`` and ``relational`` attributes are refused (file, line, attribute). MULAN names the
label attributes in an XML file instead (``<labels xmlns="..."><label name="Beach"/>...</labels>``;
nested labels of a hierarchy count too), and the labels may then be any attributes. Every other
attribute is a feature; what each kind becomes is ``arff_schema.py``'s concern.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataFormatError
from .formats import _lines

_NUMERIC_TYPES = ("numeric", "real", "integer")
_KEYWORD_RE = re.compile(r"([^ \t]*)[ \t]*(.*)")
_MEKA_C_RE = re.compile(r"(?:^|[\s:])-C\s+(-?[0-9]+)(?=\s|$)")


@dataclass
class Attribute:
    name: str
    kind: str  # "numeric", "nominal" or "string"
    line: int  # where it is declared, for errors
    values: tuple[str, ...] = ()  # a nominal's declared values, in declaration order (unquoted)

    def describe(self) -> str:
        """The declared type as an error message shows it (long value lists cut)."""
        if self.kind != "nominal":
            return self.kind
        text = "{" + ",".join(self.values) + "}"
        return text if len(text) <= 60 else text[:56] + "...}"


@dataclass
class ArffHeader:
    """What the header declares, and where its data section starts."""

    path: str
    relation: str
    relation_line: int
    attributes: list[Attribute] = field(default_factory=list)
    data_line: int = 0  # the line of @data

    def index(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.attributes)}


def read_token(text: str, pos: int, path: str, lineno: int, what: str) -> tuple[str, int]:
    """One name or value starting at ``text[pos]`` (leading blanks skipped): quoted with ' or " (a
    backslash escapes the next character) or bare up to a blank, ',' or '{'. Returns (token, end)."""
    n = len(text)
    while pos < n and text[pos] in " \t":
        pos += 1
    if pos >= n:
        raise DataFormatError(path, lineno, what, "missing")
    quote = text[pos]
    if quote in "'\"":
        out, k = [], pos + 1
        while k < n and text[k] != quote:
            if text[k] == "\\" and k + 1 < n:
                k += 1
            out.append(text[k])
            k += 1
        if k >= n:
            raise DataFormatError(path, lineno, what, f"unterminated quote in {text[pos:pos + 40]!r}")
        return "".join(out), k + 1
    end = pos
    while end < n and text[end] not in " \t,{}":
        end += 1
    return text[pos:end], end


def split_raw(text: str, path: str, lineno: int, what: str) -> list[str]:
    """Split on commas outside quotes; items keep their quotes, blanks around each are stripped."""
    if "'" not in text and '"' not in text:
        return [t.strip(" \t") for t in text.split(",")]
    out, start, quote, k = [], 0, None, 0
    while k < len(text):
        c = text[k]
        if quote:
            if c == "\\":
                k += 1  # the escaped character cannot close the quote
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == ",":
            out.append(text[start:k].strip(" \t"))
            start = k + 1
        k += 1
    if quote:
        raise DataFormatError(path, lineno, what, f"unterminated quote in {text[start:start + 40]!r}")
    out.append(text[start:].strip(" \t"))
    return out


def unquote(tok: str, path: str, lineno: int, what: str) -> str:
    """``tok`` without its quotes (and escapes) when it is quoted, else as it is."""
    if tok[:1] not in ("'", '"'):
        return tok
    value, end = read_token(tok, 0, path, lineno, what)
    if end != len(tok):
        raise DataFormatError(path, lineno, what, f"text after the closing quote in {tok[:40]!r}")
    return value


def split_values(text: str, path: str, lineno: int, what: str) -> list[str]:
    """Comma-separated values, quotes respected and removed, blanks around each value stripped."""
    return [unquote(t, path, lineno, what) for t in split_raw(text, path, lineno, what)]


def _attribute(rest: str, path: str, lineno: int) -> Attribute:
    name, pos = read_token(rest, 0, path, lineno, "attribute name")
    if not name:
        raise DataFormatError(path, lineno, "attribute name", "empty")
    kind = rest[pos:].strip(" \t")
    keyword = kind.split(None, 1)[0].lower() if kind else ""
    if keyword in _NUMERIC_TYPES and kind.lower() == keyword:
        return Attribute(name, "numeric", lineno)
    if keyword == "string" and kind.lower() == keyword:
        return Attribute(name, "string", lineno)
    if kind.startswith("{") and kind.endswith("}"):
        values = split_values(kind[1:-1], path, lineno, f"attribute {name}") if kind[1:-1].strip(" \t") else []
        if not values or "" in values:
            raise DataFormatError(path, lineno, f"attribute {name}", f"nominal {kind[:60]} has an empty value")
        seen = set()
        for v in values:  # a value's position is its one-hot column: two of one name would be ambiguous
            if v in seen:
                raise DataFormatError(path, lineno, f"attribute {name}", f"nominal value {v[:40]!r} declared twice")
            seen.add(v)
        return Attribute(name, "nominal", lineno, tuple(values))
    if keyword == "date":
        raise DataFormatError(path, lineno, f"attribute {name}", "date attributes are not supported: declare it "
                              "numeric (e.g. seconds since 1970) or string (then it is skipped)")
    raise DataFormatError(path, lineno, f"attribute {name}", f"type {kind[:40]!r} is not supported "
                          "(numeric, real, integer, string or a nominal {...})")


def read_header(path: str) -> tuple[ArffHeader, object]:
    """Parse the header of ``path`` up to @data. Returns (header, iterator over the remaining
    ``(first line number, [lines])`` blocks, starting after the @data line)."""
    it = _lines(path)
    head: ArffHeader | None = None
    names: dict[str, int] = {}
    for lineno, block in it:
        for k, line in enumerate(block):
            at = lineno + k
            text = line.strip(" \t")
            if not text or text.startswith("%"):
                continue
            word, rest = _KEYWORD_RE.match(text).groups()
            word = word.lower()
            if word == "@relation" and head is None:
                relation, _ = read_token(rest, 0, path, at, "relation") if rest.strip() else ("", 0)
                head = ArffHeader(path, relation, at)
            elif head is None:
                raise DataFormatError(path, at, "header", f"expected '@relation NAME' first, got {text[:60]!r}")
            elif word == "@attribute":
                attr = _attribute(rest, path, at)
                if attr.name in names:
                    raise DataFormatError(path, at, f"attribute {attr.name}",
                                          f"declared twice (first on line {names[attr.name]})")
                names[attr.name] = at
                head.attributes.append(attr)
            elif word == "@data":
                if not head.attributes:
                    raise DataFormatError(path, at, "header", "@data before any @attribute")
                head.data_line = at

                def rest_blocks(block=block, k=k, lineno=lineno):
                    if k + 1 < len(block):
                        yield lineno + k + 1, block[k + 1:]
                    yield from it

                return head, rest_blocks()
            else:
                raise DataFormatError(path, at, "header", f"expected @attribute or @data, got {text[:60]!r}")
    raise DataFormatError(path, 0, "header", "no @data line" if head else "no '@relation NAME' line (empty file?)")


def xml_label_names(path: str) -> list[str]:
    """Label names of a MULAN labels file, in document order (nested hierarchy labels included)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise DataFormatError(path, e.position[0], "xml", str(e)) from None
    except OSError as e:
        raise DataFormatError(path, 0, "file", f"unreadable ({e.strerror})") from None
    names = []
    for el in root.iter():
        if el.tag.rsplit("}", 1)[-1] == "label":
            name = el.get("name")
            if name is None:
                raise DataFormatError(path, 0, "label", "a <label> element without a name attribute")
            names.append(name)
    if not names:
        raise DataFormatError(path, 0, "labels", "no <label name=...> elements")
    return names


def label_attributes(head: ArffHeader, xml_path: str | None) -> np.ndarray:
    """Indices (ascending) of the label attributes: those the XML names, else MEKA's ``-C n``."""
    if xml_path:
        where, seen = head.index(), set()
        for name in xml_label_names(xml_path):
            if name in seen:
                raise DataFormatError(xml_path, 0, "label", f"{name!r} is listed twice")
            if name not in where:
                raise DataFormatError(xml_path, 0, "label", f"{name!r} is not an attribute of {head.path}")
            seen.add(name)
        picked = sorted(where[name] for name in seen)
    else:
        m = _MEKA_C_RE.search(head.relation)
        if not m:
            raise DataFormatError(head.path, head.relation_line, "relation",
                                  "no label attributes named: put a MULAN labels .xml beside the file "
                                  "or MEKA's '-C n' in the relation name")
        c, n = int(m.group(1)), len(head.attributes)
        if c == 0 or abs(c) >= n:
            raise DataFormatError(head.path, head.relation_line, "relation",
                                  f"-C {c}: needs 0 < |C| < {n} (the number of attributes)")
        picked = list(range(c)) if c > 0 else list(range(n + c, n))
    return np.asarray(picked, dtype=np.int64)


def check_same_attributes(train: ArffHeader, test: ArffHeader, skipped: frozenset[int] = frozenset()) -> None:
    """The test file must declare the train file's attributes, in the same order and of the same types; a
    nominal's values must match too (they are its columns), except for the ``skipped`` attributes."""
    for i, (a, b) in enumerate(zip(train.attributes, test.attributes)):
        same_values = i in skipped or a.values == b.values
        if (a.name, a.kind) != (b.name, b.kind) or not same_values:
            raise DataFormatError(test.path, b.line, f"attribute {b.name}",
                                  f"differs from {train.path}:{a.line} ({a.name!r}, {a.describe()})")
    if len(train.attributes) != len(test.attributes):
        raise DataFormatError(test.path, test.data_line, "header", f"declares {len(test.attributes)} attributes, "
                              f"{train.path} {len(train.attributes)}")
