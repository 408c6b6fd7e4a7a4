/*
 * mps2-an500 board constants shared by startup.S and board.c (so plain
 * preprocessor definitions only).
 */
#ifndef MPS2_AN500_H
#define MPS2_AN500_H

/* Core clock: SysTick with CLKSOURCE=1 counts at this rate (QEMU's sysclk). */
#define MPS2_CORE_HZ 25000000u

/* The word the stack is painted with at reset (high-water mark). */
#define MPS2_STACK_PAINT 0xC5AC5AC5 /* no suffix: startup.S uses it too */

/* Instructions SysTick_Handler (startup.S) executes per interrupt. */
#define MPS2_SYSTICK_ISR_INSNS 5u

/* CMSDK APB UART0. */
#define MPS2_UART0_BASE 0x40004000u

#endif /* MPS2_AN500_H */
