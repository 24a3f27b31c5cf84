"""Bounds that modules share without importing each other: how much a conversion may
write (the command line shows it without importing the converter, whose modules are
many), and how many bytes a read-ahead holds (a handle gives it as a default without
importing the reading thread's module until one is asked for), and the default of
every ``backend=`` argument.

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
    read a file on a network file system by a plan instead (_source.planned_reading)
    while an explicit ``backend="mmap"`` maps it."""

    __slots__ = ()


DEFAULT_BACKEND = ChosenBackend("mmap")
