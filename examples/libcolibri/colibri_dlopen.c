/*
 * colibri_dlopen LIBRARY IMAGE INPUT.f32 OUTPUT.f32 [WORKERS]
 *
 * Runs a model through libcolibri.so loaded at run time: dlopen() the library,
 * resolve the API with dlsym(), read the image, size and align an arena, init,
 * forward the rows of INPUT.f32 (raw f32, batch = rows in the file), write the
 * outputs to OUTPUT.f32. With WORKERS > 1 the experts run in parallel on the
 * library's thread pool (colibri_pool_* and colibri_forward_ex). Only
 * colibri.h's types are used at compile time; every function comes from dlsym.
 *
 *   cc -I<include> colibri_dlopen.c -ldl -o colibri_dlopen
 *   ./colibri_dlopen ./libcolibri.so.0 model.clb in.f32 out.f32 2
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_pool.h"

/* The API, as pointers resolved from the library. */
typedef struct api {
    const char *(*version)(void);
    const char *(*strerror)(int);
    colibri_status (*get_info)(const void *, size_t, colibri_model_info *);
    colibri_status (*model_size_ex)(const void *, size_t, size_t, size_t *);
    colibri_status (*init)(colibri_ctx **, void *, size_t, const void *, size_t);
    colibri_status (*forward)(colibri_ctx *, size_t, const float *, size_t, float *, size_t);
    colibri_status (*forward_ex)(colibri_ctx *, const colibri_exec *, size_t, const float *, size_t, float *, size_t);
    const char *(*kernels_name)(const colibri_ctx *);
    colibri_status (*free_ctx)(colibri_ctx *);
    colibri_status (*pool_create)(colibri_pool **, size_t);
    void (*pool_attach)(colibri_pool *, colibri_exec *);
    void (*pool_destroy)(colibri_pool *);
} api;

/* dlsym into a function pointer (ISO C has no object-to-function cast). */
static int resolve(void *lib, const char *name, void *fn, size_t size)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "colibri_dlopen: %s: %s\n", name, dlerror());
        return 0;
    }
    memcpy(fn, &p, size);
    return 1;
}
#define RESOLVE(lib, name, field) resolve(lib, name, &(field), sizeof(field))

static void *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    void *buf = NULL;
    long n;
    if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
        *len = (size_t)n;
        fclose(f);
        return buf; /* malloc's alignment: enough for the image's 4 bytes */
    }
    if (f)
        fclose(f);
    free(buf);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: colibri_dlopen LIBRARY IMAGE INPUT.f32 OUTPUT.f32 [WORKERS]\n");
        return 2;
    }
    const size_t workers = argc > 5 ? (size_t)strtoul(argv[5], NULL, 10) : 1;
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "colibri_dlopen: %s\n", dlerror());
        return 1;
    }
    api a;
    if (!(RESOLVE(lib, "colibri_version", a.version) && RESOLVE(lib, "colibri_strerror", a.strerror) &&
          RESOLVE(lib, "colibri_get_info", a.get_info) && RESOLVE(lib, "colibri_model_size_ex", a.model_size_ex) &&
          RESOLVE(lib, "colibri_init", a.init) && RESOLVE(lib, "colibri_forward", a.forward) &&
          RESOLVE(lib, "colibri_forward_ex", a.forward_ex) && RESOLVE(lib, "colibri_kernels_name", a.kernels_name) &&
          RESOLVE(lib, "colibri_free", a.free_ctx) && RESOLVE(lib, "colibri_pool_create", a.pool_create) &&
          RESOLVE(lib, "colibri_pool_attach", a.pool_attach) && RESOLVE(lib, "colibri_pool_destroy", a.pool_destroy)))
        return 1;

    size_t len, in_len;
    void *image = slurp(argv[2], &len);
    float *in = slurp(argv[3], &in_len);
    colibri_model_info info;
    colibri_status st;
    if (!image || !in) {
        fprintf(stderr, "colibri_dlopen: cannot read %s\n", image ? argv[3] : argv[2]);
        return 1;
    }
    if ((st = a.get_info(image, len, &info)) != COLIBRI_OK) {
        fprintf(stderr, "colibri_dlopen: %s: %s\n", argv[2], a.strerror(st));
        return 1;
    }
    const size_t row = info.input_size * sizeof(float), batch = in_len / row;
    if (batch == 0 || in_len % row || batch > info.max_batch) {
        fprintf(stderr, "colibri_dlopen: %s holds %zu bytes, not 1..%u rows of %u floats\n", argv[3], in_len,
                info.max_batch, info.input_size);
        return 1;
    }

    size_t need;
    colibri_ctx *ctx;
    colibri_pool *pool = NULL;
    colibri_exec exec = COLIBRI_EXEC_INIT;
    if ((st = a.model_size_ex(image, len, workers, &need)) != COLIBRI_OK ||
        (workers > 1 && (st = a.pool_create(&pool, workers)) != COLIBRI_OK)) {
        fprintf(stderr, "colibri_dlopen: %s\n", a.strerror(st));
        return 1;
    }
    a.pool_attach(pool, &exec);
    void *arena = aligned_alloc(COLIBRI_ARENA_ALIGN, (need + COLIBRI_ARENA_ALIGN - 1) & ~(size_t)(COLIBRI_ARENA_ALIGN - 1));
    float *out = malloc(batch * info.output_size * sizeof *out);
    if (!arena || !out || (st = a.init(&ctx, arena, need, image, len)) != COLIBRI_OK ||
        (st = a.forward_ex(ctx, pool ? &exec : NULL, batch, in, batch * info.input_size, out,
                           batch * info.output_size)) != COLIBRI_OK) {
        fprintf(stderr, "colibri_dlopen: %s\n", arena && out ? a.strerror(st) : "out of memory");
        return 1;
    }
    FILE *f = fopen(argv[4], "wb");
    if (!f || fwrite(out, sizeof *out, batch * info.output_size, f) != batch * info.output_size || fclose(f)) {
        fprintf(stderr, "colibri_dlopen: cannot write %s\n", argv[4]);
        return 1;
    }
    printf("colibri %s (%s): batch %zu, %zu worker%s, kernels %s\n", a.version(), argv[1], batch, workers,
           workers == 1 ? "" : "s", a.kernels_name(ctx));
    a.free_ctx(ctx);
    a.pool_destroy(pool);
    free(out);
    free(arena);
    free(in);
    free(image);
    dlclose(lib);
    return 0;
}
