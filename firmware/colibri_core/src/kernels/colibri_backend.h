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
void colibri_kernels_neon(struct colibri_kernels *k);
void colibri_kernels_cmsis(struct colibri_kernels *k);
void colibri_kernels_rvv(struct colibri_kernels *k);

#endif /* COLIBRI_BACKEND_H */
