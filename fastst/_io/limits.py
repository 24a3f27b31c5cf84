"""Bounds that modules share without importing each other: how much a conversion may
write (the command line shows it without importing the converter, whose modules are
many), how many bytes a read-ahead holds (a handle gives it as a default without
importing the reading thread's module until one is asked for), the default of every
``backend=`` argument, and the knobs of every read of a URL, which ``fastst.remote``
offers users: a value set there is set here, where each read looks it up as it
starts.

A conversion writes at most DEFAULT_MAX_EXPANSION times the bytes of its input, plus
EXPANSION_ALLOWANCE: a torch checkpoint converts to about its own size (more only where
views of one storage, or tied weights in a nest, are each written out), and an .npz of
real weights is compressed far less than 8 times.
"""
DEFAULT_MAX_EXPANSION = 8.0
EXPANSION_ALLOWANCE = 16 << 20      # for tiny checkpoints, whose header alone can be larger
DEFAULT_PREFETCH_BYTES = 256 << 20  # read ahead and not yet taken, by iter_tensors and prefetch


class ChosenBackend(str):
    """``"mmap"``, the reference's default backend, as the default of fastst's
    ``backend=`` arguments: equal to ``"mmap"`` (signatures read as the reference's),
    and told apart from a caller's own ``"mmap"`` by identity, so that fastst may
    read a file on a network file system by a plan instead (source.planned_reading)
    while an explicit ``backend="mmap"`` maps it."""

    __slots__ = ()


DEFAULT_BACKEND = ChosenBackend("mmap")

CONNECT_TIMEOUT = 10.0
"""Seconds to connect to a store (S3, HTTP), unless ``storage_options`` say otherwise
(``config_kwargs={"connect_timeout": ...}`` for S3, ``client_kwargs={"timeout": ...}``
for HTTP): a store that does not answer gives an error instead of a hang."""
READ_TIMEOUT = 60.0
"""Seconds a store (S3, HTTP) may stay silent while answering a request, unless
``storage_options`` say otherwise; a call as a whole may take this, plus
`CONNECT_TIMEOUT`, plus the time its bytes take at 256 KiB a second, retries
included."""
MAX_REQUESTS = 32
"""The most requests the reader of a URL keeps in flight at once, on stores read
in parallel (HTTP(S), S3, GCS...), unless ``storage_options`` say otherwise
(``max_concurrency``). A read starts with `START_REQUESTS` and adds requests while
that makes the bytes come faster: see `Pace`."""
START_REQUESTS = 4
"""Requests in flight when the reader of a URL starts: a few large ones, which a fast
link fills alone. A URL on a store that the process read before starts at the level
that read reached instead (see `Pace`)."""
PART_SIZE = 8 << 20
"""The largest request (8 MiB) of the reader of a URL, unless ``storage_options`` say
otherwise (``part_size``): the byte ranges of a read are fetched in parts of at most
this size, smaller ones at the end so that every connection stays busy to the last
byte."""
MAX_WHOLE_READ = 1 << 30
"""The largest object (1 GiB) read whole, in one request, from a server that ignores
range requests (it answers them with status 200 and the whole object, as
``python -m http.server`` does): the first read past the object's first bytes reads it
whole, and the handle serves every later read from that copy, held in memory until it
is closed (each file of a checkpoint on its own). Reading past the first bytes of a
larger object raises a `SafetensorError` that says the server ignores range requests;
nothing past the bytes asked for is read."""
# fastst's own keys in storage_options, taken out before a transport sees them
READ_OPTIONS = ("max_concurrency", "part_size", "transport")
