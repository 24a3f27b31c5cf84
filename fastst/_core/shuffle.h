/* Shuffles drawn from a NumPy bit generator (bitgen_t, numpy/random/bitgen.h), without
   the GIL: the thread Loader's orders of rows. Each draw is unbiased; a permutation of
   many rows is dealt into buckets that fit the CPU's cache first, so that no step
   waits on a cache miss a row (see fastst_deal_rows). */
#ifndef FASTST_SHUFFLE_H
#define FASTST_SHUFFLE_H

#include <stdint.h>
#include <stdlib.h>
#include "numpy/random/bitgen.h"

/* A draw from [0, range), 1 <= range <= 2^32: Lemire's multiply and reject, which
   divides only where the draw falls in the short end (2^32 mod range values). */
static inline uint64_t fastst_draw_below(bitgen_t *bits, uint64_t range) {
    uint64_t product = (uint64_t)bits->next_uint32(bits->state) * range;
    if ((uint32_t)product < range) {
        uint32_t short_end = (uint32_t)((UINT64_C(1) << 32) % range);
        while ((uint32_t)product < short_end)
            product = (uint64_t)bits->next_uint32(bits->state) * range;
    }
    return product >> 32;
}

/* A draw from [0, range), for any range >= 1: 64-bit draws past the last whole
   multiple of range drawn again. */
static uint64_t fastst_draw_wide(bitgen_t *bits, uint64_t range) {
    uint64_t short_end = (UINT64_MAX % range + 1) % range;     /* 2^64 mod range */
    uint64_t draw;
    do draw = bits->next_uint64(bits->state);
    while (short_end != 0 && draw > UINT64_MAX - short_end);
    return draw % range;
}

static inline uint64_t fastst_draw(bitgen_t *bits, uint64_t range) {
    return range <= (UINT64_C(1) << 32) ? fastst_draw_below(bits, range)
                                        : fastst_draw_wide(bits, range);
}

/* Shuffle `count` rows in place (Fisher-Yates, from the last). */
static void fastst_shuffle_rows(bitgen_t *bits, int64_t *rows, uint64_t count) {
    uint64_t place, other;
    int64_t row;
    for (place = count; place > 1; place--) {
        other = fastst_draw(bits, place);
        row = rows[place - 1];
        rows[place - 1] = rows[other];
        rows[other] = row;
    }
}

/* Rows 0..total-1 dealt into `rows`: each to one of `buckets` (at most 65,536) buckets
   at random, the buckets laid out one after another, each bucket's rows in order;
   `ends` (`buckets` of them) gets where each bucket ends, and `labels` (`total` of
   them, where there is more than one bucket) is scratch. Each bucket shuffled in turn
   then (fastst_shuffle_rows, from the same generator) makes a uniformly drawn
   permutation (Rao 1961, Sandelius 1962: for any order, the deal and the shuffles
   that make it are one of each for every set of bucket sizes, and their chances add
   up to 1/total!). Fisher-Yates over all the rows at once swaps places anywhere in
   `rows`, a cache miss each over millions; a bucket of a few ten thousand rows is
   shuffled in the cache. */
static void fastst_deal_rows(bitgen_t *bits, int64_t *rows, uint64_t total,
                             uint16_t *labels, uint64_t buckets, int64_t *ends) {
    uint64_t row, bucket;
    int64_t start = 0, size;
    if (buckets == 1) {
        for (row = 0; row < total; row++) rows[row] = (int64_t)row;
        ends[0] = (int64_t)total;
        return;
    }
    for (bucket = 0; bucket < buckets; bucket++) ends[bucket] = 0;
    for (row = 0; row < total; row++) {
        labels[row] = (uint16_t)fastst_draw(bits, buckets);
        ends[labels[row]]++;
    }
    for (bucket = 0; bucket < buckets; bucket++) {      /* each bucket's first place */
        size = ends[bucket];
        ends[bucket] = start;
        start += size;
    }
    for (row = 0; row < total; row++) rows[ends[labels[row]]++] = (int64_t)row;
}

#endif
