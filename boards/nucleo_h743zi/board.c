/*
 * NUCLEO-H743ZI (STM32H743ZI, Cortex-M7 r1p1 with FPv5-D16) board support for
 * the Colibri runner: boards/board.h.
 *
 * board_init():
 *   1. supply: LDO (PWR_CR3), locked for this power-on;
 *   2. voltage scale VOS1, then VOS0 through SYSCFG_PWRCR.ODEN on revision V
 *      silicon (480 MHz needs VOS0; revision Y stops at 400 MHz on VOS1);
 *   3. HSE in bypass mode from the ST-LINK's 8 MHz MCO (falls back to HSI);
 *   4. flash wait states for the new AXI clock, before raising it;
 *   5. PLL1 -> 480 MHz (400 MHz on revision Y), bus prescalers, SYSCLK switch;
 *   6. L1 I-cache and D-cache;
 *   7. USART3 on PD8/PD9 (ST-LINK virtual COM port) at 115200 8N1;
 *   8. DWT cycle counter, extended to 64 bits from the SysTick interrupt;
 *   9. an MPU no-access guard under the stack.
 * Plus the flash driver for the two model slots in bank 2 (board_flash_*).
 * If a step cannot complete (a ready flag that never rises), board_init()
 * keeps the last safe configuration (at worst HSI 64 MHz) instead of hanging,
 * so the console still comes up; the UART baud rate follows the clock it got.
 *
 * Clock tree at 480 MHz (RM0433 ch. 8 "Reset and clock control (RCC)",
 * figure "Core and bus clock generation"):
 *   HSE 8 MHz (bypass) /M1=4 -> 2 MHz ref (PLL1RGE 2-4 MHz, wide VCO)
 *   x N1=480 -> VCO 960 MHz; /P1=2 -> pll1_p_ck 480 MHz = sys_ck
 *   D1CPRE /1 -> CPU 480 MHz; HPRE /2 -> AXI/AHB1-4 240 MHz
 *   D1PPRE, D2PPRE1, D2PPRE2, D3PPRE /2 -> APB3, APB1, APB2, APB4 120 MHz
 *   USART3 kernel clock: rcc_pclk1 120 MHz (USART234578SEL = 000)
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../board.h"
#include "stm32h743_regs.h"

#if defined(RUNNER_MODEL_CAPACITY) && defined(RUNNER_ARENA_CAPACITY)
/* linker.ld: .axisram is AXI SRAM, 512 KB; a model slot in flash bank 2 is
 * 512 KB (the linker checks the first, this the second). */
_Static_assert(RUNNER_MODEL_CAPACITY + RUNNER_ARENA_CAPACITY <= 512u * 1024u,
               "model buffer and arena must fit in the 512 KB AXI SRAM");
_Static_assert(RUNNER_MODEL_CAPACITY <= 512u * 1024u, "a model must fit in one 512 KB flash slot");
#endif

#define HSE_HZ 8000000u  /* ST-LINK MCO on PH0/OSC_IN (UM2407, default solder bridges) */
#define HSI_HZ 64000000u /* HSI after reset, HSIDIV = /1 */
#define PLL_REF_HZ 2000000u
#define CONSOLE_BAUD 115200u

/* Bounded waits for ready flags. At 64 MHz with D3-domain register reads a
 * spin is well over 10 ns, so this is tens of milliseconds: far beyond the
 * HSE, PLL lock and voltage-scaling times in the STM32H743 datasheet. */
#define READY_SPINS 2000000u

static uint32_t sysclk_hz = HSI_HZ;
static uint32_t pclk1_hz = HSI_HZ;

static bool wait_bits(volatile uint32_t *reg, uint32_t mask, uint32_t want)
{
    for (uint32_t i = 0; i < READY_SPINS; ++i) {
        if ((*reg & mask) == want) {
            return true;
        }
    }
    return false;
}

static void short_delay(void)
{
    for (uint32_t i = 0; i < 64u; ++i) {
        __asm__ volatile("nop");
    }
}

/*
 * Supply configuration: LDO on, bypass off. RM0433 ch. 6 "Power control
 * (PWR)", "Power supply configuration" and PWR_CR3: after power-on the
 * configuration can be written once (SCUEN is then cleared); writing the
 * same LDO configuration again after a system reset is harmless. Then wait
 * for PWR_CSR1.ACTVOSRDY: the supply and the voltage scale are applied.
 */
static bool supply_ldo(void)
{
    PWR_CR3 = (PWR_CR3 & ~(PWR_CR3_SCUEN | PWR_CR3_BYPASS)) | PWR_CR3_LDOEN;
    return wait_bits(&PWR_CSR1, PWR_CSR1_ACTVOSRDY, PWR_CSR1_ACTVOSRDY);
}

/*
 * Voltage scaling. RM0433 ch. 6, "Voltage scaling" and PWR_D3CR.VOS: raise
 * to VOS1 (scale 1) and wait for VOSRDY; for 480 MHz then set SYSCFG_PWRCR.ODEN
 * (RM0433 ch. 12 "System configuration controller (SYSCFG)") which, with
 * the LDO supply and VOS1, gives VOS0, and wait for VOSRDY again. VOS0 exists
 * on revision V only (DBGMCU_IDCODE REV_ID 0x2003; datasheet DS12110: 480 MHz
 * needs VOS0, revision V). The read-back and delay after each write mirror
 * the "delay after setting the voltage scaling" ST's HAL inserts before
 * polling VOSRDY, so a stale VOSRDY = 1 is not taken for the new level.
 * Returns 0 (VOS1 not reached: stay slow), 1 (VOS1) or 2 (VOS0).
 */
static int voltage_scale(bool want_vos0)
{
    RCC_APB4ENR |= RCC_APB4ENR_SYSCFGEN; /* SYSCFG_PWRCR needs the SYSCFG clock */
    (void)RCC_APB4ENR;

    PWR_D3CR = (PWR_D3CR & ~PWR_D3CR_VOS_MASK) | PWR_D3CR_VOS_SCALE1;
    (void)PWR_D3CR;
    short_delay();
    if (!wait_bits(&PWR_D3CR, PWR_D3CR_VOSRDY, PWR_D3CR_VOSRDY)) {
        return 0;
    }
    if (!want_vos0) {
        return 1;
    }
    SYSCFG_PWRCR |= SYSCFG_PWRCR_ODEN;
    (void)SYSCFG_PWRCR;
    short_delay();
    if (!wait_bits(&PWR_D3CR, PWR_D3CR_VOSRDY, PWR_D3CR_VOSRDY)) {
        return 0; /* ODEN set but not settled: do not raise the clock at all */
    }
    return 2;
}

/*
 * Flash read latency and programming delay for the AXI clock (ACLK = HCLK)
 * at the given scale. RM0433 ch. 4 "Embedded flash memory (FLASH)", table
 * "FLASH recommended number of wait states and programming delay":
 *   VOS0, 225 < ACLK <= 240 MHz: LATENCY = 4 WS, WRHIGHFREQ = 2
 *   VOS1, 185 < ACLK <= 210 MHz: LATENCY = 2 WS, WRHIGHFREQ = 2
 * Written before the clock goes up, and read back until it has taken effect
 * (FLASH_ACR description: "check that the new number of wait states is
 * taken into account by reading FLASH_ACR").
 */
static bool flash_latency(uint32_t latency, uint32_t wrhighfreq)
{
    const uint32_t acr = (latency << FLASH_ACR_LATENCY_POS) | (wrhighfreq << FLASH_ACR_WRHIGHFREQ_POS);
    FLASH_ACR = (FLASH_ACR & ~(FLASH_ACR_LATENCY_MASK | FLASH_ACR_WRHIGHFREQ_MASK)) | acr;
    return wait_bits(&FLASH_ACR, FLASH_ACR_LATENCY_MASK | FLASH_ACR_WRHIGHFREQ_MASK, acr);
}

/*
 * HSE in bypass mode: on NUCLEO-H743ZI the ST-LINK drives an 8 MHz clock
 * (its MCO) into PH0/OSC_IN; there is no crystal on X3 by default (UM2407).
 * RM0433 §8.7.2 RCC_CR: HSEBYP is written while HSEON = 0, then HSEON,
 * then wait for HSERDY. If it never comes (solder bridges changed, ST-LINK
 * powered off), give HSE back and use HSI.
 */
static bool hse_bypass_on(void)
{
    RCC_CR &= ~RCC_CR_HSEON;
    RCC_CR |= RCC_CR_HSEBYP;
    RCC_CR |= RCC_CR_HSEON;
    if (wait_bits(&RCC_CR, RCC_CR_HSERDY, RCC_CR_HSERDY)) {
        return true;
    }
    RCC_CR &= ~RCC_CR_HSEON;
    RCC_CR &= ~RCC_CR_HSEBYP;
    return false;
}

/*
 * PLL1 (RM0433 ch. 8, "PLL description" and RCC_PLLCKSELR, RCC_PLLCFGR,
 * RCC_PLL1DIVR, RCC_PLL1FRACR). Reference 2 MHz from HSE /4 or HSI /32,
 * PLL1RGE = 2..4 MHz, wide VCO (VCOSEL = 0, 192..960 MHz on revision V with
 * VOS0), integer mode (FRACEN = 0). VCO = 2 MHz x N; P = 2 for sys_ck; Q = 4
 * and R = 2 are written but their outputs stay disabled (DIVQ1EN = DIVR1EN
 * = 0): nothing here uses them. PLLSRC/DIVM and DIVxEN may only change with
 * all PLLs off, which they are after reset. Wait for PLL1RDY.
 */
static bool pll1_on(bool from_hse, uint32_t n)
{
    const uint32_t m = from_hse ? HSE_HZ / PLL_REF_HZ : HSI_HZ / PLL_REF_HZ; /* 4 or 32 */
    const uint32_t p = 2u, q = 4u, r = 2u;

    RCC_PLLCKSELR = (RCC_PLLCKSELR & ~(RCC_PLLCKSELR_PLLSRC_MASK | RCC_PLLCKSELR_DIVM1_MASK)) |
                    (from_hse ? RCC_PLLCKSELR_PLLSRC_HSE : RCC_PLLCKSELR_PLLSRC_HSI) |
                    (m << RCC_PLLCKSELR_DIVM1_POS);
    RCC_PLLCFGR = (RCC_PLLCFGR & ~(RCC_PLLCFGR_PLL1FRACEN | RCC_PLLCFGR_PLL1VCOSEL | RCC_PLLCFGR_PLL1RGE_MASK |
                                   RCC_PLLCFGR_DIVP1EN | RCC_PLLCFGR_DIVQ1EN | RCC_PLLCFGR_DIVR1EN)) |
                  RCC_PLLCFGR_PLL1RGE_2_4MHZ | RCC_PLLCFGR_DIVP1EN;
    RCC_PLL1DIVR = ((n - 1u) << RCC_PLL1DIVR_N1_POS) | ((p - 1u) << RCC_PLL1DIVR_P1_POS) |
                   ((q - 1u) << RCC_PLL1DIVR_Q1_POS) | ((r - 1u) << RCC_PLL1DIVR_R1_POS);
    RCC_PLL1FRACR = 0u;

    RCC_CR |= RCC_CR_PLL1ON;
    return wait_bits(&RCC_CR, RCC_CR_PLL1RDY, RCC_CR_PLL1RDY);
}

static void clocks_init(void)
{
    if (!supply_ldo()) {
        return; /* HSI 64 MHz, reset scale: always allowed */
    }
    /* 480 MHz needs revision V (REV_ID 0x2003, RM0433 DBGMCU_IDCODE). Revision
     * Y (0x1003) has no VOS0: 400 MHz at VOS1, AXI 200 MHz, APB 100 MHz. */
    const bool rev_v = (DBGMCU_IDCODE >> 16) >= NH7_REV_ID_V;
    const int scale = voltage_scale(rev_v);
    if (scale == 0) {
        return;
    }
    const bool vos0 = scale == 2;
    const uint32_t n = vos0 ? 480u : 400u; /* VCO 960 or 800 MHz, sys_ck 480 or 400 MHz */

    if (!flash_latency(vos0 ? 4u : 2u, 2u)) {
        return;
    }
    const bool hse = hse_bypass_on();
    if (!pll1_on(hse, n)) {
        return;
    }

    /* Prescalers before the switch, so no bus is ever over its limit:
     * RM0433 RCC_D1CFGR (D1CPRE /1, HPRE /2, D1PPRE /2), RCC_D2CFGR (D2PPRE1
     * /2, D2PPRE2 /2), RCC_D3CFGR (D3PPRE /2). */
    RCC_D1CFGR = (RCC_HPRE_DIV1 << RCC_D1CFGR_D1CPRE_POS) | (RCC_HPRE_DIV2 << RCC_D1CFGR_HPRE_POS) |
                 (RCC_PPRE_DIV2 << RCC_D1CFGR_D1PPRE_POS);
    RCC_D2CFGR = (RCC_PPRE_DIV2 << RCC_D2CFGR_D2PPRE1_POS) | (RCC_PPRE_DIV2 << RCC_D2CFGR_D2PPRE2_POS);
    RCC_D3CFGR = RCC_PPRE_DIV2 << RCC_D3CFGR_D3PPRE_POS;
    (void)RCC_D3CFGR;

    /* Switch: RCC_CFGR.SW = PLL1, wait until SWS says so. */
    RCC_CFGR = (RCC_CFGR & ~RCC_CFGR_SW_MASK) | RCC_CFGR_SW_PLL1;
    if (wait_bits(&RCC_CFGR, RCC_CFGR_SWS_MASK, RCC_CFGR_SWS_PLL1)) {
        sysclk_hz = PLL_REF_HZ * n / 2u;
        pclk1_hz = sysclk_hz / 2u / 2u; /* HPRE /2, D2PPRE1 /2 */
    } else {
        /* still on HSI with the prescalers applied */
        pclk1_hz = HSI_HZ / 2u / 2u;
    }
}

/*
 * L1 caches, PM0253 ch. 4 cache maintenance ("Initializing and enabling the
 * L1-cache"): invalidate the whole I-cache (ICIALLU) and the whole D-cache
 * by set/way (DCISW over CCSIDR's sets and ways for CSSELR = L1 data), with
 * DSB/ISB around, then set CCR.IC and CCR.DC. Skipped if already on (a second
 * board_init() must not discard dirty lines). The default memory map makes
 * DTCM uncached and AXI SRAM and flash write-back cacheable; with no DMA in
 * this firmware there is nothing to keep coherent.
 */
static void caches_on(void)
{
    if ((SCB_CCR & SCB_CCR_IC) == 0u) {
        NH7_DSB();
        NH7_ISB();
        SCB_ICIALLU = 0u;
        NH7_DSB();
        NH7_ISB();
        SCB_CCR |= SCB_CCR_IC;
        NH7_DSB();
        NH7_ISB();
    }
    if ((SCB_CCR & SCB_CCR_DC) == 0u) {
        SCB_CSSELR = 0u; /* level 1 data cache */
        NH7_DSB();
        const uint32_t ccsidr = SCB_CCSIDR;
        uint32_t sets = SCB_CCSIDR_SETS(ccsidr);
        do {
            uint32_t ways = SCB_CCSIDR_WAYS(ccsidr);
            do {
                SCB_DCISW = (sets << SCB_DCISW_SET_POS) | (ways << SCB_DCISW_WAY_POS);
            } while (ways-- != 0u);
        } while (sets-- != 0u);
        NH7_DSB();
        SCB_CCR |= SCB_CCR_DC;
        NH7_DSB();
        NH7_ISB();
    }
}

/*
 * USART3 on PD8 (TX) / PD9 (RX), alternate function AF7: the ST-LINK virtual
 * COM port of the NUCLEO-H743ZI (UM2407). RM0433:
 *   RCC_AHB4ENR.GPIODEN, RCC_APB1LENR.USART3EN (clocks), read back so the
 *   clock is on before the first register access;
 *   RCC_D2CCIP2R.USART234578SEL = 000: kernel clock rcc_pclk1 (120 MHz);
 *   §11.4 GPIO registers: AFRH AF7, MODER alternate, push-pull, medium
 *   speed, pull-up on RX so a floating line does not make noise;
 *   USART chapter, "Character transmission procedure"/"reception": UE = 0,
 *   BRR = usart_ker_ck / baud (oversampling by 16, PRESC /1), 8 data bits,
 *   no parity, 1 stop bit (CR1 M = 00, CR2 STOP = 00), FIFO mode on (16-byte
 *   RX FIFO: slack while the runner is busy), TE and RE, then UE, and wait
 *   for TEACK and REACK.
 * BRR at 120 MHz: 1042 -> 115163 baud (-0.03 %).
 */
static void console_init(void)
{
    RCC_AHB4ENR |= RCC_AHB4ENR_GPIODEN;
    (void)RCC_AHB4ENR;
    RCC_APB1LENR |= RCC_APB1LENR_USART3EN;
    (void)RCC_APB1LENR;
    RCC_D2CCIP2R = (RCC_D2CCIP2R & ~RCC_D2CCIP2R_USART234578SEL_MASK) | RCC_D2CCIP2R_USART234578SEL_PCLK1;

    GPIOD_AFRH = (GPIOD_AFRH & ~((0xFu << 0) | (0xFu << 4))) | (7u << 0) | (7u << 4);
    GPIOD_OTYPER &= ~((1u << 8) | (1u << 9));
    GPIOD_OSPEEDR = (GPIOD_OSPEEDR & ~((3u << 16) | (3u << 18))) | (1u << 16) | (1u << 18);
    GPIOD_PUPDR = (GPIOD_PUPDR & ~((3u << 16) | (3u << 18))) | (1u << 18);
    GPIOD_MODER = (GPIOD_MODER & ~((3u << 16) | (3u << 18))) | (2u << 16) | (2u << 18);

    USART3_CR1 = 0u;
    USART3_CR2 = 0u;
    USART3_CR3 = 0u;
    USART3_PRESC = 0u;
    USART3_BRR = (pclk1_hz + CONSOLE_BAUD / 2u) / CONSOLE_BAUD;
    USART3_ICR = USART_ICR_PECF | USART_ICR_FECF | USART_ICR_NECF | USART_ICR_ORECF;
    USART3_CR1 = USART_CR1_FIFOEN | USART_CR1_TE | USART_CR1_RE; /* FIFOEN only while UE = 0 */
    USART3_CR1 |= USART_CR1_UE;
    (void)wait_bits(&USART3_ISR, USART_ISR_TEACK | USART_ISR_REACK, USART_ISR_TEACK | USART_ISR_REACK);
}

/*
 * Work counter: DWT CYCCNT (ARMv7-M ARM C1.8; Cortex-M7 TRM for DWT_LAR),
 * enabled through DEMCR.TRCENA and the DWT software unlock. CYCCNT is 32
 * bits (8.9 s at 480 MHz); the SysTick interrupt (PM0253 ch. 4 "SysTick
 * timer") samples it every 2^24 core cycles (35 ms) and counts the wraps,
 * so board_work_stop() returns a true 64-bit cycle count as long as
 * interrupts are not masked for 8.9 s.
 */
static volatile uint32_t cyc_hi;
static volatile uint32_t cyc_last;
static uint64_t work_start;

static void cycle_counter_on(void)
{
    DEMCR |= DEMCR_TRCENA;
    DWT_LAR = DWT_LAR_UNLOCK;
    DWT_CTRL |= DWT_CTRL_CYCCNTENA;
}

static void cycles_update(void)
{
    const uint32_t now = DWT_CYCCNT;
    if (now < cyc_last) {
        cyc_hi = cyc_hi + 1u;
    }
    cyc_last = now;
}

void SysTick_Handler(void);
void SysTick_Handler(void)
{
    cycles_update();
}

static uint64_t cycles64(void)
{
    uint32_t primask;
    __asm__ volatile("mrs %0, primask\n\tcpsid i" : "=r"(primask)::"memory");
    cycles_update();
    const uint64_t v = ((uint64_t)cyc_hi << 32) | cyc_last;
    __asm__ volatile("msr primask, %0" ::"r"(primask) : "memory");
    return v;
}

static void work_counter_init(void)
{
    cycle_counter_on();
    DWT_CYCCNT = 0u;
    cyc_hi = 0u;
    cyc_last = 0u;
    STK_LOAD = 0x00FFFFFFu; /* 2^24 - 1: the longest period */
    STK_VAL = 0u;
    STK_CTRL = STK_CTRL_CLKSOURCE | STK_CTRL_TICKINT | STK_CTRL_ENABLE;
}

/*
 * Stack guard: MPU region 0 = the 256 bytes linker.ld reserves right below
 * the stack, no access (AP = 000), execute never. PRIVDEFENA keeps the
 * default memory map everywhere else (PM0253 ch. 4 "Memory protection unit":
 * MPU_RNR, MPU_RBAR, MPU_RASR, MPU_CTRL). A stack overflow becomes a
 * MemManage fault, reported by startup.c, instead of silently overwriting
 * .bss. (A single frame larger than 256 bytes can still jump over it.)
 */
extern uint32_t __stack_guard_start[], __stack_guard_end[];

static void stack_guard_on(void)
{
    const uintptr_t base = (uintptr_t)__stack_guard_start;
    if ((uintptr_t)__stack_guard_end - base != NH7_STACK_GUARD_SIZE || (base & (NH7_STACK_GUARD_SIZE - 1u)) != 0u) {
        return; /* linker.ld and this file disagree: no guard rather than a wrong one */
    }
    NH7_DSB();
    MPU_CTRL = 0u;
    MPU_RNR = 0u;
    MPU_RBAR = (uint32_t)base;
    MPU_RASR = MPU_RASR_XN | (NH7_STACK_GUARD_RASR_SIZE << MPU_RASR_SIZE_POS) | MPU_RASR_ENABLE;
    MPU_CTRL = MPU_CTRL_PRIVDEFENA | MPU_CTRL_ENABLE;
    NH7_DSB();
    NH7_ISB();
}

void board_init(void)
{
    /* Report MemManage, BusFault and UsageFault as themselves rather than
     * escalated HardFaults (PM0253 SHCSR). */
    SCB_SHCSR |= SCB_SHCSR_MEMFAULTENA | SCB_SHCSR_BUSFAULTENA | SCB_SHCSR_USGFAULTENA;

    clocks_init();

    /* D2 SRAM1..3 clocks (RCC_AHB2ENR), for anything placed in .sram1..3. */
    RCC_AHB2ENR |= RCC_AHB2ENR_SRAM1EN | RCC_AHB2ENR_SRAM2EN | RCC_AHB2ENR_SRAM3EN;
    (void)RCC_AHB2ENR;

    caches_on();
    console_init();
    work_counter_init();
    stack_guard_on();
}

/* ---- console ---------------------------------------------------------- */

uint8_t board_uart_getc(void)
{
    for (;;) {
        const uint32_t isr = USART3_ISR;
        /* An overrun (or a framing/noise/parity error) must never wedge RX:
         * clear the flags and keep reading (the bytes lost are the protocol's
         * problem: a CRC or COBS error, answered and resynchronised). */
        if ((isr & (USART_ISR_ORE | USART_ISR_FE | USART_ISR_NE | USART_ISR_PE)) != 0u) {
            USART3_ICR = USART_ICR_ORECF | USART_ICR_FECF | USART_ICR_NECF | USART_ICR_PECF;
        }
        if ((isr & USART_ISR_RXNE) != 0u) { /* RXFNE in FIFO mode */
            return (uint8_t)(USART3_RDR & 0xFFu);
        }
    }
}

void board_uart_write(const uint8_t *data, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        while ((USART3_ISR & USART_ISR_TXE) == 0u) { /* TXFNF in FIFO mode */
        }
        USART3_TDR = data[i];
    }
}

/* For the fault reporter: is USART3 clocked and enabled for transmission? */
int nh7_uart_is_up(void)
{
    return (RCC_APB1LENR & RCC_APB1LENR_USART3EN) != 0u &&
           (USART3_CR1 & (USART_CR1_UE | USART_CR1_TE)) == (USART_CR1_UE | USART_CR1_TE);
}

/* One byte with a bounded wait (fault path: never hang on a dead UART). */
void nh7_uart_putc_raw(uint8_t c)
{
    (void)wait_bits(&USART3_ISR, USART_ISR_TXE, USART_ISR_TXE);
    USART3_TDR = c;
}

/* Wait until the last byte has left the shift register (ISR.TC), bounded. */
void nh7_uart_flush(void)
{
    if (nh7_uart_is_up()) {
        (void)wait_bits(&USART3_ISR, USART_ISR_TC, USART_ISR_TC);
    }
}

/* ---- work counter ----------------------------------------------------- */

void board_work_start(void)
{
    cycle_counter_on(); /* a debugger detaching may have cleared TRCENA */
    work_start = cycles64();
}

uint64_t board_work_stop(void)
{
    return cycles64() - work_start;
}

enum board_work_kind board_work_kind(void)
{
    return BOARD_WORK_DWT_CYCLES;
}

/* ---- flash: the model slots in bank 2 ---------------------------------
 *
 * RM0433 ch. 4 "Embedded flash memory (FLASH)". Slot A is bank 2 sectors 0-3
 * (0x08100000), slot B sectors 4-7 (0x08180000), linker.ld. The program runs
 * from bank 1, so it keeps executing while bank 2 erases or programs
 * (RM0433 ch. 4, "FLASH parallel operations": one bank can be read while the
 * other is written); the waits below are polls on FLASH_SR2, bounded by the
 * cycle counter.
 *
 *  - Unlock: FLASH_KEYR2 = KEY1 then KEY2 while FLASH_CR2.LOCK = 1 ("FLASH
 *    configuration protection"); LOCK is set again after every operation, so
 *    a stray write can never start one. A wrong sequence keeps it locked
 *    until reset: reported as BOARD_FLASH_E_LOCKED.
 *  - Before each operation: no operation in flight (BSY2, QW2, WBNE2 clear)
 *    and every FLASH_SR2 flag cleared through FLASH_CCR2, including stale
 *    RDPERR/RDSERR, which otherwise can make the next erase fail (ST's
 *    advice for the H743).
 *  - Sector erase ("FLASH erase operations", sector erase sequence): SER = 1,
 *    SNB = sector within the bank, PSIZE, then START; wait for QW2 to clear;
 *    check WRPERR, PGSERR, STRBERR, INCERR, OPERR.
 *  - Program ("FLASH program operations"): PG = 1, then the eight 32-bit
 *    words of one 256-bit flash word written back to back (interrupts off
 *    while they go out, DSB after) to a 32-byte aligned address: a full
 *    write buffer starts programming by itself; wait for QW2, check the same
 *    errors, PG = 0. Then read back and compare.
 *  - PSIZE = x32 for both: the parallelism for VDD 2.7-3.6 V without an
 *    external VPP (the NUCLEO board runs at 3.3 V).
 *  - Caches: flash is in the Code region, cacheable write-through in the
 *    Cortex-M7 default memory map, and the engine reads the weights through
 *    the D-cache. After an erase or program the lines over the range are
 *    invalidated by address (DCIMVAC, PM0253 cache maintenance), so no
 *    stale line outlives the new contents. (Flash lines are never dirty, so
 *    invalidating without cleaning loses nothing.)
 *  - ECC ("Flash memory error protections" / "Error correction code error"):
 *    every flash word carries ECC; a word whose program or erase was cut
 *    off by a power loss can read back with a double error, which the flash
 *    interface answers with a bus error (and DBECCERR2). board_flash_read()
 *    therefore reads slots with FAULTMASK set and CCR.BFHFNMIGN = 1, so such
 *    a load is ignored instead of faulting (PM0253 CCR), and reports
 *    DBECCERR2 as BOARD_FLASH_E_ECC. The runner reads headers and image CRCs
 *    that way, and runs an image in place only after it checked out.
 */
extern uint8_t __model_slot_a_start[], __model_slot_b_start[];
extern uint8_t __model_slot_size[], __model_slot_sector_size[]; /* absolute symbols: their address is the value */

#define FLASH_ERASE_TIMEOUT_S 10u    /* datasheet DS12110: a 128 KB sector erase takes seconds at worst */
#define FLASH_PROGRAM_TIMEOUT_MS 50u /* one flash word: well under a millisecond */

static board_flash_info_t flash_info;

const board_flash_info_t *board_flash_info(void)
{
    if (flash_info.slot_size == 0u) {
        flash_info.slot_base[0] = (uintptr_t)__model_slot_a_start;
        flash_info.slot_base[1] = (uintptr_t)__model_slot_b_start;
        flash_info.slot_size = (uint32_t)(uintptr_t)__model_slot_size;
        flash_info.sector_size = (uint32_t)(uintptr_t)__model_slot_sector_size;
        flash_info.program_size = FLASH_WORD_SIZE;
    }
    return &flash_info;
}

/* [addr, addr + n) inside one slot (so in bank 2), addr a multiple of align. */
static bool in_slot(uintptr_t addr, size_t n, uint32_t align)
{
    const board_flash_info_t *f = board_flash_info();
    if (addr % align != 0u || addr < FLASH_BANK2_BASE) {
        return false;
    }
    for (unsigned i = 0; i < 2u; i++) {
        if (addr >= f->slot_base[i] && n <= f->slot_size && addr - f->slot_base[i] <= f->slot_size - n) {
            return true;
        }
    }
    return false;
}

static void dcache_invalidate(uintptr_t addr, size_t n)
{
    if ((SCB_CCR & SCB_CCR_DC) == 0u) {
        return;
    }
    const uintptr_t end = addr + n;
    NH7_DSB();
    for (uintptr_t line = addr & ~(uintptr_t)(SCB_DCACHE_LINE - 1u); line < end; line += SCB_DCACHE_LINE) {
        SCB_DCIMVAC = (uint32_t)line;
    }
    NH7_DSB();
    NH7_ISB();
}

static uint64_t cycles_for_ms(uint32_t ms)
{
    return (uint64_t)sysclk_hz / 1000u * ms;
}

/* Waits until bank 2 has nothing queued, running or buffered. */
static bool flash_wait_idle(uint64_t timeout_cycles)
{
    const uint64_t start = cycles64();
    while ((FLASH_SR2 & (FLASH_SR_BSY | FLASH_SR_QW | FLASH_SR_WBNE)) != 0u) {
        if (cycles64() - start > timeout_cycles) {
            return false;
        }
    }
    return true;
}

static int flash_begin(void)
{
    if ((FLASH_CR2 & FLASH_CR_LOCK) != 0u) {
        FLASH_KEYR2 = FLASH_KEY1;
        FLASH_KEYR2 = FLASH_KEY2;
        if ((FLASH_CR2 & FLASH_CR_LOCK) != 0u) {
            return BOARD_FLASH_E_LOCKED;
        }
    }
    if (!flash_wait_idle(cycles_for_ms(FLASH_PROGRAM_TIMEOUT_MS))) {
        FLASH_CR2 |= FLASH_CR_LOCK;
        return BOARD_FLASH_E_TIMEOUT;
    }
    FLASH_CCR2 = FLASH_SR_ALL_FLAGS;
    return BOARD_FLASH_OK;
}

/* Waits for the operation, clears its flags, clears `bits` in FLASH_CR2 and locks. */
static int flash_end(uint64_t timeout_cycles, uint32_t bits)
{
    int st = BOARD_FLASH_OK;
    if (!flash_wait_idle(timeout_cycles)) {
        st = BOARD_FLASH_E_TIMEOUT;
    }
    const uint32_t sr = FLASH_SR2;
    FLASH_CCR2 = sr & FLASH_SR_ALL_FLAGS;
    if (st == BOARD_FLASH_OK && (sr & FLASH_SR_PROGRAM_ERRORS) != 0u) {
        st = BOARD_FLASH_E_HARDWARE;
    }
    FLASH_CR2 &= ~bits;
    FLASH_CR2 |= FLASH_CR_LOCK;
    return st;
}

int board_flash_erase_sector(uintptr_t addr)
{
    const board_flash_info_t *f = board_flash_info();
    if (!in_slot(addr, f->sector_size, f->sector_size)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    const uint32_t snb = (uint32_t)(addr - FLASH_BANK2_BASE) / FLASH_SECTOR_SIZE;
    int st = flash_begin();
    if (st != BOARD_FLASH_OK) {
        return st;
    }
    FLASH_CR2 = (FLASH_CR2 & ~(FLASH_CR_PG | FLASH_CR_SER | FLASH_CR_BER | FLASH_CR_PSIZE_MASK | FLASH_CR_FW |
                               FLASH_CR_START | FLASH_CR_SNB_MASK)) |
                FLASH_CR_PSIZE_X32 | FLASH_CR_SER | (snb << FLASH_CR_SNB_POS);
    FLASH_CR2 |= FLASH_CR_START;
    NH7_DSB();
    st = flash_end(cycles_for_ms(FLASH_ERASE_TIMEOUT_S * 1000u), FLASH_CR_SER | FLASH_CR_SNB_MASK);
    dcache_invalidate(addr, f->sector_size);
    return st;
}

int board_flash_program(uintptr_t addr, const void *data)
{
    if (!in_slot(addr, FLASH_WORD_SIZE, FLASH_WORD_SIZE)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    uint32_t words[FLASH_WORD_SIZE / 4u];
    memcpy(words, data, sizeof words);
    uint8_t now[FLASH_WORD_SIZE];
    if (board_flash_read(now, addr, sizeof now) != BOARD_FLASH_OK) {
        return BOARD_FLASH_E_NOT_ERASED; /* unreadable: a torn word, not an erased one */
    }
    for (size_t i = 0; i < sizeof now; i++) {
        if (now[i] != 0xFFu) {
            return BOARD_FLASH_E_NOT_ERASED; /* a flash word is programmed once per erase */
        }
    }
    int st = flash_begin();
    if (st != BOARD_FLASH_OK) {
        return st;
    }
    FLASH_CR2 = (FLASH_CR2 & ~(FLASH_CR_SER | FLASH_CR_BER | FLASH_CR_PSIZE_MASK | FLASH_CR_FW | FLASH_CR_START |
                               FLASH_CR_SNB_MASK)) |
                FLASH_CR_PSIZE_X32 | FLASH_CR_PG;
    NH7_ISB();
    NH7_DSB();
    uint32_t primask;
    __asm__ volatile("mrs %0, primask\n\tcpsid i" : "=r"(primask)::"memory");
    volatile uint32_t *dst = (volatile uint32_t *)addr;
    for (size_t i = 0; i < FLASH_WORD_SIZE / 4u; i++) {
        dst[i] = words[i];
    }
    NH7_ISB();
    NH7_DSB();
    __asm__ volatile("msr primask, %0" ::"r"(primask) : "memory");
    st = flash_end(cycles_for_ms(FLASH_PROGRAM_TIMEOUT_MS), FLASH_CR_PG);
    dcache_invalidate(addr, FLASH_WORD_SIZE);
    if (st == BOARD_FLASH_OK && (board_flash_read(now, addr, sizeof now) != BOARD_FLASH_OK ||
                                 memcmp(now, words, sizeof now) != 0)) {
        st = BOARD_FLASH_E_HARDWARE;
    }
    return st;
}

int board_flash_read(void *dst, uintptr_t addr, size_t n)
{
    if (!in_slot(addr, n, 1u)) {
        return BOARD_FLASH_E_ADDRESS;
    }
    uint32_t faultmask;
    __asm__ volatile("mrs %0, faultmask\n\tcpsid f" : "=r"(faultmask)::"memory");
    SCB_CCR |= SCB_CCR_BFHFNMIGN;
    NH7_DSB();
    NH7_ISB();
    FLASH_CCR2 = FLASH_SR_SNECCERR | FLASH_SR_DBECCERR;
    const volatile uint8_t *src = (const volatile uint8_t *)addr;
    uint8_t *out = dst;
    for (size_t i = 0; i < n; i++) {
        out[i] = src[i];
    }
    NH7_DSB();
    const uint32_t sr = FLASH_SR2;
    SCB_CCR &= ~SCB_CCR_BFHFNMIGN;
    NH7_DSB();
    NH7_ISB();
    __asm__ volatile("msr faultmask, %0" ::"r"(faultmask) : "memory");
    FLASH_CCR2 = sr & (FLASH_SR_SNECCERR | FLASH_SR_DBECCERR); /* a single error was corrected: fine */
    if ((sr & FLASH_SR_DBECCERR) != 0u) {
        dcache_invalidate(addr, n); /* keep no line filled from a failed read */
        return BOARD_FLASH_E_ECC;
    }
    return BOARD_FLASH_OK;
}

/* ---- identity, stack, reset ------------------------------------------- */

const char *board_name(void)
{
    return "NUCLEO-H743ZI";
}

extern uint32_t __stack_bottom[], _estack[];

uint32_t board_stack_size(void)
{
    return (uint32_t)((uintptr_t)_estack - (uintptr_t)__stack_bottom);
}

/* The painted words (startup.c) still intact from the bottom up are the
 * stack never used; the rest, up to the top, is the high-water mark. */
uint32_t board_stack_used(void)
{
    const volatile uint32_t *p = __stack_bottom;
    while ((uintptr_t)p < (uintptr_t)_estack && *p == NH7_STACK_PAINT) {
        ++p;
    }
    return (uint32_t)((uintptr_t)_estack - (uintptr_t)p);
}

/* PM0253 AIRCR: VECTKEY 0x05FA, keep PRIGROUP, SYSRESETREQ; on the STM32H743
 * this is a system reset (RM0433 ch. 8, "Reset": CPU SYSRESETREQ). */
void nh7_system_reset(void)
{
    NH7_DSB();
    SCB_AIRCR = SCB_AIRCR_VECTKEY | (SCB_AIRCR & SCB_AIRCR_PRIGROUP_MASK) | SCB_AIRCR_SYSRESETREQ;
    NH7_DSB();
    for (;;) {
        __asm__ volatile("nop");
    }
}

void board_reset(void)
{
    nh7_uart_flush(); /* the runner's last STATUS frame goes out first */
    nh7_system_reset();
}

/* No host to hand a status to: flush the console and reset. */
void board_exit(int status)
{
    (void)status;
    nh7_uart_flush();
    nh7_system_reset();
}

/* The clock board_init() achieved (diagnostics; not part of board.h). */
uint32_t nh7_sysclk_hz(void);
uint32_t nh7_sysclk_hz(void)
{
    return sysclk_hz;
}
