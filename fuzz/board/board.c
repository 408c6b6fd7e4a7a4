/*
 * A board for fuzzing the runner on the host: boards/board.h over memory
 * buffers. The UART reads from the fuzz input and checks every response the
 * runner writes (it must decode as COBS into a packet whose length field and
 * CRC-32 hold); flash is two slots in a static array with the rules of real
 * flash (erase to 0xFF by sector, program a 32-byte word once per erase,
 * bits only from 1 to 0), as boards/mps2_an500 emulates it.
 */
#include <setjmp.h>
#include <string.h>

#include "board.h"
#include "cobs.h"
#include "crc32.h"
#include "fuzz_board.h"
#include "protocol.h"

#define FLASH_WORD 32u

jmp_buf fuzz_board_done;

static const uint8_t *uart_in;
static size_t uart_left;

/* One response frame being collected, and whether all so far were sound. */
static uint8_t frame[COBS_MAX_ENCODED(PROTO_OVERHEAD + PROTO_MAX_PAYLOAD) + 16];
static uint8_t packet[sizeof frame];
static size_t frame_len;
static unsigned long responses_of[256];
static int responses_ok;

static uint8_t flash[2][FUZZ_SLOT_SIZE] __attribute__((aligned(FUZZ_SECTOR_SIZE)));
static board_flash_info_t flash_info;

void fuzz_board_begin(const uint8_t *in, size_t n)
{
    uart_in = in;
    uart_left = n;
    frame_len = 0;
    responses_ok = 1;
    memset(flash, 0xFF, sizeof flash);
}

int fuzz_board_responses_ok(void)
{
    return responses_ok;
}

unsigned long fuzz_board_responses_of(uint8_t type)
{
    return responses_of[type];
}

void board_init(void)
{
}

uint8_t board_uart_getc(void)
{
    if (uart_left == 0)
        longjmp(fuzz_board_done, 1);
    uart_left--;
    return *uart_in++;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void check_frame(void)
{
    const size_t n = cobs_decode(frame, frame_len, packet, sizeof packet);
    if (n == COBS_ERROR || n < PROTO_OVERHEAD || le32(packet + 4) != n - PROTO_OVERHEAD ||
        n - PROTO_OVERHEAD > PROTO_MAX_PAYLOAD ||
        crc32_update(0u, packet, n - PROTO_CRC_SIZE) != le32(packet + n - PROTO_CRC_SIZE))
        responses_ok = 0;
    else
        responses_of[packet[0]]++;
}

void board_uart_write(const uint8_t *data, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (data[i] == 0u) {
            check_frame();
            frame_len = 0;
        } else if (frame_len == sizeof frame) {
            responses_ok = 0; /* longer than any packet the runner may send */
        } else {
            frame[frame_len++] = data[i];
        }
    }
}

void board_work_start(void)
{
}

uint64_t board_work_stop(void)
{
    return 0u;
}

enum board_work_kind board_work_kind(void)
{
    return BOARD_WORK_NONE;
}

const char *board_name(void)
{
    return "host fuzz board";
}

uint32_t board_stack_size(void)
{
    return 0u;
}

uint32_t board_stack_used(void)
{
    return 0u;
}

void board_reset(void)
{
    longjmp(fuzz_board_done, 2);
}

void board_exit(int status)
{
    (void)status;
    longjmp(fuzz_board_done, 2);
}

const board_flash_info_t *board_flash_info(void)
{
    flash_info.slot_base[0] = (uintptr_t)flash[0];
    flash_info.slot_base[1] = (uintptr_t)flash[1];
    flash_info.slot_size = FUZZ_SLOT_SIZE;
    flash_info.sector_size = FUZZ_SECTOR_SIZE;
    flash_info.program_size = FLASH_WORD;
    return &flash_info;
}

/* Whether [addr, addr + n) lies inside one slot and addr is a multiple of align. */
static int in_slot(uintptr_t addr, size_t n, uint32_t align)
{
    if (addr % align != 0u)
        return 0;
    for (unsigned i = 0; i < 2u; i++) {
        const uintptr_t base = (uintptr_t)flash[i];
        if (addr >= base && n <= FUZZ_SLOT_SIZE && addr - base <= FUZZ_SLOT_SIZE - n)
            return 1;
    }
    return 0;
}

int board_flash_erase_sector(uintptr_t addr)
{
    if (!in_slot(addr, FUZZ_SECTOR_SIZE, FUZZ_SECTOR_SIZE))
        return BOARD_FLASH_E_ADDRESS;
    memset((uint8_t *)addr, 0xFF, FUZZ_SECTOR_SIZE);
    return BOARD_FLASH_OK;
}

int board_flash_program(uintptr_t addr, const void *data)
{
    if (!in_slot(addr, FLASH_WORD, FLASH_WORD))
        return BOARD_FLASH_E_ADDRESS;
    uint8_t *word = (uint8_t *)addr;
    const uint8_t *src = data;
    for (unsigned i = 0; i < FLASH_WORD; i++)
        if (word[i] != 0xFFu)
            return BOARD_FLASH_E_NOT_ERASED;
    for (unsigned i = 0; i < FLASH_WORD; i++)
        word[i] &= src[i];
    return BOARD_FLASH_OK;
}

int board_flash_read(void *dst, uintptr_t addr, size_t n)
{
    if (!in_slot(addr, n, 1u))
        return BOARD_FLASH_E_ADDRESS;
    memcpy(dst, (const void *)addr, n);
    return BOARD_FLASH_OK;
}
