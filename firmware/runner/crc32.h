/* CRC-32 (IEEE 802.3, reflected, as zlib.crc32). */
#ifndef RUNNER_CRC32_H
#define RUNNER_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* crc32_update(0, p, n) is zlib.crc32(p); feed pieces in order to chain. */
uint32_t crc32_update(uint32_t crc, const uint8_t *data, size_t n);

#endif /* RUNNER_CRC32_H */
