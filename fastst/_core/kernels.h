/* Small C kernels of fastst's compiled core (included by __init__.pyx). */
#ifndef FASTST_H
#define FASTST_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "platform.h"
#include <Python.h>
#include <numpy/ndarraytypes.h>

/* Fields and options that one thread writes while others read them (a handle's
 * closed flag, its lazily built index, read_options()): loaded and stored atomically,
 * so that no read is torn, a pointer is seen only after what it points to, and
 * ThreadSanitizer sees the order. Plain loads and stores on x86-64; barriers where
 * the memory model is weaker (aarch64). */
static inline int fastst_load_int(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void fastst_store_int(int *p, int value) {
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
}
static inline uint64_t fastst_load_u64(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void fastst_store_u64(uint64_t *p, uint64_t value) {
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
}
/* The pread backend's reads in flight against close() (Reader._begin_file_plan): each
   side writes its own field, then reads the other's, all in one order, so that one at
   least sees the other: a read that sees the handle closed gives up, and close() that
   sees reads in flight leaves the descriptor to the last of them. */
static inline int fastst_add_int_ordered(int *p, int amount) {
    return __atomic_add_fetch(p, amount, __ATOMIC_SEQ_CST);
}
static inline int fastst_load_int_ordered(const int *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline void fastst_store_int_ordered(int *p, int value) {
    __atomic_store_n(p, value, __ATOMIC_SEQ_CST);
}
static inline int fastst_exchange_int(int *p, int value) {
    return __atomic_exchange_n(p, value, __ATOMIC_SEQ_CST);
}
static inline void fastst_add_u64(uint64_t *p, uint64_t amount) {
    __atomic_add_fetch(p, amount, __ATOMIC_RELAXED);
}
static inline Py_ssize_t fastst_load_ssize(const Py_ssize_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void fastst_store_ssize(Py_ssize_t *p, Py_ssize_t value) {
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
}
static inline PyObject *fastst_load_object(PyObject *const *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void fastst_store_object(PyObject **p, PyObject *value) {
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
}

static inline int fastst_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}

/* Bytes of `count` elements of `bits` bits: 0 on success, -1 when they do not fill
   whole bytes, 1 when the byte count overflows 64 bits. */
static inline int fastst_packed_bytes(uint64_t count, unsigned bits, uint64_t *out) {
    unsigned __int128 total = (unsigned __int128)count * bits;
    if (total % 8) return -1;
    total /= 8;
    if (total > UINT64_MAX) return 1;
    *out = (uint64_t)total;
    return 0;
}

/* End (index of the closing quote) of a JSON string whose text starts at `pos`;
   -1 when it is unterminated or holds an escape or a control character.
   `*ascii` tells whether every byte was ASCII. The scan has no early exit, so
   the compiler vectorizes it. */
static inline Py_ssize_t fastst_string_end(const unsigned char *p, Py_ssize_t pos,
                                           Py_ssize_t n, int *ascii) {
    const unsigned char *quote = memchr(p + pos, '"', (size_t)(n - pos));
    if (quote == NULL) return -1;
    Py_ssize_t end = quote - p;
    unsigned char bad = 0, high = 0;
    for (Py_ssize_t i = pos; i < end; i++) {
        unsigned char ch = p[i];
        bad |= (unsigned char)((ch == 92) | (ch < 32));
        high |= ch;
    }
    if (bad) return -1;
    *ascii = high < 128;
    return end;
}

/* Rows [row0, row0 + rows) of an m x n matrix stored in Fortran order at `src`,
   written in C order to `dst`. Tiles of 16 columns: each output row is written
   in runs of 16, and the 16 columns being read stay in cache and in the TLB while
   consecutive rows walk down them. Loads and stores go through memcpy, which
   compiles to plain moves and tolerates unaligned arrays. */
#define FASTST_TRANSPOSE(T) {                                                  \
    const Py_ssize_t size = (Py_ssize_t)sizeof(T);                            \
    for (Py_ssize_t j0 = 0; j0 < n; j0 += 16) {                               \
        Py_ssize_t j1 = j0 + 16 < n ? j0 + 16 : n;                            \
        for (Py_ssize_t i = 0; i < rows; i++) {                               \
            const char *in = src + (j0 * m + row0 + i) * size;                \
            char *out = dst + (i * n + j0) * size;                            \
            for (Py_ssize_t j = j0; j < j1; j++, in += m * size, out += size) { \
                T value;                                                      \
                memcpy(&value, in, sizeof(T));                                \
                memcpy(out, &value, sizeof(T));                               \
            }                                                                 \
        }                                                                     \
    }                                                                         \
}

/* Ask for a copy's source bytes ahead of the copy: a gather of rows scattered over a
   big table otherwise waits, row after row, for a TLB walk and a cache miss. A short
   source is asked for whole, a long one by its first line (the hardware prefetcher
   follows a long copy by itself). */
static inline void fastst_prefetch(const char *source, uint64_t length) {
    uint64_t span = length <= 1024 ? length : 64;
    for (uint64_t at = 0; at < span; at += 64) __builtin_prefetch(source + at, 0, 1);
}

static void fastst_transpose_rows(const char *src, char *dst, Py_ssize_t m,
                                  Py_ssize_t n, Py_ssize_t row0, Py_ssize_t rows,
                                  int itemsize) {
    switch (itemsize) {
        case 1: FASTST_TRANSPOSE(uint8_t) break;
        case 2: FASTST_TRANSPOSE(uint16_t) break;
        case 4: FASTST_TRANSPOSE(uint32_t) break;
        case 8: FASTST_TRANSPOSE(uint64_t) break;
    }
}

/* Fresh memory for big arrays, in huge pages where the kernel gives them: a NumPy
   allocation handler (numpy >= 1.22), set only around the allocation of a big array,
   so the array owns its memory as any other does and frees it through the handler.
   Touching fresh memory page by page is much of what filling a big array costs (a
   fault per 4 KiB, each zeroing its page); with MADV_HUGEPAGE each fault brings 2 MiB.
   A big block is a mapping of its own: a page that holds its mapped length and size
   (realloc needs the size, which NumPy does not give it), then the data, on a 2 MiB
   boundary so that every whole 2 MiB of it can be a huge page, and so that nothing
   faults the data in before it is filled. A small block (a realloc's) comes from
   malloc, with the same two fields (mapped length 0) just before its data. The
   block is advised MADV_HUGEPAGE only where fastst_advise_huge says so, set by the
   caller for each array from the machine's settings (see _fresh_array): where the
   kernel compacts memory to serve an advised fault, a fault that finds no free 2 MiB
   stalls for longer than the small pages' faults would take. */
#define FASTST_HUGE_PAGE ((size_t)2 << 20)
#define FASTST_PAGE ((size_t)4096)
#define FASTST_HEAD ((size_t)16)           /* malloc's alignment */

static _Thread_local int fastst_advise_huge = 1;   /* the allocating thread's */

static void *fastst_block_with(char *data, size_t mapped, size_t size) {
    size_t *fields = (size_t *)data - 2;
    fields[0] = mapped;
    fields[1] = size;
    return data;
}

static void *fastst_huge_alloc(size_t size, int zeroed) {
#ifdef FASTST_CAN_HUGE_PAGES
    if (size >= FASTST_HUGE_PAGE && size <= SIZE_MAX / 2) {
        size_t span = (size + FASTST_PAGE - 1) & ~(FASTST_PAGE - 1);
        size_t asked = FASTST_PAGE + span + FASTST_HUGE_PAGE;   /* room to align */
        char *start = mmap(NULL, asked, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (start != MAP_FAILED) {
            char *data = (char *)(((uintptr_t)start + FASTST_PAGE + FASTST_HUGE_PAGE - 1)
                                  & ~(uintptr_t)(FASTST_HUGE_PAGE - 1));
            char *head = data - FASTST_PAGE, *end = data + span;
            if (head > start) munmap(start, (size_t)(head - start));
            if (start + asked > end) munmap(end, (size_t)(start + asked - end));
            /* a last, partly used 2 MiB stays in small pages: no more memory held
               than asked, within a page */
            if (fastst_advise_huge)
                madvise(data, span & ~(FASTST_HUGE_PAGE - 1), MADV_HUGEPAGE);
            return fastst_block_with(data, FASTST_PAGE + span, size);
        }
    }
#endif
    if (size > SIZE_MAX - FASTST_HEAD) return NULL;
    char *start = zeroed ? calloc(1, size + FASTST_HEAD) : malloc(size + FASTST_HEAD);
    return start == NULL ? NULL : fastst_block_with(start + FASTST_HEAD, 0, size);
}

static void *fastst_huge_malloc(void *ctx, size_t size) {
    (void)ctx;
    return fastst_huge_alloc(size, 0);
}

static void *fastst_huge_calloc(void *ctx, size_t count, size_t itemsize) {
    size_t size;
    (void)ctx;
    if (__builtin_mul_overflow(count, itemsize, &size)) return NULL;
    return fastst_huge_alloc(size, 1);    /* a fresh mapping is zeroed */
}

static void fastst_huge_free(void *ctx, void *data, size_t size) {
    (void)ctx; (void)size;
    if (data == NULL) return;
    size_t *fields = (size_t *)data - 2;
    if (fields[0]) munmap((char *)data - FASTST_PAGE, fields[0]);
    else free((char *)data - FASTST_HEAD);
}

static void *fastst_huge_realloc(void *ctx, void *data, size_t size) {
    if (data == NULL) return fastst_huge_alloc(size, 0);
    size_t old = ((size_t *)data - 2)[1];
    void *moved = fastst_huge_alloc(size, 0);
    if (moved == NULL) return NULL;
    memcpy(moved, data, old < size ? old : size);
    fastst_huge_free(ctx, data, old);
    return moved;
}

/* A primer: a thread that reads bytes [at, end) of a file in order, FASTST_PRIMER_BYTES
   a request, into a scratch buffer whose bytes no one reads (primers running at once
   share it), until it reaches the end, a read fails, or it is told to stop. The
   kernel's read-ahead follows a reader it sees reading in order, in windows that grow
   to the device's read-ahead size: the disk streams the span while the thread that
   started the primer does other work. A thread of the C library's own, not Python's:
   it needs no interpreter state or lock and takes nothing from the heap, so starting
   it leaves the memory the caller allocates meanwhile where it would be without it. */

#define FASTST_PRIMER_BYTES ((size_t)256 << 10)
#define FASTST_THREAD_STACK ((size_t)64 << 10)   /* the primers' and map readers' */

static char fastst_primer_scratch[FASTST_PRIMER_BYTES];

typedef struct {
    int fd;
    uint64_t begin, at, end;       /* `at`: where the next request starts */
    int stopping;
    int running;                   /* started and not yet joined */
    pid_t owner;                   /* the process that started it: a fork's child has no
                                      such thread to join */
    pthread_t thread;
} fastst_primer;

static void *fastst_primer_run(void *arg) {
    fastst_primer *primer = (fastst_primer *)arg;
    uint64_t at = primer->begin;
    fastst_name_thread("fastst-primer");
    while (at < primer->end && !__atomic_load_n(&primer->stopping, __ATOMIC_RELAXED)) {
        uint64_t left = primer->end - at;
        ssize_t got = pread(primer->fd, fastst_primer_scratch,
                            left < FASTST_PRIMER_BYTES ? (size_t)left : FASTST_PRIMER_BYTES,
                            (off_t)at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;       /* an error or the end of the file: the plan reports it */
        at += (uint64_t)got;
        __atomic_store_n(&primer->at, at, __ATOMIC_RELAXED);
    }
    return NULL;
}

/* Start reading [begin, end) of `fd`: 0, or an errno when no thread could be made
   (then nothing runs, and nothing is lost but the head start). */
static int fastst_primer_start(fastst_primer *primer, int fd, uint64_t begin, uint64_t end) {
    pthread_attr_t attributes;
    int error;
    primer->fd = fd;
    primer->begin = primer->at = begin;
    primer->end = end;
    primer->stopping = 0;
    primer->running = 0;
    if ((error = pthread_attr_init(&attributes)) != 0) return error;
    pthread_attr_setstacksize(&attributes, FASTST_THREAD_STACK);
    error = pthread_create(&primer->thread, &attributes, fastst_primer_run, primer);
    pthread_attr_destroy(&attributes);
    if (error == 0) {
        primer->running = 1;
        primer->owner = getpid();
    }
    return error;
}

/* Tell a primer to stop after its current request (it reads on, in the background,
   until then). */
static void fastst_primer_signal(fastst_primer *primer) {
    __atomic_store_n(&primer->stopping, 1, __ATOMIC_RELAXED);
}

/* Stop a primer and wait for its thread: the bytes it read; 0 when it was not
   running (never started, or stopped already). */
static uint64_t fastst_primer_stop(fastst_primer *primer) {
    if (!primer->running) return 0;
    primer->running = 0;
    if (primer->owner != getpid()) return 0;
    fastst_primer_signal(primer);
    pthread_join(primer->thread, NULL);
    return primer->at - primer->begin;
}

/* A map reader: a thread that goes through [at, end), a range of a file mapping, in
   order, FASTST_MAP_READER_BYTES at a time, and maps the pages of each step that is
   not all in the page cache already, reading those that are not from the file
   (MADV_POPULATE_READ, Linux 5.14): as the process's own touches would, but ahead of
   them, and without a fault each. A step the page cache holds whole is left alone
   (mincore): nothing to read there, and mapping it would only cost time and show the
   whole file in the process's RSS. A file that shrank meanwhile ends it (EFAULT,
   where a touch would raise SIGBUS). The map readers running at once hold at most
   `limit` bytes of the budget between them: a file larger than what memory can keep
   is left to be read as it is touched. */
#define FASTST_MAP_READER_BYTES ((size_t)8 << 20)
#define FASTST_MAP_PROBE_BYTES ((size_t)64 << 10)

static uint64_t fastst_map_reading;    /* bytes the running map readers were given */

typedef struct {
    char *at, *end;
    uint64_t held;                 /* of fastst_map_reading, given back at the end */
    int stopping;
    int started;                   /* once: a map is read ahead at most once */
    int running;                   /* started and not yet joined */
    pid_t owner;                   /* the process that started it (see fastst_primer) */
    pthread_t thread;
} fastst_map_reader;

#ifdef FASTST_CAN_POPULATE
/* Whether the page cache holds every page of [start, start + length) (start on a page
   boundary, length at most FASTST_MAP_READER_BYTES). */
static int fastst_cached_whole(char *start, size_t length) {
    unsigned char resident[FASTST_MAP_READER_BYTES / FASTST_PAGE];
    size_t pages = (length + FASTST_PAGE - 1) / FASTST_PAGE, k;
    if (pages > sizeof(resident) || fastst_mincore(start, length, resident) != 0) return 0;
    for (k = 0; k < pages; k++)
        if (!(resident[k] & 1)) return 0;
    return 1;
}
#endif

static void *fastst_map_reader_run(void *arg) {
#ifdef FASTST_CAN_POPULATE
    fastst_map_reader *reader = (fastst_map_reader *)arg;
    char *at = reader->at;
    fastst_name_thread("fastst-map-read");
    while (at < reader->end && !__atomic_load_n(&reader->stopping, __ATOMIC_RELAXED)) {
        size_t step = (size_t)(reader->end - at) < FASTST_MAP_READER_BYTES
                      ? (size_t)(reader->end - at) : FASTST_MAP_READER_BYTES;
        if (fastst_cached_whole(at, step)) {
            at += step;
            continue;
        }
        if (madvise(at, step, MADV_POPULATE_READ) != 0) {
            if (errno == EINTR) continue;
            break;
        }
        at += step;
    }
    __atomic_sub_fetch(&fastst_map_reading, reader->held, __ATOMIC_RELAXED);
#else
    (void)arg;
#endif
    return NULL;
}

/* Start reading [begin, end) of a mapping ahead: 0, or an errno when it does not start
   (ENOSYS: no MADV_POPULATE_READ here; EALREADY: this map was read ahead before;
   ECANCELED: the page cache holds its first and its last FASTST_MAP_PROBE_BYTES, as
   it holds a file read before, and a thread would most likely find nothing to read;
   ENOMEM: over the budget; or pthread_create's). The probes are small: mincore looks
   each page up, some 25 ns a page here, and a probe of 8 MiB at each end took longer
   than starting the thread. */
static int fastst_map_reader_start(fastst_map_reader *reader, char *begin, char *end,
                                   uint64_t limit) {
#ifdef FASTST_CAN_POPULATE
    pthread_attr_t attributes;
    int error;
    uint64_t span = (uint64_t)(end - begin);
    char *first = (char *)((uintptr_t)begin & ~(uintptr_t)(FASTST_PAGE - 1));
    char *last = end - first > (ptrdiff_t)FASTST_MAP_PROBE_BYTES    /* a page boundary */
                 ? (char *)(((uintptr_t)(end - FASTST_MAP_PROBE_BYTES) + FASTST_PAGE - 1)
                            & ~(uintptr_t)(FASTST_PAGE - 1)) : first;
    if (reader->started) return EALREADY;
    reader->started = 1;
    if (fastst_cached_whole(first, (size_t)(end - first) < FASTST_MAP_PROBE_BYTES
                                   ? (size_t)(end - first) : FASTST_MAP_PROBE_BYTES)
            && fastst_cached_whole(last, (size_t)(end - last)))
        return ECANCELED;
    if (__atomic_add_fetch(&fastst_map_reading, span, __ATOMIC_RELAXED) > limit) {
        __atomic_sub_fetch(&fastst_map_reading, span, __ATOMIC_RELAXED);
        return ENOMEM;
    }
    reader->at = first;
    reader->end = end;
    reader->held = span;
    reader->stopping = 0;
    if ((error = pthread_attr_init(&attributes)) == 0) {
        pthread_attr_setstacksize(&attributes, FASTST_THREAD_STACK);
        error = pthread_create(&reader->thread, &attributes, fastst_map_reader_run, reader);
        pthread_attr_destroy(&attributes);
    }
    if (error != 0) {
        __atomic_sub_fetch(&fastst_map_reading, span, __ATOMIC_RELAXED);
        return error;
    }
    reader->running = 1;
    reader->owner = getpid();
    return 0;
#else
    (void)reader; (void)begin; (void)end; (void)limit;
    (void)fastst_map_reader_run;
    return ENOSYS;
#endif
}

/* A fork's child runs none of its parent's map readers: none holds the budget there. */
static void fastst_map_readers_forked(void) {
    fastst_map_reading = 0;
}

static int fastst_map_readers_init(void) {
    return pthread_atfork(NULL, NULL, fastst_map_readers_forked);
}

/* Stop a map reader after its current step and wait for it (before the map goes). */
static void fastst_map_reader_stop(fastst_map_reader *reader) {
    if (!reader->running) return;
    reader->running = 0;
    if (reader->owner != getpid()) return;
    __atomic_store_n(&reader->stopping, 1, __ATOMIC_RELAXED);
    pthread_join(reader->thread, NULL);
}

/* Whether the page cache holds the page at `page` (a page boundary of a map). */
static int fastst_cached_page(char *page) {
    unsigned char resident = 0;
    return fastst_mincore(page, 1, &resident) == 0 && (resident & 1);
}

/* Whether the page cache holds the first and the last page of [start, start + length)
   (start on a page boundary): a 2 MiB piece read whole holds all of them. */
static int fastst_cached_ends(char *start, size_t length) {
    return fastst_cached_page(start)
           && fastst_cached_page(start + ((length - 1) & ~(FASTST_PAGE - 1)));
}

/* Whether the page cache holds the first and the last page of every 2 MiB-aligned
   piece of a file (of `size` bytes, mapped whole at `map`) that holds [begin, end). */
static int fastst_pieces_cached(char *map, uint64_t begin, uint64_t end, uint64_t size) {
    uint64_t at = begin & ~(uint64_t)(FASTST_HUGE_PAGE - 1);
    uint64_t stop = (end + FASTST_HUGE_PAGE - 1) & ~(uint64_t)(FASTST_HUGE_PAGE - 1);
    if (stop > size) stop = size;
    for (; at < stop; at += FASTST_HUGE_PAGE)
        if (!fastst_cached_ends(map + at, stop - at < FASTST_HUGE_PAGE
                                          ? (size_t)(stop - at) : FASTST_HUGE_PAGE))
            return 0;
    return 1;
}

/* Read [begin, end) of the file `fd` (of `size` bytes) into the page cache now, in the
   whole 2 MiB-aligned pieces of the file that hold it, each in one request, as one
   folio of 2 MiB where the file system keeps large folios: a map of the file then
   maps each piece by one entry, where WILLNEED hints and scattered faults leave 4 KiB
   pages, a TLB miss each for a later gather of scattered rows. Through a mapping of
   the pieces of its own, advised MADV_HUGEPAGE (a fault reads the aligned 2 MiB around
   it) and MADV_RANDOM (and nothing after it), populated piece by piece
   (MADV_POPULATE_READ, Linux 5.14), its pages unmapped again at the end. A piece whose
   first and last pages the page cache holds is taken as held whole and not read: a
   check of two pages, where mincore of all 512 costs more than the rest (a piece held
   in part is read by the gathers' faults). Without huge-page advice the pieces are
   read as faults read them. 0, or an errno: ENOSYS where there is no
   MADV_POPULATE_READ, EFAULT where the file is shorter than asked. */
static int fastst_cache_span(int fd, uint64_t begin, uint64_t end, uint64_t size) {
#ifdef FASTST_CAN_POPULATE
    uint64_t first = begin & ~(uint64_t)(FASTST_HUGE_PAGE - 1);
    uint64_t last = (end + FASTST_HUGE_PAGE - 1) & ~(uint64_t)(FASTST_HUGE_PAGE - 1);
    uint64_t size_pages = (size + FASTST_PAGE - 1) & ~(uint64_t)(FASTST_PAGE - 1);
    size_t span, at;
    char *map;
    int error = 0;
    if (last > size_pages) last = size_pages;
    if (last <= first) return 0;
    span = (size_t)(last - first);
    map = mmap(NULL, span, PROT_READ, MAP_SHARED, fd, (off_t)first);
    if (map == MAP_FAILED) return errno;
#ifdef FASTST_CAN_HUGE_PAGES
    if (madvise(map, span, MADV_HUGEPAGE) == 0) madvise(map, span, MADV_RANDOM);
#endif
    for (at = 0; at < span && error == 0; at += FASTST_HUGE_PAGE) {
        size_t piece = span - at < FASTST_HUGE_PAGE ? span - at : FASTST_HUGE_PAGE;
        if (fastst_cached_ends(map + at, piece)) continue;
        while (madvise(map + at, piece, MADV_POPULATE_READ) != 0 && error == 0)
            if (errno != EINTR) error = errno;
    }
    munmap(map, span);
    return error;
#else
    (void)fd; (void)begin; (void)end; (void)size;
    return ENOSYS;
#endif
}

/* Drop the first 2 MiB piece of the file `fd` (of `size` bytes) from the page cache
   where its first page alone is held: the header's pages, read at open, are small
   pages that would keep fastst_cache_span from reading the piece as one folio (pages
   mapped, dirty or being read stay; the rest is read again, 2 MiB at most). Nothing
   where the piece is held whole or not at all, or where it cannot be mapped. */
static void fastst_drop_partial_first_piece(int fd, uint64_t size) {
#ifdef FASTST_CAN_DROP_CACHE
    size_t span = size < FASTST_HUGE_PAGE ? (size_t)size : FASTST_HUGE_PAGE;
    char *map;
    if (span == 0) return;
    map = mmap(NULL, span, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return;
    if (fastst_cached_page(map) && !fastst_cached_ends(map, span))
        fastst_advise_file(fd, 0, (int64_t)span, FASTST_ADVISE_DONTNEED);
    munmap(map, span);
#else
    (void)fd; (void)size;
#endif
}

static PyDataMem_Handler fastst_huge_handler = {
    "fastst_huge_pages", 1,
    {NULL, fastst_huge_malloc, fastst_huge_calloc, fastst_huge_realloc, fastst_huge_free}
};

static PyObject *fastst_huge_handler_capsule(void) {
    return PyCapsule_New(&fastst_huge_handler, "mem_handler", NULL);
}

#endif
