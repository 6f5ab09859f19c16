"""The command line as Hydra reads it: an image reference as pyxis writes one
(``container.image=nvcr.io#nvidia/pytorch:24.07-py3``) is taken as written.

Hydra's override grammar ends an unquoted value at ``#`` and ``:`` (hydra.cc, "Override grammar": such
values are quoted), so that spelling, the one pyxis and enroot document, failed with a lexer error before
anything of Slipway ran. :func:`quote_image_refs` quotes the value of a ``container.image`` override that
Hydra cannot read as written but can read quoted; anything else (a value Hydra reads, one already quoted,
a sweep's comma-separated list) is left as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

_IMAGE = re.compile(r"^(\+{0,2}container\.image)=(.*)$", re.S)


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides(overrides=[override])
    except OverrideParseException:
        return False
    return True


def quote_image_refs(args: Sequence[str]) -> list[str]:
    """``args`` (the command line after the program) with each ``container.image=REF`` Hydra cannot read
    as written quoted for it (``container.image='REF'``)."""
    out = []
    for arg in args:
        found = _IMAGE.match(arg)
        if found and not _parses(arg):
            key, value = found.groups()
            quoted = f"{key}='{value}'"
            if "'" not in value and "," not in value and _parses(quoted):
                arg = quoted
        out.append(arg)
    return out
