/*
 * The fuzz-only board (fuzz/board/board.c): boards/board.h over memory, for
 * running the runner's frame handler on the host under libFuzzer. These are
 * the harness's handles on it; the runner itself sees only board.h.
 */
#ifndef FUZZ_BOARD_H
#define FUZZ_BOARD_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

/* Slot geometry: two slots of 64 KiB in 4 KiB sectors, 32-byte flash words. */
#define FUZZ_SLOT_SIZE (64u * 1024u)
#define FUZZ_SECTOR_SIZE 4096u

/* Where board_uart_getc() jumps (value 1) once the input is used up, and
 * board_reset()/board_exit() jump (value 2): the end of one fuzz input. */
extern jmp_buf fuzz_board_done;

/* Starts a run: the UART will deliver these bytes, then end the run; both
 * flash slots are erased. */
void fuzz_board_begin(const uint8_t *uart_in, size_t n);

/* Whether the runner wrote only well-formed response packets so far (COBS,
 * length field, CRC); 0 after the first malformed one. */
int fuzz_board_responses_ok(void);

/* Well-formed responses of this packet type (a request type | PROTO_RESPONSE,
 * or PROTO_STATUS) since the process started: what the harness reached. */
unsigned long fuzz_board_responses_of(uint8_t type);

#endif /* FUZZ_BOARD_H */
