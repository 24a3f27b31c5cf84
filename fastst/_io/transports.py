"""Which transport reads a URL (`open_object`), and the whole of a small object read
through it (`read_object`): fastst's HTTP client (``http``) for ``http(s)://``, fsspec
(``fsspec``) for every other URL and for options only fsspec takes. Each transport is
imported when a URL first needs it."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from .._core import SafetensorError
from .limits import READ_OPTIONS
from .ranged import RangedFetch, read_limits, shown_url

TRANSPORTS = ("http", "fsspec")


def open_object(url: str, storage_options: Optional[Mapping[str, Any]]) -> RangedFetch:
    """The object a URL names, opened for ranged reads by the transport that suits it:
    fastst's HTTP client for an ``http(s)://`` URL (``storage_options`` of
    ``headers``, ``client_kwargs={"timeout": ..., "headers": ...}`` and fsspec's
    caching keys, which it has no use for), fsspec for any other URL or options;
    ``storage_options={"transport": "fsspec"}`` (or ``"http"``) chooses.

    Parameters
    ----------
    url : str
        The object's URL.
    storage_options : mapping, optional
        fastst's bounds (``max_concurrency``, ``part_size``, ``transport``) and the
        transport's options.

    Returns
    -------
    RangedFetch
        A `UrlRanges`, or the HTTP client's ``HttpRanges``: the fetch the compiled
        Reader calls, with the object's ``size`` and ``identity``.

    Raises
    ------
    SafetensorError
        When ``transport`` names no transport, or ``"http"`` for a URL or options
        that the HTTP client does not take.

    Examples
    --------
    >>> import fsspec
    >>> from fastst.remote import open_object
    >>> fsspec.filesystem("memory").pipe("/docs/blob", b"0123456789")
    >>> blob = open_object("memory://docs/blob", None)
    >>> type(blob).__name__, blob.size, [bytes(part) for part in blob([(2, 3)])]
    ('UrlRanges', 10, [b'234'])
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """
    options = dict(storage_options or {})
    transport = options.get("transport")
    if transport is not None and transport not in TRANSPORTS:
        raise SafetensorError(f"{shown_url(url)}: storage_options['transport'] must be one of "
                              f"{', '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    if transport != "fsspec":
        from . import http

        refused = http.refusal(url, {key: value for key, value in options.items()
                                      if key not in READ_OPTIONS})
        if refused is None:
            return http.HttpRanges(url, options, read_limits(url, options))
        if transport == "http":
            raise SafetensorError(f"{shown_url(url)}: storage_options['transport'] is 'http', but "
                                  f"{refused}")
    from .fsspec import UrlRanges

    return UrlRanges(url, options)




def read_object(url: str, storage_options: Optional[Mapping[str, Any]], limit: int,
                what: str) -> bytes:
    """The whole of a small object at a URL: a checkpoint's index, say.

    Parameters
    ----------
    url : str
        An fsspec URL.
    storage_options : mapping, optional
        The options of its fsspec file system.
    limit : int
        The most bytes read: a larger object is refused before any is.
    what : str
        What messages call the object (``"index"``).

    Returns
    -------
    bytes

    Raises
    ------
    FileNotFoundError
        When there is no object at `url`.
    SafetensorError
        When the object is larger than `limit`, or the store answers fewer
        bytes than it holds.
    OSError
        When the store fails (`TimeoutError` when it does not answer in time).

    Examples
    --------
    >>> import fsspec
    >>> from fastst.remote import read_object
    >>> fsspec.filesystem("memory").pipe("/docs/index.json", b'{"weight_map": {}}')
    >>> read_object("memory://docs/index.json", None, 1000, "index")
    b'{"weight_map": {}}'
    >>> read_object("memory://docs/index.json", None, 10, "index")
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorError: memory://docs/index.json: index of 18 bytes exceeds the limit of 10 bytes
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """
    ranges = open_object(url, storage_options)
    if ranges.size > limit:
        raise SafetensorError(f"{ranges.label}: {what} of {ranges.size} bytes exceeds the "
                              f"limit of {limit} bytes")
    if ranges.size == 0:
        return b""
    (data,) = ranges([(0, ranges.size)])
    if len(data) != ranges.size:
        raise SafetensorError(f"{ranges.label}: {what}: the store answered {len(data)} bytes "
                              f"for {ranges.size} ("
                              f"{'a short read' if len(data) < ranges.size else 'too long'})")
    return bytes(data)


