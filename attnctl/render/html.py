"""``run … --html FILE``: the run's ``--json`` document as one self-contained HTML page.

The page is the JSON document, embedded once as ``<script type="application/json">``, and
our own script and style sheet, inline, that draw it: nothing is fetched when it opens (no
CDN, no font, no image, no request of any kind), so it works from ``file://`` offline.

Every attention array of the document (``attention``, ``encoder_attention``,
``decoder_attention``, ``cross_attention`` and each block's in ``layers``) is replaced by a
compact encoding (:func:`encode_attention`): per query row, its largest weight as a float32
and every weight as an unsigned integer of that maximum, little-endian, base64. An 8k-key
input's default rows stay a few MB. The rest of the document is kept as it is (extra keys
and nulls pass through), so the page shows what ``--json`` holds.

User text cannot leave the data block: ``<``, ``>``, ``&`` and U+2028/U+2029 are written
as JSON escapes, and the script puts every string into the page with ``textContent``.
The same document gives the same bytes (no time stamp, no random id).
"""

from __future__ import annotations

import base64
import html
import json
import math
import sys
from array import array
from importlib import resources
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.literal import printable
from attnctl.output_files import OutputFile, checked_output, write_atomically

ENCODING = "rowmax-uint"  # the name the page's script decodes
ATTENTION_KEYS = ("attention", "encoder_attention", "decoder_attention", "cross_attention")
# up to this many weights, 16 bits a weight (error ≤ row max / 131070); above, 8 bits
# (error ≤ row max / 510), so that an 8k-key run's default rows stay a few MB; a weight
# above 0 but below half a step reads as one step
WIDE_LIMIT = 1 << 20
DATA_ID = "attnctl-data"
_SCRIPT_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def check_html_path(given: str) -> OutputFile:
    """The file --html names, refused (exit 2) before the run if it cannot be written."""
    return checked_output(given, "--html")


def _shape(nested: Any, name: str) -> tuple[int, int, int, int]:
    """(B, heads, rows, Lk) of a rectangular nested list; refused otherwise."""
    try:
        batch = len(nested)
        heads = len(nested[0]) if batch else 0
        rows = len(nested[0][0]) if heads else 0
        keys = len(nested[0][0][0]) if rows else 0
        for per_text in nested:
            if len(per_text) != heads:
                raise ValueError("heads")
            for head in per_text:
                if len(head) != rows or any(len(row) != keys for row in head):
                    raise ValueError("rows")
    except (TypeError, IndexError, ValueError) as error:
        raise AttnctlError(
            f"--html: {name} is not a (B, heads, rows, keys) array", exit_code=RUNTIME
        ) from error
    return batch, heads, rows, keys


def encode_attention(nested: list, name: str = "attention") -> dict[str, Any]:
    """A (B, heads, rows, Lk) array of weights in [0, 1], encoded compactly.

    ``row_max``: each row's largest weight (float32, little-endian, base64, B·heads·rows of
    them); ``data``: each weight as round(w / row_max · M), M = 2^bits - 1, but at least 1
    for a weight above 0, so that 0 stands only for a weight of exactly 0 (a masked key),
    unsigned little-endian (``bits`` 16, or 8 above :data:`WIDE_LIMIT` weights), base64. A
    row of zeros (or of anything not finite) has row_max 0. Decoding: q / M · row_max.
    """
    batch, heads, rows, keys = _shape(nested, name)
    bits = 16 if batch * heads * rows * keys <= WIDE_LIMIT else 8
    top = (1 << bits) - 1
    maxima = array("f")
    levels = array("H" if bits == 16 else "B")
    for per_text in nested:
        for head in per_text:
            for row in head:
                finite = [w if math.isfinite(w) and w > 0 else 0.0 for w in row]
                largest = max(finite, default=0.0)
                maxima.append(largest)
                stored = maxima[-1]  # the float32 the page reads
                if stored <= 0:
                    levels.extend(bytes(keys) if bits == 8 else [0] * keys)
                    continue
                scale = top / stored
                # a weight that is not 0 keeps at least one step: 0 stays "exactly 0" (masked)
                levels.extend(min(top, max(1, round(w * scale))) if w > 0 else 0 for w in finite)
    if sys.byteorder == "big":  # the page reads little-endian
        maxima.byteswap()
        levels.byteswap()
    return {
        "encoding": ENCODING,
        "shape": [batch, heads, rows, keys],
        "bits": bits,
        "row_max": base64.b64encode(maxima.tobytes()).decode("ascii"),
        "data": base64.b64encode(levels.tobytes()).decode("ascii"),
    }


def decode_attention(encoded: dict[str, Any]) -> list:
    """The nested lists an :func:`encode_attention` result stands for (for tests, scripts)."""
    batch, heads, rows, keys = encoded["shape"]
    bits = encoded["bits"]
    maxima = array("f", base64.b64decode(encoded["row_max"]))
    levels = array("H" if bits == 16 else "B", base64.b64decode(encoded["data"]))
    if sys.byteorder == "big":
        maxima.byteswap()
        levels.byteswap()
    top = (1 << bits) - 1
    out: list = []
    index = 0
    for _ in range(batch):
        per_text = []
        for _ in range(heads):
            head = []
            for _ in range(rows):
                largest = maxima[index]
                start = index * keys
                head.append([q / top * largest for q in levels[start : start + keys]])
                index += 1
            per_text.append(head)
        out.append(per_text)
    return out


def _finite(value: Any) -> Any:
    """The document with NaN and infinities as null (JSON.parse reads no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def page_data(document: dict[str, Any]) -> dict[str, Any]:
    """The document the page embeds: ``document`` with each attention array encoded."""
    data = dict(document)
    for key in ATTENTION_KEYS:
        if isinstance(data.get(key), list):
            data[key] = encode_attention(data[key], key)
    layers = data.get("layers")
    if isinstance(layers, list):
        data["layers"] = [_encoded_block(block, "layers") for block in layers]
    elif isinstance(layers, dict):
        data["layers"] = {
            kind: [_encoded_block(block, f"layers.{kind}") for block in blocks]
            if isinstance(blocks, list)
            else blocks
            for kind, blocks in layers.items()
        }
    return _finite(data)


def _encoded_block(block: Any, where: str) -> Any:
    if not isinstance(block, dict) or not isinstance(block.get("attention"), list):
        return block
    return {**block, "attention": encode_attention(block["attention"], where)}


def script_json(data: Any) -> str:
    """JSON that cannot end the ``<script>`` holding it, nor open markup inside it."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in _SCRIPT_ESCAPES.items():
        text = text.replace(char, escape)
    return text


def _asset(name: str) -> str:
    return resources.files("attnctl.render").joinpath("html_assets", name).read_text("utf-8")


def _title(document: dict[str, Any]) -> str:
    """attnctl run: the first text (shortened), for the browser's tab."""
    tokens = document.get("source_tokens") or document.get("tokens") or []
    first = tokens[0] if tokens and isinstance(tokens[0], list) else []
    pieces: list[str] = []
    last = -1
    for token in first:
        if not isinstance(token, dict) or token.get("pad"):
            continue
        start, end = token.get("start"), token.get("end")
        if not isinstance(start, int) or not isinstance(end, int) or end <= start or start < last:
            continue
        pieces.append((" " if 0 <= last < start else "") + str(token.get("text", "")))
        last = end
    words = printable(" ".join("".join(pieces).split()))
    if len(words) > 60:
        words = words[:59] + "…"
    return "attnctl run" + (f": {words}" if words else "")


def html_page(document: dict[str, Any]) -> str:
    """The whole page for a run's JSON document (the same document: the same text)."""
    style = _asset("report.css")
    script = _asset("report.js")
    data = script_json(page_data(document))
    title = html.escape(_title(document), quote=True)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        # nothing may be fetched: no source but the page itself, no connection
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline'; style-src 'unsafe-inline'\">\n"
        f"<title>{title}</title>\n<style>\n{style}</style>\n</head>\n<body>\n"
        '<noscript><p class="noscript">This report draws itself with JavaScript; the data '
        "is in the page (script attnctl-data).</p></noscript>\n"
        # the script reads the SVG namespace from this element (the HTML parser sets it)
        '<svg id="svg-namespace" class="namespace" width="0" height="0" aria-hidden="true"></svg>\n'
        '<main id="report"></main>\n'
        f'<script type="application/json" id="{DATA_ID}">{data}</script>\n'
        f"<script>\n{script}</script>\n</body>\n</html>\n"
    )


def write_html(output: OutputFile, document: dict[str, Any]) -> int:
    """Write the page to ``output`` atomically (exit 1 on an I/O failure); its bytes."""
    return write_atomically(output, html_page(document).encode("utf-8"))
