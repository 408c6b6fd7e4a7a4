/*
 * Optimised backend: 32-bit Arm with the DSP extension and an FPv5 FPU
 * (Cortex-M7; it also builds for a Cortex-M4F, whose FPv4 has VFMA too).
 * No CMSIS dependency: the int8 path uses ACLE intrinsics (arm_acle.h), the
 * f32 and f16 inner loops a few lines of inline assembly, because the compiler
 * never emits the multi-register loads (VLDM) they are built on.
 *
 *   f32 weights   8 output rows at a time (then 4, 3, 2, 1): per 8 columns
 *                 one VLDM of x, one VLDM per weight row, 64 VFMA: ~1.15
 *                 instructions per multiply-accumulate (two chunks a loop
 *                 step when in % 16 == 0; separate loops for storing or
 *                 accumulating, with a bias or without: 13 instructions of
 *                 bookkeeping per 8-row block). Each accumulator starts from
 *                 the bias (or 0) and the 8 results leave with one VSTM.
 *                 Summation order: bias, then 8-column chunks in index
 *                 order, fused (one rounding per product-add). One token of
 *                 a matrix in whole 8 x 8 blocks goes straight to the block
 *                 loop (batch 1), one of whole chunks to f32_whole_rows.
 *   f16 weights   2 rows at a time, 8 halves per VLDM of 4 words, widened
 *                 exactly by VCVTB/VCVTT, then as f32 (rows 4-byte aligned,
 *                 i.e. in even; otherwise row by row).
 *   I8, int8 act. 4 rows at a time: 4 int8 per word, SXTB16 and SXTB16 of the
 *                 word rotated by 8 into int16 pairs, 2 SMLAD per 4
 *                 products, x's pairs shared by the rows (two words a loop
 *                 step when the count is even). The int32 sum is exact, and
 *                 the float part follows the reference's order, so the
 *                 result is the reference's bit for bit. Scales and biases
 *                 four rows at a time (colibri_q8_scale4), E by an assembly
 *                 routine per 4-row block with entries, bounded where it
 *                 reads (colibri_cmsis_q8_terms4_*, "I8 weights" below).
 *   I8, f32 act.  4 rows at a time (the last out % 4 row by row), each int8
 *                 weight widened (exactly: SXTB, VCVT) and
 *                 fused-multiply-added; the scale and E as the reference.
 *   I4            int8 act. bit for bit (UXTB16 + SMLAD on u = Q + 8, less
 *                 8·Σ xq), f32 act. fused (SBFX, VCVT, VFMA): "I4 weights"
 *                 below.
 *   f32 batches   tokens two by two (4 rows x 2 tokens per weight load).
 *   quantiser     the reference's bits (VLDM, VMAXNM, VCVTA).
 *   ReLU          the reference's bits (VCMP, VSELGT), 16 values a step.
 *   SiLU, sigmoid the reference's formulas with a single-precision e^x
 *                 (within 2^-20 relative of the reference).
 *
 * Tolerance of the f32, f16 and I8-with-f32-activation kernels against the
 * reference (fused products, another summation order), tested by
 * tests/c/cm7/kernel_test.c on the emulated M7: |opt - ref| <=
 * (in + 4) · 2^-23 · (|b| + Σ_k |w_k · x_k|) per output (linear_acc: s · that
 * plus a rounding of y); NaN and inf propagate as in the reference (a
 * NaN product or an inf - inf in a sum gives NaN in any order). Everything
 * else (other activations, norms, mul, add) stays the reference's.
 *
 * Compiled to nothing unless colibri_backend.h selects it.
 */
#include "../../colibri_kernels.h"
#include "../colibri_backend.h"

#if defined(COLIBRI_BACKEND_CMSIS)

#include <arm_acle.h>
#include <math.h>

#include "colibri_format.h"

/* What this FPU offers (the int8 kernels need the DSP extension alone):
 *   CMSIS_F32   single precision with VFMA (FPv4, FPv5): f32, q8 f32-act kernels
 *   CMSIS_F16   and half-precision conversions known to the compiler: f16 kernels
 *   CMSIS_FPV5  FPv5's VSEL, VMAXNM, VCVTA (Cortex-M7 with the double-precision
 *               FPU, where GCC reports it): ReLU and the quantiser
 * What a build lacks runs the reference kernels (a Cortex-M4F natmod module,
 * armv7emsp: f32, q8 and int8 here; f16, ReLU and the quantiser reference). */
#if defined(__ARM_FP) && (__ARM_FP & 4) && defined(__ARM_FEATURE_FMA)
#define CMSIS_F32 1
#if (__ARM_FP & 2)
#define CMSIS_F16 1
#endif
#if (__ARM_FP & 8)
#define CMSIS_FPV5 1
#endif
#endif

#if defined(CMSIS_F32)
/* The accumulators' starting values when there is no bias. Read-only data. */
static const float zeros8[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};

#define S_ALL                                                                                                       \
    "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11", "s12", "s13", "s14", "s15", "s16",  \
        "s17", "s18", "s19", "s20", "s21", "s22", "s23", "s24", "s25", "s26", "s27", "s28", "s29", "s30", "s31"

/* ---- f32 ---- */

/* Two rows, 8 columns: row A's weights in s0-s7, row B's in s8-s15, x in
 * s16-s23; accumulators A and B. Alternating rows keeps neighbouring VFMAs
 * independent for the FPU's pipeline. */
#define FMA_PAIR(A, B)                                                                                              \
    "vfma.f32 " A ", s0, s16\n\t"                                                                                   \
    "vfma.f32 " B ", s8, s16\n\t"                                                                                   \
    "vfma.f32 " A ", s1, s17\n\t"                                                                                   \
    "vfma.f32 " B ", s9, s17\n\t"                                                                                   \
    "vfma.f32 " A ", s2, s18\n\t"                                                                                   \
    "vfma.f32 " B ", s10, s18\n\t"                                                                                  \
    "vfma.f32 " A ", s3, s19\n\t"                                                                                   \
    "vfma.f32 " B ", s11, s19\n\t"                                                                                  \
    "vfma.f32 " A ", s4, s20\n\t"                                                                                   \
    "vfma.f32 " B ", s12, s20\n\t"                                                                                  \
    "vfma.f32 " A ", s5, s21\n\t"                                                                                   \
    "vfma.f32 " B ", s13, s21\n\t"                                                                                  \
    "vfma.f32 " A ", s6, s22\n\t"                                                                                   \
    "vfma.f32 " B ", s14, s22\n\t"                                                                                  \
    "vfma.f32 " A ", s7, s23\n\t"                                                                                   \
    "vfma.f32 " B ", s15, s23\n\t"

#define LOAD_PAIR_F32(P, Q) "vldmia %[" P "]!, {s0-s7}\n\t" \
                            "vldmia %[" Q "]!, {s8-s15}\n\t"

/* v[r] = init[r] + Σ_{k < 8·chunks} w[r·in + k] · x[k] for r < R (8, 4 or
 * 2), chunks >= 1; then dst[r] = v[r], or dst[r] += *scale · v[r] (fused)
 * when scale is not NULL. Functions of their own (noinline): their pointers
 * and counter then have the core registers to themselves, and the caller's
 * loop keeps its few values without spilling.
 *
 * Ten pointers and a counter leave too few core registers for init and dst
 * as well: the accumulators s24-s31 are loaded by one VLDM and stored by one
 * VSTM in asm statements of their own, and in between held by C variables
 * pinned to d12-d15 (= s24-s31; doubles only as bit containers, so the
 * operand count stays within GCC's 30). */
#define S0_23                                                                                                       \
    "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11", "s12", "s13", "s14", "s15", "s16",  \
        "s17", "s18", "s19", "s20", "s21", "s22", "s23"

/* The end of a block of R rows held in s24...: store, or y += s · v. */
#define F32_EMIT(LIST, FMAS)                                                                                        \
    if (scale)                                                                                                      \
        __asm__ volatile("vldmia %[dst], " LIST "\n\t"                                                              \
                         "vldr s16, [%[s]]\n\t" FMAS "vstmia %[dst], " LIST                                        \
                         :                                                                                          \
                         : [dst] "r"(dst), [s] "r"(scale), "w"(a01), "w"(a23), "w"(a45), "w"(a67)                  \
                         : S0_23, "memory");                                                                        \
    else                                                                                                            \
        __asm__ volatile("vstmia %[dst], {s24-s31}" : : [dst] "r"(dst), "w"(a01), "w"(a23), "w"(a45), "w"(a67)     \
                         : "memory")

static __attribute__((noinline)) void f32_rows8(const float *w, size_t in, const float *x, size_t chunks,
                                                const float *init, float *dst, const float *scale)
{
    const float *p0 = w, *p1 = p0 + in, *p2 = p1 + in, *p3 = p2 + in;
    const float *p4 = p3 + in, *p5 = p4 + in, *p6 = p5 + in, *p7 = p6 + in;
    register double a01 __asm__("d12"), a23 __asm__("d13"), a45 __asm__("d14"), a67 __asm__("d15");
    __asm__ volatile("vldmia %[init], {s24-s31}"
                     : "=w"(a01), "=w"(a23), "=w"(a45), "=w"(a67)
                     : [init] "r"(init)
                     : "memory");
    __asm__ volatile("1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     LOAD_PAIR_F32("p0", "p1") FMA_PAIR("s24", "s25")
                     LOAD_PAIR_F32("p2", "p3") FMA_PAIR("s26", "s27")
                     LOAD_PAIR_F32("p4", "p5") FMA_PAIR("s28", "s29")
                     LOAD_PAIR_F32("p6", "p7") FMA_PAIR("s30", "s31")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     : [p0] "+r"(p0), [p1] "+r"(p1), [p2] "+r"(p2), [p3] "+r"(p3), [p4] "+r"(p4), [p5] "+r"(p5),
                       [p6] "+r"(p6), [p7] "+r"(p7), [x] "+r"(x), [n] "+r"(chunks), "+w"(a01), "+w"(a23), "+w"(a45),
                       "+w"(a67)
                     :
                     : S0_23, "memory", "cc");
    F32_EMIT("{s0-s7}", "vfma.f32 s0, s24, s16\n\tvfma.f32 s1, s25, s16\n\tvfma.f32 s2, s26, s16\n\t"
                        "vfma.f32 s3, s27, s16\n\tvfma.f32 s4, s28, s16\n\tvfma.f32 s5, s29, s16\n\t"
                        "vfma.f32 s6, s30, s16\n\tvfma.f32 s7, s31, s16\n\t");
}

/* Every 8-row block of a matrix whose rows are whole chunks (in % 8 == 0):
 * blocks × 8 rows from w, results into dst (F32_STORE8) or dst += scale · v
 * (F32_ACC8), the accumulators starting from the bias, which steps 8 floats
 * a block (BIAS), or from zeros8 (ZERO). One asm loop over the
 * blocks; row r of the next block starts where row 7 of this one ended, so
 * only rows 1-7 are recomputed per block. Registers: the 8 row pointers, x
 * and its end (the chunk loop runs until x reaches it, then x steps back),
 * in4, init, dst and dst's end. The accumulating loop keeps its scale in
 * an 8-byte frame of its own (no core register is left for a pointer to
 * it). Per block: the 8 accumulators loaded, 7 row pointers, the chunk
 * loop, x back, the 8 results out, the loop's end: 13 instructions
 * besides the chunks when storing. A function per combination (bias or
 * not, storing or accumulating, one or two chunks a loop step) rather than
 * a test per block. */
#define F32_INIT_BIAS "vldmia %[init]!, {s24-s31}\n\t"
#define F32_INIT_ZERO "vldmia %[init], {s24-s31}\n\t"
#define F32_INIT_PTR_BIAS b
#define F32_INIT_PTR_ZERO ((void)b, zeros8)
#define F32_STORE8_ENTER ""
#define F32_STORE8 "vstmia %[dst]!, {s24-s31}\n\t"
#define F32_STORE8_LEAVE ""
#define F32_ACC8_ENTER                                                                                              \
    "vldr s16, [%[p1]]\n\t"                                                                                         \
    "sub sp, sp, #8\n\t"                                                                                            \
    "vstr s16, [sp]\n\t"
#define F32_ACC8                                                                                                    \
    "vldr s16, [sp]\n\t"                                                                                            \
    "vldmia %[dst], {s0-s7}\n\t"                                                                                    \
    "vfma.f32 s0, s24, s16\n\t"                                                                                     \
    "vfma.f32 s1, s25, s16\n\t"                                                                                     \
    "vfma.f32 s2, s26, s16\n\t"                                                                                     \
    "vfma.f32 s3, s27, s16\n\t"                                                                                     \
    "vfma.f32 s4, s28, s16\n\t"                                                                                     \
    "vfma.f32 s5, s29, s16\n\t"                                                                                     \
    "vfma.f32 s6, s30, s16\n\t"                                                                                     \
    "vfma.f32 s7, s31, s16\n\t"                                                                                     \
    "vstmia %[dst]!, {s0-s7}\n\t"
#define F32_ACC8_LEAVE "add sp, sp, #8\n\t"

/* NAME(w, in, x, blocks, b, dst, scale): b is the bias (INIT BIAS) or unused
 * (INIT ZERO); scale is read by the accumulating loop alone. */
#define F32_BLOCKS8(NAME, CHUNK, INIT, EMIT)                                                                        \
    static __attribute__((noinline)) void NAME(const float *w, size_t in, const float *x, size_t blocks,           \
                                               const float *b, float *dst, const float *scale)                     \
    {                                                                                                               \
        const float *p0 = w, *init = F32_INIT_PTR_##INIT;                                                   \
        uintptr_t p1 = (uintptr_t)scale, p2, p3, p4, p5, p6, p7;                                                    \
        const float *const x_end = x + in;                                                                          \
        float *const dst_end = dst + blocks * 8u;                                                                   \
        const size_t in4 = in * sizeof(float);                                                                      \
        __asm__ volatile(EMIT##_ENTER                                                                               \
                         "2:\n\t"                                                                                   \
                         F32_INIT_##INIT                                                                            \
                         "add %[p1], %[p0], %[in4]\n\t"                                                             \
                         "add %[p2], %[p1], %[in4]\n\t"                                                             \
                         "add %[p3], %[p2], %[in4]\n\t"                                                             \
                         "add %[p4], %[p3], %[in4]\n\t"                                                             \
                         "add %[p5], %[p4], %[in4]\n\t"                                                             \
                         "add %[p6], %[p5], %[in4]\n\t"                                                             \
                         "add %[p7], %[p6], %[in4]\n\t"                                                             \
                         "1:\n\t" CHUNK                                                                             \
                         "cmp %[x], %[x_end]\n\t"                                                                   \
                         "bne 1b\n\t"                                                                               \
                         "sub %[x], %[x], %[in4]\n\t"                                                               \
                         EMIT                                                                                       \
                         "mov %[p0], %[p7]\n\t"                                                                     \
                         "cmp %[dst], %[dst_end]\n\t"                                                               \
                         "bne 2b\n\t"                                                                               \
                         EMIT##_LEAVE                                                                               \
                         : [p0] "+r"(p0), [p1] "+r"(p1), [p2] "=&r"(p2), [p3] "=&r"(p3), [p4] "=&r"(p4),            \
                           [p5] "=&r"(p5), [p6] "=&r"(p6), [p7] "=&r"(p7), [x] "+r"(x), [init] "+r"(init),          \
                           [dst] "+r"(dst)                                                                          \
                         : [in4] "r"(in4), [x_end] "r"(x_end), [dst_end] "r"(dst_end)                               \
                         : S_ALL, "memory", "cc");                                                                  \
    }

/* One 8-column chunk of the 8 rows (F32_CHUNK8), or two a loop step
 * (F32_CHUNK16, when the rows hold an even number of chunks: half the loop
 * counting). */
#define F32_CHUNK8                                                                                                  \
    "vldmia %[x]!, {s16-s23}\n\t"                                                                                   \
    LOAD_PAIR_F32("p0", "p1") FMA_PAIR("s24", "s25")                                                                \
    LOAD_PAIR_F32("p2", "p3") FMA_PAIR("s26", "s27")                                                                \
    LOAD_PAIR_F32("p4", "p5") FMA_PAIR("s28", "s29")                                                                \
    LOAD_PAIR_F32("p6", "p7") FMA_PAIR("s30", "s31")
#define F32_CHUNK16 F32_CHUNK8 F32_CHUNK8

F32_BLOCKS8(f32_blocks8_bias_store, F32_CHUNK8, BIAS, F32_STORE8)
F32_BLOCKS8(f32_blocks8_bias_acc, F32_CHUNK8, BIAS, F32_ACC8)
F32_BLOCKS8(f32_blocks8_zero_store, F32_CHUNK8, ZERO, F32_STORE8)
F32_BLOCKS8(f32_blocks8_zero_acc, F32_CHUNK8, ZERO, F32_ACC8)
F32_BLOCKS8(f32_blocks16_bias_store, F32_CHUNK16, BIAS, F32_STORE8)
F32_BLOCKS8(f32_blocks16_bias_acc, F32_CHUNK16, BIAS, F32_ACC8)
F32_BLOCKS8(f32_blocks16_zero_store, F32_CHUNK16, ZERO, F32_STORE8)
F32_BLOCKS8(f32_blocks16_zero_acc, F32_CHUNK16, ZERO, F32_ACC8)

/* dst = (or += *scale ·) the blocks, each from its bias b (NULL: 0): the
 * loop for this bias, emit and chunks per step (two when in % 16 == 0). */
static inline void f32_blocks8(const float *w, size_t in, const float *x, size_t blocks, const float *b, float *dst,
                               const float *scale)
{
    if (in % 16u == 0u) {
        if (b)
            (scale ? f32_blocks16_bias_acc : f32_blocks16_bias_store)(w, in, x, blocks, b, dst, scale);
        else
            (scale ? f32_blocks16_zero_acc : f32_blocks16_zero_store)(w, in, x, blocks, b, dst, scale);
    } else {
        if (b)
            (scale ? f32_blocks8_bias_acc : f32_blocks8_bias_store)(w, in, x, blocks, b, dst, scale);
        else
            (scale ? f32_blocks8_zero_acc : f32_blocks8_zero_store)(w, in, x, blocks, b, dst, scale);
    }
}

static __attribute__((noinline)) void f32_rows4(const float *w, size_t in, const float *x, size_t chunks,
                                                const float *init, float *dst, const float *scale)
{
    const float *p0 = w, *p1 = p0 + in, *p2 = p1 + in, *p3 = p2 + in;
    __asm__ volatile("vldmia %[init], {s24-s27}\n\t"
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     LOAD_PAIR_F32("p0", "p1") FMA_PAIR("s24", "s25")
                     LOAD_PAIR_F32("p2", "p3") FMA_PAIR("s26", "s27")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "cbz %[s], 2f\n\t"
                     "vldmia %[dst], {s0-s3}\n\t"
                     "vldr s16, [%[s]]\n\t"
                     "vfma.f32 s0, s24, s16\n\t"
                     "vfma.f32 s1, s25, s16\n\t"
                     "vfma.f32 s2, s26, s16\n\t"
                     "vfma.f32 s3, s27, s16\n\t"
                     "vstmia %[dst], {s0-s3}\n\t"
                     "b 3f\n\t"
                     "2:\n\t"
                     "vstmia %[dst], {s24-s27}\n\t"
                     "3:\n\t"
                     : [p0] "+l"(p0), [p1] "+r"(p1), [p2] "+r"(p2), [p3] "+r"(p3), [x] "+r"(x), [n] "+r"(chunks)
                     : [init] "r"(init), [dst] "r"(dst), [s] "l"(scale)
                     : S_ALL, "memory", "cc");
}

/* Three rows (a small router's), stored: dst[r] = init[r] + Σ w[r·in + k] ·
 * x[k], r < 3; rows 0 and 1 alternate as in FMA_PAIR, row 2 in s8-s15
 * into s26. */
static __attribute__((noinline)) void f32_rows3(const float *w, size_t in, const float *x, size_t chunks,
                                                const float *init, float *dst)
{
    const float *p0 = w, *p1 = p0 + in, *p2 = p1 + in;
    __asm__ volatile("vldmia %[init], {s24-s26}\n\t"
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     LOAD_PAIR_F32("p0", "p1") FMA_PAIR("s24", "s25")
                     "vldmia %[p2]!, {s8-s15}\n\t"
                     "vfma.f32 s26, s8, s16\n\t"
                     "vfma.f32 s26, s9, s17\n\t"
                     "vfma.f32 s26, s10, s18\n\t"
                     "vfma.f32 s26, s11, s19\n\t"
                     "vfma.f32 s26, s12, s20\n\t"
                     "vfma.f32 s26, s13, s21\n\t"
                     "vfma.f32 s26, s14, s22\n\t"
                     "vfma.f32 s26, s15, s23\n\t"
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "vstmia %[dst], {s24-s26}\n\t"
                     : [p0] "+r"(p0), [p1] "+r"(p1), [p2] "+r"(p2), [x] "+r"(x), [n] "+r"(chunks)
                     : [init] "r"(init), [dst] "r"(dst)
                     : S_ALL, "memory", "cc");
}

static __attribute__((noinline)) void f32_rows2(const float *w, size_t in, const float *x, size_t chunks,
                                                const float *init, float *dst, const float *scale)
{
    const float *p0 = w, *p1 = p0 + in;
    __asm__ volatile("vldmia %[init], {s24-s25}\n\t"
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     LOAD_PAIR_F32("p0", "p1") FMA_PAIR("s24", "s25")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "cbz %[s], 2f\n\t"
                     "vldmia %[dst], {s0-s1}\n\t"
                     "vldr s16, [%[s]]\n\t"
                     "vfma.f32 s0, s24, s16\n\t"
                     "vfma.f32 s1, s25, s16\n\t"
                     "vstmia %[dst], {s0-s1}\n\t"
                     "b 3f\n\t"
                     "2:\n\t"
                     "vstmia %[dst], {s24-s25}\n\t"
                     "3:\n\t"
                     : [p0] "+r"(p0), [p1] "+r"(p1), [x] "+r"(x), [n] "+r"(chunks)
                     : [init] "r"(init), [dst] "r"(dst), [s] "l"(scale)
                     : S_ALL, "memory", "cc");
}

/* One row: v = Σ_{k < 8·chunks} w[k] · x[k] (chunks >= 1), 8 columns a
 * step into two accumulators (even and odd columns), added at the end. */
static __attribute__((noinline)) float f32_row1(const float *w, const float *x, size_t chunks)
{
    float v;
    __asm__ volatile("vmov s24, s25, %[z], %[z]\n\t" /* +0, as the reference's sum starts */
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     "vldmia %[w]!, {s0-s7}\n\t"
                     "vfma.f32 s24, s0, s16\n\t"
                     "vfma.f32 s25, s1, s17\n\t"
                     "vfma.f32 s24, s2, s18\n\t"
                     "vfma.f32 s25, s3, s19\n\t"
                     "vfma.f32 s24, s4, s20\n\t"
                     "vfma.f32 s25, s5, s21\n\t"
                     "vfma.f32 s24, s6, s22\n\t"
                     "vfma.f32 s25, s7, s23\n\t"
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "vadd.f32 %[v], s24, s25\n\t"
                     : [w] "+r"(w), [x] "+r"(x), [n] "+r"(chunks), [v] "=t"(v)
                     : [z] "r"(0u)
                     : "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s16", "s17", "s18", "s19", "s20", "s21",
                       "s22", "s23", "s24", "s25", "memory", "cc");
    return v;
}

/* Two tokens at once (a small GEMM): 4 rows × 2 tokens, 8 columns a step.
 * Each weight chunk is loaded once for both tokens (half the weight traffic,
 * which on a real part with the weights in flash is most of the cost); x of
 * token A in s16-s23, of token B in s24-s31, the row's weights in s0-s7,
 * the accumulators s8-s11 (token A, rows 0-3) and s12-s15 (token B), both
 * starting from init. Results: dst_a[0..3], dst_b[0..3]. chunks >= 1. */
#define FMA_TOK2(A, B)                                                                                              \
    "vfma.f32 " A ", s0, s16\n\t"                                                                                   \
    "vfma.f32 " B ", s0, s24\n\t"                                                                                   \
    "vfma.f32 " A ", s1, s17\n\t"                                                                                   \
    "vfma.f32 " B ", s1, s25\n\t"                                                                                   \
    "vfma.f32 " A ", s2, s18\n\t"                                                                                   \
    "vfma.f32 " B ", s2, s26\n\t"                                                                                   \
    "vfma.f32 " A ", s3, s19\n\t"                                                                                   \
    "vfma.f32 " B ", s3, s27\n\t"                                                                                   \
    "vfma.f32 " A ", s4, s20\n\t"                                                                                   \
    "vfma.f32 " B ", s4, s28\n\t"                                                                                   \
    "vfma.f32 " A ", s5, s21\n\t"                                                                                   \
    "vfma.f32 " B ", s5, s29\n\t"                                                                                   \
    "vfma.f32 " A ", s6, s22\n\t"                                                                                   \
    "vfma.f32 " B ", s6, s30\n\t"                                                                                   \
    "vfma.f32 " A ", s7, s23\n\t"                                                                                   \
    "vfma.f32 " B ", s7, s31\n\t"

static __attribute__((noinline)) void f32_rows4_tok2(const float *w, size_t in, const float *xa, const float *xb,
                                                     size_t chunks, const float *init, float *dst_a, float *dst_b)
{
    const float *p0 = w, *p1 = p0 + in, *p2 = p1 + in, *p3 = p2 + in;
    __asm__ volatile("vldmia %[init], {s8-s11}\n\t"
                     "vldmia %[init], {s12-s15}\n\t"
                     "1:\n\t"
                     "vldmia %[xa]!, {s16-s23}\n\t"
                     "vldmia %[xb]!, {s24-s31}\n\t"
                     "vldmia %[p0]!, {s0-s7}\n\t" FMA_TOK2("s8", "s12")
                     "vldmia %[p1]!, {s0-s7}\n\t" FMA_TOK2("s9", "s13")
                     "vldmia %[p2]!, {s0-s7}\n\t" FMA_TOK2("s10", "s14")
                     "vldmia %[p3]!, {s0-s7}\n\t" FMA_TOK2("s11", "s15")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "vstmia %[da], {s8-s11}\n\t"
                     "vstmia %[db], {s12-s15}\n\t"
                     : [p0] "+r"(p0), [p1] "+r"(p1), [p2] "+r"(p2), [p3] "+r"(p3), [xa] "+r"(xa), [xb] "+r"(xb),
                       [n] "+r"(chunks)
                     : [init] "r"(init), [da] "r"(dst_a), [db] "r"(dst_b)
                     : S_ALL, "memory", "cc");
}

#if defined(CMSIS_F16)
/* ---- f16: VLDM of the raw halves, VCVTB/VCVTT widen them exactly ---- */

/* 8 halves of a row, in 4 words (RAW0..3), widened into D0..D7. */
#define CVT_ROW(RAW0, RAW1, RAW2, RAW3, D0, D1, D2, D3, D4, D5, D6, D7)                                            \
    "vcvtb.f32.f16 " D0 ", " RAW0 "\n\t"                                                                            \
    "vcvtt.f32.f16 " D1 ", " RAW0 "\n\t"                                                                            \
    "vcvtb.f32.f16 " D2 ", " RAW1 "\n\t"                                                                            \
    "vcvtt.f32.f16 " D3 ", " RAW1 "\n\t"                                                                            \
    "vcvtb.f32.f16 " D4 ", " RAW2 "\n\t"                                                                            \
    "vcvtt.f32.f16 " D5 ", " RAW2 "\n\t"                                                                            \
    "vcvtb.f32.f16 " D6 ", " RAW3 "\n\t"                                                                            \
    "vcvtt.f32.f16 " D7 ", " RAW3 "\n\t"

/* dst[r] = init[r] + Σ_{k < 8·chunks} f16(w[r·in + k]) · x[k] for r < 2,
 * chunks >= 1, w 4-byte aligned (in even). Registers: x s16-s23; the raw
 * words of row A in s24-s27 widen into s0-s7, then row B's (reusing
 * s24-s27) into s8-s15; the two accumulators are s30, s31. */
static __attribute__((noinline)) void f16_rows2(const uint16_t *w, size_t in, const float *x, size_t chunks, const float *init,
                             float *dst)
{
    const uint16_t *p0 = w, *p1 = p0 + in;
    __asm__ volatile("vldmia %[init], {s30-s31}\n\t"
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     "vldmia %[p0]!, {s24-s27}\n\t"
                     CVT_ROW("s24", "s25", "s26", "s27", "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7")
                     "vldmia %[p1]!, {s24-s27}\n\t"
                     CVT_ROW("s24", "s25", "s26", "s27", "s8", "s9", "s10", "s11", "s12", "s13", "s14", "s15")
                     FMA_PAIR("s30", "s31")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "vstmia %[dst], {s30-s31}\n\t"
                     : [p0] "+r"(p0), [p1] "+r"(p1), [x] "+r"(x), [n] "+r"(chunks)
                     : [init] "r"(init), [dst] "r"(dst)
                     : S_ALL, "memory", "cc");
}

/* f16 bits -> f32 by VCVTB: exact, NaN stays NaN. */
static inline float f16_widen(uint16_t h)
{
    float f, raw;
    const uint32_t bits = h;
    memcpy(&raw, &bits, sizeof raw);
    __asm__("vcvtb.f32.f16 %0, %1" : "=t"(f) : "t"(raw));
    return f;
}

#endif /* CMSIS_F16 */

/* The columns k0 <= k < in of one row (or a whole row):
 * v + Σ w[k] · x[k], fused, two accumulators. ELEM(row, k) reads a weight. */
#define DOT_TAIL(NAME, TYPE, ELEM)                                                                                  \
    static inline float NAME(const TYPE *row, const float *x, size_t k0, size_t in, float v)                       \
    {                                                                                                               \
        float v1 = 0.0f;                                                                                            \
        size_t k = k0;                                                                                              \
        for (; k + 2 <= in; k += 2) {                                                                               \
            v = __builtin_fmaf(ELEM(row, k), x[k], v);                                                              \
            v1 = __builtin_fmaf(ELEM(row, k + 1), x[k + 1], v1);                                                    \
        }                                                                                                           \
        if (k < in)                                                                                                 \
            v = __builtin_fmaf(ELEM(row, k), x[k], v);                                                              \
        return v + v1;                                                                                              \
    }
#define ELEM_F32(row, k) ((row)[k])
DOT_TAIL(dot_tail_f32, float, ELEM_F32)
#if defined(CMSIS_F16)
#define ELEM_F16(row, k) f16_widen((row)[k])
DOT_TAIL(dot_tail_f16, uint16_t, ELEM_F16)
#endif

/* One token of an F32 matrix whose rows are whole chunks (in % 8 == 0,
 * in >= 8): y[o] = v_o, or y[o] += *scale · v_o (scale not NULL), v_o =
 * (row o of W) · x + b_o; 8-row blocks, then 4, 3 (stored only), 2 and 1
 * rows. A function of its own with few live values: a small matrix (a
 * router's few rows) pays no frame for matvec_f32's column tails. */
static __attribute__((noinline)) void f32_whole_rows(const float *wd, size_t in, size_t out, const float *x,
                                                     const float *b, const float *scale, float *y)
{
    const size_t chunks = in / 8u;
    size_t o = 0;
    if (out >= 8u) {
        f32_blocks8(wd, in, x, out / 8u, b, y, scale);
        o = out / 8u * 8u;
    }
    if (o + 4u <= out) {
        f32_rows4(wd + o * in, in, x, chunks, b ? b + o : zeros8, y + o, scale);
        o += 4u;
    }
    if (o + 3u == out && !scale) {
        f32_rows3(wd + o * in, in, x, chunks, b ? b + o : zeros8, y + o);
        return;
    }
    if (o + 2u <= out) {
        f32_rows2(wd + o * in, in, x, chunks, b ? b + o : zeros8, y + o, scale);
        o += 2u;
    }
    if (o < out)
        colibri_emit(y, o, f32_row1(wd + o * in, x, chunks), b, scale != NULL, scale ? *scale : 1.0f);
}

/* One token of an F32 or F16 matrix: y[o] = v_o, or y[o] += s · v_o (acc),
 * v_o = (row o of W) · x + b_o, as colibri_matvec_f32 / _f16 within the
 * tolerance. */
static void matvec_f32(const colibri_matrix *w, const float *x, const float *b, int acc, float s, float *y)
{
    const float *wd = w->data;
    const size_t in = w->cols, out = w->rows, chunks = in / 8u, done = chunks * 8u;
    size_t o = 0;
    if (chunks != 0u && done == in) {
        /* Whole chunks: the blocks store (or accumulate into) y themselves. */
        f32_whole_rows(wd, in, out, x, b, acc ? &s : NULL, y);
        return;
    }
    /* Column tails (in % 8 != 0): blocks into tmp, tails added, then emitted. */
    float tmp[8];
    while (o < out) {
        const size_t left = out - o;
        const size_t r = chunks == 0u ? 1u : left >= 8u ? 8u : left >= 4u ? 4u : left >= 2u ? 2u : 1u;
        const float *row = wd + o * in;
        if (r == 1u) {
            tmp[0] = dot_tail_f32(row, x, 0, in, b ? b[o] : 0.0f);
        } else {
            const float *init = b ? b + o : zeros8;
            if (r == 8u)
                f32_rows8(row, in, x, chunks, init, tmp, NULL);
            else if (r == 4u)
                f32_rows4(row, in, x, chunks, init, tmp, NULL);
            else
                f32_rows2(row, in, x, chunks, init, tmp, NULL);
            for (size_t i = 0; i < r; i++)
                tmp[i] = dot_tail_f32(row + i * in, x, done, in, tmp[i]);
        }
        for (size_t i = 0; i < r; i++)
            colibri_emit(y, o + i, tmp[i], NULL, acc, s);
        o += r;
    }
}

/* Two tokens of an F32 matrix whose rows are whole chunks (in % 8 == 0):
 * ya = xa Wᵀ + b and yb = xb Wᵀ + b, or ya += sa · (...), yb += sb · (...)
 * (acc), 4 rows at a time by f32_rows4_tok2, the last out % 4 rows one by one. */
static void matvec_f32_pair(const colibri_matrix *w, const float *xa, const float *xb, const float *b, int acc,
                            float sa, float sb, float *ya, float *yb)
{
    const float *wd = w->data;
    const size_t in = w->cols, out = w->rows, chunks = in / 8u;
    float ta[4], tb[4];
    size_t o = 0;
    for (; o + 4u <= out; o += 4u) {
        const float *init = b ? b + o : zeros8;
        if (acc) {
            f32_rows4_tok2(wd + o * in, in, xa, xb, chunks, init, ta, tb);
            for (size_t i = 0; i < 4; i++) {
                ya[o + i] += sa * ta[i];
                yb[o + i] += sb * tb[i];
            }
        } else {
            f32_rows4_tok2(wd + o * in, in, xa, xb, chunks, init, ya + o, yb + o);
        }
    }
    for (; o < out; o++) {
        colibri_emit(ya, o, dot_tail_f32(wd + o * in, xa, 0, in, 0.0f), b, acc, sa);
        colibri_emit(yb, o, dot_tail_f32(wd + o * in, xb, 0, in, 0.0f), b, acc, sb);
    }
}

#if defined(CMSIS_F16)
/* As matvec_f32 for F16 weights: 2 rows at a time when the rows are 4-byte
 * aligned (in even), which VLDM needs; otherwise row by row. */
static void matvec_f16(const colibri_matrix *w, const float *x, const float *b, int acc, float s, float *y)
{
    const uint16_t *wd = w->data;
    const size_t in = w->cols, out = w->rows, chunks = in % 2u ? 0u : in / 8u, done = chunks * 8u;
    float tmp[2];
    size_t o = 0;
    while (o < out) {
        const size_t r = chunks == 0u || out - o < 2u ? 1u : 2u;
        const uint16_t *row = wd + o * in;
        float *dst = acc ? tmp : y + o;
        if (r == 1u) {
            dst[0] = dot_tail_f16(row, x, 0, in, b ? b[o] : 0.0f);
        } else {
            f16_rows2(row, in, x, chunks, b ? b + o : zeros8, dst);
            if (done < in)
                for (size_t i = 0; i < r; i++)
                    dst[i] = dot_tail_f16(row + i * in, x, done, in, dst[i]);
        }
        if (acc)
            for (size_t i = 0; i < r; i++)
                y[o + i] += s * tmp[i];
        o += r;
    }
}

#endif /* CMSIS_F16 */
#endif /* CMSIS_F32 */

/* ---- I8 weights ---- */

/* STMT for I = 0, 1, 2, 3, written out (the compiler keeps a loop over a
 * 4-float array in memory otherwise). */
#define FOR4(I, STMT)                                                                                               \
    do {                                                                                                            \
        { const size_t I = 0; STMT; }                                                                               \
        { const size_t I = 1; STMT; }                                                                               \
        { const size_t I = 2; STMT; }                                                                               \
        { const size_t I = 3; STMT; }                                                                               \
    } while (0)

#if defined(COLIBRI_Q8_VCVTB) && defined(CMSIS_F32)
/* The compensation terms of a 4-row block: colibri_q8_compensate4's E part,
 * the same operations in the same order (v += e · x[col], e widened by
 * VCVTB, then multiplied and added with a rounding each, as VMLA does).
 *
 * Row pointers and columns are read in place from the image, so each is
 * bounded where it is used, by a compare and a branch: a row's end against
 * nnz once per row that has entries, a column against cols per entry. One
 * cursor k walks the four rows (for a valid image, row r's entries are
 * k_r .. k_{r+1} - 1, and k ends each row where the next one starts); a row
 * is read only while k < its end <= nnz, so k never reaches past col and val
 * however the pointers were changed. An out-of-bounds row end or column
 * leaves the block's remaining terms out (k = UINT32_MAX): wrong numbers,
 * never a read outside the image's tables.
 *
 * In assembly, called from q8_compensate4 with its arguments and results
 * pinned to the registers the routine uses (r0 = w, r1 = o, r2 = x, the
 * sums in s0-s3): a C function returning four floats costs a stack frame
 * and four dead stores at each call, more than this whole routine's
 * bookkeeping. It clobbers r0-r3, r12, lr, s14, s15 and the flags, as any
 * call may. Register use: r0 nnz, r1 col, r2 x, r3 cols, r4 the cursor k,
 * r5-r8 the rows' ends k_1 .. k_4, r12 val, lr and r9 the entry's column
 * and value. */
_Static_assert(offsetof(colibri_matrix, q8_ptr) == 3 && offsetof(colibri_matrix, cols) == 8 &&
                   offsetof(colibri_matrix, q8_nnz) == 12 && offsetof(colibri_matrix, row_ptr) == 24 &&
                   offsetof(colibri_matrix, col) == 28 && offsetof(colibri_matrix, val) == 32,
               "colibri_cmsis_q8_terms4 reads these fields at these offsets");

#define Q8_ROW_TERMS(ACC, END)                                                                                      \
    "cmp r4, " END "\n\t"                                                                                           \
    "bhs 3f\n\t"                                                                                                    \
    "cmp " END ", r0\n\t"                                                                                           \
    "bhi 2f\n"                                                                                                      \
    "1:\n\t"                                                                                                        \
    "ldrh lr, [r1, r4, lsl #1]\n\t"                                                                                 \
    "ldrh r9, [r12, r4, lsl #1]\n\t"                                                                                \
    "cmp lr, r3\n\t"                                                                                                \
    "bhs 2f\n\t"                                                                                                    \
    "add lr, r2, lr, lsl #2\n\t"                                                                                    \
    "vldr s15, [lr]\n\t"                                                                                            \
    "vmov s14, r9\n\t"                                                                                              \
    "vcvtb.f32.f16 s14, s14\n\t"                                                                                    \
    "vmla.f32 " ACC ", s14, s15\n\t"                                                                                \
    "adds r4, r4, #1\n\t"                                                                                           \
    "cmp r4, " END "\n\t"                                                                                           \
    "blo 1b\n\t"                                                                                                    \
    "b 3f\n"                                                                                                        \
    "2:\n\t"                                                                                                        \
    "mvn r4, #0\n"                                                                                                  \
    "3:\n\t"

/* Three entry points, one per row pointer width (1, 2, 4 bytes), with
 * r1 = &row_ptr[o]: the caller has dispatched on the width already. */
__asm__(".section .text.colibri_cmsis_q8_terms4,\"ax\",%progbits\n\t"
        ".syntax unified\n\t"
        ".thumb\n\t"
        ".p2align 2\n\t"
        ".type colibri_cmsis_q8_terms4_u16, %function\n\t"
        ".thumb_func\n"
        "colibri_cmsis_q8_terms4_u16:\n\t"
        "push {r4-r9, lr}\n\t"
        "ldrh r4, [r1]\n\t"
        "ldrh r5, [r1, #2]\n\t"
        "ldrh r6, [r1, #4]\n\t"
        "ldrh r7, [r1, #6]\n\t"
        "ldrh r8, [r1, #8]\n\t"
        "b 7f\n\t"
        ".type colibri_cmsis_q8_terms4_u32, %function\n\t"
        ".thumb_func\n"
        "colibri_cmsis_q8_terms4_u32:\n\t"
        "push {r4-r9, lr}\n\t"
        "ldr r4, [r1]\n\t"
        "ldrd r5, r6, [r1, #4]\n\t"
        "ldrd r7, r8, [r1, #12]\n\t"
        "b 7f\n\t"
        ".type colibri_cmsis_q8_terms4_u8, %function\n\t"
        ".thumb_func\n"
        "colibri_cmsis_q8_terms4_u8:\n\t"
        "push {r4-r9, lr}\n\t"
        "ldrb r4, [r1]\n\t"
        "ldrb r5, [r1, #1]\n\t"
        "ldrb r6, [r1, #2]\n\t"
        "ldrb r7, [r1, #3]\n\t"
        "ldrb r8, [r1, #4]\n"
        "7:\n\t"
        "ldrd r1, r12, [r0, #28]\n\t" /* col, val */
        "ldrd r3, r0, [r0, #8]\n\t"   /* cols, nnz */
        Q8_ROW_TERMS("s0", "r5") Q8_ROW_TERMS("s1", "r6") Q8_ROW_TERMS("s2", "r7") Q8_ROW_TERMS("s3", "r8")
        "pop {r4-r9, pc}\n\t"
        ".size colibri_cmsis_q8_terms4_u16, .-colibri_cmsis_q8_terms4_u16\n\t"
        ".text");

/* v[0..3] += the E terms of the block whose row pointers start at rp, by
 * the entry point SYM, arguments and results pinned to its registers. */
#define Q8_TERMS4_CALL(SYM, RP)                                                                                     \
    do {                                                                                                            \
        register const colibri_matrix *r0 __asm__("r0") = w;                                                        \
        register const void *r1 __asm__("r1") = (RP);                                                               \
        register const float *r2 __asm__("r2") = x;                                                                 \
        register float s0 __asm__("s0") = v[0], s1 __asm__("s1") = v[1], s2 __asm__("s2") = v[2],                 \
                            s3 __asm__("s3") = v[3];                                                                \
        __asm__ volatile("bl " SYM                                                                                  \
                         : "+r"(r0), "+r"(r1), "+r"(r2), "+t"(s0), "+t"(s1), "+t"(s2), "+t"(s3)                    \
                         :                                                                                          \
                         : "r3", "r12", "lr", "s14", "s15", "cc", "memory");                                        \
        v[0] = s0;                                                                                                  \
        v[1] = s1;                                                                                                  \
        v[2] = s2;                                                                                                  \
        v[3] = s3;                                                                                                  \
    } while (0)

/* colibri_q8_compensate4: the E terms by colibri_cmsis_q8_terms4_* when
 * the block has any (k_0 != k_4), then the companion bias. */
static inline __attribute__((always_inline)) void q8_compensate4(const colibri_matrix *w, size_t o, const float *x,
                                                                 float v[4])
{
    const uint8_t width = w->q8_ptr;
    if (width == 1u) {
        const uint8_t *rp = (const uint8_t *)w->row_ptr + o;
        if (rp[0] != rp[4])
            Q8_TERMS4_CALL("colibri_cmsis_q8_terms4_u8", rp);
    } else if (width == 2u) {
        const uint16_t *rp = (const uint16_t *)w->row_ptr + o;
        if (rp[0] != rp[4])
            Q8_TERMS4_CALL("colibri_cmsis_q8_terms4_u16", rp);
    } else if (width) {
        const uint32_t *rp = (const uint32_t *)w->row_ptr + o;
        if (rp[0] != rp[4])
            Q8_TERMS4_CALL("colibri_cmsis_q8_terms4_u32", rp);
    }
    if (w->q8_bias) {
        float b[4];
        colibri_q8_param4(w, (size_t)w->rows + o, b);
        v[0] += b[0];
        v[1] += b[1];
        v[2] += b[2];
        v[3] += b[3];
    }
}
#else
#define q8_compensate4 colibri_q8_compensate4
#endif

/* The end of a 4-row I8 block after the scale (v[4] local, its address
 * never leaving the function, so it stays in registers): the compensation
 * and companion bias, the layer's bias, then store or y += s · v. */
#define Q8_EPILOGUE4()                                                                                              \
    do {                                                                                                            \
        if (with_e)                                                                                                 \
            q8_compensate4(w, o, x, v);                                                                             \
        if (b)                                                                                                      \
            FOR4(i, v[i] += b[o + i]);                                                                              \
        if (acc)                                                                                                    \
            FOR4(i, y[o + i] += s * v[i]);                                                                          \
        else                                                                                                        \
            FOR4(i, y[o + i] = v[i]);                                                                               \
    } while (0)

/* Σ_k Q[k] · xq[k] of 4 rows (q0 .. q0 + 3·in) at once, 4 columns per step:
 * each weight word (4 int8) becomes two int16 pairs by SXTB16 and SXTB16 of
 * it rotated by 8, matched by x's pairs, two SMLAD per word. The int32 sums
 * wrap as the reference's (modulo 2^32, only for rows past 132 104 entries).
 * Words are read with memcpy: the rows of an I8 matrix need not be 4-byte
 * aligned (in % 4 != 0), and the M7 reads unaligned words. */
static inline uint32_t word_at(const int8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The word rotated right by 8 (ACLE's __ror, which this GCC's arm_acle.h
 * lacks): the compiler folds it into SXTB16's rotation. */
static inline uint32_t ror8(uint32_t v)
{
    return v >> 8 | v << 24;
}

static inline int32_t smlad(uint32_t a, uint32_t b, int32_t acc)
{
    return __smlad((int16x2_t)a, (int16x2_t)b, acc);
}

/* One word (4 columns) of the 4 rows: x's 4 int8 as two int16 pairs (even
 * and odd columns), then per row its weight word, its two pairs, two SMLAD. */
#define DOT4_WORD                                                                                                   \
    "ldr %[xo], [%[px]], #4\n\t"                                                                                    \
    "sxtb16 %[xe], %[xo]\n\t"                                                                                       \
    "sxtb16 %[xo], %[xo], ror #8\n\t"                                                                               \
    "ldr %[wv], [%[pa], %[in]]\n\t"                                                                                 \
    "sxtb16 %[t], %[wv]\n\t"                                                                                        \
    "smlad %[s1], %[t], %[xe], %[s1]\n\t"                                                                           \
    "sxtb16 %[t], %[wv], ror #8\n\t"                                                                                \
    "smlad %[s1], %[t], %[xo], %[s1]\n\t"                                                                           \
    "ldr %[wv], [%[pa]], #4\n\t"                                                                                    \
    "sxtb16 %[t], %[wv]\n\t"                                                                                        \
    "smlad %[s0], %[t], %[xe], %[s0]\n\t"                                                                           \
    "sxtb16 %[t], %[wv], ror #8\n\t"                                                                                \
    "smlad %[s0], %[t], %[xo], %[s0]\n\t"                                                                           \
    "ldr %[wv], [%[pb], %[in]]\n\t"                                                                                 \
    "sxtb16 %[t], %[wv]\n\t"                                                                                        \
    "smlad %[s3], %[t], %[xe], %[s3]\n\t"                                                                           \
    "sxtb16 %[t], %[wv], ror #8\n\t"                                                                                \
    "smlad %[s3], %[t], %[xo], %[s3]\n\t"                                                                           \
    "ldr %[wv], [%[pb]], #4\n\t"                                                                                    \
    "sxtb16 %[t], %[wv]\n\t"                                                                                        \
    "smlad %[s2], %[t], %[xe], %[s2]\n\t"                                                                           \
    "sxtb16 %[t], %[wv], ror #8\n\t"                                                                                \
    "smlad %[s2], %[t], %[xo], %[s2]\n\t"

static __attribute__((noinline)) void dot4_i8(const int8_t *q0, size_t in, const int8_t *xq, int32_t sum[4])
{
    /* Rows 0 and 2 by pointer, rows 1 and 3 at the same pointer + in. */
    const int8_t *pa = q0, *pb = q0 + 2u * in, *px = xq;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t words = in / 4u;
    if (words > 0u) {
        uint32_t xe, xo, wv, t;
        /* Two words a loop step when their count is even (half the loop
         * counting), else one. */
        if (words % 2u == 0u) {
            words /= 2u;
            __asm__ volatile("1:\n\t" DOT4_WORD DOT4_WORD
                             "subs %[n], %[n], #1\n\t"
                             "bne 1b\n\t"
                             : [pa] "+r"(pa), [pb] "+r"(pb), [px] "+r"(px), [n] "+r"(words), [s0] "+r"(s0),
                               [s1] "+r"(s1), [s2] "+r"(s2), [s3] "+r"(s3), [xe] "=&r"(xe), [xo] "=&r"(xo),
                               [wv] "=&r"(wv), [t] "=&r"(t)
                             : [in] "r"(in)
                             : "memory", "cc");
        } else {
            __asm__ volatile("1:\n\t" DOT4_WORD
                             "subs %[n], %[n], #1\n\t"
                             "bne 1b\n\t"
                             : [pa] "+r"(pa), [pb] "+r"(pb), [px] "+r"(px), [n] "+r"(words), [s0] "+r"(s0),
                               [s1] "+r"(s1), [s2] "+r"(s2), [s3] "+r"(s3), [xe] "=&r"(xe), [xo] "=&r"(xo),
                               [wv] "=&r"(wv), [t] "=&r"(t)
                             : [in] "r"(in)
                             : "memory", "cc");
        }
    }
    /* In uint32, like the reference, so a (theoretical) wrap is defined. */
    uint32_t u0 = (uint32_t)s0, u1 = (uint32_t)s1, u2 = (uint32_t)s2, u3 = (uint32_t)s3;
    for (size_t k = in / 4u * 4u; k < in; k++) {
        const int32_t xk = xq[k];
        u0 += (uint32_t)(q0[k] * xk);
        u1 += (uint32_t)(q0[in + k] * xk);
        u2 += (uint32_t)(q0[2u * in + k] * xk);
        u3 += (uint32_t)(q0[3u * in + k] * xk);
    }
    sum[0] = (int32_t)u0;
    sum[1] = (int32_t)u1;
    sum[2] = (int32_t)u2;
    sum[3] = (int32_t)u3;
}

static int32_t dot1_i8(const int8_t *q, size_t in, const int8_t *xq)
{
    int32_t s = 0;
    size_t k = 0;
    for (; k + 4 <= in; k += 4) {
        const uint32_t xw = word_at(xq + k), ww = word_at(q + k);
        s = smlad((uint32_t)__sxtb16((int8x4_t)ww), (uint32_t)__sxtb16((int8x4_t)xw), s);
        s = smlad((uint32_t)__sxtb16((int8x4_t)ror8(ww)), (uint32_t)__sxtb16((int8x4_t)ror8(xw)), s);
    }
    uint32_t u = (uint32_t)s;
    for (; k < in; k++)
        u += (uint32_t)(q[k] * (int32_t)xq[k]);
    return (int32_t)u;
}

/* As colibri_matvec_q8q8, bit for bit: the integer sums are exact and the
 * float steps are the reference's, in its order (scale, E, bias, emit). */
static void matvec_q8q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a, const float *b,
                        int acc, float s, float *y)
{
    const int8_t *q = w->data;
    const size_t in = w->cols, out = w->rows;
    const int with_e = colibri_q8_has_terms(w);
    int32_t sum[4];
    size_t o = 0;
    for (; o + 4 <= out; o += 4) {
        float sc[4], v[4];
        dot4_i8(q + o * in, in, xq, sum);
        colibri_q8_scale4(w, o, sc);
        FOR4(i, v[i] = (float)sum[i] * (sc[i] * a));
        Q8_EPILOGUE4();
    }
    for (; o < out; o++)
        colibri_emit(y, o,
                     colibri_q8_compensate(w, o, x, (float)dot1_i8(q + o * in, in, xq) * (colibri_q8_scale(w, o) * a)),
                     b, acc, s);
}

#if defined(CMSIS_F32)
/* Row R of 4 (word at [PA] or [PA, in]): its 4 int8 weights sign-extended by
 * SXTB (with the byte rotations), moved two by two into S0-S3, converted
 * exactly (VCVT from int32), fused-multiply-added with x in s16-s19 into ACC. */
#define Q8_ROW(LOAD, S0, S1, S2, S3, ACC)                                                                          \
    LOAD "\n\t"                                                                                                     \
    "sxtb %[b0], %[wv]\n\t"                                                                                         \
    "sxtb %[b1], %[wv], ror #8\n\t"                                                                                 \
    "sxtb %[b2], %[wv], ror #16\n\t"                                                                                \
    "sxtb %[b3], %[wv], ror #24\n\t"                                                                                \
    "vmov " S0 ", " S1 ", %[b0], %[b1]\n\t"                                                                         \
    "vmov " S2 ", " S3 ", %[b2], %[b3]\n\t"                                                                         \
    "vcvt.f32.s32 " S0 ", " S0 "\n\t"                                                                               \
    "vcvt.f32.s32 " S1 ", " S1 "\n\t"                                                                               \
    "vcvt.f32.s32 " S2 ", " S2 "\n\t"                                                                               \
    "vcvt.f32.s32 " S3 ", " S3 "\n\t"                                                                               \
    "vfma.f32 " ACC ", " S0 ", s16\n\t"                                                                             \
    "vfma.f32 " ACC ", " S1 ", s17\n\t"                                                                             \
    "vfma.f32 " ACC ", " S2 ", s18\n\t"                                                                             \
    "vfma.f32 " ACC ", " S3 ", s19\n\t"

/* v[r] = Σ_{k < 4·words} (float)q[r·in + k] · x[k], fused, for 4 rows at
 * once (rows 0 and 2 by pointer, 1 and 3 at the same pointer + in, as
 * dot4_i8), words >= 1; 4 columns a step, x's 4 values loaded once. */
static __attribute__((noinline)) void q8f_rows4(const int8_t *q0, size_t in, const float *x, size_t words,
                                                float v[4])
{
    const int8_t *pa = q0, *pb = q0 + 2u * in;
    uint32_t wv, b0, b1, b2, b3;
    __asm__ volatile("vldmia %[v], {s24-s27}\n\t"
                     "1:\n\t"
                     "vldmia %[x]!, {s16-s19}\n\t"
                     Q8_ROW("ldr %[wv], [%[pa], %[in]]", "s0", "s1", "s2", "s3", "s25")
                     Q8_ROW("ldr %[wv], [%[pa]], #4", "s4", "s5", "s6", "s7", "s24")
                     Q8_ROW("ldr %[wv], [%[pb], %[in]]", "s8", "s9", "s10", "s11", "s27")
                     Q8_ROW("ldr %[wv], [%[pb]], #4", "s12", "s13", "s14", "s15", "s26")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     "vstmia %[v], {s24-s27}\n\t"
                     : [pa] "+r"(pa), [pb] "+r"(pb), [x] "+r"(x), [n] "+r"(words), [wv] "=&r"(wv), [b0] "=&r"(b0),
                       [b1] "=&r"(b1), [b2] "=&r"(b2), [b3] "=&r"(b3)
                     : [in] "r"(in), [v] "r"(v)
                     : S_ALL, "memory", "cc");
}

/* One row (the last out % 4, e.g. a small router's): *v0 and *v1, the even
 * and odd column pairs' sums, += Σ_{k < 4·words} (float)q[k] · x[k], fused,
 * 4 columns a step (as Q8_ROW, two accumulators), words >= 1. */
static __attribute__((noinline)) void q8f_row1(const int8_t *q, const float *x, size_t words, float *v0, float *v1)
{
    uint32_t wv, b0, b1, b2, b3;
    float a0 = *v0, a1 = *v1;
    __asm__ volatile("1:\n\t"
                     "vldmia %[x]!, {s16-s19}\n\t"
                     "ldr %[wv], [%[q]], #4\n\t"
                     "sxtb %[b0], %[wv]\n\t"
                     "sxtb %[b1], %[wv], ror #8\n\t"
                     "sxtb %[b2], %[wv], ror #16\n\t"
                     "sxtb %[b3], %[wv], ror #24\n\t"
                     "vmov s0, s1, %[b0], %[b1]\n\t"
                     "vmov s2, s3, %[b2], %[b3]\n\t"
                     "vcvt.f32.s32 s0, s0\n\t"
                     "vcvt.f32.s32 s1, s1\n\t"
                     "vcvt.f32.s32 s2, s2\n\t"
                     "vcvt.f32.s32 s3, s3\n\t"
                     "vfma.f32 %[a0], s0, s16\n\t"
                     "vfma.f32 %[a1], s1, s17\n\t"
                     "vfma.f32 %[a0], s2, s18\n\t"
                     "vfma.f32 %[a1], s3, s19\n\t"
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     : [q] "+r"(q), [x] "+r"(x), [n] "+r"(words), [wv] "=&r"(wv), [b0] "=&r"(b0), [b1] "=&r"(b1),
                       [b2] "=&r"(b2), [b3] "=&r"(b3), [a0] "+t"(a0), [a1] "+t"(a1)
                     :
                     : "s0", "s1", "s2", "s3", "s16", "s17", "s18", "s19", "memory", "cc");
    *v0 = a0;
    *v1 = a1;
}

/* I8 weights, f32 activations: 4 rows at a time (q8f_rows4), each int8
 * weight widened exactly and fused-multiply-added; then the reference's
 * scale, E, bias and emit, in its order. */
static void matvec_q8(const colibri_matrix *w, const float *x, const float *b, int acc, float s, float *y)
{
    const int8_t *q = w->data;
    const size_t in = w->cols, out = w->rows, words = in / 4u;
    const int with_e = colibri_q8_has_terms(w);
    size_t o = 0;
    for (; o + 4 <= out; o += 4) {
        const int8_t *q0 = q + o * in;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, v[4];
        if (words != 0u)
            q8f_rows4(q0, in, x, words, d);
        for (size_t k = words * 4u; k < in; k++)
            for (size_t i = 0; i < 4; i++)
                d[i] = __builtin_fmaf((float)q0[i * in + k], x[k], d[i]);
        FOR4(i, v[i] = d[i]);
        float sc[4];
        colibri_q8_scale4(w, o, sc);
        FOR4(i, v[i] *= sc[i]);
        Q8_EPILOGUE4();
    }
    for (; o < out; o++) {
        const int8_t *qo = q + o * in;
        float v = 0.0f, v1 = 0.0f;
        size_t k = 0;
        if (words != 0u) {
            q8f_row1(qo, x, words, &v, &v1);
            k = words * 4u;
        }
        for (; k + 2 <= in; k += 2) {
            v = __builtin_fmaf((float)qo[k], x[k], v);
            v1 = __builtin_fmaf((float)qo[k + 1], x[k + 1], v1);
        }
        if (k < in)
            v = __builtin_fmaf((float)qo[k], x[k], v);
        colibri_emit(y, o, colibri_q8_compensate(w, o, x, (v + v1) * colibri_q8_scale(w, o)), b, acc, s);
    }
}
#endif /* CMSIS_F32 */

/* ---- I4 weights (format v5) ----
 * Eight columns are one word of four bytes: byte i holds columns 2i (low
 * nibble) and 2i + 1 (high).
 *
 *   int8 act.  Per group, the token's xq is first regrouped into int16 pairs
 *              in the order the nibbles come out of a word, (x0, x4), (x2,
 *              x6), (x1, x5), (x3, x7) per 8 columns (SXTB16, PKHBT/PKHTB),
 *              and 8 · Σ xq of the group summed alongside. Then per row and
 *              word: the nibbles flipped to u = Q + 8 in 0..15 (EOR with
 *              0x88888888), the low and high ones masked out (AND, AND with
 *              LSR #4), spread into int16 pairs
 *              by UXTB16 (and UXTB16 ROR #8), two SMLAD per 4 columns; the
 *              group's Σ Q·xq = Σ u·xq - 8 · Σ xq, exact. The float steps
 *              are the reference's in its order: its bits. 2 rows share
 *              each load of x's pairs (an asm loop, q4_dot_u2).
 *   f32 act.   Two rows at a time (an asm loop, q4f_rows2): each nibble
 *              sign-extended (SBFX), moved two by two (VMOV), converted
 *              (VCVT), fused-multiply-added with x (8 values a VLDM, shared
 *              by the rows) into the group's sum, which is then fused-
 *              multiply-added with the group's scale: within the tolerance
 *              above with |w| = |Q|·s_g.
 * Columns past the last whole word of a group (only in a row's last group)
 * are done one by one. */

static inline uint32_t q4_word(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v); /* the M7 reads unaligned words */
    return v;
}

/* The group's xq [c0, c0 + 8·words) as int16 pairs, 4 words per 8 columns,
 * into xp; returns 8 · Σ xq over those columns. */
static int32_t q4_pairs(const int8_t *xq, size_t words, uint32_t *xp)
{
    int32_t sum = 0;
    for (size_t k = 0; k < words; k++, xq += 8, xp += 4) {
        const uint32_t a = q4_word((const uint8_t *)xq), b = q4_word((const uint8_t *)xq + 4);
        const uint32_t a02 = (uint32_t)__sxtb16((int8x4_t)a), a13 = (uint32_t)__sxtb16((int8x4_t)ror8(a));
        const uint32_t b46 = (uint32_t)__sxtb16((int8x4_t)b), b57 = (uint32_t)__sxtb16((int8x4_t)ror8(b));
        xp[0] = (a02 & 0xFFFFu) | b46 << 16;          /* (x0, x4) */
        xp[1] = a02 >> 16 | (b46 & 0xFFFF0000u);      /* (x2, x6) */
        xp[2] = (a13 & 0xFFFFu) | b57 << 16;          /* (x1, x5) */
        xp[3] = a13 >> 16 | (b57 & 0xFFFF0000u);      /* (x3, x7) */
        sum = smlad(xp[0], 0x00080008u, sum);
        sum = smlad(xp[1], 0x00080008u, sum);
        sum = smlad(xp[2], 0x00080008u, sum);
        sum = smlad(xp[3], 0x00080008u, sum);
    }
    return sum;
}

/* Σ u·xq over `words` words of a row (u = Q + 8), pairs from q4_pairs. */
static int32_t q4_dot_u(const uint8_t *p, const uint32_t *xp, size_t words, int32_t s)
{
    for (size_t k = 0; k < words; k++, p += 4, xp += 4) {
        const uint32_t wv = q4_word(p) ^ 0x88888888u, lo = wv & 0x0F0F0F0Fu, hi = (wv >> 4) & 0x0F0F0F0Fu;
        s = smlad((uint32_t)__uxtb16((uint8x4_t)lo), xp[0], s);
        s = smlad((uint32_t)__uxtb16((uint8x4_t)ror8(lo)), xp[1], s);
        s = smlad((uint32_t)__uxtb16((uint8x4_t)hi), xp[2], s);
        s = smlad((uint32_t)__uxtb16((uint8x4_t)ror8(hi)), xp[3], s);
    }
    return s;
}

/* Two rows at once (p0 and p0 + stride), words >= 1: *s0, *s1 += Σ u·xq,
 * x's pairs loaded once per word for both. Per row and word: LDR, EOR (u =
 * Q + 8), AND / LSR + AND (low and high nibbles), 4 UXTB16 and 4 SMLAD. */
#define Q4_ROW_WORD(PTR_LOAD, S)                                                                                    \
    PTR_LOAD "\n\t"                                                                                                 \
    "eor %[wv], %[wv], #0x88888888\n\t"                                                                             \
    "and %[lo], %[wv], #0x0F0F0F0F\n\t"                                                                             \
    "lsr %[hi], %[wv], #4\n\t"                                                                                      \
    "and %[hi], %[hi], #0x0F0F0F0F\n\t"                                                                             \
    "uxtb16 %[wv], %[lo]\n\t"                                                                                       \
    "smlad " S ", %[wv], %[x0], " S "\n\t"                                                                          \
    "uxtb16 %[wv], %[lo], ror #8\n\t"                                                                               \
    "smlad " S ", %[wv], %[x1], " S "\n\t"                                                                          \
    "uxtb16 %[wv], %[hi]\n\t"                                                                                       \
    "smlad " S ", %[wv], %[x2], " S "\n\t"                                                                          \
    "uxtb16 %[wv], %[hi], ror #8\n\t"                                                                               \
    "smlad " S ", %[wv], %[x3], " S "\n\t"

static inline __attribute__((always_inline)) void q4_dot_u2(const uint8_t *p0, size_t stride, const uint32_t *xp, size_t words,
                                                int32_t *s0, int32_t *s1)
{
    int32_t a0 = *s0, a1 = *s1;
    uint32_t x0, x1, x2, x3, wv, lo, hi;
    __asm__ volatile("1:\n\t"
                     "ldrd %[x0], %[x1], [%[px]]\n\t"
                     "ldrd %[x2], %[x3], [%[px], #8]\n\t"
                     "adds %[px], %[px], #16\n\t"
                     Q4_ROW_WORD("ldr %[wv], [%[pa], %[st]]", "%[a1]")
                     Q4_ROW_WORD("ldr %[wv], [%[pa]], #4", "%[a0]")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     : [pa] "+r"(p0), [px] "+r"(xp), [n] "+r"(words), [a0] "+r"(a0), [a1] "+r"(a1), [x0] "=&r"(x0),
                       [x1] "=&r"(x1), [x2] "=&r"(x2), [x3] "=&r"(x3), [wv] "=&r"(wv), [lo] "=&r"(lo), [hi] "=&r"(hi)
                     : [st] "r"(stride)
                     : "memory", "cc");
    *s0 = a0;
    *s1 = a1;
}

/* Σ Q·xq over columns [c, end) of a row, one by one (fewer than 8). */
static int32_t q4_dot_tail(const uint8_t *row, const int8_t *xq, size_t c, size_t end)
{
    int32_t s = 0;
    for (; c < end; c++)
        s += colibri_q4_nibble(row, c) * (int32_t)xq[c];
    return s;
}

/* As colibri_matvec_q4q8, bit for bit. When the row fits the pair buffer
 * (in <= 256) x's pairs and each group's correction are made once for the
 * token; otherwise per group and block of rows. */
#define Q4_PAIR_COLS 256u
static void matvec_q4q8(const colibri_matrix *w, const float *x, const int8_t *xq, float a, const float *b, int acc,
                        float s, float *y)
{
    const size_t in = w->cols, out = w->rows, stride = (in + 1u) >> 1, G = w->q4_groups;
    const size_t group = (size_t)1 << w->q4_group_log2;
    uint32_t xp[Q4_PAIR_COLS / 2u]; /* 4 pair words per 8 columns */
    int32_t corr_all[Q4_PAIR_COLS / 8u];
    const int once = in <= Q4_PAIR_COLS;
    if (once)
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
            corr_all[g] = q4_pairs(xq + c0, (end - c0) / 8u, xp + c0 / 2u);
        }
    size_t o = 0;
    for (; o + 2u <= out; o += 2u) {
        const uint8_t *r0 = colibri_q4_row(w, o);
        const uint16_t *sc = colibri_q4_scales(w, o);
        float v0 = 0.0f, v1 = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in, words = (end - c0) / 8u;
            const uint32_t *gp = xp + c0 / 2u;
            int32_t corr;
            if (once) {
                corr = corr_all[g];
            } else {
                gp = xp;
                corr = q4_pairs(xq + c0, words, xp);
            }
            int32_t s0 = -corr, s1 = -corr;
            if (words)
                q4_dot_u2(r0 + (c0 >> 1), stride, gp, words, &s0, &s1);
            if (c0 + words * 8u < end) {
                s0 += q4_dot_tail(r0, xq, c0 + words * 8u, end);
                s1 += q4_dot_tail(r0 + stride, xq, c0 + words * 8u, end);
            }
            v0 += (float)s0 * colibri_q8_half(sc[g]);
            v1 += (float)s1 * colibri_q8_half(sc[G + g]);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v0 * a), b, acc, s);
        colibri_emit(y, o + 1u, colibri_q4_epilogue(w, o + 1u, x, v1 * a), b, acc, s);
    }
    if (o < out) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *sc = colibri_q4_scales(w, o);
        float v = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in, words = (end - c0) / 8u;
            const int32_t corr = q4_pairs(xq + c0, words, xp);
            const int32_t sum = q4_dot_u(row + (c0 >> 1), xp, words, 0) - corr +
                                q4_dot_tail(row, xq, c0 + words * 8u, end);
            v += (float)sum * colibri_q8_half(sc[g]);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v * a), b, acc, s);
    }
}

#if defined(CMSIS_F32)
/* One row's word (8 columns, the word at [PA] or [PA, st]): the nibbles
 * sign-extended (SBFX) two by two into S0.., converted exactly (VCVT),
 * fused-multiply-added with x in s16-s23 into ACC. */
#define Q4F_ROW(LOAD, S0, S1, S2, S3, S4, S5, S6, S7, ACC)                                                         \
    LOAD "\n\t"                                                                                                     \
    "sbfx %[b0], %[wv], #0, #4\n\t"                                                                                 \
    "sbfx %[b1], %[wv], #4, #4\n\t"                                                                                 \
    "sbfx %[b2], %[wv], #8, #4\n\t"                                                                                 \
    "sbfx %[b3], %[wv], #12, #4\n\t"                                                                                \
    "vmov " S0 ", " S1 ", %[b0], %[b1]\n\t"                                                                         \
    "vmov " S2 ", " S3 ", %[b2], %[b3]\n\t"                                                                         \
    "sbfx %[b0], %[wv], #16, #4\n\t"                                                                                \
    "sbfx %[b1], %[wv], #20, #4\n\t"                                                                                \
    "sbfx %[b2], %[wv], #24, #4\n\t"                                                                                \
    "asr %[b3], %[wv], #28\n\t"                                                                                     \
    "vmov " S4 ", " S5 ", %[b0], %[b1]\n\t"                                                                         \
    "vmov " S6 ", " S7 ", %[b2], %[b3]\n\t"                                                                         \
    "vcvt.f32.s32 " S0 ", " S0 "\n\t"                                                                               \
    "vcvt.f32.s32 " S1 ", " S1 "\n\t"                                                                               \
    "vcvt.f32.s32 " S2 ", " S2 "\n\t"                                                                               \
    "vcvt.f32.s32 " S3 ", " S3 "\n\t"                                                                               \
    "vcvt.f32.s32 " S4 ", " S4 "\n\t"                                                                               \
    "vcvt.f32.s32 " S5 ", " S5 "\n\t"                                                                               \
    "vcvt.f32.s32 " S6 ", " S6 "\n\t"                                                                               \
    "vcvt.f32.s32 " S7 ", " S7 "\n\t"                                                                               \
    "vfma.f32 " ACC ", " S0 ", s16\n\t"                                                                             \
    "vfma.f32 " ACC ", " S1 ", s17\n\t"                                                                             \
    "vfma.f32 " ACC ", " S2 ", s18\n\t"                                                                             \
    "vfma.f32 " ACC ", " S3 ", s19\n\t"                                                                             \
    "vfma.f32 " ACC ", " S4 ", s20\n\t"                                                                             \
    "vfma.f32 " ACC ", " S5 ", s21\n\t"                                                                             \
    "vfma.f32 " ACC ", " S6 ", s22\n\t"                                                                             \
    "vfma.f32 " ACC ", " S7 ", s23\n\t"

/* Two rows (p0 and p0 + stride), words >= 1: *v0, *v1 += Σ (float)Q · x
 * over 8·words columns, fused, x's 8 values loaded once (VLDM) per word. */
static __attribute__((noinline)) void q4f_rows2(const uint8_t *p0, size_t stride, const float *x, size_t words,
                                                float *v0, float *v1)
{
    float a0 = *v0, a1 = *v1;
    uint32_t wv, b0, b1, b2, b3;
    __asm__ volatile("1:\n\t"
                     "vldmia %[x]!, {s16-s23}\n\t"
                     Q4F_ROW("ldr %[wv], [%[pa], %[st]]", "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "%[a1]")
                     Q4F_ROW("ldr %[wv], [%[pa]], #4", "s8", "s9", "s10", "s11", "s12", "s13", "s14", "s15", "%[a0]")
                     "subs %[n], %[n], #1\n\t"
                     "bne 1b\n\t"
                     : [pa] "+r"(p0), [x] "+r"(x), [n] "+r"(words), [wv] "=&r"(wv), [b0] "=&r"(b0), [b1] "=&r"(b1),
                       [b2] "=&r"(b2), [b3] "=&r"(b3), [a0] "+t"(a0), [a1] "+t"(a1)
                     : [st] "r"(stride)
                     : "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11", "s12", "s13", "s14",
                       "s15", "s16", "s17", "s18", "s19", "s20", "s21", "s22", "s23", "memory", "cc");
    *v0 = a0;
    *v1 = a1;
}

/* I4 weights, f32 activations: rows two by two (q4f_rows2 per group), each
 * group's sum then fused-multiply-added with the group's scale; a group's
 * last columns short of a word, and an odd last row, one by one. */
static void matvec_q4(const colibri_matrix *w, const float *x, const float *b, int acc, float s, float *y)
{
    const size_t in = w->cols, out = w->rows, G = w->q4_groups, group = (size_t)1 << w->q4_group_log2;
    const size_t stride = (in + 1u) >> 1;
    size_t o = 0;
    for (; o + 2u <= out; o += 2u) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *sc = colibri_q4_scales(w, o);
        float v0 = 0.0f, v1 = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in, words = (end - c0) / 8u;
            float p0 = 0.0f, p1 = 0.0f;
            if (words)
                q4f_rows2(row + (c0 >> 1), stride, x + c0, words, &p0, &p1);
            for (size_t c = c0 + words * 8u; c < end; c++) {
                p0 = __builtin_fmaf((float)colibri_q4_nibble(row, c), x[c], p0);
                p1 = __builtin_fmaf((float)colibri_q4_nibble(row + stride, c), x[c], p1);
            }
            v0 = __builtin_fmaf(p0, colibri_q8_half(sc[g]), v0);
            v1 = __builtin_fmaf(p1, colibri_q8_half(sc[G + g]), v1);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v0), b, acc, s);
        colibri_emit(y, o + 1u, colibri_q4_epilogue(w, o + 1u, x, v1), b, acc, s);
    }
    if (o < out) {
        const uint8_t *row = colibri_q4_row(w, o);
        const uint16_t *sc = colibri_q4_scales(w, o);
        float v = 0.0f;
        for (size_t g = 0; g < G; g++) {
            const size_t c0 = g * group, end = c0 + group < in ? c0 + group : in;
            float p = 0.0f;
            for (size_t c = c0; c < end; c++)
                p = __builtin_fmaf((float)colibri_q4_nibble(row, c), x[c], p);
            v = __builtin_fmaf(p, colibri_q8_half(sc[g]), v);
        }
        colibri_emit(y, o, colibri_q4_epilogue(w, o, x, v), b, acc, s);
    }
}
#endif /* CMSIS_F32 */

#if defined(CMSIS_FPV5)
/* ---- The int8 quantiser: the reference's bits, faster ----
 * m = max |x| by VMAXNM and a sum of |x| · 0 (NaN as soon as some x is NaN or
 * inf), 4 values a step; then q = lroundf(x · (127 / m)) by VCVTA (round half
 * away from zero, as roundf). No clamp: |x| <= m gives |x · fl(127/m)| <=
 * 127 (1 + 2^-24)^2 < 127.5, so the reference's clamp to ±127 never acts.
 * Rows with NaN or inf, all zeros, or m < 2^-100 (the reference's rescaling)
 * go to the reference, which then decides their every bit. */
static void quantize_rows_cmsis(const float *x, const uint16_t *rows, size_t n, size_t in, int8_t *restrict q,
                                float *restrict a)
{
    const size_t steps = in / 4u; /* 4 values a step (VLDM), then the tail in C */
    for (size_t i = 0; i < n; i++, q += in) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        float m0 = 0.0f, m1 = 0.0f, z0 = 0.0f, z1 = 0.0f;
        if (steps != 0u) {
            const float *p = xi;
            size_t c = steps;
            __asm__ volatile("1:\n\t"
                             "vldmia %[p]!, {s0-s3}\n\t"
                             "vabs.f32 s0, s0\n\t"
                             "vabs.f32 s1, s1\n\t"
                             "vabs.f32 s2, s2\n\t"
                             "vabs.f32 s3, s3\n\t"
                             "vmaxnm.f32 %[m0], %[m0], s0\n\t"
                             "vmaxnm.f32 %[m1], %[m1], s1\n\t"
                             "vfma.f32 %[z0], s0, %[zero]\n\t"
                             "vfma.f32 %[z1], s1, %[zero]\n\t"
                             "vmaxnm.f32 %[m0], %[m0], s2\n\t"
                             "vmaxnm.f32 %[m1], %[m1], s3\n\t"
                             "vfma.f32 %[z0], s2, %[zero]\n\t"
                             "vfma.f32 %[z1], s3, %[zero]\n\t"
                             "subs %[c], %[c], #1\n\t"
                             "bne 1b\n\t"
                             : [p] "+r"(p), [c] "+r"(c), [m0] "+t"(m0), [m1] "+t"(m1), [z0] "+t"(z0), [z1] "+t"(z1)
                             : [zero] "t"(0.0f)
                             : "s0", "s1", "s2", "s3", "memory", "cc");
        }
        for (size_t k = steps * 4u; k < in; k++) {
            const float v = fabsf(xi[k]);
            m0 = fmaxf(m0, v);
            z0 = __builtin_fmaf(v, 0.0f, z0);
        }
        const float m = fmaxf(m0, m1);
        if (z0 + z1 != 0.0f || !(m >= 0x1p-100f)) {
            colibri_quantize_rows_ref(xi, NULL, 1, in, q, a + i);
            continue;
        }
        const float inv = 127.0f / m;
        if (steps != 0u) {
            const float *p = xi;
            int8_t *d = q;
            size_t c = steps;
            uint32_t r0, r1, r2, r3;
            __asm__ volatile("1:\n\t"
                             "vldmia %[p]!, {s0-s3}\n\t"
                             "vmul.f32 s0, s0, %[inv]\n\t"
                             "vmul.f32 s1, s1, %[inv]\n\t"
                             "vmul.f32 s2, s2, %[inv]\n\t"
                             "vmul.f32 s3, s3, %[inv]\n\t"
                             "vcvta.s32.f32 s0, s0\n\t"
                             "vcvta.s32.f32 s1, s1\n\t"
                             "vcvta.s32.f32 s2, s2\n\t"
                             "vcvta.s32.f32 s3, s3\n\t"
                             "vmov %[r0], %[r1], s0, s1\n\t"
                             "vmov %[r2], %[r3], s2, s3\n\t"
                             "strb %[r0], [%[d]], #1\n\t"
                             "strb %[r1], [%[d]], #1\n\t"
                             "strb %[r2], [%[d]], #1\n\t"
                             "strb %[r3], [%[d]], #1\n\t"
                             "subs %[c], %[c], #1\n\t"
                             "bne 1b\n\t"
                             : [p] "+r"(p), [d] "+r"(d), [c] "+r"(c), [r0] "=&r"(r0), [r1] "=&r"(r1), [r2] "=&r"(r2),
                               [r3] "=&r"(r3)
                             : [inv] "t"(inv)
                             : "s0", "s1", "s2", "s3", "memory", "cc");
        }
        for (size_t k = steps * 4u; k < in; k++)
            q[k] = (int8_t)lroundf(xi[k] * inv);
        a[i] = m / 127.0f;
    }
}

#endif /* CMSIS_FPV5 */

/* ---- The linear kernels: one token at a time, weights by dtype ---- */


static void matvec(const colibri_matrix *w, const float *x, const int8_t *xq, float a, const float *b, int acc,
                   float s, float *y)
{
    if (w->dtype == COLIBRI_DTYPE_I8) {
        if (xq)
            matvec_q8q8(w, x, xq, a, b, acc, s, y);
        else
#if defined(CMSIS_F32)
            matvec_q8(w, x, b, acc, s, y);
#else
            colibri_matvec_q8(w, x, b, acc, s, y);
#endif
    } else if (w->dtype == COLIBRI_DTYPE_F16) {
#if defined(CMSIS_F16)
        matvec_f16(w, x, b, acc, s, y);
#else
        colibri_matvec_f16(w, x, b, acc, s, y);
#endif
    } else {
#if defined(CMSIS_F32)
        matvec_f32(w, x, b, acc, s, y);
#else
        colibri_matvec_f32(w, x, b, acc, s, y);
#endif
    }
}

/* F32 weights with whole-chunk rows and at least 2 tokens: the tokens two by
 * two (matvec_f32_pair), so each weight is read once per pair. */
static int f32_pairs(const colibri_matrix *w, size_t n)
{
#if defined(CMSIS_F32)
    return n >= 2u && w->dtype == COLIBRI_DTYPE_F32 && w->cols >= 8u && w->cols % 8u == 0u;
#else
    (void)w;
    (void)n;
    return 0;
#endif
}

/* F32 weights in whole 8 x 8 blocks (rows and columns multiples of 8): one
 * token goes straight to f32_blocks8. */
static int f32_whole_blocks(const colibri_matrix *w)
{
#if defined(CMSIS_F32)
    return w->dtype == COLIBRI_DTYPE_F32 && w->cols != 0u && (w->cols | w->rows) % 8u == 0u && w->rows != 0u;
#else
    (void)w;
    return 0;
#endif
}

#if defined(CMSIS_F32)
static const float one = 1.0f;
#endif

static __attribute__((noinline)) void linear_tokens(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                         const colibri_qrows *xq, float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    size_t i = 0;
#if defined(CMSIS_F32)
    if (f32_pairs(w, n))
        for (; i + 2u <= n; i += 2u)
            matvec_f32_pair(w, x + (rows ? rows[i] : i) * in, x + (rows ? rows[i + 1] : i + 1) * in, b, 0, 1.0f,
                            1.0f, y + i * out, y + (i + 1) * out);
#endif
    for (; i < n; i++)
        matvec(w, x + (rows ? rows[i] : i) * in, xq ? xq->q + i * in : NULL, xq ? xq->a[i] : 0.0f, b, 0, 1.0f,
               y + i * out);
}

static __attribute__((noinline)) void linear_acc_tokens(const float *x, size_t n, const colibri_matrix *w, const float *b, const uint16_t *rows,
                             const float *scale, const colibri_qrows *xq, float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    size_t i = 0;
#if defined(CMSIS_F32)
    if (f32_pairs(w, n))
        for (; i + 2u <= n; i += 2u)
            matvec_f32_pair(w, x + i * in, x + (i + 1) * in, b, 1, scale ? scale[i] : 1.0f,
                            scale ? scale[i + 1] : 1.0f, y + (rows ? rows[i] : i) * out,
                            y + (rows ? rows[i + 1] : i + 1) * out);
#endif
    for (; i < n; i++)
        matvec(w, x + i * in, xq ? xq->q + i * in : NULL, xq ? xq->a[i] : 0.0f, b, 1, scale ? scale[i] : 1.0f,
               y + (rows ? rows[i] : i) * out);
}

#if defined(CMSIS_F32)
#define MATVEC_Q4 matvec_q4
#else
#define MATVEC_Q4 colibri_matvec_q4
#endif

/* I4 weights: token by token, out of line (the dispatch to them is one
 * test of the dtype in linear_cmsis and linear_acc_cmsis, after the f32
 * batch-1 paths and before the token loops of the other dtypes, which
 * stay as they were). */
static __attribute__((noinline)) void linear_i4(const float *x, const uint16_t *rows, size_t n,
                                                const colibri_matrix *w, const float *b, const colibri_qrows *xq,
                                                float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + (rows ? rows[i] : i) * in;
        if (xq)
            matvec_q4q8(w, xi, xq->q + i * in, xq->a[i], b, 0, 1.0f, y + i * out);
        else
            MATVEC_Q4(w, xi, b, 0, 1.0f, y + i * out);
    }
}

static __attribute__((noinline)) void linear_acc_i4(const float *x, size_t n, const colibri_matrix *w,
                                                    const float *b, const uint16_t *rows, const float *scale,
                                                    const colibri_qrows *xq, float *restrict y)
{
    const size_t in = w->cols, out = w->rows;
    for (size_t i = 0; i < n; i++) {
        float *yi = y + (rows ? rows[i] : i) * out;
        const float s = scale ? scale[i] : 1.0f;
        if (xq)
            matvec_q4q8(w, x + i * in, xq->q + i * in, xq->a[i], b, 1, s, yi);
        else
            MATVEC_Q4(w, x + i * in, b, 1, s, yi);
    }
}

/* The linear kernels: one token of a matrix in whole 8 x 8 F32 blocks goes
 * straight to f32_blocks8 (the common case of a small model at batch 1,
 * kept free of the general path's frame); everything else token by token
 * (linear_tokens, linear_acc_tokens). */
static void linear_cmsis(const float *x, const uint16_t *rows, size_t n, const colibri_matrix *w, const float *b,
                         const colibri_qrows *xq, float *restrict y)
{
#if defined(CMSIS_F32)
    if (n == 1u && f32_whole_blocks(w)) {
        const size_t in = w->cols;
        f32_blocks8(w->data, in, x + (rows ? rows[0] : 0u) * in, w->rows / 8u, b, y, NULL);
        return;
    }
#endif
#if defined(CMSIS_F32)
    if (n == 1u && w->dtype == COLIBRI_DTYPE_F32) {
        const size_t in = w->cols;
        if (in != 0u && in % 8u == 0u)
            f32_whole_rows(w->data, in, w->rows, x + (rows ? rows[0] : 0u) * in, b, NULL, y);
        else
            matvec_f32(w, x + (rows ? rows[0] : 0u) * in, b, 0, 1.0f, y);
        return;
    }
#endif
    if (w->dtype == COLIBRI_DTYPE_I4) {
        linear_i4(x, rows, n, w, b, xq, y);
        return;
    }
    linear_tokens(x, rows, n, w, b, xq, y);
}

static void linear_acc_cmsis(const float *x, size_t n, const colibri_matrix *w, const float *b, const uint16_t *rows,
                             const float *scale, const colibri_qrows *xq, float *restrict y)
{
#if defined(CMSIS_F32)
    if (n == 1u && f32_whole_blocks(w)) {
        const size_t out = w->rows;
        f32_blocks8(w->data, w->cols, x, out / 8u, b, y + (rows ? rows[0] : 0u) * out, scale ? scale : &one);
        return;
    }
#endif
    if (w->dtype == COLIBRI_DTYPE_I4) {
        linear_acc_i4(x, n, w, b, rows, scale, xq, y);
        return;
    }
    linear_acc_tokens(x, n, w, b, rows, scale, xq, y);
}

#if defined(CMSIS_FPV5)
/* ---- ReLU: exactly the reference's v < 0 ? 0 : v ----
 * VCMP of 0 with v, then VSELGT picks 0 where 0 > v: NaN compares unordered
 * (not GT) and stays, -0 is not above 0 and stays, as in the reference. 8
 * values per VLDM/VSTM. Other activations: the reference. */
#define RELU1(R) "vcmp.f32 s8, " R "\n\tvmrs APSR_nzcv, fpscr\n\tvselgt.f32 " R ", s8, " R "\n\t"
#define RELU8                                                                                                       \
    "vldmia %[p], {s0-s7}\n\t"                                                                                      \
    RELU1("s0") RELU1("s1") RELU1("s2") RELU1("s3") RELU1("s4") RELU1("s5") RELU1("s6") RELU1("s7")                 \
    "vstmia %[p]!, {s0-s7}\n\t"

/* ---- SiLU and sigmoid: the reference's formulas, v · (1 / (1 + e^-v)) and
 * 1 / (1 + e^-v), with a single-precision e^x: n = round(x / ln 2) (VCVTA),
 * r = x - n ln 2 (two fused steps, Cody-Waite), e^r by its Taylor series to
 * r^8/8! (Horner, fused; truncation < 6e-9 relative for |r| <= ln2 / 2), then
 * · 2^n by the exponent bits. Within a few ulp of the reference's double-
 * precision colibri_expf (the tolerance: tests/c/cm7/kernel_test.c). Values
 * with |v| > 87 (n would leave the normal range), NaN and ±inf go to the
 * reference, which then gives their every bit. */
#define SILU_RANGE 87.0f

static inline float expf_fast(float v)
{
    const long n = lroundf(v * 1.44269504088896341f);
    const float nf = (float)n;
    float r = __builtin_fmaf(-nf, 0.693145751953125f, v);
    r = __builtin_fmaf(-nf, 1.42860682030941723e-6f, r);
    float p = 1.0f / 40320.0f;
    p = __builtin_fmaf(p, r, 1.0f / 5040.0f);
    p = __builtin_fmaf(p, r, 1.0f / 720.0f);
    p = __builtin_fmaf(p, r, 1.0f / 120.0f);
    p = __builtin_fmaf(p, r, 1.0f / 24.0f);
    p = __builtin_fmaf(p, r, 1.0f / 6.0f);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static __attribute__((noinline)) void sigmoid_family(float *x, size_t n, uint32_t kind)
{
    const int silu = kind == COLIBRI_ACT_SILU;
    for (size_t i = 0; i < n; i++) {
        const float v = x[i];
        if (!(__builtin_fabsf(v) <= SILU_RANGE)) {
            colibri_activation_ref(x + i, 1, kind);
            continue;
        }
        const float sig = 1.0f / (1.0f + expf_fast(-v));
        x[i] = silu ? v * sig : sig;
    }
}

static void activation_cmsis(float *x, size_t n, uint32_t kind)
{
    if (kind != COLIBRI_ACT_RELU) {
        if (kind == COLIBRI_ACT_SILU || kind == COLIBRI_ACT_SIGMOID)
            sigmoid_family(x, n, kind);
        else
            colibri_activation_ref(x, n, kind);
        return;
    }
    size_t blocks = n / 8u;
    float *p = x;
    if (blocks != 0u) {
        /* Two blocks a loop step, after a lone first block when their
         * count is odd. */
        __asm__ volatile("vmov s8, %[z]\n\t"
                         "lsrs %[n], %[n], #1\n\t"
                         "bcc 1f\n\t"
                         RELU8
                         "cmp %[n], #0\n\t"
                         "beq 2f\n\t"
                         "1:\n\t"
                         RELU8 RELU8
                         "subs %[n], %[n], #1\n\t"
                         "bne 1b\n\t"
                         "2:\n\t"
                         : [p] "+r"(p), [n] "+r"(blocks)
                         : [z] "r"(0u) /* +0.0f */
                         : "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "memory", "cc");
    }
    for (size_t i = n / 8u * 8u; i < n; i++)
        x[i] = x[i] < 0.0f ? 0.0f : x[i];
}

#endif /* CMSIS_FPV5 */

void colibri_kernels_cmsis(colibri_kernels *k)
{
#if defined(CMSIS_FPV5)
    k->name = "cmsis (Cortex-M DSP + FPv5)";
#elif defined(CMSIS_F32)
    k->name = "cmsis (Cortex-M DSP + FPv4)";
#else
    k->name = "cmsis (Cortex-M DSP)";
#endif
    k->linear = linear_cmsis;
    k->linear_acc = linear_acc_cmsis;
#if defined(CMSIS_FPV5)
    k->activation = activation_cmsis;
    k->quantize_rows = quantize_rows_cmsis;
#endif
}

#endif /* COLIBRI_BACKEND_CMSIS */
