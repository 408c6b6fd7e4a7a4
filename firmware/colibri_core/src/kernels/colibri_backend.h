/*
 * Which optimised backend this build compiles (colibri_kernels.h): named with
 * -DCOLIBRI_KERNELS_<REF|X86|NEON|CMSIS|RVV> (make KERNELS=...), or by default
 * the one for the target's architecture. Exactly one COLIBRI_BACKEND_* ends
 * up defined, or none (reference kernels only); each backend's sources are
 * wrapped in #if COLIBRI_BACKEND_<name>, so every build system compiles the
 * one source list (sources.txt) and the selection is this one macro.
 */
#ifndef COLIBRI_BACKEND_H
#define COLIBRI_BACKEND_H

#if (defined(COLIBRI_KERNELS_REF) + defined(COLIBRI_KERNELS_X86) + defined(COLIBRI_KERNELS_NEON) + \
     defined(COLIBRI_KERNELS_CMSIS) + defined(COLIBRI_KERNELS_RVV)) > 1
#error "name at most one of COLIBRI_KERNELS_REF, _X86, _NEON, _CMSIS, _RVV"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_CAN_X86 1
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define COLIBRI_CAN_NEON 1
#endif
#if defined(__ARM_FEATURE_DSP) && !defined(__aarch64__)
#define COLIBRI_CAN_CMSIS 1
#endif
/* RVV 1.0 with 64-bit elements and f64 (the V extension proper, not a Zve*
 * subset) and a compiler with the __riscv_ intrinsics (clang 16+, GCC 13+). */
#if defined(__riscv_vector) && defined(__riscv_v_intrinsic) && __riscv_v_intrinsic >= 11000 && \
    defined(__riscv_v_elen_fp) && __riscv_v_elen_fp >= 64
#define COLIBRI_CAN_RVV 1
#endif

#if defined(COLIBRI_KERNELS_REF)
/* reference kernels only */
#elif defined(COLIBRI_KERNELS_X86)
#if !defined(COLIBRI_CAN_X86)
#error "KERNELS=x86 needs an x86-64 target and GCC or Clang"
#endif
#define COLIBRI_BACKEND_X86 1
#elif defined(COLIBRI_KERNELS_NEON)
#if !defined(COLIBRI_CAN_NEON)
#error "KERNELS=neon needs an AArch64 target with NEON"
#endif
#define COLIBRI_BACKEND_NEON 1
#elif defined(COLIBRI_KERNELS_CMSIS)
#if !defined(COLIBRI_CAN_CMSIS)
#error "KERNELS=cmsis needs a 32-bit Arm target with the DSP extension (Cortex-M4/M7/M33 ...)"
#endif
#define COLIBRI_BACKEND_CMSIS 1
#elif defined(COLIBRI_KERNELS_RVV)
#if !defined(COLIBRI_CAN_RVV)
#error "KERNELS=rvv needs a RISC-V target with the V extension (-march=rv64gcv) and the __riscv_ intrinsics (clang 16+, GCC 13+)"
#endif
#define COLIBRI_BACKEND_RVV 1
#elif defined(COLIBRI_CAN_X86)
#define COLIBRI_BACKEND_X86 1
#elif defined(COLIBRI_CAN_NEON)
#define COLIBRI_BACKEND_NEON 1
#elif defined(COLIBRI_CAN_CMSIS)
#define COLIBRI_BACKEND_CMSIS 1
#elif defined(COLIBRI_CAN_RVV)
#define COLIBRI_BACKEND_RVV 1
#endif

/* Each backend fills the entries of *k it improves on for this CPU and
 * leaves the rest (the reference kernels) alone. */
struct colibri_kernels;
void colibri_kernels_x86(struct colibri_kernels *k);
/* The x86-64 backend up to a level (1: AVX2+FMA+F16C, 2: AVX-512F as well,
 * 3: AVX-512 VNNI as well),
 * for the kernel tests to cover every level the CPU has. */
void colibri_kernels_x86_level(struct colibri_kernels *k, int max_level);
/* The same with AVX-VNNI (the VEX vpdpbusd on ymm, used by the block form of
 * int8 activations below AVX-512 VNNI) allowed or not, so the tests reach
 * the AVX2 block kernels on a CPU that has AVX-VNNI. */
void colibri_kernels_x86_caps(struct colibri_kernels *k, int max_level, int allow_avx_vnni);
/* The x86-64 block-form kernels (x86/colibri_kernels_x86_blocks.c) into *k:
 * isa 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI (BW, VL); the caller checked the CPU. */
void colibri_x86_blocks(struct colibri_kernels *k, int isa);
/* The x86-64 token-model kernels (x86/colibri_kernels_x86_lm.c: attention
 * over the KV cache) into *k; needs AVX2, FMA and F16C (the caller checked). */
void colibri_x86_lm(struct colibri_kernels *k);
void colibri_kernels_neon(struct colibri_kernels *k);
/* The NEON backend with SDOT allowed or not (where the CPU has it), so the
 * kernel tests reach the ARMv8.0 kernels on a CPU with dotprod too. */
void colibri_kernels_neon_caps(struct colibri_kernels *k, int allow_dotprod);
/* The NEON block-form kernels (neon/colibri_kernels_neon_blocks.c) into *k:
 * dotprod 1 SDOT (the caller checked the CPU), 0 ARMv8.0. */
void colibri_neon_blocks(struct colibri_kernels *k, int dotprod);
/* The x86-64 backend's I4 linear kernels (x86/colibri_kernels_x86_q4.c, a
 * file of its own to keep the other's compile time): n tokens, token i
 * reading x row xrows ? xrows[i] : i (and int8 row i of xq, or xq NULL for
 * f32 activations) and storing (acc 0) or adding with gate scale[i] into y
 * row yrows ? yrows[i] : i. Needs AVX2, FMA and F16C; avx512 (the CPU has
 * AVX-512F) sums f32 activations in 16 lanes as the AVX-512 GEMM does. */
struct colibri_matrix;
struct colibri_qrows;
void colibri_x86_q4_gemm(const float *x, const uint16_t *xrows, const uint16_t *yrows, const float *scale,
                         const struct colibri_qrows *xq, const struct colibri_matrix *w, const float *b, float *y,
                         size_t n, int acc, int avx512);
/* Rows [o, o + R) of an I4 matrix widened to f32 weights Q · s_g (exact)
 * into wide [R, cols], for the f32 GEMM micro-kernels (AVX2, F16C). */
void colibri_x86_q4_widen(const struct colibri_matrix *w, size_t o, size_t R, float *wide);
/* The same values with 16-lane conversions (AVX-512F). */
void colibri_x86_q4_widen512(const struct colibri_matrix *w, size_t o, size_t R, float *wide);
void colibri_kernels_cmsis(struct colibri_kernels *k);
void colibri_kernels_rvv(struct colibri_kernels *k);

#endif /* COLIBRI_BACKEND_H */
