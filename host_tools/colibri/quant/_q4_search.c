/*
 * colibri.quant._q4_search: the q4 clip search of colibri/quant/quantize.py in C.
 *
 * For each group of weights it gives the scale `q4_scales_spec` gives, bit for bit: the f32 value of
 * the f16 scale f16(alpha * amax / 7) of the first alpha (of the grid passed in) with the least
 * squared error over the group's marked weights. The bits are the spec's because every step is the
 * float32 operation numpy does, in numpy's order:
 *
 * - per weight and alpha: w / safe, rint (round half to even), clip to -8..7, times the scale,
 *   subtracted from w, squared; unmarked weights count as +0 (the spec's np.where(m, err, 0));
 * - per group: the squares summed in the order numpy's float32 add.reduce sums a contiguous run
 *   (eight running sums over blocks of at most 128, combined as ((0+1)+(2+3))+((4+5)+(6+7)), a
 *   longer run split in halves: `_pairwise_sum` in quantize.py);
 * - a later alpha only replaces the best when its error is strictly less (ties keep the earlier).
 *
 * The vector lanes are groups, never weights of one group: a block of LANES groups is transposed to
 * [weight][group], so each lane runs one group's scalar sequence and the order within a group is
 * kept whatever the vector width. The module is compiled with -ffp-contract=off (a fused multiply-add
 * would round once where numpy rounds twice) and without -ffast-math (no reassociation, no
 * reciprocal for the division); GCC and clang vectorise only what keeps each lane's operations, so the
 * SSE2, AVX2 and AVX-512 forms (picked at run time on x86-64) and AArch64's NEON give the same bits.
 *
 * `values` then gives the int4 values and the residuals under the scales found, as quantize_q4's numpy
 * steps do. The GIL is released during both: quantize.py's threads run the search on disjoint groups
 * at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* setup.py passes the hash of the sources it builds from (colibri/runtime/sources.py), as for the
 * engine binding: a checkout refuses a build older than its sources. */
#ifndef COLIBRI_SOURCE_HASH
#define COLIBRI_SOURCE_HASH "unknown"
#endif

/* x87's excess precision would round the products and quotients differently from numpy. */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the q4 search needs float arithmetic evaluated in float (FLT_EVAL_METHOD 0)"
#endif

enum { SEARCH_OK = 0, SEARCH_TOO_LARGE = 1, SEARCH_NONFINITE = 2 };

#define LANES 32        /* groups a block; a lane each */
#define MAX_GROUP 256   /* quantize_q4's largest group */
#define PAIRWISE_BLOCK 128 /* numpy's PW_BLOCKSIZE */
#define F16_MIN_NORMAL 6.103515625e-05f /* 2^-14 */
#define F16_MAX 65504.0

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* `_f16_scale(s).astype(float32)` for 0 <= s <= 65504: a nonzero s below f16's normal range becomes
 * 2^-14, then the nearest f16 (ties to even: 13 mantissa bits dropped with rounding, a carry moving
 * into the exponent as it should). Every result is an f16 normal or +0, exactly an f32. */
static float f16_scale(float s) {
    if (s > 0 && s < F16_MIN_NORMAL) {
        s = F16_MIN_NORMAL;
    }
    uint32_t u = float_to_bits(s);
    u += 0x0FFFu + ((u >> 13) & 1u);
    return bits_to_float(u & ~0x1FFFu);
}

/* rint(w / safe) without the division where that is provably the same integer, which makes the search
 * about twice as fast (a vector division takes 5 to 10 cycles; the rest of a weight's steps, a few).
 *
 * numpy's quotient is z = RN(w / safe); the screen computes y = RN(w * RN(1 / safe)). Each rounding
 * is off by at most u = 2^-24 relative (or 2^-150 absolute below the normals), so
 * |y - z| <= |w / safe| * (3u + u^2) + 2^-149 < 2^-18 wherever |y| < 16. Then when y is further than
 * 2^-18 from every half-integer (|y - rint(y)| < 1/2 - 2^-18; y - rint(y) is exact there), z lies
 * between the same two half-integers and is none of them: rint(z) = rint(y). Where |y| >= 16, z is
 * beyond 8.5 with y's sign, and both clip to the same end of -8..7. Otherwise (about 8 weights in a
 * million) the block's sums for that scale are computed again with the division. */
#define NEAR_HALF (0.5f - 0x1p-18f)

/* One weight's squared error under scale s (safe: s, or 1 where s is 0), the spec's steps: q is
 * rint(w / safe), screened (inv = 1 / safe; *near set when the screen cannot tell) or by the division. */
static inline __attribute__((always_inline)) float squared_error(float w, float s, float safe, const float *inv,
                                                                 int l, int32_t *near) {
    float q;
    if (inv) {
        float y = w * inv[l];
        q = rintf(y);
        *near |= fabsf(y - q) >= NEAR_HALF;
    } else {
        q = rintf(w / safe);
    }
    /* Clipped as an integer: GCC makes the float form compare-and-blend chains, the integer one
     * vpmaxsd/vpminsd. q is an integer of magnitude below 15 (|w| <= amax, safe >= alpha * amax / 7
     * but for the f16 rounding, or 1 where amax / 7 underflows), exact in an int32; only the sign of a
     * zero q is lost, and w - (+0 or -0) * s squares to the same value either way. */
    int32_t qi = (int32_t)q;
    qi = qi < -8 ? -8 : qi;
    qi = qi > 7 ? 7 : qi;
    float d = w - (float)qi * s;
    return d * d;
}

/* Per lane, Σ of the squared errors of rows [0, rows) of kT ([rows][LANES]) in numpy's order for a run
 * of at most PAIRWISE_BLOCK (rows a multiple of 8): eight running sums, sum j taking rows j, j + 8, ...
 * in turn (computed one after the other: each stays in registers), then combined as numpy does. With
 * inv the screened quotients, and a nonzero return when one came near a half-integer (the sums are
 * then to be computed again); without, the division. */
static inline __attribute__((always_inline)) int pairwise_error(const float *kT, size_t rows, const float *s,
                                                                const float *safe, const float *inv, float *sum) {
    float r[8][LANES];
    int32_t near[LANES] = {0};
    for (int j = 0; j < 8; j++) {
        float acc[LANES];
        for (int l = 0; l < LANES; l++) {
            acc[l] = squared_error(kT[j * LANES + l], s[l], safe[l], inv, l, &near[l]);
        }
        for (size_t i = (size_t)j + 8; i < rows; i += 8) {
            for (int l = 0; l < LANES; l++) {
                acc[l] += squared_error(kT[i * LANES + l], s[l], safe[l], inv, l, &near[l]);
            }
        }
        memcpy(r[j], acc, sizeof acc);
    }
    int32_t any = 0;
    for (int l = 0; l < LANES; l++) {
        sum[l] = ((r[0][l] + r[1][l]) + (r[2][l] + r[3][l])) + ((r[4][l] + r[5][l]) + (r[6][l] + r[7][l]));
        any |= near[l];
    }
    return any != 0;
}

/* numpy splits a run longer than PAIRWISE_BLOCK in halves (a multiple of 8 each; for a power of two
 * from 8 to 256 one split at most) and adds their sums. */
static inline __attribute__((always_inline)) int group_error_with(const float *kT, size_t group, const float *s,
                                                                  const float *safe, const float *inv, float *sum) {
    if (group <= PAIRWISE_BLOCK) {
        return pairwise_error(kT, group, s, safe, inv, sum);
    }
    float low[LANES], high[LANES];
    int near = pairwise_error(kT, group / 2, s, safe, inv, low);
    near |= pairwise_error(kT + group / 2 * LANES, group / 2, s, safe, inv, high);
    for (int l = 0; l < LANES; l++) {
        sum[l] = low[l] + high[l];
    }
    return near;
}

/* Every lane's squared error under its scale: screened, and with the division where the screen asks. */
static inline __attribute__((always_inline)) void group_error(const float *kT, size_t group, const float *s,
                                                              const float *safe, float *sum) {
    float inv[LANES];
    for (int l = 0; l < LANES; l++) {
        inv[l] = 1.0f / safe[l];
    }
    if (group_error_with(kT, group, s, safe, inv, sum)) {
        group_error_with(kT, group, s, safe, NULL, sum);
    }
}

/* The scales of n groups of `group` weights (g and m row-major [n][group]) into out[n]; with `errors`
 * ([n_alphas][n]) also every alpha's squared error, for the tests. */
static inline __attribute__((always_inline)) int search_body(const float *g, const uint8_t *m, size_t n,
                                                             size_t group, const float *alphas, size_t n_alphas,
                                                             float *out, float *errors) {
    float kT[MAX_GROUP * LANES];
    uint32_t krow[LANES * MAX_GROUP];
    float top[LANES], s[LANES], safe[LANES], err[LANES], best[LANES], best_err[LANES];
    for (size_t b0 = 0; b0 < n; b0 += LANES) {
        size_t lanes = n - b0 < LANES ? n - b0 : LANES;
        const float *gb = g + b0 * group;
        const uint8_t *mb = m + b0 * group;
        /* The marked weights (+0 elsewhere), each group's largest |weight| among them and whether any
         * weight, marked or not, is NaN or inf: on the bits, where |w| orders as an unsigned integer
         * (and vectorises, a float max reduction would not). */
        uint32_t widest = 0, too_large = 0;
        for (size_t l = 0; l < lanes; l++) {
            uint32_t t = 0;
            for (size_t i = 0; i < group; i++) {
                uint32_t w = float_to_bits(gb[l * group + i]);
                uint32_t mag = w & 0x7FFFFFFFu;
                widest = mag > widest ? mag : widest;
                uint32_t k = mb[l * group + i] ? w : 0u;
                krow[l * group + i] = k;
                mag = k & 0x7FFFFFFFu;
                t = mag > t ? mag : t;
            }
            top[l] = bits_to_float(t);
            /* numpy's test, (double)top / 7 > F16_MAX: the same, as no float top has a quotient that
             * rounds onto the bound */
            too_large |= top[l] > F16_MAX * 7;
        }
        if (widest >= 0x7F800000u) {
            return SEARCH_NONFINITE; /* marked or not: the numpy search takes those */
        }
        if (too_large) {
            return SEARCH_TOO_LARGE; /* before any scale: f16_scale holds for scales within f16 only */
        }
        for (size_t l = 0; l < lanes; l++) {
            for (size_t i = 0; i < group; i++) {
                kT[i * LANES + l] = bits_to_float(krow[l * group + i]);
            }
        }
        for (size_t l = lanes; l < LANES; l++) { /* a partial block's spare lanes: zero groups */
            for (size_t i = 0; i < group; i++) {
                kT[i * LANES + l] = 0.0f;
            }
            top[l] = 0.0f;
        }
        for (size_t a = 0; a < n_alphas; a++) {
            for (int l = 0; l < LANES; l++) {
                s[l] = f16_scale((top[l] * alphas[a]) / 7.0f);
                safe[l] = s[l] > 0 ? s[l] : 1.0f;
            }
            group_error(kT, group, s, safe, err);
            for (int l = 0; l < LANES; l++) {
                if (a == 0 || err[l] < best_err[l]) {
                    best_err[l] = err[l];
                    best[l] = s[l];
                }
            }
            if (errors) {
                memcpy(errors + a * n + b0, err, lanes * sizeof *errors);
            }
        }
        memcpy(out + b0, best, lanes * sizeof *out);
    }
    return SEARCH_OK;
}

/* quantize_q4's int4 values and residuals of n groups (g row-major [n][group]) under their scales:
 * q = clip(rint(w / safe), -8, 7), 0 where the scale is 0, and w - q·scale, numpy's float32 steps. */
static inline __attribute__((always_inline)) void values_body(const float *restrict g, const float *restrict scale,
                                                              size_t n, size_t group, int8_t *restrict q,
                                                              float *restrict residual) {
    for (size_t b = 0; b < n; b++) {
        float s = scale[b];
        float safe = s > 0 ? s : 1.0f;
        const float *w = g + b * group;
        int8_t *qb = q + b * group;
        float *rb = residual + b * group;
        for (size_t i = 0; i < group; i++) {
            float v = rintf(w[i] / safe);
            v = v < -8.0f ? -8.0f : v;
            v = v > 7.0f ? 7.0f : v;
            v = s > 0 ? v : 0.0f;
            qb[i] = (int8_t)v;
            rb[i] = w[i] - v * s;
        }
    }
}

typedef struct {
    const char *name;
    int (*search)(const float *, const uint8_t *, size_t, size_t, const float *, size_t, float *, float *);
    void (*values)(const float *, const float *, size_t, size_t, int8_t *, float *);
    int (*runs_here)(void);
} kernel;

/* One kernel's entry points, compiled with `attrs` (a target attribute, or none). */
#define KERNEL_FUNCTIONS(suffix, attrs)                                                                          \
    attrs static int search_##suffix(const float *g, const uint8_t *m, size_t n, size_t group,                 \
                                     const float *alphas, size_t n_alphas, float *out, float *errors) {        \
        return search_body(g, m, n, group, alphas, n_alphas, out, errors);                                     \
    }                                                                                                          \
    attrs static void values_##suffix(const float *g, const float *scale, size_t n, size_t group, int8_t *q,   \
                                      float *residual) {                                                       \
        values_body(g, scale, n, group, q, residual);                                                          \
    }

static int always(void) { return 1; }

KERNEL_FUNCTIONS(generic, )

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same code for wider vectors (rintf becomes roundps / vrndscaleps), picked at run time, so the
 * module runs on any x86-64. FMA is not enabled, and -ffp-contract=off would keep it from fusing. */
#define X86_KERNELS 1
KERNEL_FUNCTIONS(avx2, __attribute__((target("avx2"))))
KERNEL_FUNCTIONS(avx512f, __attribute__((target("avx512f,prefer-vector-width=512"))))

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

static int has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#endif

/* Widest last: the default is the last one this CPU runs. */
static const kernel kernels[] = {
    {"generic", search_generic, values_generic, always},
#ifdef X86_KERNELS
    {"avx2", search_avx2, values_avx2, has_avx2},
    {"avx512f", search_avx512f, values_avx512f, has_avx512f},
#endif
};
#define N_KERNELS (sizeof kernels / sizeof kernels[0])

static const kernel *chosen;

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    int ok = kind == 'f'   ? (strcmp(f, "f") == 0 && view->itemsize == 4)
             : kind == 'b' ? (strcmp(f, "b") == 0 && view->itemsize == 1)
                           : ((strcmp(f, "?") == 0 || strcmp(f, "B") == 0) && view->itemsize == 1);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s buffer, got format '%s'", what,
                     kind == 'f' ? "float32" : kind == 'b' ? "int8" : "bool", view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) {
        PyBuffer_Release(&views[i]);
    }
}

/* Buffers by kind ('f' float32, 'b' int8, '?' bool; upper case: writable); -1 with all released on error. */
static int get_buffers(PyObject **objs, Py_buffer *views, const char *kinds, const char *const *names) {
    for (int i = 0; kinds[i]; i++) {
        char k = kinds[i];
        int writable = k == 'F' || k == 'B';
        if (get_buffer(objs[i], &views[i], writable, writable ? (char)(k - 'A' + 'a') : k, names[i]) < 0) {
            release(views, i);
            return -1;
        }
    }
    return 0;
}

static PyObject *run_search(PyObject *args, int with_errors) {
    PyObject *objs[5] = {NULL};
    static const char *const names[] = {"g", "m", "alphas", "out", "errors"};
    if (!PyArg_ParseTuple(args, with_errors ? "OOOOO:errors" : "OOOO:scales", &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4])) {
        return NULL;
    }
    Py_buffer v[5];
    int count = with_errors ? 5 : 4;
    if (get_buffers(objs, v, with_errors ? "f?fFF" : "f?fF", names) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)(v[3].len / 4);
    size_t group = v[0].ndim == 2 ? (size_t)v[0].shape[1] : 0;
    size_t n_alphas = (size_t)(v[2].len / 4);
    if (group < 8 || group > MAX_GROUP || (group & (group - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "g must be [groups, group] with group a power of two from 8 to %d",
                     MAX_GROUP);
    } else if ((size_t)v[0].shape[0] != n || v[1].len != v[0].len / 4) {
        PyErr_Format(PyExc_ValueError, "g, m and out disagree: %zd groups, %zd marks for %zd weights, %zu outputs",
                     v[0].shape[0], v[1].len, v[0].len / 4, n);
    } else if (n_alphas == 0) {
        PyErr_SetString(PyExc_ValueError, "alphas is empty");
    } else if (with_errors && (size_t)v[4].len != 4 * n * n_alphas) {
        PyErr_Format(PyExc_ValueError, "errors must hold %zu x %zu float32", n_alphas, n);
    } else {
        const kernel *k = chosen;
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = k->search((const float *)v[0].buf, (const uint8_t *)v[1].buf, n, group, (const float *)v[2].buf,
                           n_alphas, (float *)v[3].buf, with_errors ? (float *)v[4].buf : NULL);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(status);
    }
    release(v, count);
    return result;
}

PyDoc_STRVAR(scales_doc,
             "scales(g, m, alphas, out) -> status\n\n"
             "The clip search's scale of each group of g (float32, C-contiguous [n, group]; group a power\n"
             "of two from 8 to 256) over the weights m (bool, same shape) marks, into out (float32 [n]),\n"
             "with the GIL released. alphas: the float32 clip ratios, the first tried first. Returns OK,\n"
             "TOO_LARGE (a group scale beyond f16: out is incomplete) or NONFINITE (g holds NaN or inf,\n"
             "which this search does not take: out is incomplete).");

static PyObject *scales(PyObject *self, PyObject *args) {
    (void)self;
    return run_search(args, 0);
}

PyDoc_STRVAR(errors_doc,
             "errors(g, m, alphas, out, errors) -> status\n\n"
             "scales(), also writing each alpha's squared error of each group into errors (float32\n"
             "[len(alphas), n]): the sums the search compares, for the tests.");

static PyObject *errors(PyObject *self, PyObject *args) {
    (void)self;
    return run_search(args, 1);
}

PyDoc_STRVAR(values_doc,
             "values(g, scale, q, residual)\n\n"
             "The int4 values (into q, int8 [n, group]) and the residuals w - q*scale (into residual, float32\n"
             "[n, group]) of the groups of g (float32 [n, group], finite) under scale (float32 [n]), with the\n"
             "GIL released.");

static PyObject *values(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[4];
    static const char *const names[] = {"g", "scale", "q", "residual"};
    if (!PyArg_ParseTuple(args, "OOOO:values", &objs[0], &objs[1], &objs[2], &objs[3])) {
        return NULL;
    }
    Py_buffer v[4];
    if (get_buffers(objs, v, "ffBF", names) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)(v[1].len / 4);
    size_t weights = (size_t)(v[0].len / 4);
    if (n == 0 || weights % n != 0 || (size_t)v[2].len != weights || (size_t)v[3].len != 4 * weights) {
        PyErr_Format(PyExc_ValueError, "g (%zu weights), scale (%zu), q (%zd) and residual (%zd) disagree", weights,
                     n, v[2].len, v[3].len / 4);
    } else {
        const kernel *k = chosen;
        Py_BEGIN_ALLOW_THREADS
        k->values((const float *)v[0].buf, (const float *)v[1].buf, n, weights / n, (int8_t *)v[2].buf,
                  (float *)v[3].buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    release(v, 4);
    return result;
}

PyDoc_STRVAR(kernels_doc, "kernels() -> tuple\n\nThe kernels this CPU runs, the default (the widest) last.");

static PyObject *kernels_here(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *names = PyTuple_New(0);
    for (size_t i = 0; names && i < N_KERNELS; i++) {
        if (kernels[i].runs_here()) {
            PyObject *name = PyUnicode_FromString(kernels[i].name);
            if (!name || _PyTuple_Resize(&names, PyTuple_GET_SIZE(names) + 1) < 0) {
                Py_XDECREF(name);
                Py_XDECREF(names);
                return NULL;
            }
            PyTuple_SET_ITEM(names, PyTuple_GET_SIZE(names) - 1, name);
        }
    }
    return names;
}

PyDoc_STRVAR(kernel_doc,
             "kernel(name=None) -> str\n\n"
             "The kernel in use; with a name (one of kernels()), switch to it first. The tests run each one.");

static PyObject *kernel_in_use(PyObject *self, PyObject *args) {
    (void)self;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z:kernel", &name)) {
        return NULL;
    }
    if (name) {
        const kernel *found = NULL;
        for (size_t i = 0; i < N_KERNELS; i++) {
            if (strcmp(kernels[i].name, name) == 0 && kernels[i].runs_here()) {
                found = &kernels[i];
            }
        }
        if (!found) {
            PyErr_Format(PyExc_ValueError, "no kernel '%s' on this CPU", name);
            return NULL;
        }
        chosen = found;
    }
    return PyUnicode_FromString(chosen->name);
}

static PyMethodDef methods[] = {
    {"scales", scales, METH_VARARGS, scales_doc},
    {"errors", errors, METH_VARARGS, errors_doc},
    {"values", values, METH_VARARGS, values_doc},
    {"kernels", kernels_here, METH_NOARGS, kernels_doc},
    {"kernel", kernel_in_use, METH_VARARGS, kernel_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "colibri.quant._q4_search", "The q4 clip search in C (colibri/quant/quantize.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__q4_search(void) {
    for (size_t i = 0; i < N_KERNELS; i++) {
        if (kernels[i].runs_here()) {
            chosen = &kernels[i];
        }
    }
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(mod, "SOURCE_HASH", COLIBRI_SOURCE_HASH) < 0 ||
        PyModule_AddIntConstant(mod, "OK", SEARCH_OK) < 0 ||
        PyModule_AddIntConstant(mod, "TOO_LARGE", SEARCH_TOO_LARGE) < 0 ||
        PyModule_AddIntConstant(mod, "NONFINITE", SEARCH_NONFINITE) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
