/*
 * Board support for QEMU's mps2-an500 (Cortex-M7), implementing boards/board.h.
 *
 * Console: CMSDK APB UART0, polled. Work counter: SysTick on the core clock
 * (reload 0xFFFFFF, its interrupt counts wraps). Under QEMU -icount shift=N
 * every instruction advances virtual time by 2^N ns and SysTick ticks every
 * 40 ns (25 MHz), so ticks x 40 / 2^N, rounded, is the exact number of
 * instructions executed (not Cortex-M7 cycles: QEMU does not model timing).
 * The fixed cost of board_work_start()/board_work_stop() themselves is
 * measured at boot and subtracted. Exit: semihosting SYS_EXIT_EXTENDED.
 *
 * Flash: the board has none; two model slots of emulated STM32H7-like flash
 * live in QEMU's PSRAM (mps2_an500.ld), with the rules of real flash: erase
 * sets a 128 KiB sector to 0xFF, a program writes one erased 32-byte word and
 * only clears bits. A debug hook cuts the power after a chosen number of
 * flash operations, cleanly or half way through one (BOARD_HAS_POWER_CUT).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "board.h"
#include "mps2_an500.h"

#ifndef COLIBRI_QEMU_ICOUNT_SHIFT
#error "COLIBRI_QEMU_ICOUNT_SHIFT (QEMU -icount shift=) must come from board.mk"
#endif

#define REG(addr) (*(volatile uint32_t *)(uintptr_t)(addr))

/* CMSDK APB UART */
#define UART_DATA REG(MPS2_UART0_BASE + 0x00u)
#define UART_STATE REG(MPS2_UART0_BASE + 0x04u)
#define UART_CTRL REG(MPS2_UART0_BASE + 0x08u)
#define UART_BAUDDIV REG(MPS2_UART0_BASE + 0x10u)
#define UART_STATE_TX_FULL 1u
#define UART_STATE_RX_FULL 2u
#define UART_CTRL_TX_EN 1u
#define UART_CTRL_RX_EN 2u

/* SysTick */
#define SYST_CSR REG(0xE000E010u)
#define SYST_RVR REG(0xE000E014u)
#define SYST_CVR REG(0xE000E018u)
#define SYST_CSR_ENABLE 1u
#define SYST_CSR_TICKINT 2u
#define SYST_CSR_CLKSOURCE 4u /* processor clock */
#define SYST_RELOAD 0xFFFFFFu

/* System control block */
#define SCB_ICSR REG(0xE000ED04u)
#define SCB_SHCSR REG(0xE000ED24u)
#define SCB_CFSR REG(0xE000ED28u)
#define SCB_HFSR REG(0xE000ED2Cu)
#define SCB_MMFAR REG(0xE000ED34u)
#define SCB_BFAR REG(0xE000ED38u)
#define ICSR_PENDSTSET (1u << 26)
#define ICSR_PENDSTCLR (1u << 25)
#define SHCSR_FAULTS_EN ((1u << 16) | (1u << 17) | (1u << 18)) /* MemManage, BusFault, UsageFault */

/* Linker script symbols */
extern uint32_t __stack_bottom__[];
extern uint32_t __stack_top__[];

/* -- console UART ----------------------------------------------------------- */

static void uart_init(void)
{
    UART_BAUDDIV = 16u; /* QEMU ignores the rate; it only wants a valid divider */
    UART_CTRL = UART_CTRL_TX_EN | UART_CTRL_RX_EN;
}

uint8_t board_uart_getc(void)
{
    while ((UART_STATE & UART_STATE_RX_FULL) == 0u) {
    }
    return (uint8_t)UART_DATA;
}

void board_uart_write(const uint8_t *data, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        while ((UART_STATE & UART_STATE_TX_FULL) != 0u) {
        }
        UART_DATA = data[i];
    }
}

static void uart_puts(const char *s)
{
    while (*s != '\0') {
        board_uart_write((const uint8_t *)s, 1);
        s++;
    }
}

static void uart_hex(uint32_t v)
{
    char text[11] = "0x";
    for (int i = 0; i < 8; i++) {
        const uint32_t nibble = (v >> (28 - 4 * i)) & 15u;
        text[2 + i] = (char)(nibble < 10u ? '0' + nibble : 'a' + nibble - 10u);
    }
    text[10] = '\0';
    uart_puts(text);
}

/* -- work counter: SysTick under QEMU -icount --------------------------------- */

_Static_assert(1000000000u % MPS2_CORE_HZ == 0u, "SysTick period must be a whole number of ns");
#define NS_PER_TICK (1000000000u / MPS2_CORE_HZ)

/* Wraps of SysTick since board_work_start(), counted by SysTick_Handler in
 * startup.S: exactly MPS2_SYSTICK_ISR_INSNS instructions, which
 * board_work_stop() takes back out of the count. */
volatile uint32_t board_systick_wraps;
static uint64_t work_overhead; /* instructions of an empty start/stop pair */

/* QEMU's SysTick (a ptimer with WRAP_AFTER_ONE_PERIOD, NO_IMMEDIATE_RELOAD,
 * TRIGGER_ONLY_ON_DECREMENT), after board_work_start() cleared the counter:
 * it shows 0 for one tick, then RELOAD, RELOAD-1, ..., 1, 0 (the interrupt
 * fires on entering 0), RELOAD, ... So after k ticks the counter shows
 * v = (RELOAD + 1 - k) mod (RELOAD + 1) with floor(k / (RELOAD + 1)) wraps
 * counted, i.e. k = wraps * (RELOAD + 1) + ((RELOAD + 1 - v) mod (RELOAD + 1)). */
static uint64_t systick_ticks(uint32_t *isr_runs)
{
    __asm__ volatile("cpsid i" ::: "memory");
    uint32_t wraps = board_systick_wraps;
    uint32_t value = SYST_CVR;
    *isr_runs = wraps;
    if ((SCB_ICSR & ICSR_PENDSTSET) != 0u) {
        /* Wrapped, interrupt not taken yet: the value read may be from either
         * side of the wrap, so read it again, after it. */
        value = SYST_CVR;
        wraps++;
    }
    __asm__ volatile("cpsie i" ::: "memory");
    return (uint64_t)wraps * (SYST_RELOAD + 1u) + ((SYST_RELOAD + 1u - value) & SYST_RELOAD);
}

__attribute__((noipa, noinline)) void board_work_start(void)
{
    /* Restart SysTick from a cleared counter, so the measured region always
     * begins at the same phase: its wrap interrupts then fall on the same
     * instructions every time, whatever ran before (e.g. polling the UART). */
    SYST_CSR = 0u;
    SYST_RVR = SYST_RELOAD;
    SYST_CVR = 0u;
    SCB_ICSR = ICSR_PENDSTCLR;
    board_systick_wraps = 0u;
    SYST_CSR = SYST_CSR_ENABLE | SYST_CSR_TICKINT | SYST_CSR_CLKSOURCE;
}

__attribute__((noipa, noinline)) uint64_t board_work_stop(void)
{
    uint32_t isr_runs;
    const uint64_t ticks = systick_ticks(&isr_runs);
    /* Off until the next start: a wrap interrupt outside the measured region
     * lands wherever host timing put the UART polling, so the painted-stack
     * high-water would vary run to run by where its frame was pushed. */
    SYST_CSR = 0u;
    SCB_ICSR = ICSR_PENDSTCLR;
    /* instructions = ticks x 40 ns / 2^shift ns, rounded to nearest: the
     * rounding error of a tick count is under one tick, 40 / 128 of an
     * instruction at shift 7, so the count is exact. */
    uint64_t insns = (ticks * NS_PER_TICK + (1u << (COLIBRI_QEMU_ICOUNT_SHIFT - 1))) >> COLIBRI_QEMU_ICOUNT_SHIFT;
    const uint64_t not_measured = work_overhead + (uint64_t)isr_runs * MPS2_SYSTICK_ISR_INSNS;
    return insns > not_measured ? insns - not_measured : 0u;
}

enum board_work_kind board_work_kind(void)
{
    return BOARD_WORK_QEMU_INSTRUCTIONS;
}

/* -- the rest of board.h ----------------------------------------------------- */

void board_init(void)
{
    uart_init();
    SCB_SHCSR |= SHCSR_FAULTS_EN; /* report them as themselves, not as HardFault */
    /* Calibrate on an adjacent start/stop pair, which thus reads 0: a
     * measurement counts the instructions from the return of
     * board_work_start() up to, not including, the call of board_work_stop(). */
    work_overhead = 0u;
    uint32_t lo, hi;
    __asm__ volatile("bl board_work_start\n\t"
                     "bl board_work_stop\n\t"
                     "mov %0, r0\n\t"
                     "mov %1, r1"
                     : "=r"(lo), "=r"(hi)
                     :
                     : "r0", "r1", "r2", "r3", "r12", "lr", "cc", "memory", "d0", "d1", "d2", "d3", "d4", "d5",
                       "d6", "d7");
    work_overhead = (uint64_t)hi << 32 | lo;
}

const char *board_name(void)
{
    return "mps2-an500 (QEMU)";
}

uint32_t board_stack_size(void)
{
    return (uint32_t)((uintptr_t)__stack_top__ - (uintptr_t)__stack_bottom__);
}

uint32_t board_stack_used(void)
{
    const volatile uint32_t *p = __stack_bottom__;
    while (p < __stack_top__ && *p == (uint32_t)MPS2_STACK_PAINT) {
        p++;
    }
    return (uint32_t)((uintptr_t)__stack_top__ - (uintptr_t)p);
}

void board_exit(int status)
{
    /* Semihosting SYS_EXIT_EXTENDED (0x20) with ADP_Stopped_ApplicationExit:
     * QEMU exits with exactly `status`. */
    const volatile uint32_t block[2] = {0x20026u, (uint32_t)status};
    register uint32_t r0 __asm__("r0") = 0x20u;
    register const volatile uint32_t *r1 __asm__("r1") = block;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
    for (;;) {
        __asm__ volatile("wfi");
    }
}

void board_reset(void)
{
    board_exit(0);
}

/* -- emulated flash ------------------------------------------------------------ */

/* mps2_an500.ld: slots A and B back to back in PSRAM, which nothing else
 * touches (no ELF segment covers it, Reset_Handler does not clear it). */
extern uint8_t __model_slot_a_start[], __model_slot_b_start[];
extern uint8_t __model_slot_size[], __model_slot_sector_size[]; /* absolute symbols: their address is the value */

#define FLASH_WORD 32u

static board_flash_info_t flash_info;

const board_flash_info_t *board_flash_info(void)
{
    if (flash_info.slot_size == 0u) {
        flash_info.slot_base[0] = (uintptr_t)__model_slot_a_start;
        flash_info.slot_base[1] = (uintptr_t)__model_slot_b_start;
        flash_info.slot_size = (uint32_t)(uintptr_t)__model_slot_size;
        flash_info.sector_size = (uint32_t)(uintptr_t)__model_slot_sector_size;
        flash_info.program_size = FLASH_WORD;
    }
    return &flash_info;
}

/* Whether [addr, addr + n) lies inside one slot and addr is a multiple of align. */
static int in_slot(uintptr_t addr, size_t n, uint32_t align)
{
    const board_flash_info_t *f = board_flash_info();
    if (addr % align != 0u) {
        return 0;
    }
    for (unsigned i = 0; i < 2u; i++) {
        if (addr >= f->slot_base[i] && n <= f->slot_size && addr - f->slot_base[i] <= f->slot_size - n) {
            return 1;
        }
    }
    return 0;
}

static uint32_t flash_ops; /* completed or started erases + programs since reset */

#ifdef BOARD_HAS_POWER_CUT
static struct {
    uint32_t armed; /* 0: off */
    uint32_t at;    /* flash_ops value that triggers */
    uint32_t mode;  /* 0 clean, 1 torn */
    uint32_t tear;
} power_cut;

void board_power_cut_arm(uint32_t n, uint32_t mode, uint32_t tear)
{
    power_cut.armed = 1u;
    power_cut.at = flash_ops + n;
    power_cut.mode = mode;
    power_cut.tear = tear;
}

uint32_t board_flash_op_count(void)
{
    return flash_ops;
}

/* Semihosting SYS_WRITE0: a line on QEMU's stderr (not the UART), so the host
 * knows the board is dead without waiting for a timeout. */
static void semihosting_write0(const char *text)
{
    register uint32_t r0 __asm__("r0") = 0x04u;
    register const char *r1 __asm__("r1") = text;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
}

static __attribute__((noreturn)) void power_lost(void)
{
    __asm__ volatile("cpsid i" ::: "memory");
    semihosting_write0("colibri: power cut\n");
    for (;;) {
        __asm__ volatile("" ::: "memory");
    }
}

/* Before an operation: dies now for a clean cut at 0 operations, or returns
 * 1 if this operation is the one to tear. */
static int power_cut_before_op(void)
{
    if (power_cut.armed == 0u) {
        return 0;
    }
    if (power_cut.mode == 0u && flash_ops == power_cut.at) {
        power_lost();
    }
    return power_cut.mode == 1u && flash_ops + 1u == power_cut.at;
}

static void power_cut_after_op(void)
{
    if (power_cut.armed != 0u && power_cut.mode == 0u && flash_ops == power_cut.at) {
        power_lost();
    }
}
#else
static int power_cut_before_op(void)
{
    return 0;
}

static void power_cut_after_op(void)
{
}
#endif

int board_flash_erase_sector(uintptr_t addr)
{
    const board_flash_info_t *f = board_flash_info();
    if (!in_slot(addr, f->sector_size, f->sector_size)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    uint8_t *sector = (uint8_t *)addr;
    if (power_cut_before_op()) {
#ifdef BOARD_HAS_POWER_CUT
        /* Torn: the start of the sector is erased, the rest as it was. */
        const uint32_t most = f->sector_size - FLASH_WORD; /* torn: never the whole sector */
        const uint32_t n = (power_cut.tear < most ? power_cut.tear : most) / FLASH_WORD * FLASH_WORD;
        memset(sector, 0xFF, n);
        power_lost();
#endif
    }
    memset(sector, 0xFF, f->sector_size);
    flash_ops++;
    power_cut_after_op();
    return BOARD_FLASH_OK;
}

int board_flash_program(uintptr_t addr, const void *data)
{
    if (!in_slot(addr, FLASH_WORD, FLASH_WORD)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    uint8_t *word = (uint8_t *)addr;
    const uint8_t *src = data;
    for (unsigned i = 0; i < FLASH_WORD; i++) {
        if (word[i] != 0xFFu) {
            /* Like the STM32H7, a flash word is programmed once per erase. */
            return BOARD_FLASH_E_NOT_ERASED;
        }
    }
    if (power_cut_before_op()) {
#ifdef BOARD_HAS_POWER_CUT
        /* Torn: only the bytes the mask names reach the array. */
        for (unsigned i = 0; i < FLASH_WORD; i++) {
            if ((power_cut.tear >> i) & 1u) {
                word[i] &= src[i];
            }
        }
        power_lost();
#endif
    }
    for (unsigned i = 0; i < FLASH_WORD; i++) {
        word[i] &= src[i]; /* programming only clears bits */
    }
    flash_ops++;
    power_cut_after_op();
    return BOARD_FLASH_OK;
}

int board_flash_read(void *dst, uintptr_t addr, size_t n)
{
    if (!in_slot(addr, n, 1u)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    memcpy(dst, (const void *)addr, n);
    return BOARD_FLASH_OK;
}

/* -- faults ------------------------------------------------------------------- */

static const char *exception_name(uint32_t n)
{
    switch (n) {
    case 2u:
        return "NMI";
    case 3u:
        return "HardFault";
    case 4u:
        return "MemManage";
    case 5u:
        return "BusFault";
    case 6u:
        return "UsageFault";
    case 11u:
        return "SVCall";
    case 12u:
        return "DebugMonitor";
    case 14u:
        return "PendSV";
    default:
        return "exception";
    }
}

/* Called by Fault_Handler (startup.S) with the stacked frame {r0, r1, r2,
 * r3, r12, lr, pc, xpsr} and EXC_RETURN. Prints one line between two 0x00
 * delimiters (so a frame-reading host sees it as one undecodable frame) and
 * ends the run with status 3. */
__attribute__((noreturn, used)) void board_fault(const uint32_t *frame, uint32_t exc_return);
void board_fault(const uint32_t *frame, uint32_t exc_return)
{
    uint32_t ipsr;
    __asm__ volatile("mrs %0, ipsr" : "=r"(ipsr));
    ipsr &= 0x1FFu;
    const uint32_t hfsr = SCB_HFSR;

    uart_init();
    static const uint8_t delimiter = 0u;
    board_uart_write(&delimiter, 1);
    uart_puts("FAULT ");
    uart_puts(exception_name(ipsr));
    uart_puts(" exc=");
    uart_hex(ipsr);
    uart_puts(" pc=");
    uart_hex(frame[6]);
    uart_puts(" lr=");
    uart_hex(frame[5]);
    uart_puts(" xpsr=");
    uart_hex(frame[7]);
    uart_puts(" cfsr=");
    uart_hex(SCB_CFSR);
    uart_puts(" hfsr=");
    uart_hex(hfsr);
    uart_puts(" mmfar=");
    uart_hex(SCB_MMFAR);
    uart_puts(" bfar=");
    uart_hex(SCB_BFAR);
    uart_puts(" sp=");
    uart_hex((uint32_t)(uintptr_t)frame);
    uart_puts(" exc_return=");
    uart_hex(exc_return);
    const uint16_t *pc = (const uint16_t *)(uintptr_t)(frame[6] & ~1u);
    if (ipsr == 3u && (uintptr_t)pc < 0x00400000u && *pc == 0xBEABu) {
        /* The fault is a semihosting bkpt 0xAB: semihosting is off. The exit
         * below then locks the core up, which makes QEMU abort. */
        uart_puts(" (semihosting call without -semihosting-config enable=on,target=native)");
    }
    uart_puts("\r\n");
    board_uart_write(&delimiter, 1);
    board_exit(3);
}
