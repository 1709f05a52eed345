"""Field helpers shared by the recipe sections: a field with its one-line doc, and range checks."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

def f(default: Any, doc: str):
    """A dataclass field with a default and a one-line doc (shown by `--print-config --docs`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def positive(e: list[str], path: str, value) -> None:
    if not value > 0:
        e.append(f"{path}={value!r} must be > 0")


def non_negative(e: list[str], path: str, value) -> None:
    if not value >= 0:
        e.append(f"{path}={value!r} must be >= 0")
