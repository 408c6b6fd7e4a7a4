/*
 * colibri_run IMAGE BATCH < input.f32 > output.f32
 *
 * Runs one forward of BATCH tokens: stdin holds the raw little-endian f32
 * input [BATCH, input_size], stdout receives the output [BATCH, output_size].
 * On any error: a message (the engine's status text) on stderr, exit 1.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "colibri.h"
#include "colibri_common.h"

/* Everything main() allocates, freed on every path (LeakSanitizer). */
typedef struct run {
    void *image, *arena;
    float *in, *out;
} run;

static int finish(run *r, int code)
{
    free(r->image);
    free(r->arena);
    free(r->in);
    free(r->out);
    return code;
}

static int fail(run *r, const char *what, colibri_status st)
{
    fprintf(stderr, "colibri_run: %s: %s (%d)\n", what, colibri_strerror(st), (int)st);
    return finish(r, 1);
}

int main(int argc, char **argv)
{
    run r = {0};
    if (argc != 3) {
        fprintf(stderr, "usage: colibri_run IMAGE BATCH < input.f32 > output.f32\n");
        return 1;
    }
    char *end;
    const unsigned long batch = strtoul(argv[2], &end, 10);
    if (*argv[2] == '\0' || *end != '\0') {
        fprintf(stderr, "colibri_run: bad batch '%s'\n", argv[2]);
        return 1;
    }
    size_t len;
    if (!(r.image = read_file(argv[1], &len))) {
        fprintf(stderr, "colibri_run: cannot read %s\n", argv[1]);
        return 1;
    }

    colibri_model_info info;
    colibri_ctx *ctx;
    colibri_status st = colibri_get_info(r.image, len, &info);
    if (st != COLIBRI_OK)
        return fail(&r, argv[1], st);
    if (!(r.arena = malloc(info.arena_size))) {
        fprintf(stderr, "colibri_run: cannot allocate a %zu-byte arena\n", info.arena_size);
        return finish(&r, 1);
    }
    if ((st = colibri_init(&ctx, r.arena, info.arena_size, r.image, len)) != COLIBRI_OK)
        return fail(&r, "colibri_init", st);

    /* The engine itself reports a bad batch or an input of the wrong length:
     * stdin is read up to one float more than expected and the count read
     * is passed on as input_count. */
    const size_t tokens = batch <= info.max_batch ? batch : 0;
    const size_t n_in = tokens * info.input_size, n_out = tokens * info.output_size;
    r.in = malloc((n_in + 1) * sizeof *r.in);
    r.out = malloc((n_out + 1) * sizeof *r.out);
    if (!r.in || !r.out) {
        fprintf(stderr, "colibri_run: out of memory\n");
        return finish(&r, 1);
    }
    const size_t got = fread(r.in, sizeof *r.in, n_in + 1, stdin);
    if ((st = colibri_forward(ctx, batch, r.in, got, r.out, n_out)) != COLIBRI_OK)
        return fail(&r, "colibri_forward", st);
    colibri_free(ctx);
    if (fwrite(r.out, sizeof *r.out, n_out, stdout) != n_out || fflush(stdout) != 0) {
        fprintf(stderr, "colibri_run: cannot write the output\n");
        return finish(&r, 1);
    }
    return finish(&r, 0);
}
