/*
 * colibri_work: validates a stream of images through the engine's internal
 * entry point colibri_check_work() and prints, per image, the status and the
 * validator's work (table records read + payload entries scanned), so a test
 * can bound validation by a count instead of a time (tests/engine/test_engine_validation.py).
 *
 * stdin: records of { u32 little-endian length L, L bytes of image };
 * L = 0xFFFFFFFF (or end of input) ends the stream.
 * stdout, one line per record: validate=S work=W
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "colibri_internal.h"

int main(void)
{
    for (;;) {
        uint8_t hdr[4];
        const size_t got = fread(hdr, 1, sizeof hdr, stdin);
        if (got == 0 && feof(stdin))
            return 0;
        if (got != sizeof hdr) {
            fprintf(stderr, "colibri_work: truncated record length\n");
            return 2;
        }
        const uint32_t len = colibri_rd_u32(hdr);
        if (len == 0xFFFFFFFFu)
            return 0;
        uint8_t *image = malloc(len ? len : 1);
        if (!image || fread(image, 1, len, stdin) != len) {
            fprintf(stderr, "colibri_work: cannot read a %u-byte image\n", (unsigned)len);
            return 2;
        }
        colibri_model m;
        uint64_t work = 0;
        const colibri_status st = colibri_check_work(image, len, &m, &work);
        printf("validate=%d work=%llu\n", (int)st, (unsigned long long)work);
        fflush(stdout);
        free(image);
    }
}
