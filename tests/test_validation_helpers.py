import json
import struct


def raw_file(header, data: bytes = b"") -> bytes:
    """A safetensors file from a header (dict, str or bytes, used verbatim) and data."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data
