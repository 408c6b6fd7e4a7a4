/*
 * colibri_hook_test IMAGE...
 *
 * The accelerator hook (colibri_exec.expert, include/colibri.h) with a
 * "device" that is a second thread: the hook posts each expert call to it and
 * waits, the device thread runs the expert with its own code (double
 * accumulation straight from the image's F32/F16 payloads, which it finds in
 * the image's tensor table; I8 experts it declines, as a device without
 * int8 support would) and accumulates into the engine's rows. For each image,
 * against colibri_forward():
 *   - single-threaded and over a colibri_pool of 2 workers (the hook then
 *     runs on both workers, serialised by the device): the output within
 *     TOLERANCE · (1 + max |output|);
 *   - the device declining every expert (an int8 image): the same bits;
 *   - the device failing on the first expert it ran: that status, and the
 *     next colibri_forward() gives the same bits as before.
 * Prints the worst error seen and "hook ok", exits 0; or reports, exits 1.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_check.h"
#include "colibri_common.h"
#include "colibri_format.h"
#include "colibri_pool.h"

/* The device sums in double, the engine in f32 with its own order and
 * expf approximations: a few f32 roundings per output apart (measured
 * worst: 5.7e-8 over tests/engine/test_engine_hook.py's images). */
#define TOLERANCE 1e-6
#define DEVICE_HIDDEN 4096 /* the device's scratch; larger experts are declined */

typedef struct device {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const colibri_expert_call *job; /* posted, NULL when the device is free */
    int done, quit;
    colibri_status result;
    const uint8_t *image;
    uint32_t fail_expert;           /* this expert record fails; UINT32_MAX: none */
    uint32_t first_ran;             /* the first expert record the device ran */
    size_t ran, declined;
    double hidden[DEVICE_HIDDEN];   /* the device's own memory, not the engine's */
} device;

static uint32_t u32_at(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The dtype of the tensor whose payload starts at p (docs/model-format.md
 * "Tensor record"), 0 if none does. */
static unsigned payload_dtype(const uint8_t *image, const void *p)
{
    const uint32_t count = u32_at(image + 32), table = u32_at(image + 36);
    const size_t off = (size_t)((const uint8_t *)p - image);
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *rec = image + table + (size_t)i * COLIBRI_TENSOR_SIZE;
        if (u32_at(rec) == off)
            return rec[16];
    }
    return 0;
}

static double half_to_double(uint16_t h)
{
    const int e = (h >> 10) & 31, m = h & 1023;
    const double s = (h & 0x8000u) ? -1.0 : 1.0;
    if (e == 0)
        return s * ldexp(m, -24);
    if (e == 31)
        return m ? NAN : s * INFINITY;
    return s * ldexp(1024 + m, e - 25);
}

static double weight_at(const void *w, unsigned dtype, size_t i)
{
    if (dtype == COLIBRI_DTYPE_F16) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)w + 2 * i, sizeof h);
        return half_to_double(h);
    }
    return ((const float *)w)[i];
}

static double activate(unsigned act, double v)
{
    switch (act) {
    case COLIBRI_ACT_RELU: return v > 0 ? v : 0;
    case COLIBRI_ACT_GELU_ERF: return 0.5 * v * (1 + erf(v / sqrt(2.0)));
    case COLIBRI_ACT_GELU_TANH: return 0.5 * v * (1 + tanh(0.7978845608028654 /* sqrt(2/pi) */ * (v + 0.044715 * v * v * v)));
    case COLIBRI_ACT_SILU: return v / (1 + exp(-v));
    case COLIBRI_ACT_TANH: return tanh(v);
    case COLIBRI_ACT_SIGMOID: return 1 / (1 + exp(-v));
    default: return NAN;
    }
}

/* y[y_row(i)] += gate[i] · expert(x[x_row(i)]) in double, or DECLINED. */
static colibri_status device_run(device *dev, const colibri_expert_call *c)
{
    const unsigned t1 = payload_dtype(dev->image, c->w1), t2 = payload_dtype(dev->image, c->w2);
    const unsigned t3 = c->w3 ? payload_dtype(dev->image, c->w3) : t1;
    const int f32_or_f16 = (t1 == COLIBRI_DTYPE_F32 || t1 == COLIBRI_DTYPE_F16) && t2 == t1 && t3 == t1;
    if (!f32_or_f16 || c->hidden > DEVICE_HIDDEN) {
        dev->declined++;
        return COLIBRI_EXPERT_DECLINED;
    }
    if (dev->ran++ == 0)
        dev->first_ran = c->expert;
    if (c->expert == dev->fail_expert)
        return COLIBRI_E_UNSUPPORTED;
    for (size_t i = 0; i < c->n; i++) {
        const float *x = c->x + (size_t)(c->x_rows ? c->x_rows[i] : i) * c->d;
        float *y = c->y + (size_t)(c->y_rows ? c->y_rows[i] : i) * c->d;
        for (size_t j = 0; j < c->hidden; j++) {
            double a = c->b1 ? c->b1[j] : 0.0, g = c->b3 ? c->b3[j] : 0.0;
            for (size_t k = 0; k < c->d; k++) {
                a += weight_at(c->w1, t1, j * c->d + k) * x[k];
                if (c->w3)
                    g += weight_at(c->w3, t3, j * c->d + k) * x[k];
            }
            dev->hidden[j] = activate(c->activation, a) * (c->w3 ? g : 1.0);
        }
        const double gate = c->gate ? c->gate[i] : 1.0;
        for (size_t j = 0; j < c->d; j++) {
            double o = c->b2 ? c->b2[j] : 0.0;
            for (size_t k = 0; k < c->hidden; k++)
                o += weight_at(c->w2, t2, j * c->hidden + k) * dev->hidden[k];
            y[j] += (float)(gate * o);
        }
    }
    return COLIBRI_OK;
}

static void *device_main(void *arg)
{
    device *dev = arg;
    pthread_mutex_lock(&dev->mu);
    for (;;) {
        while (!dev->quit && (!dev->job || dev->done))
            pthread_cond_wait(&dev->cv, &dev->mu);
        if (dev->quit)
            break;
        dev->result = device_run(dev, dev->job);
        dev->done = 1;
        pthread_cond_broadcast(&dev->cv);
    }
    pthread_mutex_unlock(&dev->mu);
    return NULL;
}

/* The hook: post the call to the device thread and wait for its status.
 * With a pool it is called from several workers: they queue for the device. */
static colibri_status hook(void *user, const colibri_expert_call *c)
{
    device *dev = user;
    pthread_mutex_lock(&dev->mu);
    while (dev->job)
        pthread_cond_wait(&dev->cv, &dev->mu);
    dev->job = c;
    dev->done = 0;
    pthread_cond_broadcast(&dev->cv);
    while (!dev->done)
        pthread_cond_wait(&dev->cv, &dev->mu);
    const colibri_status st = dev->result;
    dev->job = NULL;
    pthread_cond_broadcast(&dev->cv);
    pthread_mutex_unlock(&dev->mu);
    return st;
}

static double worst;

/* max |a - b| / (1 + max |b|) */
static double error_of(const float *a, const float *b, size_t n)
{
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return d / (1 + m);
}

static void test_image(const char *path, device *dev, colibri_pool *pool)
{
    size_t len, arena_size;
    void *image = read_file(path, &len);
    colibri_model_info info;
    CHECK(image && colibri_get_info(image, len, &info) == COLIBRI_OK, "%s: unreadable", path);
    if (!image)
        return;
    CHECK(colibri_model_size_ex(image, len, 2, &arena_size) == COLIBRI_OK, "%s: size", path);
    const size_t B = info.max_batch, ni = B * info.input_size, no = B * info.output_size;
    float *in = malloc(ni * sizeof *in), *ref = malloc(no * sizeof *ref), *out = malloc(no * sizeof *out);
    void *arena = aligned_alloc(8, (arena_size + 7) & ~(size_t)7);
    for (size_t i = 0; i < ni; i++)
        in[i] = sinf(0.37f * (float)i) * 2.0f;
    colibri_ctx *ctx;
    CHECK(colibri_init(&ctx, arena, arena_size, image, len) == COLIBRI_OK, "%s: init", path);
    CHECK(colibri_forward(ctx, B, in, ni, ref, no) == COLIBRI_OK, "%s: forward", path);

    dev->image = image;
    for (int pooled = 0; pooled < 2; pooled++) {
        colibri_exec e = COLIBRI_EXEC_INIT;
        e.expert = hook;
        e.expert_user = dev;
        if (pooled)
            colibri_pool_attach(pool, &e);
        dev->fail_expert = UINT32_MAX;
        dev->ran = dev->declined = 0;
        memset(out, 0xA5, no * sizeof *out);
        colibri_status st = colibri_forward_ex(ctx, &e, B, in, ni, out, no);
        const double err = error_of(out, ref, no);
        worst = fmax(worst, err);
        CHECK(st == COLIBRI_OK && err <= TOLERANCE, "%s workers %u: %s, error %.3g", path, e.workers,
              colibri_strerror(st), err);
        CHECK(dev->ran + dev->declined > 0 || info.num_moe_layers == 0, "%s: no expert offered", path);
        CHECK(dev->ran > 0 || memcmp(out, ref, no * sizeof *out) == 0, "%s: every expert declined, yet not "
              "colibri_forward's bits", path);
        printf("%s workers %u: device ran %zu experts, declined %zu, error %.3g\n", path, e.workers, dev->ran,
               dev->declined, err);
        if (dev->ran) {
            dev->fail_expert = dev->first_ran;
            st = colibri_forward_ex(ctx, &e, B, in, ni, out, no);
            CHECK(st == COLIBRI_E_UNSUPPORTED, "%s: failing expert gave %s", path, colibri_strerror(st));
            CHECK(colibri_forward(ctx, B, in, ni, out, no) == COLIBRI_OK && memcmp(out, ref, no * sizeof *out) == 0,
                  "%s: forward after a failed hook differs", path);
        }
    }
    colibri_free(ctx);
    free(in);
    free(ref);
    free(out);
    free(arena);
    free(image);
}

int main(int argc, char **argv)
{
    static device dev;
    colibri_pool *pool;
    pthread_mutex_init(&dev.mu, NULL);
    pthread_cond_init(&dev.cv, NULL);
    if (pthread_create(&dev.thread, NULL, device_main, &dev) != 0 || colibri_pool_create(&pool, 2) != COLIBRI_OK) {
        fprintf(stderr, "no device thread or pool\n");
        return 1;
    }
    for (int i = 1; i < argc; i++)
        test_image(argv[i], &dev, pool);
    pthread_mutex_lock(&dev.mu);
    dev.quit = 1;
    pthread_cond_broadcast(&dev.cv);
    pthread_mutex_unlock(&dev.mu);
    pthread_join(dev.thread, NULL);
    colibri_pool_destroy(pool);
    if (failures) {
        fprintf(stderr, "%d failures\n", failures);
        return 1;
    }
    printf("hook ok: %d images, worst error %.3g (tolerance %g)\n", argc - 1, worst, TOLERANCE);
    return 0;
}
