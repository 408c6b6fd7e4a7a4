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

/* -- flash: the two model slots (firmware/runner/slots.c) -------------------
 *
 * Two slots, A and B, each a whole number of erase sectors, hold a model
 * image behind a 32-byte header (docs/protocol.md, "Model slots"). The engine
 * reads a committed image in place, so a slot is memory-mapped and readable
 * with plain loads; board_flash_read() is the careful way to read a region
 * that may hold an interrupted program or erase (on the STM32H7 such a flash
 * word can have an uncorrectable ECC error, which a plain load turns into a
 * bus fault).
 *
 * Erase sets every byte of a sector to 0xFF. Program writes one flash word
 * (program_size bytes, aligned) that must be erased; bits only go from 1 to 0.
 * The functions block until the operation is complete and return
 * BOARD_FLASH_OK or a negative board_flash_status. They accept addresses in
 * the two slots only, so nothing else in flash (the program) can be hit. */
typedef struct board_flash_info {
    uintptr_t slot_base[2]; /* slot A, slot B */
    uint32_t slot_size;     /* bytes per slot: a whole number of sectors */
    uint32_t sector_size;   /* erase unit, bytes */
    uint32_t program_size;  /* program unit (one flash word), bytes: 32 */
} board_flash_info_t;

enum board_flash_status {
    BOARD_FLASH_OK = 0,
    BOARD_FLASH_E_ADDRESS = -1,    /* not a sector/word start inside a slot */
    BOARD_FLASH_E_NOT_ERASED = -2, /* programming a word that is not erased */
    BOARD_FLASH_E_LOCKED = -3,     /* the controller did not unlock */
    BOARD_FLASH_E_TIMEOUT = -4,    /* the operation did not finish in time */
    BOARD_FLASH_E_HARDWARE = -5,   /* the controller reported an error (write protection, sequence, ...) */
    BOARD_FLASH_E_ECC = -6,        /* a read hit an uncorrectable ECC error */
};

const board_flash_info_t *board_flash_info(void);

/* Erases the sector starting at addr. */
int board_flash_erase_sector(uintptr_t addr);

/* Programs the flash word at addr (program_size aligned) with program_size
 * bytes from data (any alignment). */
int board_flash_program(uintptr_t addr, const void *data);

/* Copies n bytes of slot flash at addr to dst; BOARD_FLASH_E_ECC instead of a
 * fault if any of them is unreadable. */
int board_flash_read(void *dst, uintptr_t addr, size_t n);

#ifdef BOARD_HAS_POWER_CUT
/* Debug, emulated boards only: a deterministic power loss in the flash driver.
 * After `n` more flash operations (erases and programs counted together) the
 * board loses power: mode 0 cleanly once the n-th operation has completed (n
 * = 0: before the next one starts), mode 1 in the middle of the n-th one
 * (n >= 1): a torn erase sets only the first `tear` bytes of the sector
 * (rounded down to flash words) to 0xFF, a torn program programs only the
 * bytes whose bit is set in `tear` (bit i = byte i of the first 32). The
 * board then stops dead (interrupts off, spinning, never answering). */
void board_power_cut_arm(uint32_t n, uint32_t mode, uint32_t tear);

/* Flash operations (erases + programs) since reset. */
uint32_t board_flash_op_count(void);
#endif

#endif /* COLIBRI_BOARD_H */
