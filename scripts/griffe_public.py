"""A griffe extension for the API reference (mkdocs.yml names it and its options), so that the
reference presents what users call and nothing of how aiocoll makes it:

- a parameter whose default is a private sentinel (``timeout=_DEFAULT``: "the group's timeout";
  a store's ``_DEFAULT_TIMEOUT``) shows ``<default>`` instead of a name users can neither pass
  nor import; the parameter's description says what the default is;
- a class that aiocoll (or torch) makes and users only receive (``made_by_aiocoll``: a group
  handle, a Work) shows no constructor: neither its signature nor its docstring's ``Args:``.

Imports griffe only; nothing of aiocoll's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import griffe

# A Google-style "Args:" section: its header and every indented line after it.
_ARGS = re.compile(r"^Args:\n(?:[ \t]+\S.*\n?|\n(?=[ \t]))*", re.M)


class PrivateDefaults(griffe.Extension):
    """Replace private sentinel defaults with ``<default>``; hide the constructors of the
    classes named in ``made_by_aiocoll`` (their paths where they are defined)."""

    def __init__(self, made_by_aiocoll: Sequence[str] = ()) -> None:
        super().__init__()
        self.made_by_aiocoll = frozenset(made_by_aiocoll)

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        for parameter in func.parameters:
            default = parameter.default
            if default is not None and str(default).startswith("_") and str(default).isidentifier():
                parameter.default = "<default>"

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path not in self.made_by_aiocoll:
            return
        if "__init__" in cls.members:
            del cls.members["__init__"]
        if cls.docstring is not None:
            cls.docstring.value = _ARGS.sub("", cls.docstring.value).rstrip()
