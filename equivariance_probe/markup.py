"""The one path by which a string reaches HTML: :class:`Markup`, escaping by construction.

Place in the seams: the ground floor, beside :mod:`~equivariance_probe.errors` (it imports nothing of
the package), so that every layer that writes HTML (the head ranking's table, a result's notebook
view, the display's pages) writes it the same way.

Results travel between people, and a result file's header, a positional study's stored values, a
model's name, a label or a document's token are all data that someone else may have written. Every
page is therefore built from :class:`Markup` (MarkupSafe's, the type Jinja and Django's templates
use): ``Markup(template).format(...)`` and ``Markup(separator).join(...)`` escape every argument that
is not itself ``Markup``, so a builder that passes a data string on gets it escaped without having to
remember to: the unescaped form needs an explicit ``Markup(data)``, which is what review looks for.

Data that a ``<script>`` needs is written by :func:`json_script`: JSON with ``<``, ``>`` and ``&`` as
``\\u003c``, ``\\u003e`` and ``\\u0026`` (what Django's ``json_script`` and Jinja's ``tojson`` write). Inside
a script element the HTML parser looks for ``</script`` and, after ``<!--``, for ``<script``; with no ``<``
left in the data, no token can end the script early or put the parser into the state where the script
no longer ends at its ``</script>``.
"""

from __future__ import annotations

import json
from typing import Any

from markupsafe import Markup, escape

__all__ = ["Markup", "escape", "json_script", "script_safe"]

#: The characters that can change the HTML parser's state inside a script element, as JSON escapes.
_SCRIPT_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026",
                   # JSON allows these two raw; older JavaScript engines end a string literal at them.
                   0x2028: "\\u2028", 0x2029: "\\u2029"}


def script_safe(text: str) -> Markup:
    """JSON text (or JavaScript whose only ``<``, ``>`` and ``&`` are inside string literals, such as a
    ``render(id, "Name", {json})`` call) with those characters written as JSON escapes, for a ``<script>``.

    The escapes are valid inside JSON and JavaScript string literals and mean the same characters there;
    outside string literals they would be a syntax error, so this is for data, never for code with
    operators.
    """
    return Markup(text.translate(_SCRIPT_ESCAPES))


def json_script(data: Any) -> Markup:
    """``data`` as JSON that a ``<script>`` can hold verbatim (see :func:`script_safe`).

    Example:
        >>> json_script({"token": "</script><!--<script>"})
        Markup('{"token": "\\\\u003c/script\\\\u003e\\\\u003c!--\\\\u003cscript\\\\u003e"}')
    """
    return script_safe(json.dumps(data))
