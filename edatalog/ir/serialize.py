"""JSON form of the IR: every frozen dataclass as an object tagged with its class name.

Tuples become lists and come back as tuples; non-finite floats are spelled out, since JSON has
no ``inf``.  Only the classes the caller lists can be decoded: loading a file never runs code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

OMIT_EMPTY = "omit_empty"  # field metadata: an empty tuple or None is left out of the JSON (its default)
FORMAT = 2  # bump when the JSON layout changes (2: index parts are affine expressions)


def encode(obj: Any, *, with_origins: bool = True) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {"$type": type(obj).__name__}
        for f in dataclasses.fields(obj):
            if not with_origins and not f.compare:
                continue
            value = getattr(obj, f.name)
            if f.metadata.get(OMIT_EMPTY) and (value == () or value is None):
                continue  # an optional part left empty (lookups, repeats): written as before it existed
            out[f.name] = encode(value, with_origins=with_origins)
        return out
    if isinstance(obj, (tuple, list)):
        return [encode(x, with_origins=with_origins) for x in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"$float": repr(obj)}
    return obj


def decode(data: Any, classes: Mapping[str, type]) -> Any:
    if isinstance(data, list):
        return tuple(decode(x, classes) for x in data)
    if isinstance(data, dict):
        if "$float" in data:
            return float(data["$float"])
        name = data.get("$type")
        cls = classes.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(f"unknown IR object type {name!r}")
        return cls(**{k: decode(v, classes) for k, v in data.items() if k != "$type"})
    return data


def dumps(obj: Any) -> str:
    return json.dumps({"format": FORMAT, "ir": encode(obj)}, indent=1)


def loads(text: str, classes: Iterable[type]) -> Any:
    """Decode text written by :func:`dumps`; only instances of ``classes`` are built."""
    data = json.loads(text)
    if not isinstance(data, dict) or "ir" not in data:
        raise ValueError("not an edatalog IR file")
    if data.get("format") != FORMAT:
        raise ValueError(
            f"IR format {data.get('format')!r}, but this edatalog reads format {FORMAT}: "
            "write it again with this version (for a plan: make the plan again)"
        )
    return decode(data["ir"], {c.__name__: c for c in classes})
