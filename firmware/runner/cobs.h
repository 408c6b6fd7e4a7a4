/*
 * Consistent Overhead Byte Stuffing: frames carry no 0x00, which is left to
 * delimit them on the wire. Same encoding as the Python `cobs` package.
 */
#ifndef RUNNER_COBS_H
#define RUNNER_COBS_H

#include <stddef.h>
#include <stdint.h>

/* Largest encoding of n bytes (without the 0x00 delimiter). */
#define COBS_MAX_ENCODED(n) ((n) + (n) / 254u + 1u)

#define COBS_ERROR ((size_t)-1)

/* Decodes n encoded bytes (no delimiter) into out (at most cap bytes).
 * out may equal in (decoding in place). Returns the decoded length, or
 * COBS_ERROR for a malformed encoding (a 0x00 byte, a block running past
 * the end) or an output longer than cap. */
size_t cobs_decode(const uint8_t *in, size_t n, uint8_t *out, size_t cap);

/* Encodes n bytes, handing the encoding to emit piece by piece (no
 * delimiter is emitted). */
void cobs_encode_stream(const uint8_t *data, size_t n, void (*emit)(const uint8_t *piece, size_t len));

#endif /* RUNNER_COBS_H */
