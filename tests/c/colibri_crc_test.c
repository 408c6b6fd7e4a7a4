/* colibri_crc32 over byte ranges of a file: `colibri_crc_test FILE OFF:LEN ...` prints one CRC (hex)
 * a line. tests/image/test_image_crc.py builds it with -DCOLIBRI_CRC_SLICING=0 and =1 and holds both
 * to zlib.crc32 on the same ranges (unaligned starts, tails of every length). */
#include <stdio.h>
#include <stdlib.h>

#include "colibri_internal.h"

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f)
        return 2;
    static uint8_t buf[1 << 20];
    const size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    for (int i = 2; i < argc; i++) {
        char *end;
        const unsigned long off = strtoul(argv[i], &end, 10), len = strtoul(end + 1, NULL, 10);
        if (off > n || len > n - off)
            return 3;
        printf("%08x\n", (unsigned)colibri_crc32(buf + off, len));
    }
    return 0;
}
