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


def parse_json(body: bytes) -> dict:
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("body", "is not JSON") from None
    if not isinstance(fields, dict):
        raise RequestError("body", "must be a JSON object")
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
        raise RequestError("body", "send multipart/form-data or JSON, not a urlencoded form")
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
