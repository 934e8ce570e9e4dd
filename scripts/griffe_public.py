"""A griffe extension for the API reference (mkdocs.yml names it): a parameter whose default is a
private sentinel (``timeout=_DEFAULT``: "the group's timeout"; a store's ``_DEFAULT_TIMEOUT``)
shows ``<default>`` instead of the sentinel's private name, which users can neither pass nor
import; the parameter's description says what the default is.

Imports griffe only; nothing of aiocoll's.
"""

from __future__ import annotations

from typing import Any

import griffe


class PrivateDefaults(griffe.Extension):
    """Replace defaults that name a private module-level sentinel with ``<default>``."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        for parameter in func.parameters:
            default = parameter.default
            if default is not None and str(default).startswith("_") and str(default).isidentifier():
                parameter.default = "<default>"
