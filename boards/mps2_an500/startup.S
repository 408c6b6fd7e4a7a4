/*
 * mps2-an500 startup: vector table, Reset_Handler (FPU on, .data copied,
 * .bss zeroed, stack painted, then main) and the fault entry that hands the
 * stacked exception frame to board_fault() in board.c.
 *
 * Everything before main is assembly so that no C code (which could use the
 * FPU or call memset on the stack it is painting) runs before it is safe.
 */
    .syntax unified
    .cpu cortex-m7
    .fpu fpv5-d16
    .thumb

#include "mps2_an500.h"

    .section .isr_vector, "a"
    .align 7
    .global __isr_vector
__isr_vector:
    .word __stack_top__
    .word Reset_Handler
    .word Fault_Handler         /* 2 NMI */
    .word Fault_Handler         /* 3 HardFault */
    .word Fault_Handler         /* 4 MemManage */
    .word Fault_Handler         /* 5 BusFault */
    .word Fault_Handler         /* 6 UsageFault */
    .word 0, 0, 0, 0
    .word Fault_Handler         /* 11 SVCall */
    .word Fault_Handler         /* 12 DebugMonitor */
    .word 0
    .word Fault_Handler         /* 14 PendSV */
    .word SysTick_Handler       /* 15 SysTick */
    .rept 64                    /* external interrupts: none is enabled */
    .word Fault_Handler
    .endr
    .size __isr_vector, . - __isr_vector

    .text

    .global Reset_Handler
    .type Reset_Handler, %function
    .thumb_func
Reset_Handler:
    /* FPU: full access to CP10/CP11 before any floating-point instruction. */
    ldr r0, =0xE000ED88         /* CPACR */
    ldr r1, [r0]
    orr r1, r1, #(0xF << 20)
    str r1, [r0]
    dsb
    isb

    /* .data: copy its initial values from code memory. */
    ldr r0, =__data_start__
    ldr r1, =__data_end__
    ldr r2, =__data_load__
1:  cmp r0, r1
    bhs 2f
    ldr r3, [r2], #4
    str r3, [r0], #4
    b 1b
2:
    /* .bss: zero (8-byte aligned bounds). */
    ldr r0, =__bss_start__
    ldr r1, =__bss_end__
    movs r2, #0
    movs r3, #0
3:  cmp r0, r1
    bhs 4f
    strd r2, r3, [r0], #8
    b 3b
4:
    /* Stack: paint from its bottom up to the current stack pointer. */
    ldr r0, =__stack_bottom__
    mov r1, sp
    ldr r2, =MPS2_STACK_PAINT
5:  cmp r0, r1
    bhs 6f
    str r2, [r0], #4
    b 5b
6:
    bl main
    bl board_exit               /* main's return value is the exit status */
    b .
    .size Reset_Handler, . - Reset_Handler

/* Every fault and unexpected exception: pass the stacked frame (from MSP or
 * PSP, as EXC_RETURN says) and EXC_RETURN to board_fault(), which reports
 * and ends the run. */
    .global Fault_Handler
    .type Fault_Handler, %function
    .thumb_func
Fault_Handler:
    tst lr, #4
    ite eq
    mrseq r0, msp
    mrsne r0, psp
    mov r1, lr
    b board_fault
    .size Fault_Handler, . - Fault_Handler

/* SysTick: counts counter wraps for the work counter (board.c). Exactly
 * MPS2_SYSTICK_ISR_INSNS (5) instructions, which board_work_stop() subtracts
 * from a measurement once per interrupt taken. */
    .global SysTick_Handler
    .type SysTick_Handler, %function
    .thumb_func
SysTick_Handler:
    ldr r0, =board_systick_wraps
    ldr r1, [r0]
    adds r1, r1, #1
    str r1, [r0]
    bx lr
    .size SysTick_Handler, . - SysTick_Handler

    .pool
