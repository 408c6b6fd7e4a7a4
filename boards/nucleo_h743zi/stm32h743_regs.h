/*
 * The few STM32H743 and Cortex-M7 registers this board support touches,
 * written out by hand (no vendor HAL, CMSIS device header or STM32Cube).
 * Shared by startup.c and board.c; private to boards/nucleo_h743zi/.
 *
 * Sources, each block below names its own:
 *   RM0433  STM32H742, STM32H743/753 and STM32H750 reference manual (Rev 8).
 *   PM0253  STM32F7 and STM32H7 Series Cortex-M7 processor programming manual.
 *   ARMv7-M Architecture Reference Manual (DDI 0403) for the debug blocks
 *   (DEMCR, DWT) that PM0253 does not describe, and the Cortex-M7 TRM
 *   (DDI 0489) for the DWT software lock (LAR).
 *
 * Addresses are plain integer constants; NH7_REG() turns one into a volatile
 * 32-bit lvalue. Every offset is the one in the register map table at the end
 * of the named RM0433 chapter.
 */
#ifndef NUCLEO_H743ZI_REGS_H
#define NUCLEO_H743ZI_REGS_H

#include <stdint.h>

#define NH7_REG(addr) (*(volatile uint32_t *)(uintptr_t)(addr))

/* ------------------------------------------------------------------------
 * Memory map. RM0433 §2.3 "Memory organization", memory map and register
 * boundary addresses table. Kept in step with linker.ld.
 * ---------------------------------------------------------------------- */
#define NH7_DTCM_BASE 0x20000000u    /* 128 KB, D1, CPU-only, not cached */
#define NH7_DTCM_SIZE 0x00020000u
#define NH7_AXISRAM_BASE 0x24000000u /* 512 KB, D1 AXI SRAM */
#define NH7_AXISRAM_SIZE 0x00080000u

/* ------------------------------------------------------------------------
 * RCC. RM0433 ch. 8 "Reset and clock control (RCC)", §8.7 RCC register
 * description and its register map table. Base 0x58024400 (AHB4, D3).
 * ---------------------------------------------------------------------- */
#define RCC_BASE 0x58024400u
#define RCC_CR NH7_REG(RCC_BASE + 0x000u)        /* §8.7.2 RCC source control register */
#define RCC_CFGR NH7_REG(RCC_BASE + 0x010u)      /* RCC clock configuration register */
#define RCC_D1CFGR NH7_REG(RCC_BASE + 0x018u)    /* RCC domain 1 clock configuration register */
#define RCC_D2CFGR NH7_REG(RCC_BASE + 0x01Cu)    /* RCC domain 2 clock configuration register */
#define RCC_D3CFGR NH7_REG(RCC_BASE + 0x020u)    /* RCC domain 3 clock configuration register */
#define RCC_PLLCKSELR NH7_REG(RCC_BASE + 0x028u) /* RCC PLLs clock source selection register */
#define RCC_PLLCFGR NH7_REG(RCC_BASE + 0x02Cu)   /* RCC PLLs configuration register */
#define RCC_PLL1DIVR NH7_REG(RCC_BASE + 0x030u)  /* RCC PLL1 dividers configuration register */
#define RCC_PLL1FRACR NH7_REG(RCC_BASE + 0x034u) /* RCC PLL1 fractional divider register */
#define RCC_D2CCIP2R NH7_REG(RCC_BASE + 0x054u)  /* RCC domain 2 kernel clock configuration register 2 */
#define RCC_AHB2ENR NH7_REG(RCC_BASE + 0x0DCu)   /* RCC AHB2 clock register */
#define RCC_AHB4ENR NH7_REG(RCC_BASE + 0x0E0u)   /* RCC AHB4 clock register */
#define RCC_APB1LENR NH7_REG(RCC_BASE + 0x0E8u)  /* RCC APB1 clock register (low word) */
#define RCC_APB4ENR NH7_REG(RCC_BASE + 0x0F4u)   /* RCC APB4 clock register */

/* RCC_CR */
#define RCC_CR_HSION (1u << 0)
#define RCC_CR_HSIRDY (1u << 2)
#define RCC_CR_HSEON (1u << 16)
#define RCC_CR_HSERDY (1u << 17)
#define RCC_CR_HSEBYP (1u << 18)
#define RCC_CR_PLL1ON (1u << 24)
#define RCC_CR_PLL1RDY (1u << 25)

/* RCC_CFGR: SW[2:0] selects, SWS[5:3] reports; 000 HSI, 001 CSI, 010 HSE, 011 PLL1 */
#define RCC_CFGR_SW_MASK (7u << 0)
#define RCC_CFGR_SW_PLL1 (3u << 0)
#define RCC_CFGR_SWS_MASK (7u << 3)
#define RCC_CFGR_SWS_PLL1 (3u << 3)

/* RCC_D1CFGR: D1CPRE[11:8], D1PPRE[6:4], HPRE[3:0]. RCC_D2CFGR: D2PPRE2[10:8],
 * D2PPRE1[6:4]. RCC_D3CFGR: D3PPRE[6:4]. The 4-bit core/AHB prescalers
 * encode 0xxx = /1, 1000 = /2, 1001 = /4 ...; the 3-bit APB ones 0xx = /1,
 * 100 = /2, 101 = /4 ... */
#define RCC_D1CFGR_D1CPRE_POS 8u
#define RCC_D1CFGR_D1PPRE_POS 4u
#define RCC_D1CFGR_HPRE_POS 0u
#define RCC_D2CFGR_D2PPRE2_POS 8u
#define RCC_D2CFGR_D2PPRE1_POS 4u
#define RCC_D3CFGR_D3PPRE_POS 4u
#define RCC_HPRE_DIV1 0x0u
#define RCC_HPRE_DIV2 0x8u
#define RCC_PPRE_DIV2 0x4u

/* RCC_PLLCKSELR: PLLSRC[1:0] (00 HSI, 01 CSI, 10 HSE, 11 none), DIVM1[9:4]
 * (the divider itself, 0 = prescaler off, 1..63). */
#define RCC_PLLCKSELR_PLLSRC_MASK (3u << 0)
#define RCC_PLLCKSELR_PLLSRC_HSI (0u << 0)
#define RCC_PLLCKSELR_PLLSRC_HSE (2u << 0)
#define RCC_PLLCKSELR_DIVM1_POS 4u
#define RCC_PLLCKSELR_DIVM1_MASK (0x3Fu << RCC_PLLCKSELR_DIVM1_POS)

/* RCC_PLLCFGR, PLL1 fields: PLL1FRACEN bit 0, PLL1VCOSEL bit 1 (0 = wide VCO
 * range, 1 = medium), PLL1RGE[3:2] reference range (00 1-2 MHz, 01 2-4 MHz,
 * 10 4-8 MHz, 11 8-16 MHz), DIVP1EN bit 16, DIVQ1EN bit 17, DIVR1EN bit 18. */
#define RCC_PLLCFGR_PLL1FRACEN (1u << 0)
#define RCC_PLLCFGR_PLL1VCOSEL (1u << 1)
#define RCC_PLLCFGR_PLL1RGE_POS 2u
#define RCC_PLLCFGR_PLL1RGE_MASK (3u << RCC_PLLCFGR_PLL1RGE_POS)
#define RCC_PLLCFGR_PLL1RGE_2_4MHZ (1u << RCC_PLLCFGR_PLL1RGE_POS)
#define RCC_PLLCFGR_DIVP1EN (1u << 16)
#define RCC_PLLCFGR_DIVQ1EN (1u << 17)
#define RCC_PLLCFGR_DIVR1EN (1u << 18)

/* RCC_PLL1DIVR: DIVN1[8:0] = N - 1, DIVP1[15:9] = P - 1 (P even for PLL1),
 * DIVQ1[22:16] = Q - 1, DIVR1[30:24] = R - 1. */
#define RCC_PLL1DIVR_N1_POS 0u
#define RCC_PLL1DIVR_P1_POS 9u
#define RCC_PLL1DIVR_Q1_POS 16u
#define RCC_PLL1DIVR_R1_POS 24u

/* RCC_D2CCIP2R: USART234578SEL[2:0], 000 = rcc_pclk1 (reset value). */
#define RCC_D2CCIP2R_USART234578SEL_MASK (7u << 0)
#define RCC_D2CCIP2R_USART234578SEL_PCLK1 (0u << 0)

/* RCC_AHB2ENR: the D2 SRAM1/2/3 bits (SRAM1EN..SRAM3EN; CMSIS D2SRAMxEN). */
#define RCC_AHB2ENR_SRAM1EN (1u << 29)
#define RCC_AHB2ENR_SRAM2EN (1u << 30)
#define RCC_AHB2ENR_SRAM3EN (1u << 31)
/* RCC_AHB4ENR: GPIODEN bit 3. RCC_APB1LENR: USART3EN bit 18. RCC_APB4ENR: SYSCFGEN bit 1. */
#define RCC_AHB4ENR_GPIODEN (1u << 3)
#define RCC_APB1LENR_USART3EN (1u << 18)
#define RCC_APB4ENR_SYSCFGEN (1u << 1)

/* ------------------------------------------------------------------------
 * PWR. RM0433 ch. 6 "Power control (PWR)", PWR register description and
 * register map (PWR_CSR1, PWR_CR3, PWR_D3CR). Base 0x58024800.
 * ---------------------------------------------------------------------- */
#define PWR_BASE 0x58024800u
#define PWR_CSR1 NH7_REG(PWR_BASE + 0x04u) /* PWR control status register 1 */
#define PWR_CR3 NH7_REG(PWR_BASE + 0x0Cu)  /* PWR control register 3 (supply configuration) */
#define PWR_D3CR NH7_REG(PWR_BASE + 0x18u) /* PWR D3 domain control register (VOS) */

/* PWR_CR3: BYPASS bit 0, LDOEN bit 1, SCUEN bit 2 (supply configuration
 * update enable: the configuration can be written once per power-on). */
#define PWR_CR3_BYPASS (1u << 0)
#define PWR_CR3_LDOEN (1u << 1)
#define PWR_CR3_SCUEN (1u << 2)
/* PWR_CSR1: ACTVOSRDY bit 13 (the supply configuration and VOS are applied). */
#define PWR_CSR1_ACTVOSRDY (1u << 13)
/* PWR_D3CR: VOS[15:14] (01 scale 3 = reset, 10 scale 2, 11 scale 1), VOSRDY bit 13. */
#define PWR_D3CR_VOS_MASK (3u << 14)
#define PWR_D3CR_VOS_SCALE1 (3u << 14)
#define PWR_D3CR_VOSRDY (1u << 13)

/* ------------------------------------------------------------------------
 * SYSCFG. RM0433 ch. 12 "System configuration controller (SYSCFG)",
 * SYSCFG_PWRCR (power control register): ODEN bit 0, the overdrive that
 * turns VOS1 into VOS0 (revision V silicon).
 * ---------------------------------------------------------------------- */
#define SYSCFG_BASE 0x58000400u
#define SYSCFG_PWRCR NH7_REG(SYSCFG_BASE + 0x2Cu)
#define SYSCFG_PWRCR_ODEN (1u << 0)

/* ------------------------------------------------------------------------
 * FLASH. RM0433 ch. 4 "Embedded flash memory (FLASH)", FLASH_ACR (access
 * control register, shared by both banks): LATENCY[3:0] read wait states,
 * WRHIGHFREQ[5:4] programming delay; values from the table "FLASH
 * recommended number of wait states and programming delay".
 * ---------------------------------------------------------------------- */
#define FLASH_REGS_BASE 0x52002000u
#define FLASH_ACR NH7_REG(FLASH_REGS_BASE + 0x00u)
#define FLASH_ACR_LATENCY_POS 0u
#define FLASH_ACR_LATENCY_MASK (0xFu << FLASH_ACR_LATENCY_POS)
#define FLASH_ACR_WRHIGHFREQ_POS 4u
#define FLASH_ACR_WRHIGHFREQ_MASK (3u << FLASH_ACR_WRHIGHFREQ_POS)

/* FLASH bank 2 (the model slots): RM0433 ch. 4, "FLASH registers" (register
 * map table: the bank 2 registers sit 0x100 above bank 1's). FLASH_KEYR2
 * unlock keys KEY1/KEY2 ("FLASH configuration protection", unlocking the
 * control registers); FLASH_CR2, FLASH_SR2 and the write-1-to-clear
 * FLASH_CCR2 with their bit positions. */
#define FLASH_KEYR2 NH7_REG(FLASH_REGS_BASE + 0x104u)
#define FLASH_CR2 NH7_REG(FLASH_REGS_BASE + 0x10Cu)
#define FLASH_SR2 NH7_REG(FLASH_REGS_BASE + 0x110u)
#define FLASH_CCR2 NH7_REG(FLASH_REGS_BASE + 0x114u)
#define FLASH_KEY1 0x45670123u
#define FLASH_KEY2 0xCDEF89ABu
#define FLASH_BANK2_BASE 0x08100000u
#define FLASH_SECTOR_SIZE 0x20000u /* 128 KB, 8 per bank */
#define FLASH_WORD_SIZE 32u        /* 256-bit flash word, with 10 bits of ECC */

/* FLASH_CRx: LOCK 0, PG 1, SER 2, BER 3, PSIZE[5:4] (00 x8, 01 x16, 10 x32,
 * 11 x64), FW 6, START 7, SNB[10:8] (sector in the bank). */
#define FLASH_CR_LOCK (1u << 0)
#define FLASH_CR_PG (1u << 1)
#define FLASH_CR_SER (1u << 2)
#define FLASH_CR_BER (1u << 3)
#define FLASH_CR_PSIZE_MASK (3u << 4)
#define FLASH_CR_PSIZE_X32 (2u << 4)
#define FLASH_CR_FW (1u << 6)
#define FLASH_CR_START (1u << 7)
#define FLASH_CR_SNB_POS 8u
#define FLASH_CR_SNB_MASK (7u << FLASH_CR_SNB_POS)
/* FLASH_SRx: BSY 0, WBNE 1 (write buffer not empty), QW 2 (operation queued
 * or running), EOP 16, WRPERR 17, PGSERR 18, STRBERR 19, INCERR 21, OPERR 22,
 * RDPERR 23, RDSERR 24, SNECCERR 25, DBECCERR 26. FLASH_CCRx clears the flag
 * in the same position (CLR_EOP ... CLR_DBECCERR). */
#define FLASH_SR_BSY (1u << 0)
#define FLASH_SR_WBNE (1u << 1)
#define FLASH_SR_QW (1u << 2)
#define FLASH_SR_EOP (1u << 16)
#define FLASH_SR_WRPERR (1u << 17)
#define FLASH_SR_PGSERR (1u << 18)
#define FLASH_SR_STRBERR (1u << 19)
#define FLASH_SR_INCERR (1u << 21)
#define FLASH_SR_OPERR (1u << 22)
#define FLASH_SR_RDPERR (1u << 23)
#define FLASH_SR_RDSERR (1u << 24)
#define FLASH_SR_SNECCERR (1u << 25)
#define FLASH_SR_DBECCERR (1u << 26)
#define FLASH_SR_PROGRAM_ERRORS \
    (FLASH_SR_WRPERR | FLASH_SR_PGSERR | FLASH_SR_STRBERR | FLASH_SR_INCERR | FLASH_SR_OPERR)
#define FLASH_SR_ALL_FLAGS \
    (FLASH_SR_EOP | FLASH_SR_PROGRAM_ERRORS | FLASH_SR_RDPERR | FLASH_SR_RDSERR | FLASH_SR_SNECCERR | FLASH_SR_DBECCERR)

/* ------------------------------------------------------------------------
 * GPIOD. RM0433 ch. 11 "General-purpose I/Os (GPIO)", §11.4 GPIO registers.
 * GPIOA at 0x58020000, one port every 0x400 on AHB4.
 * ---------------------------------------------------------------------- */
#define GPIOD_BASE 0x58020C00u
#define GPIOD_MODER NH7_REG(GPIOD_BASE + 0x00u)   /* 2 bits/pin: 00 in, 01 out, 10 AF, 11 analog (reset) */
#define GPIOD_OTYPER NH7_REG(GPIOD_BASE + 0x04u)  /* 1 bit/pin: 0 push-pull */
#define GPIOD_OSPEEDR NH7_REG(GPIOD_BASE + 0x08u) /* 2 bits/pin: 00 low .. 11 very high */
#define GPIOD_PUPDR NH7_REG(GPIOD_BASE + 0x0Cu)   /* 2 bits/pin: 00 none, 01 pull-up */
#define GPIOD_AFRH NH7_REG(GPIOD_BASE + 0x24u)    /* 4 bits/pin for pins 8..15 */

/* ------------------------------------------------------------------------
 * USART3. RM0433 chapter "Universal synchronous asynchronous receiver
 * transmitter (USART)", USART register description and map. APB1 (D2),
 * base 0x40004800.
 * ---------------------------------------------------------------------- */
#define USART3_BASE 0x40004800u
#define USART3_CR1 NH7_REG(USART3_BASE + 0x00u)
#define USART3_CR2 NH7_REG(USART3_BASE + 0x04u)
#define USART3_CR3 NH7_REG(USART3_BASE + 0x08u)
#define USART3_BRR NH7_REG(USART3_BASE + 0x0Cu)
#define USART3_ISR NH7_REG(USART3_BASE + 0x1Cu)
#define USART3_ICR NH7_REG(USART3_BASE + 0x20u)
#define USART3_RDR NH7_REG(USART3_BASE + 0x24u)
#define USART3_TDR NH7_REG(USART3_BASE + 0x28u)
#define USART3_PRESC NH7_REG(USART3_BASE + 0x2Cu)

/* USART_CR1: UE bit 0, RE bit 2, TE bit 3, OVER8 bit 15, M0 bit 12, M1 bit 28, FIFOEN bit 29. */
#define USART_CR1_UE (1u << 0)
#define USART_CR1_RE (1u << 2)
#define USART_CR1_TE (1u << 3)
#define USART_CR1_FIFOEN (1u << 29)
/* USART_ISR (FIFO mode names in brackets): PE 0, FE 1, NE 2, ORE 3,
 * RXNE [RXFNE] 5, TC 6, TXE [TXFNF] 7, TEACK 21, REACK 22. */
#define USART_ISR_PE (1u << 0)
#define USART_ISR_FE (1u << 1)
#define USART_ISR_NE (1u << 2)
#define USART_ISR_ORE (1u << 3)
#define USART_ISR_RXNE (1u << 5)
#define USART_ISR_TC (1u << 6)
#define USART_ISR_TXE (1u << 7)
#define USART_ISR_TEACK (1u << 21)
#define USART_ISR_REACK (1u << 22)
/* USART_ICR: PECF 0, FECF 1, NECF 2, ORECF 3 (write 1 to clear). */
#define USART_ICR_PECF (1u << 0)
#define USART_ICR_FECF (1u << 1)
#define USART_ICR_NECF (1u << 2)
#define USART_ICR_ORECF (1u << 3)

/* ------------------------------------------------------------------------
 * DBGMCU. RM0433 chapter "Debug infrastructure", DBGMCU_IDCODE: REV_ID[31:16]
 * (0x1003 revision Y, 0x2003 revision V), DEV_ID[11:0] = 0x450.
 * ---------------------------------------------------------------------- */
#define DBGMCU_IDCODE NH7_REG(0x5C001000u)
#define NH7_REV_ID_V 0x2003u

/* ------------------------------------------------------------------------
 * Cortex-M7 system control block: PM0253 ch. 4 "Cortex-M7 peripherals",
 * section "System control block" (register names as there).
 * ---------------------------------------------------------------------- */
#define SCB_VTOR NH7_REG(0xE000ED08u)  /* VTOR vector table offset register */
#define SCB_AIRCR NH7_REG(0xE000ED0Cu) /* AIRCR application interrupt and reset control */
#define SCB_CCR NH7_REG(0xE000ED14u)   /* CCR configuration and control register */
#define SCB_SHCSR NH7_REG(0xE000ED24u) /* system handler control and state register */
#define SCB_CFSR NH7_REG(0xE000ED28u)  /* configurable fault status (MMFSR|BFSR|UFSR) */
#define SCB_HFSR NH7_REG(0xE000ED2Cu)  /* hard fault status */
#define SCB_MMFAR NH7_REG(0xE000ED34u) /* memory management fault address */
#define SCB_BFAR NH7_REG(0xE000ED38u)  /* bus fault address */

#define SCB_AIRCR_VECTKEY (0x05FAu << 16)
#define SCB_AIRCR_PRIGROUP_MASK (7u << 8)
#define SCB_AIRCR_SYSRESETREQ (1u << 2)
#define SCB_CCR_BFHFNMIGN (1u << 8) /* priority -1/-2 code ignores data BusFaults of loads and stores */
#define SCB_CCR_DC (1u << 16) /* data cache enable */
#define SCB_CCR_IC (1u << 17) /* instruction cache enable */
#define SCB_SHCSR_MEMFAULTENA (1u << 16)
#define SCB_SHCSR_BUSFAULTENA (1u << 17)
#define SCB_SHCSR_USGFAULTENA (1u << 18)

/* Floating-point unit: PM0253 ch. 4, section "Floating point unit (FPU)", CPACR
 * (coprocessor access control register): CP10 [21:20] and CP11 [23:22] = 11
 * full access. */
#define SCB_CPACR NH7_REG(0xE000ED88u)
#define SCB_CPACR_CP10_CP11_FULL (0xFu << 20)

/* Cache identification and maintenance: PM0253 ch. 4, the cache
 * maintenance operations section (ICIALLU, DCISW, "Initializing and enabling
 * the L1-cache") and the CCSIDR/CSSELR cache identification registers. */
#define SCB_CCSIDR NH7_REG(0xE000ED80u) /* cache size ID of the level CSSELR selects */
#define SCB_CSSELR NH7_REG(0xE000ED84u) /* cache size selection: 0 = L1 data cache */
#define SCB_ICIALLU NH7_REG(0xE000EF50u) /* I-cache invalidate all to the PoU */
#define SCB_DCISW NH7_REG(0xE000EF60u)   /* D-cache invalidate by set/way */
#define SCB_DCIMVAC NH7_REG(0xE000EF5Cu) /* D-cache invalidate by address to the PoC */
#define SCB_DCACHE_LINE 32u
#define SCB_CCSIDR_SETS(x) (((x) >> 13) & 0x7FFFu) /* number of sets - 1 */
#define SCB_CCSIDR_WAYS(x) (((x) >> 3) & 0x3FFu)   /* associativity - 1 */
#define SCB_DCISW_SET_POS 5u  /* 32-byte lines on the Cortex-M7 */
#define SCB_DCISW_WAY_POS 30u /* 4 ways on the Cortex-M7 */

/* SysTick: PM0253 ch. 4, section "SysTick timer (STK)". */
#define STK_CTRL NH7_REG(0xE000E010u)
#define STK_LOAD NH7_REG(0xE000E014u)
#define STK_VAL NH7_REG(0xE000E018u)
#define STK_CTRL_ENABLE (1u << 0)
#define STK_CTRL_TICKINT (1u << 1)
#define STK_CTRL_CLKSOURCE (1u << 2) /* 1 = processor clock */

/* MPU: PM0253 ch. 4, section "Memory protection unit (MPU)". MPU_RASR: ENABLE bit 0,
 * SIZE[5:1] (region 2^(SIZE+1) bytes), AP[26:24] (000 no access), XN bit 28. */
#define MPU_CTRL NH7_REG(0xE000ED94u)
#define MPU_RNR NH7_REG(0xE000ED98u)
#define MPU_RBAR NH7_REG(0xE000ED9Cu)
#define MPU_RASR NH7_REG(0xE000EDA0u)
#define MPU_CTRL_ENABLE (1u << 0)
#define MPU_CTRL_PRIVDEFENA (1u << 2)
#define MPU_RASR_ENABLE (1u << 0)
#define MPU_RASR_SIZE_POS 1u
#define MPU_RASR_XN (1u << 28)

/* Debug: ARMv7-M ARM C1.6.5 DEMCR (TRCENA bit 24) and C1.8 DWT (CTRL
 * CYCCNTENA bit 0, CYCCNT); Cortex-M7 TRM: DWT_LAR software lock, unlocked
 * by writing 0xC5ACCE55 (the STM32H7 DWT ignores writes while locked). */
#define DEMCR NH7_REG(0xE000EDFCu)
#define DEMCR_TRCENA (1u << 24)
#define DWT_CTRL NH7_REG(0xE0001000u)
#define DWT_CYCCNT NH7_REG(0xE0001004u)
#define DWT_LAR NH7_REG(0xE0001FB0u)
#define DWT_CTRL_CYCCNTENA (1u << 0)
#define DWT_LAR_UNLOCK 0xC5ACCE55u

/* Barriers: PM0253 ch. 3 instruction set, DSB and ISB. */
#define NH7_DSB() __asm__ volatile("dsb 0xF" ::: "memory")
#define NH7_ISB() __asm__ volatile("isb 0xF" ::: "memory")

/* The word the stack is painted with at reset (board_stack_used). */
#define NH7_STACK_PAINT 0xC011B12Eu

/* AXI interconnect (GPV), RM0433 ch. 2 "Memory and bus architecture", AXI
 * interconnect registers: AXI_TARG7_FN_MOD (target 7 = AXI SRAM), bit 0
 * READ_ISS_OVERRIDE. Workaround for revision Y silicon, errata ES0392
 * "Reading from AXI SRAM may lead to data read corruption". */
#define AXI_TARG7_FN_MOD NH7_REG(0x51008108u)
#define AXI_FN_MOD_READ_ISS_OVERRIDE (1u << 0)

/* The MPU guard region below the stack (linker.ld reserves it). */
#define NH7_STACK_GUARD_SIZE 256u
#define NH7_STACK_GUARD_RASR_SIZE 7u /* 2^(7+1) = 256 bytes */

/* Shared between startup.c and board.c. */
void nh7_uart_flush(void);
void nh7_system_reset(void) __attribute__((noreturn));
int nh7_uart_is_up(void);
void nh7_uart_putc_raw(uint8_t c);

#endif /* NUCLEO_H743ZI_REGS_H */
