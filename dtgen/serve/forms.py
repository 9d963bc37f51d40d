"""Request bodies: JSON, or multipart/form-data (OpenAI's edits and videos routes), read
with a size limit and parsed by the standard library (no multipart dependency).

Form fields arrive as text: `coerce` turns them into the types a model's field table
says, with a `RequestError` naming the field when one does not parse.
"""
from __future__ import annotations

import json
from email import policy
from email.parser import BytesParser

from dtgen.requests import RequestError


class TooLarge(Exception):
    """The body is over the server's upload limit: answer 413."""


class WrongContentType(RequestError):
    """A body whose Content-Type is neither JSON nor multipart/form-data: answer 415."""


# No request field nests deeper than a few levels (a step cache's knobs are the deepest); the
# bound keeps a hostile body (thousands of brackets) from exhausting the parser's recursion.
MAX_JSON_DEPTH = 32
JSON_TYPES = ("application/json",)


# A refused body is still read (and dropped) up to this many times the limit before the 413
# goes out: a client that sends its whole body before it reads the answer (urllib, most
# scripts) would otherwise see the connection reset instead of the 413. Past it, the
# connection is cut: the client gets no answer, but the server reads no more.
DRAIN_FACTOR = 4


async def read_body(request, limit: int) -> bytes:
    """The whole body, refusing (TooLarge) past `limit` bytes, keeping none of the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request, DRAIN_FACTOR * limit)
        raise TooLarge(f"the body is {int(declared)} bytes; the limit is {limit} (--max-upload-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, DRAIN_FACTOR * limit - size)
            raise TooLarge(f"the body is over {limit} bytes (--max-upload-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request, bound: int) -> None:
    """Read and drop what is left of the body, `bound` bytes at most."""
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > bound:
            return


def json_depth(value) -> int:
    """How deep arrays and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(body: bytes) -> dict:
    too_deep = RequestError("body", f"JSON nests deeper than {MAX_JSON_DEPTH} levels (the limit)")
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("body", "is not JSON") from None
    except RecursionError:   # deeper than the interpreter's stack: far past the limit
        raise too_deep from None
    if not isinstance(fields, dict):
        raise RequestError("body", "must be a JSON object")
    if json_depth(fields) > MAX_JSON_DEPTH:
        raise too_deep
    return fields


def parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, str], dict[str, list[tuple[str, bytes]]]]:
    """multipart/form-data -> (text fields, files by field name: [(filename, bytes), ...]).
    A text field given twice is refused by name."""
    if "boundary=" not in content_type:
        raise RequestError("body", "multipart/form-data without a boundary")
    message = BytesParser(policy=policy.HTTP).parsebytes(
        b"MIME-Version: 1.0\r\nContent-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise RequestError("body", "is not multipart/form-data")
    fields: dict[str, str] = {}
    files: dict[str, list[tuple[str, bytes]]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise RequestError("body", "a form part has no name")
        data = part.get_payload(decode=True) or b""
        filename = part.get_filename()
        if filename is not None:
            files.setdefault(name, []).append((filename, data))
            continue
        if name in fields:
            raise RequestError(name, "is given twice")
        try:
            fields[name] = data.decode(part.get_content_charset() or "utf-8")
        except (UnicodeDecodeError, LookupError):
            raise RequestError(name, "is not UTF-8 text") from None
    return fields, files


def parse_body(content_type: str, body: bytes) -> tuple[dict, dict[str, list[tuple[str, bytes]]], bool]:
    """(fields, files, whether the fields are form text) from a JSON or a multipart body."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        fields, files = parse_multipart(content_type, body)
        return fields, files, True
    if kind == "application/x-www-form-urlencoded":
        raise WrongContentType("Content-Type", "send multipart/form-data or JSON, not a urlencoded form")
    if kind not in JSON_TYPES:
        raise WrongContentType("Content-Type", f"{kind or 'none given'}: the body must be application/json "
                                               "or multipart/form-data")
    return parse_json(body), {}, False


def coerce(fields: dict[str, str], types: dict[str, type]) -> dict:
    """Form text -> the field's type (int, float, str; bool from true/false). Unknown
    names are left as they are: the model's parser refuses them by name."""
    out = {}
    for name, text in fields.items():
        kind = types.get(name, str)
        if kind is str:
            out[name] = text
        elif kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise RequestError(name, f"must be true or false, got {text!r}")
            out[name] = text.lower() in ("true", "1")
        else:
            try:
                out[name] = kind(text)
            except ValueError:
                raise RequestError(name, f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    return out
