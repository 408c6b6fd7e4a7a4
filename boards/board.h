/*
 * What the runner firmware needs from a board. Each board folder
 * (boards/mps2_an500, boards/nucleo_h743zi) implements it with its own
 * startup code, linker script and a board.mk for the runner's Makefile.
 */
#ifndef COLIBRI_BOARD_H
#define COLIBRI_BOARD_H

#include <stddef.h>
#include <stdint.h>

/* How board_work_stop() measures work (docs/protocol.md, work_kind). */
enum board_work_kind {
    BOARD_WORK_NONE = 0,
    BOARD_WORK_QEMU_INSTRUCTIONS = 1, /* instructions, from SysTick under QEMU -icount */
    BOARD_WORK_DWT_CYCLES = 2,        /* core clock cycles from the DWT cycle counter */
};

/* Clocks, caches, FPU, the console UART, the work counter, stack painting. */
void board_init(void);

/* Blocking read of one byte from the console UART. */
uint8_t board_uart_getc(void);

/* Blocking write of n bytes to the console UART. */
void board_uart_write(const uint8_t *data, size_t n);

/* Work measurement around one call: start, then stop returns the units of
 * board_work_kind() elapsed since start. */
void board_work_start(void);
uint64_t board_work_stop(void);
enum board_work_kind board_work_kind(void);

/* A short name, e.g. "mps2-an500 (QEMU)" or "NUCLEO-H743ZI". */
const char *board_name(void);

/* Stack size and high-water mark in bytes (the stack is painted at reset). */
uint32_t board_stack_size(void);
uint32_t board_stack_used(void);

/* Resets the board; under QEMU ends the emulator with status 0. */
void board_reset(void) __attribute__((noreturn));

/* Ends the program with a status (QEMU: semihosting exit; hardware: reset). */
void board_exit(int status) __attribute__((noreturn));

#endif /* COLIBRI_BOARD_H */
