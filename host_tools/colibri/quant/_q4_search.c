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
 * The GIL is released during the search: quantize.py's threads run it on disjoint groups at once.
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

static float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t float_to_bits(float f) {
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

/* One weight's squared error under scale s (safe: s, or 1 where s is 0), the spec's steps. */
static inline __attribute__((always_inline)) float squared_error(float w, float s, float safe) {
    float q = rintf(w / safe);
    q = q < -8.0f ? -8.0f : q;
    q = q > 7.0f ? 7.0f : q;
    float d = w - q * s;
    return d * d;
}

/* Per lane, Σ of the squared errors of rows [0, rows) of kT ([rows][LANES]) in numpy's order for a run
 * of at most PAIRWISE_BLOCK; rows is a multiple of 8. */
static inline __attribute__((always_inline)) void pairwise_error(const float *kT, size_t rows, const float *s,
                                                                 const float *safe, float *sum) {
    float r[8][LANES];
    for (int j = 0; j < 8; j++) {
        for (int l = 0; l < LANES; l++) {
            r[j][l] = squared_error(kT[j * LANES + l], s[l], safe[l]);
        }
    }
    for (size_t i = 8; i < rows; i += 8) {
        for (int j = 0; j < 8; j++) {
            for (int l = 0; l < LANES; l++) {
                r[j][l] += squared_error(kT[(i + j) * LANES + l], s[l], safe[l]);
            }
        }
    }
    for (int l = 0; l < LANES; l++) {
        sum[l] = ((r[0][l] + r[1][l]) + (r[2][l] + r[3][l])) + ((r[4][l] + r[5][l]) + (r[6][l] + r[7][l]));
    }
}

/* numpy splits a run longer than PAIRWISE_BLOCK in halves (a multiple of 8 each; for a power of two
 * from 8 to 256 one split at most) and adds their sums. */
static inline __attribute__((always_inline)) void group_error(const float *kT, size_t group, const float *s,
                                                              const float *safe, float *sum) {
    if (group <= PAIRWISE_BLOCK) {
        pairwise_error(kT, group, s, safe, sum);
    } else {
        float low[LANES], high[LANES];
        pairwise_error(kT, group / 2, s, safe, low);
        pairwise_error(kT + group / 2 * LANES, group / 2, s, safe, high);
        for (int l = 0; l < LANES; l++) {
            sum[l] = low[l] + high[l];
        }
    }
}

/* The scales of n groups of `group` weights (g and m row-major [n][group]) into out[n]. */
static inline __attribute__((always_inline)) int search_body(const float *g, const uint8_t *m, size_t n,
                                                             size_t group, const float *alphas, size_t n_alphas,
                                                             float *out) {
    float kT[MAX_GROUP * LANES];
    float top[LANES], s[LANES], safe[LANES], err[LANES], best[LANES], best_err[LANES];
    int too_large = 0;
    for (size_t b0 = 0; b0 < n; b0 += LANES) {
        size_t lanes = n - b0 < LANES ? n - b0 : LANES;
        const float *gb = g + b0 * group;
        const uint8_t *mb = m + b0 * group;
        int nonfinite = 0;
        for (size_t l = 0; l < lanes; l++) {
            float t = 0.0f;
            for (size_t i = 0; i < group; i++) {
                float w = gb[l * group + i];
                nonfinite |= !(fabsf(w) <= FLT_MAX); /* masked or not: the numpy path decides then */
                float k = mb[l * group + i] ? w : 0.0f;
                kT[i * LANES + l] = k;
                t = fabsf(k) > t ? fabsf(k) : t;
            }
            top[l] = t;
        }
        if (nonfinite) {
            return SEARCH_NONFINITE;
        }
        for (size_t l = lanes; l < LANES; l++) { /* a partial block's spare lanes: zero groups */
            for (size_t i = 0; i < group; i++) {
                kT[i * LANES + l] = 0.0f;
            }
            top[l] = 0.0f;
        }
        for (size_t l = 0; l < lanes; l++) {
            too_large |= (double)top[l] / 7 > F16_MAX;
        }
        if (too_large) {
            return SEARCH_TOO_LARGE; /* before any scale: beyond f16, f16_scale would be wrong */
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
        }
        memcpy(out + b0, best, lanes * sizeof *out);
    }
    return SEARCH_OK;
}

typedef int (*search_fn)(const float *, const uint8_t *, size_t, size_t, const float *, size_t, float *);

static int search_generic(const float *g, const uint8_t *m, size_t n, size_t group, const float *alphas,
                          size_t n_alphas, float *out) {
    return search_body(g, m, n, group, alphas, n_alphas, out);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same code for wider vectors (rintf becomes roundps): picked at run time, so the module runs on
 * any x86-64. FMA is not enabled, and -ffp-contract=off would keep it from fusing anyway. */
__attribute__((target("avx2"))) static int search_avx2(const float *g, const uint8_t *m, size_t n, size_t group,
                                                        const float *alphas, size_t n_alphas, float *out) {
    return search_body(g, m, n, group, alphas, n_alphas, out);
}

__attribute__((target("avx512f,prefer-vector-width=512"))) static int search_avx512(
    const float *g, const uint8_t *m, size_t n, size_t group, const float *alphas, size_t n_alphas, float *out) {
    return search_body(g, m, n, group, alphas, n_alphas, out);
}
#endif

static search_fn pick(const char **name) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        *name = "avx512f";
        return search_avx512;
    }
    if (__builtin_cpu_supports("avx2")) {
        *name = "avx2";
        return search_avx2;
    }
#endif
    *name = "generic";
    return search_generic;
}

static search_fn chosen;
static const char *chosen_name;

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    int ok = kind == 'f' ? (strcmp(f, "f") == 0 && view->itemsize == 4)
                         : ((strcmp(f, "?") == 0 || strcmp(f, "B") == 0) && view->itemsize == 1);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s buffer, got format '%s'", what,
                     kind == 'f' ? "float32" : "bool", view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
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
    PyObject *g_obj, *m_obj, *a_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO:scales", &g_obj, &m_obj, &a_obj, &out_obj)) {
        return NULL;
    }
    Py_buffer g, m, a, out;
    if (get_buffer(g_obj, &g, 0, 'f', "g") < 0) {
        return NULL;
    }
    if (get_buffer(m_obj, &m, 0, '?', "m") < 0) {
        PyBuffer_Release(&g);
        return NULL;
    }
    if (get_buffer(a_obj, &a, 0, 'f', "alphas") < 0) {
        PyBuffer_Release(&g);
        PyBuffer_Release(&m);
        return NULL;
    }
    if (get_buffer(out_obj, &out, 1, 'f', "out") < 0) {
        PyBuffer_Release(&g);
        PyBuffer_Release(&m);
        PyBuffer_Release(&a);
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)(out.len / 4);
    size_t group = g.ndim == 2 ? (size_t)g.shape[1] : 0;
    if (group < 8 || group > MAX_GROUP || (group & (group - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "g must be [groups, group] with group a power of two from 8 to %d",
                     MAX_GROUP);
    } else if ((size_t)g.shape[0] != n || m.len != g.len / 4) {
        PyErr_Format(PyExc_ValueError, "g, m and out disagree: %zd groups, %zd marks for %zd weights, %zu outputs",
                     g.shape[0], m.len, g.len / 4, n);
    } else if (a.len < 4) {
        PyErr_SetString(PyExc_ValueError, "alphas is empty");
    } else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = chosen((const float *)g.buf, (const uint8_t *)m.buf, n, group, (const float *)a.buf,
                        (size_t)(a.len / 4), (float *)out.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(status);
    }
    PyBuffer_Release(&g);
    PyBuffer_Release(&m);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"scales", scales, METH_VARARGS, scales_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "colibri.quant._q4_search", "The q4 clip search in C (colibri/quant/quantize.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__q4_search(void) {
    chosen = pick(&chosen_name);
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(mod, "SOURCE_HASH", COLIBRI_SOURCE_HASH) < 0 ||
        PyModule_AddStringConstant(mod, "KERNEL", chosen_name) < 0 ||
        PyModule_AddIntConstant(mod, "OK", SEARCH_OK) < 0 ||
        PyModule_AddIntConstant(mod, "TOO_LARGE", SEARCH_TOO_LARGE) < 0 ||
        PyModule_AddIntConstant(mod, "NONFINITE", SEARCH_NONFINITE) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
