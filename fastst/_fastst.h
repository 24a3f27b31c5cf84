/* Small C kernels of fastst's compiled core (included by _core.pyx). */
#ifndef FASTST_H
#define FASTST_H

#include <stdint.h>
#include <string.h>
#include <Python.h>

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

#endif
