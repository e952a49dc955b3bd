"""A small editor of JSON with comments (JSONC): VS Code's, Zed's and Cursor's settings files.

It sets or removes one member of an object by its path and leaves every other byte of the file
as it was (comments, key order, indentation, trailing commas), so the file a person keeps by
hand stays theirs. Parsing is a plain recursive descent that records where each value starts
and ends; an edit is a splice of text at those offsets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


class JsoncError(ValueError):
    """The text is not JSON (with comments): names the line and column."""


@dataclass
class Node:
    start: int
    end: int
    value: Any
    # Objects: (key, start of the key's string, value node); arrays: (None, start, node).
    members: list[tuple[str | None, int, Node]] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str, at: int | None = None) -> JsoncError:
        at = self.pos if at is None else at
        line = self.text.count("\n", 0, at) + 1
        column = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return JsoncError(f"line {line} column {column}: {what}")

    def skip(self) -> None:
        """Skips whitespace and comments."""
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t\r\n\ufeff":
                self.pos += 1
            elif text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = n if end < 0 else end
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.fail("a /* comment is never closed")
                self.pos = end + 2
            else:
                return

    def value(self) -> Node:
        self.skip()
        if self.pos >= len(self.text):
            raise self.fail("a value was expected, the text ended")
        c = self.text[self.pos]
        if c == "{":
            return self.container("}")
        if c == "[":
            return self.container("]")
        if c == '"':
            start = self.pos
            return Node(start, self.string_end(), self.string(start))
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",]}/ \t\r\n":
            self.pos += 1
        word = self.text[start : self.pos]
        try:
            return Node(start, self.pos, json.loads(word, parse_constant=_not_json))
        except ValueError:
            raise self.fail(f"{word[:20]!r} is not a JSON value", start) from None

    def string(self, start: int) -> str:
        """The string between `start` and the parser's position (a bad escape or a control
        character in it is the file's fault, said as such)."""
        try:
            return str(json.loads(self.text[start : self.pos]))
        except json.JSONDecodeError as exc:
            raise self.fail(f"a string JSON does not allow ({exc.msg})", start) from None

    def string_end(self) -> int:
        i = self.pos + 1
        while i < len(self.text):
            c = self.text[i]
            if c == "\\":
                i += 2
            elif c == '"':
                self.pos = i + 1
                return self.pos
            elif c == "\n":
                break
            else:
                i += 1
        raise self.fail("a string is never closed")

    def container(self, close: str) -> Node:
        start = self.pos
        self.pos += 1
        node = Node(start, start, {} if close == "}" else [])
        while True:
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == close:
                self.pos += 1
                node.end = self.pos
                return node
            key: str | None = None
            at = self.pos
            if close == "}":
                if self.pos >= len(self.text) or self.text[self.pos] != '"':
                    raise self.fail("a quoted key or } was expected")
                self.string_end()
                key = self.string(at)
                self.skip()
                if self.pos >= len(self.text) or self.text[self.pos] != ":":
                    raise self.fail("':' was expected after a key")
                self.pos += 1
            child = self.value()
            node.members.append((key, at, child))
            if key is None:
                node.value.append(child.value)
            else:
                node.value[key] = child.value
            self.skip()
            if self.pos < len(self.text) and self.text[self.pos] == ",":
                self.pos += 1
            elif self.pos >= len(self.text) or self.text[self.pos] != close:
                raise self.fail(f"',' or {close} was expected")


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is Python's JSON, not JSON")  # NaN, Infinity


def parse(text: str) -> Node:
    """The document's root (an empty text is an empty object)."""
    if not text.strip():
        return Node(0, 0, {})
    parser = _Parser(text)
    try:
        root = parser.value()
    except RecursionError:
        raise JsoncError("values nested too deeply to edit") from None
    parser.skip()
    if parser.pos != len(text):
        raise parser.fail("text after the document's end")
    return root


def loads(text: str) -> Any:
    return parse(text).value


class Document:
    """A JSONC text with in-place edits by path (a list of object keys)."""

    def __init__(self, text: str) -> None:
        # edited with \n line ends; a file written with \r\n throughout gets them back
        # (rendered()); one with both is edited as it is, each line keeping its own
        self.crlf = "\r\n" in text and text.count("\r\n") == text.count("\n")
        if self.crlf:
            text = text.replace("\r\n", "\n")
        self.text = text if text.strip() else "{}\n"
        self.root = parse(self.text)
        if not isinstance(self.root.value, dict):
            raise JsoncError("the document is not an object")

    def rendered(self) -> str:
        """The text to write: with the line ends the file had."""
        return self.text.replace("\n", "\r\n") if self.crlf else self.text

    @property
    def value(self) -> Any:
        return self.root.value

    def get(self, path: list[str]) -> Any:
        value = self.root.value
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    def _find(self, path: list[str]) -> Node | None:
        node = self.root
        for key in path:
            if not isinstance(node.value, dict):
                return None
            found = _members(node, key, path)
            if not found:
                return None
            node = found[0]
        return node

    def set(self, path: list[str], value: Any) -> None:
        """Sets the member at `path` (creating the objects on the way) to `value`."""
        if self.get(path) == value and self._find(path) is not None:
            return
        for depth in range(len(path), 0, -1):
            parent = self._find(path[: depth - 1])
            if parent is None or not isinstance(parent.value, dict):
                continue
            existing = _members(parent, path[depth - 1], path)
            if depth == len(path) and existing:
                node = existing[0]
                indent = _indent_of_line(self.text, node.start)
                self._splice(node.start, node.end, _dump(value, indent, self._unit()))
                return
            if not existing:
                inner: Any = value
                for key in reversed(path[depth:]):
                    inner = {key: inner}
                self._insert(parent, json.dumps(path[depth - 1]) + ": ", inner)
                return
            raise JsoncError(f"{'.'.join(path[:depth])} is not an object")
        raise JsoncError("the document is not an object")

    def append(self, path: list[str], item: Any) -> None:
        """Appends `item` to the array at `path` (made when missing) unless it is there."""
        current = self.get(path)
        if current is None:
            self.set(path, [item])
            return
        if not isinstance(current, list):
            raise JsoncError(f"{'.'.join(path)} is not an array")
        if item in current:
            return
        node = self._find(path)
        assert node is not None
        self._insert(node, "", item)

    def remove(self, path: list[str]) -> bool:
        """Removes the member at `path`; False when there was none."""
        parent = self._find(path[:-1])
        if parent is None or not isinstance(parent.value, dict):
            return False
        if not _members(parent, path[-1], path):
            return False
        index = next(i for i, m in enumerate(parent.members) if m[0] == path[-1])
        self._cut(parent, index)
        return True

    def blank(self, path: list[str]) -> bool:
        """The member at `path` is `{}` (or `[]`) with nothing inside, not even a comment."""
        node = self._find(path)
        return (
            node is not None
            and not node.members
            and isinstance(node.value, dict | list)
            and not self.text[node.start + 1 : node.end - 1].strip()
        )

    def remove_item(self, path: list[str], item: Any) -> bool:
        """Removes `item` from the array at `path`; False when it is not there."""
        node = self._find(path)
        if node is None or not isinstance(node.value, list):
            return False
        index = next((i for i, m in enumerate(node.members) if m[2].value == item), None)
        if index is None:
            return False
        self._cut(node, index)
        return True

    # --- splicing -----------------------------------------------------------------------

    def _unit(self) -> str:
        """The file's indentation step (the first indented member's), else two spaces."""
        for _, at, _ in self.root.members:
            indent = _line_indent(self.text, at)
            if indent:
                return indent
        return "  "

    def _splice(self, start: int, end: int, new: str, reparse: bool = True) -> None:
        self.text = self.text[:start] + new + self.text[end:]
        if reparse:
            self.root = parse(self.text)

    def _insert(self, container: Node, prefix: str, value: Any) -> None:
        text = self.text
        close = container.end - 1
        if not container.members:
            indent = _indent_of_line(text, container.start)
            inner = indent + self._unit()
            kept = text[container.start + 1 : close].rstrip()  # comments: "// none yet"
            new = kept + "\n" + inner + prefix + _dump(value, inner, self._unit()) + "\n" + indent
            self._splice(container.start + 1, close, new)
            return
        _, at, last = container.members[-1]
        inner = _line_indent(text, at)
        after = _skip_blank(text, last.end)
        trailing = after < len(text) and text[after] == ","
        dumped = (
            _dump(value, inner, self._unit()) if inner else json.dumps(value, ensure_ascii=False)
        )
        member = prefix + dumped
        if trailing:  # keep the file's style: the new last member has its comma too
            member += ","
            at_end = after + 1
            head = ""
        else:
            at_end = last.end
            head = ","
        line_end = text.find("\n", at_end)
        rest = text[at_end : line_end if line_end >= 0 else len(text)]
        if line_end >= 0 and line_end < close and _only_comment(rest):
            new = head + rest + "\n" + inner + member
            self._splice(at_end, line_end, new)
        else:
            sep = "\n" + inner if inner else " "
            self._splice(at_end, at_end, head + sep + member)

    def _cut(self, container: Node, index: int) -> None:
        text = self.text
        _, at, node = container.members[index]
        if len(container.members) == 1:  # the container is left empty: `{}` (or `[]`)
            inside = text[container.start + 1 : at] + text[node.end : container.end - 1]
            if not inside.replace(",", "").strip():
                self._splice(container.start + 1, container.end - 1, "")
                return
        after = _skip_blank(text, node.end)
        has_comma = after < len(text) and text[after] == ","
        end = after + 1 if has_comma else node.end
        if index == len(container.members) - 1 and not has_comma and index > 0:
            # the last member: the previous one's comma goes too (what a connect added)
            comma = _skip_blank(text, container.members[index - 1][2].end)
            if comma < len(text) and text[comma] == ",":
                line_end = text.find("\n", comma)
                if 0 <= line_end < at:  # on its own line: the comma's line keeps its comment
                    self._cut_span(at, end, reparse=False)
                    self._splice(comma, comma + 1, "")
                    return
                at = comma
        self._cut_span(at, end)

    def _cut_span(self, start: int, end: int, reparse: bool = True) -> None:
        text = self.text
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        if not text[line_start:start].strip() and not text[end:line_end].strip():
            start, end = line_start - 1 if line_start > 0 else line_start, line_end
        self._splice(start, end, "", reparse)


def _members(node: Node, key: str, path: list[str]) -> list[Node]:
    """`node`'s members named `key`: one at most. Of a repeated key, which one a client reads
    is its parser's choice (JSON.parse the last, others the first or an error), so an edit
    through one could change what it does not read, or leave what it does."""
    found = [child for k, _, child in node.members if k == key]
    if len(found) > 1:
        where = ".".join(path[: path.index(key)]) if key in path else ""
        raise JsoncError(f"{key!r} is in {where or 'the document'} more than once")
    return found


def _line_indent(text: str, at: int) -> str:
    line_start = text.rfind("\n", 0, at) + 1
    line = text[line_start:at]
    return line[: len(line) - len(line.lstrip())] if not line.strip() else ""


def _indent_of_line(text: str, at: int) -> str:
    line_start = text.rfind("\n", 0, at) + 1
    line = text[line_start:at]
    return line[: len(line) - len(line.lstrip())]


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t":
        at += 1
    return at


def _only_comment(rest: str) -> bool:
    """Nothing but comments (that end on the line) and blanks."""
    return re.fullmatch(r"\s*(/\*.*?\*/\s*)*(//.*)?", rest) is not None


def _dump(value: Any, indent: str, unit: str) -> str:
    """`value` as JSON laid out for a place indented by `indent`."""
    text = json.dumps(value, indent=unit or "  ", ensure_ascii=False)
    return text.replace("\n", "\n" + indent)
