#include "cobs.h"

size_t cobs_decode(const uint8_t *in, size_t n, uint8_t *out, size_t cap)
{
    size_t i = 0, o = 0;
    while (i < n) {
        const uint8_t code = in[i++];
        if (code == 0u) {
            return COBS_ERROR;
        }
        const size_t run = (size_t)code - 1u;
        if (run > n - i || run > cap - o) {
            return COBS_ERROR;
        }
        /* Forward copy: o < i, so decoding in place is safe. */
        for (size_t k = 0; k < run; k++) {
            const uint8_t b = in[i++];
            if (b == 0u) {
                return COBS_ERROR;
            }
            out[o++] = b;
        }
        /* A block shorter than 254 bytes stands for its bytes and a zero,
         * except at the very end of the frame. */
        if (code != 0xFFu && i < n) {
            if (o == cap) {
                return COBS_ERROR;
            }
            out[o++] = 0u;
        }
    }
    return o;
}

void cobs_encode_stream(const uint8_t *data, size_t n, void (*emit)(const uint8_t *piece, size_t len))
{
    size_t i = 0;
    for (;;) {
        size_t run = 0;
        while (run < 254u && i + run < n && data[i + run] != 0u) {
            run++;
        }
        const uint8_t code = (uint8_t)(run + 1u);
        emit(&code, 1);
        if (run > 0u) {
            emit(data + i, run);
        }
        i += run;
        if (i >= n) {
            return;
        }
        if (run < 254u) {
            i++; /* the zero this block stands for */
        }
    }
}
