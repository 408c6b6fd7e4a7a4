/*
 * FreeRTOS configuration of the Colibri smart meter example, for its two
 * boards (the Makefile defines APP_BOARD_MPS2_AN500 for BOARD=mps2_an500):
 *   - NUCLEO-H743ZI (default): STM32H743ZI, Cortex-M7 at 480 MHz with the
 *     double-precision FPv5-D16 FPU;
 *   - mps2-an500 (APP_BOARD_MPS2_AN500): the Cortex-M7 that QEMU emulates,
 *     25 MHz, the same FPU.
 * Kernel port GCC/ARM_CM7/r0p1 on both (see README.md for why that port).
 *
 * Written for FreeRTOS-Kernel V10.4.2 .. V11.x and main (README.md,
 * "Kernel versions"): it sets only options all of them understand
 * (INCLUDE_xTaskDelayUntil, which V10.4.2 introduced: defining the old
 * INCLUDE_vTaskDelayUntil as well is an #error from V10.4.2 on;
 * configUSE_16_BIT_TICKS rather than V11's
 * configTICK_TYPE_WIDTH_IN_BITS, which V11 derives from it; the two must not
 * both be set), and configSTACK_DEPTH_TYPE = uint32_t, which makes the static
 * memory callbacks' stack size parameter the same type in both (V10:
 * uint32_t *, V11.1+: configSTACK_DEPTH_TYPE *).
 *
 * Everything is allocated statically: no heap_x.c is linked, and
 * pvPortMalloc() does not exist in the program.
 */
#ifndef FREERTOS_CONFIG_H
#define FREERTOS_CONFIG_H

#ifndef __ASSEMBLER__
#include <stdint.h>

#if !defined(APP_BOARD_MPS2_AN500)
/* boards/nucleo_h743zi/board.c: the core clock board_init() achieved. */
uint32_t nh7_sysclk_hz(void);
#endif

/* main.c: prints the failed assertion on the console and stops. */
void app_assert_failed(const char *file, int line);
#endif

/* ---- clock and tick ----------------------------------------------------- */

#if defined(APP_BOARD_MPS2_AN500)
/* QEMU's mps2-an500: SysTick counts the 25 MHz system clock
 * (boards/mps2_an500/mps2_an500.h). Under -icount the tick is 1 ms of QEMU's
 * virtual time, not of the host's. */
#define configCPU_CLOCK_HZ 25000000UL
#else
/* The nominal core clock: PLL1 at 480 MHz on revision V silicon (VOS0). */
#define APP_NOMINAL_CPU_CLOCK_HZ 480000000UL

/* The clock the SysTick reload is computed from (the port does it at run
 * time, in vPortSetupTimerInterrupt()). board_init() reaches 480 MHz on
 * revision V silicon, 400 MHz on revision Y (VOS1 is its limit), and stays on
 * the 64 MHz HSI if the HSE or the PLL does not come up; taking the clock it
 * actually reached keeps the tick at 1 ms in every case. On revision V it is
 * exactly APP_NOMINAL_CPU_CLOCK_HZ. */
#define configCPU_CLOCK_HZ ((unsigned long)nh7_sysclk_hz())
#endif
#define configTICK_RATE_HZ ((TickType_t)1000) /* 1 ms tick: pdMS_TO_TICKS() is exact */
#define configUSE_16_BIT_TICKS 0              /* 32-bit TickType_t: 49 days before it wraps */
#define configUSE_TICKLESS_IDLE 0

/* ---- scheduler ---------------------------------------------------------- */

#define configUSE_PREEMPTION 1
#define configUSE_TIME_SLICING 1
#define configUSE_PORT_OPTIMISED_TASK_SELECTION 1 /* CLZ; needs configMAX_PRIORITIES <= 32 */
#define configMAX_PRIORITIES 5                    /* 0 idle .. 4 timer service task */
#define configIDLE_SHOULD_YIELD 1
#define configMAX_TASK_NAME_LEN 12
#define configUSE_TASK_NOTIFICATIONS 1
#define configUSE_MUTEXES 0
#define configUSE_RECURSIVE_MUTEXES 0
#define configUSE_COUNTING_SEMAPHORES 0
#define configUSE_QUEUE_SETS 0
#define configQUEUE_REGISTRY_SIZE 0
#define configUSE_NEWLIB_REENTRANT 0 /* no task calls newlib functions that keep state */
#define configENABLE_BACKWARD_COMPATIBILITY 0
#define configUSE_CO_ROUTINES 0
#define configMAX_CO_ROUTINE_PRIORITIES 1

/* Stack sizes are in words (StackType_t, 4 bytes on the Cortex-M7). */
#define configSTACK_DEPTH_TYPE uint32_t
#define configMINIMAL_STACK_SIZE ((configSTACK_DEPTH_TYPE)256) /* 1 KB: the idle task */

/* ---- memory: static allocation only -------------------------------------- */

#define configSUPPORT_STATIC_ALLOCATION 1  /* xTaskCreateStatic, xQueueCreateStatic, the two callbacks */
#define configSUPPORT_DYNAMIC_ALLOCATION 0 /* no pvPortMalloc: link no heap_x.c */
#define configKERNEL_PROVIDED_STATIC_MEMORY 0 /* V11.1+: main.c provides the idle and timer task memory */

/* ---- software timers (the timer service task; its memory is main.c's) ---- */

#define configUSE_TIMERS 1
#define configTIMER_TASK_PRIORITY (configMAX_PRIORITIES - 1)
#define configTIMER_QUEUE_LENGTH 4
#define configTIMER_TASK_STACK_DEPTH ((configSTACK_DEPTH_TYPE)256)

/* ---- hooks and checks --------------------------------------------------- */

#define configUSE_IDLE_HOOK 1 /* main.c: wfi until the next interrupt */
#define configUSE_TICK_HOOK 0
#define configUSE_MALLOC_FAILED_HOOK 0 /* nothing to fail: no dynamic allocation */
#define configUSE_DAEMON_TASK_STARTUP_HOOK 0
/* Method 2: on every switch out, the end of the task's stack must still hold
 * the fill pattern; vApplicationStackOverflowHook() (main.c) reports it. */
#define configCHECK_FOR_STACK_OVERFLOW 2
#define configGENERATE_RUN_TIME_STATS 0
#define configUSE_TRACE_FACILITY 0
#define configUSE_STATS_FORMATTING_FUNCTIONS 0

/* Every kernel assertion goes to app_assert_failed() (main.c): the file and
 * line on USART3, then a halt with interrupts off. */
#define configASSERT(x)                              \
    do {                                             \
        if ((x) == 0) {                              \
            app_assert_failed(__FILE__, __LINE__);   \
        }                                            \
    } while (0)

/* ---- interrupt priorities ------------------------------------------------ */

#if defined(APP_BOARD_MPS2_AN500)
/* QEMU's NVIC: how many priority bits it implements depends on the QEMU
 * version (7.2 implements all 8), and V10's ports assert that
 * configPRIO_BITS, when defined, equals what they read back. So it is not
 * defined here, and the two levels are given as 8-bit register values: the
 * NUCLEO's levels 15 (the kernel: the lowest) and 5, which any number of
 * implemented bits from 4 up keeps distinct and V11's 8-bit check accepts
 * (lowest bit clear). */
#define configKERNEL_INTERRUPT_PRIORITY 0xFF
#define configMAX_SYSCALL_INTERRUPT_PRIORITY 0x50
#else
/* The STM32H7 NVIC implements 4 priority bits (16 levels, in the top nibble). */
#define configPRIO_BITS 4
#define configLIBRARY_LOWEST_INTERRUPT_PRIORITY 15
/* Interrupts at this level or lower in urgency (numerically >= 5) may call
 * ...FromISR() functions; 0..4 are never masked by the kernel. */
#define configLIBRARY_MAX_SYSCALL_INTERRUPT_PRIORITY 5
#define configKERNEL_INTERRUPT_PRIORITY (configLIBRARY_LOWEST_INTERRUPT_PRIORITY << (8 - configPRIO_BITS))
#define configMAX_SYSCALL_INTERRUPT_PRIORITY (configLIBRARY_MAX_SYSCALL_INTERRUPT_PRIORITY << (8 - configPRIO_BITS))
#endif
#define configMAX_API_CALL_INTERRUPT_PRIORITY configMAX_SYSCALL_INTERRUPT_PRIORITY

/* ---- exception handlers --------------------------------------------------- */

#if !defined(APP_BOARD_MPS2_AN500)
/* Direct routing of SVCall and PendSV: the port's handlers take the names of
 * the weak aliases in boards/nucleo_h743zi/startup.c's vector table, so the
 * table points at them and V11's configCHECK_HANDLER_INSTALLATION check
 * passes.
 *
 * SysTick is different: boards/nucleo_h743zi/board.c defines SysTick_Handler
 * itself (it extends the DWT cycle counter behind board_work_start/stop), so
 * the port's xPortSysTickHandler keeps its own name and main.c installs a RAM
 * copy of the vector table whose SysTick entry calls both (see
 * install_vectors() there). */
#define vPortSVCHandler SVC_Handler
#define xPortPendSVHandler PendSV_Handler
#else
/* mps2-an500: boards/mps2_an500/startup.S sends SVCall and PendSV to its
 * fault report and SysTick to its work counter, and has no weak aliases, so
 * main.c's RAM copy of the vector table points all three at the port's
 * handlers under their own names (install_vectors() there); the check below
 * reads that copy. */
#endif
#define configCHECK_HANDLER_INSTALLATION 1

/* ---- optional API functions ------------------------------------------------ */

#define INCLUDE_vTaskPrioritySet 0
#define INCLUDE_uxTaskPriorityGet 0
#define INCLUDE_vTaskDelete 0
#define INCLUDE_vTaskSuspend 1          /* also: portMAX_DELAY blocks without a timeout */
/* Only the new name: from V10.4.2 on, FreeRTOS.h stops with an #error if
 * INCLUDE_vTaskDelayUntil is defined as well (tests/target/test_target_freertos.py checks). */
#define INCLUDE_xTaskDelayUntil 1
#define INCLUDE_vTaskDelay 1
#define INCLUDE_xTaskGetSchedulerState 1 /* main.c's SysTick entry asks it */
#define INCLUDE_xTaskGetCurrentTaskHandle 1
#define INCLUDE_uxTaskGetStackHighWaterMark 1
#define INCLUDE_xTaskGetIdleTaskHandle 0
#define INCLUDE_eTaskGetState 0
#define INCLUDE_xTimerPendFunctionCall 0

#endif /* FREERTOS_CONFIG_H */
