"""The commands' attention flags, built from :class:`~ringmpi.options.AttentionOptions`' fields.

Each field that a command maps one to one states its flag, kind, metavar and
help once, in ``options.py``; ``ringmpi run`` and ``ringmpi bench`` take the
fields they offer with :func:`attention_flags`, and their values arrive under
the fields' names, already as the options object holds them (``--window``'s
-1 as None, ``--alibi-slopes`` as a float32 array): :func:`pop_attention`
takes them out of a command's keywords.  A new option with a flag needs no
line here; its rules are the options object's.
"""

from __future__ import annotations

from typing import Callable, Dict

import click

from ..core.masks import window_problem, window_sides
from ..options import AttentionOptions, option_edge


def _floats(ctx, param, value):
    """Comma-separated numbers as a float32 array (its length and values are the options' to check)."""
    import numpy as np

    if value is None:
        return None
    try:
        return np.array([float(x) for x in value.split(",")], dtype=np.float32)
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


def _window(ctx, param, value):
    """``L R`` with -1 for an unbounded side as the field holds it (None unbounded); a bad one is
    left for the options' check to name."""
    return value if window_problem(value) else window_sides(value)


_KINDS: Dict[str, Callable[[dict], dict]] = {  # a field's kind -> its click keywords
    "switch": lambda e: {} if "/" in e["flag"] else dict(is_flag=True),
    "float": lambda e: dict(type=float),
    "uint64": lambda e: dict(type=click.IntRange(0, 2 ** 64 - 1)),
    "text": lambda e: dict(type=str),
    "floats": lambda e: dict(type=str, callback=_floats),
    "window": lambda e: dict(nargs=2, type=int, callback=_window),
}


def attention_flags(*names: str, **overrides: dict):
    """A decorator adding the click options of the fields ``names``, in that order; ``overrides``:
    per field, click keywords of this command (its default, help, ...)."""
    def decorate(command):
        for name in reversed(names):
            edge = option_edge(name)
            kw = dict(default=AttentionOptions.__dataclass_fields__[name].default, help=edge["help"])
            if edge["metavar"]:
                kw["metavar"] = edge["metavar"]
            kw.update(_KINDS[edge["kind"]](edge))
            kw.update(overrides.get(name, {}))
            command = click.option(edge["flag"], name, **kw)(command)
        return command
    return decorate


def pop_attention(keywords: dict, *names: str) -> dict:
    """The fields ``names`` taken out of a command's ``keywords`` (what :func:`attention_flags` added)."""
    return {name: keywords.pop(name) for name in names}
