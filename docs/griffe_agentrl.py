"""Griffe extension for the docs site's API reference (mkdocs.yml loads it; mkdocs does not publish it).

agentrl documents its code in two ways that griffe does not read on its own:
- a config field is documented by the ``# comment`` on its line, as ``agentrl config show`` reads it
  (``agentrl.config.loader.field_docs``); here that comment becomes the attribute's docstring, unless
  the field has a docstring of its own (the string literal below it);
- docstrings cross-reference with Sphinx roles (``:class:`~agentrl.env.ToolEnv```); here each role
  becomes a link to the object when the site documents it, and plain code when it does not, so a
  role naming an object outside the reference page neither breaks the strict build nor shows its
  markup.
"""

from __future__ import annotations

import html
import io
import re
import tokenize
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|data|mod|attr|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?`"
)
# comments that speak to a tool, not to a reader
TOOL_COMMENT = re.compile(r"(?:type|pyright|pragma|noqa|fmt|ruff)\b")


def line_comment(line: str) -> str | None:
    """The ``# comment`` of one source line, or None (a ``#`` inside a string is no comment)."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # the last line of a statement that spans several; any comment was yielded before
    return None


def field_comment(attr: griffe.Attribute) -> str | None:
    """An attribute's documentation from the comment at the end of its statement."""
    if attr.endlineno is None:
        return None
    lines = attr.module.lines
    if not 0 < attr.endlineno <= len(lines):
        return None
    comment = line_comment(lines[attr.endlineno - 1])
    if not comment or TOOL_COMMENT.match(comment):
        return None
    return comment


def resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as named in ``obj``'s docstring (relative names: from its scope)."""
    head, _, rest = target.partition(".")
    try:
        full = obj.resolve(head)
    except (griffe.NameResolutionError, KeyError, ValueError):
        return target
    return f"{full}.{rest}" if rest else full


def roles_to_links(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        target = match["target"]
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        identifier = html.escape(resolve(obj, target), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{html.escape(shown)}</code></autoref>'

    return ROLE.sub(link, text)


class AgentrlDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.is_alias:
            return
        if isinstance(obj, griffe.Attribute) and obj.docstring is None:
            comment = field_comment(obj)
            if comment:
                obj.docstring = griffe.Docstring(comment, lineno=obj.endlineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = roles_to_links(obj, obj.docstring.value)
