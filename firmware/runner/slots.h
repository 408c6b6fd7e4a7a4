/*
 * A/B model slots in flash (docs/protocol.md, "Model slots"): the header
 * format, reading a slot's state, and the flash steps of an update. The same
 * code for every board; the flash itself is the board's (boards/board.h).
 *
 * A slot is a 32-byte header, one flash word so that the commit is a single
 * program operation, followed by the image at slot offset 32:
 *   u32 magic "CSLT", u32 version 1, u32 sequence, u32 image_size,
 *   u32 image_crc32, u32 reserved 0 x 2, u32 header_crc32 (of bytes 0..27).
 * Valid iff magic, version, header CRC and image_size <= capacity check and
 * the CRC-32 of the image bytes in flash is image_crc32. The valid slot with
 * the highest sequence is the active one.
 */
#ifndef RUNNER_SLOTS_H
#define RUNNER_SLOTS_H

#include <stdint.h>

#define SLOT_MAGIC 0x544C5343u /* the bytes "CSLT" */
#define SLOT_VERSION 1u
#define SLOT_HEADER_SIZE 32u
#define SLOT_COUNT 2u
#define SLOT_NONE 0xFFu

/* What a scan finds in a slot (SLOT_INFO reports it as a u8). */
enum slot_state {
    SLOT_EMPTY = 0,      /* header word erased (all 0xFF) */
    SLOT_VALID = 1,      /* header and image check */
    SLOT_BAD_HEADER = 2, /* header present but magic, version, header CRC or size wrong */
    SLOT_BAD_IMAGE = 3,  /* header fine, image CRC wrong (or unreadable) */
    SLOT_UNREADABLE = 4, /* the header word itself cannot be read (uncorrectable ECC) */
};

typedef struct {
    uint8_t state; /* enum slot_state */
    uint32_t sequence, image_size, image_crc;
} slot_status;

/* Largest image one slot holds (slot size minus the header). */
uint32_t slot_capacity(void);

/* The slot's base address, and the address of its image (base + 32). */
uintptr_t slot_base(unsigned slot);
const uint8_t *slot_image(unsigned slot);

/* Reads slot's header and checks its image CRC in flash. */
void slot_scan(unsigned slot, slot_status *out);

/* The valid slot with the highest sequence (A on a tie), or SLOT_NONE. */
unsigned slot_active(const slot_status st[SLOT_COUNT]);

/* Erases the sectors of `slot` that a header plus `image_size` bytes occupy,
 * the header's sector first. A board_flash_status. *failed_at gets the address
 * of a failing operation. */
int slot_erase_for(unsigned slot, uint32_t image_size, uintptr_t *failed_at);

/* CRC-32 of `size` image bytes of `slot`, read from flash. A board_flash_status. */
int slot_image_crc(unsigned slot, uint32_t size, uint32_t *crc);

/* Programs the header word: the commit. A board_flash_status. */
int slot_write_header(unsigned slot, uint32_t sequence, uint32_t image_size, uint32_t image_crc);

#endif /* RUNNER_SLOTS_H */
