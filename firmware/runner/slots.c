/*
 * A/B model slots: see slots.h. Every read of a slot goes through
 * board_flash_read(), which on the STM32H7 turns an uncorrectable ECC error
 * (a word whose program or erase was cut off) into a status instead of a bus
 * fault; only a slot that checked out is then read in place by the engine.
 */
#include "slots.h"

#include <stddef.h>
#include <string.h>

#include "board.h"
#include "crc32.h"

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

uint32_t slot_capacity(void)
{
    return board_flash_info()->slot_size - SLOT_HEADER_SIZE;
}

uintptr_t slot_base(unsigned slot)
{
    return board_flash_info()->slot_base[slot];
}

const uint8_t *slot_image(unsigned slot)
{
    return (const uint8_t *)(slot_base(slot) + SLOT_HEADER_SIZE);
}

int slot_image_crc(unsigned slot, uint32_t size, uint32_t *crc)
{
    uint8_t buf[256];
    uint32_t c = 0u;
    const uintptr_t start = slot_base(slot) + SLOT_HEADER_SIZE;
    for (uint32_t off = 0u; off < size;) {
        const uint32_t n = size - off < sizeof buf ? size - off : (uint32_t)sizeof buf;
        const int st = board_flash_read(buf, start + off, n);
        if (st != BOARD_FLASH_OK) {
            return st;
        }
        c = crc32_update(c, buf, n);
        off += n;
    }
    *crc = c;
    return BOARD_FLASH_OK;
}

void slot_scan(unsigned slot, slot_status *out)
{
    uint8_t h[SLOT_HEADER_SIZE];
    memset(out, 0, sizeof *out);
    if (board_flash_read(h, slot_base(slot), sizeof h) != BOARD_FLASH_OK) {
        out->state = SLOT_UNREADABLE;
        return;
    }
    unsigned erased = 0u;
    for (size_t i = 0; i < sizeof h; i++) {
        erased += h[i] == 0xFFu;
    }
    if (erased == sizeof h) {
        out->state = SLOT_EMPTY;
        return;
    }
    if (le32(h) != SLOT_MAGIC || le32(h + 4) != SLOT_VERSION || le32(h + 28) != crc32_update(0u, h, 28u) ||
        le32(h + 12) > slot_capacity()) {
        out->state = SLOT_BAD_HEADER;
        return;
    }
    out->sequence = le32(h + 8);
    out->image_size = le32(h + 12);
    out->image_crc = le32(h + 16);
    uint32_t crc;
    const int st = slot_image_crc(slot, out->image_size, &crc);
    out->state = st == BOARD_FLASH_OK && crc == out->image_crc ? SLOT_VALID : SLOT_BAD_IMAGE;
}

unsigned slot_active(const slot_status st[SLOT_COUNT])
{
    unsigned best = SLOT_NONE;
    for (unsigned i = 0; i < SLOT_COUNT; i++) {
        if (st[i].state == SLOT_VALID && (best == SLOT_NONE || st[i].sequence > st[best].sequence)) {
            best = i;
        }
    }
    return best;
}

int slot_erase_for(unsigned slot, uint32_t image_size, uintptr_t *failed_at)
{
    const board_flash_info_t *f = board_flash_info();
    const uint32_t bytes = SLOT_HEADER_SIZE + image_size;
    const uint32_t sectors = (bytes + f->sector_size - 1u) / f->sector_size;
    /* Ascending from the slot's start: the header's sector goes first, so an
     * erase cut off half way never leaves this slot's old header in front of
     * a half-erased image (and the image CRC would catch that anyway). */
    for (uint32_t s = 0; s < sectors; s++) {
        const uintptr_t addr = slot_base(slot) + (uintptr_t)s * f->sector_size;
        const int st = board_flash_erase_sector(addr);
        if (st != BOARD_FLASH_OK) {
            *failed_at = addr;
            return st;
        }
    }
    return BOARD_FLASH_OK;
}

int slot_write_header(unsigned slot, uint32_t sequence, uint32_t image_size, uint32_t image_crc)
{
    uint8_t h[SLOT_HEADER_SIZE] __attribute__((aligned(4)));
    memset(h, 0, sizeof h);
    put_le32(h, SLOT_MAGIC);
    put_le32(h + 4, SLOT_VERSION);
    put_le32(h + 8, sequence);
    put_le32(h + 12, image_size);
    put_le32(h + 16, image_crc);
    put_le32(h + 28, crc32_update(0u, h, 28u));
    return board_flash_program(slot_base(slot), h);
}
