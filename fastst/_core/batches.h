/* The thread Loader's gathers: threads that copy the rows of each batch from the
   files' maps into a ring of batch buffers, and the consumer that takes the batches in
   order, with no Python between them (see BatchRing in batches.pxi).

   Batch k (its place in the iteration) goes into slot k % slots once batch
   k - ahead is taken; a thread takes the next batch that may start, waits until the
   rows it needs are read (the gate, which the page cache's reader moves), copies the
   rows, and marks the slot filled with k. */
#ifndef FASTST_BATCHES_H
#define FASTST_BATCHES_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <stdio.h>
#include "kernels.h"           /* fastst_prefetch */
#include "platform.h"          /* FASTST_CAN_WATCH, fastst_watchable */

/* The format core's guarded copy (faults.h: compiled there, once, with the one SIGBUS
   handler): the ring's module sets it as it starts (fastst_batches_use_guard). */
typedef int (*fastst_guard)(void (*copy)(void *), void *argument, const char **address);
static fastst_guard fastst_batches_guarded;

static void fastst_batches_use_guard(void *guard) {
    fastst_batches_guarded = (fastst_guard)guard;
}

#define FASTST_BATCH_PREFETCH 8   /* rows whose sources are asked for ahead of their copy */
#define FASTST_BATCH_CHUNKS 16384 /* the most chunks of rows whose first row's part is kept */

enum {
    FASTST_BATCH_OK = 0,
    FASTST_BATCH_SHORT_FILE = 1,      /* a file is shorter than when it was mapped */
    FASTST_BATCH_READER_FAILED = 2,   /* the reading the gate waits for failed */
    FASTST_BATCH_BAD_ROW = 3,         /* a row outside the dataset (never, by design) */
    FASTST_BATCH_STOPPED = 4,         /* stopped before the batch was filled */
    FASTST_BATCH_NOT_YET = 5,         /* not filled within the wait asked for */
};

enum {                        /* what a batch knows of a file's length */
    FASTST_FILE_UNWATCHED = 0,    /* nothing: each batch that takes rows from it checks */
    FASTST_FILE_WATCHED = 1,      /* no shorter until the kernel says it changed */
    FASTST_FILE_SHORT = 2,        /* found shorter than mapped */
};

typedef struct {
    /* fixed before the threads start */
    int tensors, parts, slots;
    const int64_t *starts;       /* parts + 1: each part's first row, then the rows in all */
    const int *chunk_parts;      /* the part of each chunk's first row (see _part) */
    int chunk_shift;             /* a chunk: 2^chunk_shift rows */
    char *const *bases;          /* parts x tensors: row 0 of a tensor in a part's map */
    const uint64_t *row_bytes;   /* tensors */
    const int *fds;              /* parts: a descriptor on each mapped file */
    const uint64_t *sizes;       /* parts: the size each file had when mapped */
    const int64_t *order;        /* the iteration's rows, batch after batch */
    int64_t order_rows, batch_rows;
    int64_t first_batch, batch_step, count;   /* place k: batch first_batch + k * batch_step */
    char *const *outs;           /* slots x tensors: each slot's buffer of each tensor */
    int64_t ahead;
    const int64_t *needs;        /* per place: the reads it waits for; NULL: none waits */
    int stream;                  /* copy rows of whole lines with stores that bypass the cache */
    int taker_fills;             /* batches small enough for the consumer to fill (_take) */
    int watch_fd;                /* an inotify instance on the files, or -1 */
    const int *watches;          /* parts: each file's watch (-1: none) */
    int *file_states;            /* parts: FASTST_FILE_*, read and set atomically */
    /* changed by the gathering threads (the fields above are fixed once they start;
       file_states' contents change, atomically) */
    int64_t checks;              /* the fstat calls made of the files (atomic) */
    pthread_mutex_t watch_lock;  /* held while the kernel's news is read and acted on */
    /* changed under `lock` */
    pthread_mutex_t lock;
    pthread_cond_t startable, gate_moved, filled_one;
    int64_t next, limit;         /* the next place to start; places below `limit` may start */
    int64_t claimed, ready;      /* places whose `needs` are set; reads done */
    int64_t *filled;             /* slots: the place last filled in each */
    int *errors;                 /* slots: how that fill ended */
    int *error_parts;            /* slots: the part of a short file */
    /* the consumer's own, as a gathering thread's (see fastst_batches_work): where it
       fills a batch itself while it waits (fastst_batches_take) */
    int64_t *taker_checked;      /* parts */
    int *taker_row_parts;        /* batch_rows */
    int stopping, reader_failed;
} fastst_batches;

static int fastst_batches_init(fastst_batches *ring) {
    int k;
    ring->next = ring->claimed = ring->ready = 0;
    ring->limit = ring->ahead < ring->count ? ring->ahead : ring->count;
    ring->stopping = ring->reader_failed = 0;
    for (k = 0; k < ring->slots; k++) {
        ring->filled[k] = -1;
        ring->errors[k] = FASTST_BATCH_OK;
        ring->error_parts[k] = -1;
    }
    for (k = 0; k < ring->parts; k++) ring->taker_checked[k] = -1;
    if (pthread_mutex_init(&ring->lock, NULL) != 0) return -1;
    if (pthread_cond_init(&ring->startable, NULL) != 0) goto no_startable;
    if (pthread_cond_init(&ring->gate_moved, NULL) != 0) goto no_gate_moved;
    if (pthread_cond_init(&ring->filled_one, NULL) != 0) goto no_filled_one;
    if (pthread_mutex_init(&ring->watch_lock, NULL) != 0) goto no_watch_lock;
    return 0;
no_watch_lock:
    pthread_cond_destroy(&ring->filled_one);
no_filled_one:
    pthread_cond_destroy(&ring->gate_moved);
no_gate_moved:
    pthread_cond_destroy(&ring->startable);
no_startable:
    pthread_mutex_destroy(&ring->lock);
    return -1;
}

static void fastst_batches_destroy(fastst_batches *ring) {
    pthread_mutex_destroy(&ring->watch_lock);
    pthread_cond_destroy(&ring->filled_one);
    pthread_cond_destroy(&ring->gate_moved);
    pthread_cond_destroy(&ring->startable);
    pthread_mutex_destroy(&ring->lock);
}

/* The part that holds row `row` (0 <= row < starts[parts]): the part of the row's
   chunk's first row, or one after it (a step a part that starts within the chunk). A
   binary search over the starts cost a row more than its copy where the rows lie in
   hundreds of files (its branches are a coin toss each). */
static inline int fastst_batches_part(const fastst_batches *ring, int64_t row) {
    int part = ring->chunk_parts[row >> ring->chunk_shift];
    while (ring->starts[part + 1] <= row) part++;
    return part;
}

/* Fill `chunk_parts` (FASTST_BATCH_CHUNKS at most) with the part of each chunk's first
   row, chunks of 2^chunk_shift rows, the fewest rows that keep the table that long. */
static void fastst_batches_index_parts(fastst_batches *ring, int *chunk_parts) {
    int64_t rows = ring->starts[ring->parts], chunk;
    int part = 0;
    ring->chunk_shift = 0;
    while ((rows - 1) >> ring->chunk_shift >= FASTST_BATCH_CHUNKS) ring->chunk_shift++;
    for (chunk = 0; rows > 0 && chunk <= (rows - 1) >> ring->chunk_shift; chunk++) {
        while (ring->starts[part + 1] <= chunk << ring->chunk_shift) part++;
        chunk_parts[chunk] = part;
    }
    ring->chunk_parts = chunk_parts;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTST_CAN_STREAM 1
/* Copy `bytes` (a multiple of 128) to `destination` (32-byte aligned) with stores that
   bypass the cache (AVX2: see fastst_batches_can_stream). */
__attribute__((target("avx2")))
static void fastst_stream_copy(char *destination, const char *source, uint64_t bytes) {
    uint64_t at;
    for (at = 0; at < bytes; at += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(source + at));
        __m256i b = _mm256_loadu_si256((const __m256i *)(source + at + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(source + at + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(source + at + 96));
        _mm256_stream_si256((__m256i *)(destination + at), a);
        _mm256_stream_si256((__m256i *)(destination + at + 32), b);
        _mm256_stream_si256((__m256i *)(destination + at + 64), c);
        _mm256_stream_si256((__m256i *)(destination + at + 96), d);
    }
}
#endif

/* Whether this CPU can copy with fastst_stream_copy. */
static int fastst_batches_can_stream(void) {
#ifdef FASTST_CAN_STREAM
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* Where row `row` (of part `part`) of tensor `t` is in the part's map. */
static inline const char *fastst_batches_source(const fastst_batches *ring, int64_t row,
                                                int part, int t) {
    return ring->bases[(size_t)part * ring->tensors + t]
           + (uint64_t)(row - ring->starts[part]) * ring->row_bytes[t];
}

/* Ask for row `row` (of part `part`) of every tensor ahead of its copy: a gather of
   rows scattered over a big table otherwise waits, row after row, for a TLB walk and a
   cache miss. */
static inline void fastst_batches_ask_row(const fastst_batches *ring, int64_t row,
                                          int part) {
    int t;
    for (t = 0; t < ring->tensors; t++)
        fastst_prefetch(fastst_batches_source(ring, row, part, t), ring->row_bytes[t]);
}

/* Copy row `row` (of part `part`) of every tensor into row `k` of the slot's buffers
   `outs`. */
static inline void fastst_batches_copy_row(const fastst_batches *ring, int64_t row,
                                           int part, char *const *outs, uint64_t k) {
    int t;
    for (t = 0; t < ring->tensors; t++) {
        uint64_t bytes = ring->row_bytes[t];
        char *destination = outs[t] + k * bytes;
        const char *source = fastst_batches_source(ring, row, part, t);
#ifdef FASTST_CAN_STREAM
        if (ring->stream && bytes % 128 == 0 && ((uintptr_t)destination & 31) == 0) {
            fastst_stream_copy(destination, source, bytes);
            continue;
        }
#endif
        memcpy(destination, source, bytes);
    }
}

/* Whether the reads that place `place` needs are done (under the lock). */
static int fastst_batches_gate_open(const fastst_batches *ring, int64_t place) {
    if (ring->needs == NULL) return 1;
    return place < ring->claimed && ring->ready >= ring->needs[place];
}

/* Whether part `part`'s file is no shorter than it was mapped (fstat of a descriptor
   held on it). */
static int fastst_batches_long_enough(fastst_batches *ring, int part) {
    struct stat info;
    __atomic_add_fetch(&ring->checks, 1, __ATOMIC_RELAXED);
    return fstat(ring->fds[part], &info) == 0 && (uint64_t)info.st_size >= ring->sizes[part];
}

/* A descriptor to watch files with (inotify), or -1 where there is none. */
static int fastst_batches_watcher(void) {
#ifdef FASTST_CAN_WATCH
    return inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
#else
    return -1;
#endif
}

/* Watch each file of a local file system for changes (inotify, the descriptor
   `watch_fd`; `watches`, one a part, get the watches), so that a batch checks a file's
   length only once the kernel says the file changed: an fstat of every file a batch
   takes rows from costs more than the copies where the rows lie in many small files.
   A file that cannot be watched is checked by each batch, as before. Each file is
   checked once more after its watch is set, so that nothing done before goes unseen.
   The files watched. */
static int fastst_batches_watch(fastst_batches *ring, int watch_fd, int *watches) {
    int part, watched = 0;
    ring->watch_fd = watch_fd;
    ring->watches = watches;
    for (part = 0; part < ring->parts; part++) {
        watches[part] = -1;
        ring->file_states[part] = FASTST_FILE_UNWATCHED;
#ifdef FASTST_CAN_WATCH
        if (watch_fd >= 0 && fastst_watchable(ring->fds[part])) {
            char path[64];
            snprintf(path, sizeof path, "/proc/self/fd/%d", ring->fds[part]);
            watches[part] = inotify_add_watch(watch_fd, path, IN_MODIFY);
        }
#endif
        if (watches[part] >= 0) {
            ring->file_states[part] = fastst_batches_long_enough(ring, part)
                                      ? FASTST_FILE_WATCHED : FASTST_FILE_SHORT;
            watched++;
        }
    }
    return watched;
}

/* Act on what the kernel said of the watched files since this was last done: each file
   changed is checked again (all of them where its queue overflowed), and one found
   short is marked so; a file whose watch ended is checked by each batch from then
   on. Under `watch_lock`, so that a batch that looks after another has seen its news
   waits until that one has acted on it. */
static void fastst_batches_look_at_changes(fastst_batches *ring) {
#ifdef FASTST_CAN_WATCH
    union {
        char bytes[4096];
        struct inotify_event first;    /* the alignment of the events */
    } news;
    ssize_t got;
    pthread_mutex_lock(&ring->watch_lock);
    while ((got = read(ring->watch_fd, news.bytes, sizeof news.bytes)) > 0) {
        const char *at = news.bytes;
        while (at < news.bytes + got) {
            const struct inotify_event *event = (const struct inotify_event *)at;
            int part;
            for (part = 0; part < ring->parts; part++) {
                int state;
                if (!(event->mask & IN_Q_OVERFLOW) && ring->watches[part] != event->wd)
                    continue;
                if (event->mask & IN_IGNORED) state = FASTST_FILE_UNWATCHED;
                else if (!fastst_batches_long_enough(ring, part)) state = FASTST_FILE_SHORT;
                else continue;
                if (__atomic_load_n(&ring->file_states[part], __ATOMIC_RELAXED)
                        != FASTST_FILE_SHORT)
                    __atomic_store_n(&ring->file_states[part], state, __ATOMIC_RELAXED);
            }
            at += sizeof(struct inotify_event) + event->len;
        }
    }
    pthread_mutex_unlock(&ring->watch_lock);
#else
    (void)ring;
#endif
}

/* Whether part `part`'s file may be read: no shorter than it was mapped, as far as its
   watch or an fstat tells. */
static int fastst_batches_file_whole(fastst_batches *ring, int part) {
    switch (__atomic_load_n(&ring->file_states[part], __ATOMIC_RELAXED)) {
    case FASTST_FILE_WATCHED: return 1;
    case FASTST_FILE_SHORT: return 0;
    default: return fastst_batches_long_enough(ring, part);
    }
}

/* A batch's rows to copy: `size` rows `rows`, each of part `row_parts[k]`, into the
   slot's buffers `outs`. */
typedef struct {
    const fastst_batches *ring;
    const int64_t *rows;
    const int *row_parts;
    char *const *outs;
    int64_t size;
} fastst_batch_rows;

/* Copy a batch's rows (a fastst_batch_rows), each asked for ahead of its copy. */
static void fastst_batches_copy_rows(void *argument) {
    const fastst_batch_rows *copy = (const fastst_batch_rows *)argument;
    const fastst_batches *ring = copy->ring;
    const int64_t *rows = copy->rows;
    const int *row_parts = copy->row_parts;
    int64_t size = copy->size, k;
    for (k = 0; k < size && k < FASTST_BATCH_PREFETCH; k++)
        fastst_batches_ask_row(ring, rows[k], row_parts[k]);
    for (k = 0; k < size; k++) {
        int64_t ahead = k + FASTST_BATCH_PREFETCH;
        if (ahead < size) fastst_batches_ask_row(ring, rows[ahead], row_parts[ahead]);
        fastst_batches_copy_row(ring, rows[k], row_parts[k], copy->outs, (uint64_t)k);
    }
#ifdef FASTST_CAN_STREAM
    if (ring->stream) _mm_sfence();     /* the streamed stores land before the batch is marked */
#endif
}

/* The part whose rows hold the byte at `address` in its map; -1 where none does. */
static int fastst_batches_part_at(const fastst_batches *ring, const char *address) {
    int part, t;
    for (part = 0; part < ring->parts; part++)
        for (t = 0; t < ring->tensors; t++) {
            const char *base = ring->bases[(size_t)part * ring->tensors + t];
            uint64_t bytes = (uint64_t)(ring->starts[part + 1] - ring->starts[part])
                             * ring->row_bytes[t];
            if (address >= base && (uint64_t)(address - base) < bytes) return part;
        }
    return -1;
}

/* Copy the rows of place `place` into its slot. Every file the batch takes rows from
   is first checked to be no shorter than it was mapped (its watch, or else an fstat),
   so that a file cut short is found before its rows are copied where it can be; one
   cut short while they are is found by the fault (SIGBUS) of the guarded copy (see
   faults.h). Either way the batch ends FASTST_BATCH_SHORT_FILE, `error_part` the
   file's part. `checked` (one a part) and `row_parts` (one a row of a batch) are the
   thread's own: the place each file was last checked for, and each row's part, looked
   up once. */
static int fastst_batches_fill(fastst_batches *ring, int64_t place, int64_t *checked,
                               int *row_parts, int *error_part) {
    int64_t index = ring->first_batch + place * ring->batch_step;
    int64_t first = index * ring->batch_rows, size = ring->order_rows - first, k;
    const int64_t *rows = ring->order + first;
    int slot = (int)(place % ring->slots);
    char *const *outs = ring->outs + (size_t)slot * ring->tensors;
    fastst_batch_rows copy;
    const char *faulted;
    if (size > ring->batch_rows) size = ring->batch_rows;
    if (ring->watch_fd >= 0) fastst_batches_look_at_changes(ring);
    for (k = 0; k < size; k++) {
        int64_t row = rows[k];
        int part;
        if (row < 0 || row >= ring->starts[ring->parts]) return FASTST_BATCH_BAD_ROW;
        part = row_parts[k] = ring->parts == 1 ? 0 : fastst_batches_part(ring, row);
        if (checked[part] == place) continue;
        checked[part] = place;
        if (!fastst_batches_file_whole(ring, part)) {
            *error_part = part;
            return FASTST_BATCH_SHORT_FILE;
        }
    }
    copy.ring = ring;
    copy.rows = rows;
    copy.row_parts = row_parts;
    copy.outs = outs;
    copy.size = size;
    if (fastst_batches_guarded(fastst_batches_copy_rows, &copy, &faulted)) {
        *error_part = fastst_batches_part_at(ring, faulted);
        return FASTST_BATCH_SHORT_FILE;
    }
    return FASTST_BATCH_OK;
}

/* Copy the rows of place `place`, just taken from `next`, into its slot and mark it
   filled, with how its fill ended: called under `lock`, let go while the rows are
   copied. `checked` and `row_parts`: the filling thread's own (fastst_batches_fill). */
static void fastst_batches_fill_place(fastst_batches *ring, int64_t place, int64_t *checked,
                                      int *row_parts) {
    int error = ring->reader_failed ? FASTST_BATCH_READER_FAILED : FASTST_BATCH_OK;
    int error_part = -1, slot = (int)(place % ring->slots);
    pthread_mutex_unlock(&ring->lock);
    if (error == FASTST_BATCH_OK)
        error = fastst_batches_fill(ring, place, checked, row_parts, &error_part);
    pthread_mutex_lock(&ring->lock);
    ring->filled[slot] = place;
    ring->errors[slot] = error;
    ring->error_parts[slot] = error_part;
    pthread_cond_broadcast(&ring->filled_one);
}

/* A gathering thread: fills places until none is left or the ring stops. 0, or ENOMEM. */
static int fastst_batches_work(fastst_batches *ring) {
    int64_t *checked = (int64_t *)malloc(sizeof(int64_t) * (size_t)ring->parts), place;
    int *row_parts = (int *)malloc(sizeof(int) * (size_t)ring->batch_rows);
    int k;
    if (checked == NULL || row_parts == NULL) {
        free(checked);
        free(row_parts);
        return ENOMEM;
    }
    for (k = 0; k < ring->parts; k++) checked[k] = -1;
    pthread_mutex_lock(&ring->lock);
    for (;;) {
        while (!ring->stopping && ring->next < ring->count && ring->next >= ring->limit)
            pthread_cond_wait(&ring->startable, &ring->lock);
        if (ring->stopping || ring->next >= ring->count) break;
        place = ring->next++;
        while (!ring->stopping && !ring->reader_failed && !fastst_batches_gate_open(ring, place))
            pthread_cond_wait(&ring->gate_moved, &ring->lock);
        if (ring->stopping) break;
        fastst_batches_fill_place(ring, place, checked, row_parts);
    }
    pthread_mutex_unlock(&ring->lock);
    free(checked);
    free(row_parts);
    return 0;
}

/* Take place `place` (in order): the place `ahead` after it may start; waits until it
   is filled, or `wait_ms` milliseconds at most (then FASTST_BATCH_NOT_YET: the caller
   looks at its signals and takes it again). How its fill ended, and the part of a
   short file. */
static int fastst_batches_take(fastst_batches *ring, int64_t place, int *error_part,
                               long wait_ms) {
    int slot = (int)(place % ring->slots), error;
    int64_t limit = place + 1 + ring->ahead;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += wait_ms / 1000;
    until.tv_nsec += (wait_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ring->lock);
    if (limit > ring->count) limit = ring->count;
    if (limit == ring->limit + 1)        /* one more place: one thread to wake */
        pthread_cond_signal(&ring->startable);
    else if (limit > ring->limit)
        pthread_cond_broadcast(&ring->startable);
    if (limit > ring->limit) ring->limit = limit;
    while (ring->filled[slot] != place && !ring->stopping) {
        /* Rather than sleep until a thread has filled it, the consumer fills the next
           batch no thread has started, where its rows are ready: a sleep and a wake-up
           cost about as much as copying a small batch (TAKER_FILLS_BATCH_BYTES). */
        int64_t next = ring->next;
        if (ring->taker_fills && next < ring->limit && next < ring->count && !ring->reader_failed
                && fastst_batches_gate_open(ring, next)) {
            ring->next++;
            fastst_batches_fill_place(ring, next, ring->taker_checked, ring->taker_row_parts);
            continue;
        }
        if (pthread_cond_timedwait(&ring->filled_one, &ring->lock, &until) == ETIMEDOUT)
            break;
    }
    if (ring->filled[slot] == place) error = ring->errors[slot];
    else error = ring->stopping ? FASTST_BATCH_STOPPED : FASTST_BATCH_NOT_YET;
    *error_part = ring->error_parts[slot];
    pthread_mutex_unlock(&ring->lock);
    return error;
}

/* The gate moves: `ready` reads are done, `claimed` places have their needs set (each
   only grows; a smaller value leaves it). */
static void fastst_batches_advance(fastst_batches *ring, int64_t ready, int64_t claimed) {
    pthread_mutex_lock(&ring->lock);
    if (ready > ring->ready) ring->ready = ready;
    if (claimed > ring->claimed) ring->claimed = claimed;
    pthread_cond_broadcast(&ring->gate_moved);
    pthread_mutex_unlock(&ring->lock);
}

/* The reading failed (reader_failed) or the iteration ends (stopping): every waiting
   thread wakes. */
static void fastst_batches_end(fastst_batches *ring, int stopping) {
    pthread_mutex_lock(&ring->lock);
    if (stopping) ring->stopping = 1;
    else ring->reader_failed = 1;
    pthread_cond_broadcast(&ring->startable);
    pthread_cond_broadcast(&ring->gate_moved);
    pthread_cond_broadcast(&ring->filled_one);
    pthread_mutex_unlock(&ring->lock);
}

#endif
