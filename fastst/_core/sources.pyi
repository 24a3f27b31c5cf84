"""How local files are read: the options, the counters and what the system is asked."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

class ReadOptions(NamedTuple):
    """How local files are read into fresh memory (see `read_options`)."""
    threads: int
    request_bytes: int
    direct: bool
    hints: bool
    huge_pages: bool


def read_options(*, threads: int | None = None, request_bytes: int | None = None,
                 direct: bool | None = None, hints: bool | None = None,
                 huge_pages: bool | None = None) -> ReadOptions:
    """Set how local files are read into fresh memory, and return the options
    that were in force before the call (with no argument, only return them).

    They apply to every read plan on a local file: ``load_file(copy=True)``,
    the ``"pread"`` backend, ``load_into``, ``copy_tensors``, ``read_into``,
    checkpoints, and ``iter_tensors``. A plan of 8 MiB or more is cut into
    requests of `request_bytes` that `threads` threads share, the GIL released:
    on a cold disk several requests in flight keep its queue full where one
    thread would wait for each in turn. With the page cache hot the threads
    share the copy. A plan of 64 KiB or less, on a Python with a GIL, is read
    from the page cache first without letting go of the GIL (``preadv2`` with
    ``RWF_NOWAIT``, on Linux), and what is not there with the GIL released:
    threads reading small tensors then do not hand the GIL to one another at
    every read. The defaults (one thread per usable CPU, at most 4, and
    4 MiB requests) came from a sweep on a cold local disk
    (``bench/cold.py --sweep``). They are settings of the process, shared by
    its threads.

    Parameters
    ----------
    threads : int, optional
        Threads one read plan is shared by, 1 to 64; 0 (the default): one
        per usable CPU, at most 4.
    request_bytes : int, optional
        The largest request, a multiple of 4096 from 64 KiB to 1 GiB.
    direct : bool, optional
        Read with ``O_DIRECT``, bypassing the page cache, where the file
        system takes it (tmpfs does not: its reads then go through the page
        cache, and ``read_counters()["direct_refused"]`` counts it). A
        tensor whose offset, length and memory are 4096-aligned (a file
        saved with ``align=4096``, read by ``read_into`` into aligned
        arrays) is read straight into its memory; any other through an
        aligned buffer of the thread's. The results are the same bytes.
        Plans under 1 MiB always go through the cache.
    hints : bool, optional
        Tell the kernel (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``) that a plan
        of 8 MiB or more reads its bytes in file order, so that it reads
        further ahead; start the disk reading a whole file's tensors
        (``copy_tensors``) while their fresh arrays are made (a thread reads
        ahead until the copy starts); and read a mapped file whose every
        tensor is asked for (``get_tensors``) into the page cache in the
        background, in file order. True by default.
    huge_pages : bool, optional
        Give fresh arrays of 4 MiB or more (from files, buffers, file objects
        and URLs alike) memory mapped for transparent huge pages, through a
        NumPy allocation handler: a fault brings 2 MiB, not 4 KiB, which makes
        filling fresh memory several times cheaper. It is advised
        ``madvise(MADV_HUGEPAGE)`` (Linux) as the kernel's settings allow
        without a fault waiting for memory to be compacted (see
        `use_huge_page_settings`). The arrays own their memory as any
        other (``flags.owndata``, ``resize``, pickling), and each gives it
        back when freed. True by default.

    Returns
    -------
    ReadOptions
        The options in force before the call; pass ``**options._asdict()``
        to restore them.

    Raises
    ------
    SafetensorError
        When a value is out of its range or of the wrong type.

    Examples
    --------
    >>> import fastst
    >>> before = fastst.read_options(threads=8, request_bytes=8 << 20)
    >>> fastst.read_options().threads
    8
    >>> _ = fastst.read_options(**before._asdict())
    """


def read_counters() -> dict[str, int]:
    """What read plans on local files have done since the process started, a count
    by name: for tests and benchmarks, which compare two snapshots.

    ``requests`` and ``bytes``: all the requests and bytes read; ``direct_requests``
    and ``direct_bytes``: those read with ``O_DIRECT``; ``bounced_bytes``: the bytes
    of those read through an aligned buffer; ``direct_refused``: the files that
    refused ``O_DIRECT``; ``hinted_plans``: the plans given ``posix_fadvise`` hints;
    ``threads_started``: the threads started; ``primed_plans`` and
    ``primed_bytes``: the plans read ahead while their memory was made, and the
    bytes read so (not counted in ``bytes``: the plan reads them again, from the
    page cache); ``maps_read_ahead``: the maps read ahead in the background;
    ``rows_cached``: the calls of ``Reader.cache_rows`` that read rows into the
    page cache; ``files_checked``: the checks of a file's length (``fstat``) by
    the thread Loader's gathers, of the rings closed; ``cached_requests``: the
    requests of small plans read from the page cache without letting go of the
    GIL (a Python with a GIL only: see ``read_options``).
    """
def use_huge_page_settings(folder: str = "/sys/kernel/mm/transparent_hugepage",
                           buddyinfo: str = "/proc/buddyinfo") -> str:
    """Decide when fresh arrays are advised ``MADV_HUGEPAGE`` from the kernel's
    transparent huge page settings in `folder` (``enabled``, ``defrag``), and
    where free memory is counted (`buddyinfo`): return the decision, ``"never"``,
    ``"always"`` or ``"while free"``. Made before the first big array; with other
    arguments, for tests.

    ``"never"`` where advice gains nothing: the kernel gives no huge pages, or
    gives them to every mapping (advice would only make a fault that finds no
    free 2 MiB compact memory first). ``"always"`` where an advised fault never
    waits for compaction (``defrag`` is ``defer`` or ``never``). ``"while free"``
    where it does: an array is advised only while free 2 MiB blocks hold twice
    its size (a reading of `buddyinfo` serves a tenth of a second, less what was
    advised since), as a fault that compacts takes longer than the small pages'
    faults it saves.
    """
def free_huge_page_bytes(path: str = "/proc/buddyinfo") -> int:
    """Bytes of free memory in blocks of 2 MiB or more, in the zones that serve a
    process's memory (all but DMA), from the kernel's free lists in `path`; 0 where
    it cannot be read."""
def read_ahead_limit() -> int:
    """Half the machine's memory: the most read into the page cache ahead of use
    and counted on to stay there (the map readers' bytes at once, and a data set
    whose shuffle reads whole 2 MiB pieces: the thread Loader's); 1 where the
    memory is not known, so that nothing is read ahead."""
def hint_sequential(fd: int, offset: int, length: int, /) -> bool:
    """Tell the kernel that bytes ``[offset, offset + length)`` of the file open as
    `fd` will be read once, in order (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``),
    unless `read_options` turned hints off: True when it was told (never where the
    system takes no such advice).

    For readers of their own (the CUDA ring): what read plans do themselves.
    """
def read_threads() -> int:
    """The threads a read plan of two requests or more is shared by now: the
    ``threads`` of `read_options`, or by default one per usable CPU, at most 4."""
def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it),
    which thread pools size themselves by."""
def file_system_type(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], /) -> int:
    """The magic number of the file system that holds `path` (statfs's f_type, as
    linux/magic.h names them: 0x6969 for NFS...); 0 where the platform tells none.
    OSError where the path cannot be looked up."""
