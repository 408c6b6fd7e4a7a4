/*
 * NUCLEO-H743ZI startup: the STM32H743 vector table, Reset_Handler and the
 * fault handlers.
 *
 * Reset_Handler does only what C needs before main(): FPU access (CPACR),
 * the AXI SRAM read-issuing workaround for revision Y, .data copy, .bss and
 * .axisram zeroing, the stack paint, constructors. Clocks, caches, the UART
 * and the work counter are board_init()'s (board.c), which the runner calls
 * first thing in main(). Until then the core runs from HSI at 64 MHz, which
 * RM0433 guarantees after any reset at the reset voltage scale.
 *
 * Every unexpected exception and interrupt lands in Default_Handler: it
 * switches to a small dedicated stack (so a stack overflow can be reported
 * too), prints a short report on USART3 if board_init() has brought it up,
 * and resets the board through SCB AIRCR SYSRESETREQ.
 */
#include <stddef.h>
#include <stdint.h>

#include "stm32h743_regs.h"

/* Linker script symbols (linker.ld). */
extern uint32_t _sidata[], _sdata[], _edata[]; /* .data: load address in flash, run addresses in DTCM */
extern uint32_t _sbss[], _ebss[];              /* .bss in DTCM */
extern uint32_t __axisram_start[], __axisram_end[]; /* .axisram: the runner's model buffer and arena */
extern uint32_t __stack_bottom[], _estack[];   /* the main stack, top of DTCM */

typedef void (*nh7_handler)(void);
extern nh7_handler __preinit_array_start[], __preinit_array_end[];
extern nh7_handler __init_array_start[], __init_array_end[];

int main(void);

void Reset_Handler(void) __attribute__((noreturn));
void Default_Handler(void);
void nh7_fault_report(const uint32_t *frame, uint32_t exc_return) __attribute__((noreturn));

/* Cortex-M7 system exceptions (PM0253 ch. 2, "Exception types"). */
#define NH7_WEAK __attribute__((weak, alias("Default_Handler")))
void NMI_Handler(void) NH7_WEAK;
void HardFault_Handler(void) NH7_WEAK;
void MemManage_Handler(void) NH7_WEAK;
void BusFault_Handler(void) NH7_WEAK;
void UsageFault_Handler(void) NH7_WEAK;
void SVC_Handler(void) NH7_WEAK;
void DebugMon_Handler(void) NH7_WEAK;
void PendSV_Handler(void) NH7_WEAK;
void SysTick_Handler(void) NH7_WEAK; /* board.c defines it (work counter) */

/* STM32H743 interrupts, RM0433 chapter "Nested vectored interrupt
 * controller (NVIC)", "Interrupt and exception vectors" table (positions
 * 0..149; the gaps are reserved, or peripherals of other H7 lines). */
void WWDG_IRQHandler(void) NH7_WEAK;
void PVD_AVD_IRQHandler(void) NH7_WEAK;
void TAMP_STAMP_IRQHandler(void) NH7_WEAK;
void RTC_WKUP_IRQHandler(void) NH7_WEAK;
void FLASH_IRQHandler(void) NH7_WEAK;
void RCC_IRQHandler(void) NH7_WEAK;
void EXTI0_IRQHandler(void) NH7_WEAK;
void EXTI1_IRQHandler(void) NH7_WEAK;
void EXTI2_IRQHandler(void) NH7_WEAK;
void EXTI3_IRQHandler(void) NH7_WEAK;
void EXTI4_IRQHandler(void) NH7_WEAK;
void DMA1_Stream0_IRQHandler(void) NH7_WEAK;
void DMA1_Stream1_IRQHandler(void) NH7_WEAK;
void DMA1_Stream2_IRQHandler(void) NH7_WEAK;
void DMA1_Stream3_IRQHandler(void) NH7_WEAK;
void DMA1_Stream4_IRQHandler(void) NH7_WEAK;
void DMA1_Stream5_IRQHandler(void) NH7_WEAK;
void DMA1_Stream6_IRQHandler(void) NH7_WEAK;
void ADC_IRQHandler(void) NH7_WEAK;
void FDCAN1_IT0_IRQHandler(void) NH7_WEAK;
void FDCAN2_IT0_IRQHandler(void) NH7_WEAK;
void FDCAN1_IT1_IRQHandler(void) NH7_WEAK;
void FDCAN2_IT1_IRQHandler(void) NH7_WEAK;
void EXTI9_5_IRQHandler(void) NH7_WEAK;
void TIM1_BRK_IRQHandler(void) NH7_WEAK;
void TIM1_UP_IRQHandler(void) NH7_WEAK;
void TIM1_TRG_COM_IRQHandler(void) NH7_WEAK;
void TIM1_CC_IRQHandler(void) NH7_WEAK;
void TIM2_IRQHandler(void) NH7_WEAK;
void TIM3_IRQHandler(void) NH7_WEAK;
void TIM4_IRQHandler(void) NH7_WEAK;
void I2C1_EV_IRQHandler(void) NH7_WEAK;
void I2C1_ER_IRQHandler(void) NH7_WEAK;
void I2C2_EV_IRQHandler(void) NH7_WEAK;
void I2C2_ER_IRQHandler(void) NH7_WEAK;
void SPI1_IRQHandler(void) NH7_WEAK;
void SPI2_IRQHandler(void) NH7_WEAK;
void USART1_IRQHandler(void) NH7_WEAK;
void USART2_IRQHandler(void) NH7_WEAK;
void USART3_IRQHandler(void) NH7_WEAK;
void EXTI15_10_IRQHandler(void) NH7_WEAK;
void RTC_Alarm_IRQHandler(void) NH7_WEAK;
void TIM8_BRK_TIM12_IRQHandler(void) NH7_WEAK;
void TIM8_UP_TIM13_IRQHandler(void) NH7_WEAK;
void TIM8_TRG_COM_TIM14_IRQHandler(void) NH7_WEAK;
void TIM8_CC_IRQHandler(void) NH7_WEAK;
void DMA1_Stream7_IRQHandler(void) NH7_WEAK;
void FMC_IRQHandler(void) NH7_WEAK;
void SDMMC1_IRQHandler(void) NH7_WEAK;
void TIM5_IRQHandler(void) NH7_WEAK;
void SPI3_IRQHandler(void) NH7_WEAK;
void UART4_IRQHandler(void) NH7_WEAK;
void UART5_IRQHandler(void) NH7_WEAK;
void TIM6_DAC_IRQHandler(void) NH7_WEAK;
void TIM7_IRQHandler(void) NH7_WEAK;
void DMA2_Stream0_IRQHandler(void) NH7_WEAK;
void DMA2_Stream1_IRQHandler(void) NH7_WEAK;
void DMA2_Stream2_IRQHandler(void) NH7_WEAK;
void DMA2_Stream3_IRQHandler(void) NH7_WEAK;
void DMA2_Stream4_IRQHandler(void) NH7_WEAK;
void ETH_IRQHandler(void) NH7_WEAK;
void ETH_WKUP_IRQHandler(void) NH7_WEAK;
void FDCAN_CAL_IRQHandler(void) NH7_WEAK;
void DMA2_Stream5_IRQHandler(void) NH7_WEAK;
void DMA2_Stream6_IRQHandler(void) NH7_WEAK;
void DMA2_Stream7_IRQHandler(void) NH7_WEAK;
void USART6_IRQHandler(void) NH7_WEAK;
void I2C3_EV_IRQHandler(void) NH7_WEAK;
void I2C3_ER_IRQHandler(void) NH7_WEAK;
void OTG_HS_EP1_OUT_IRQHandler(void) NH7_WEAK;
void OTG_HS_EP1_IN_IRQHandler(void) NH7_WEAK;
void OTG_HS_WKUP_IRQHandler(void) NH7_WEAK;
void OTG_HS_IRQHandler(void) NH7_WEAK;
void DCMI_IRQHandler(void) NH7_WEAK;
void RNG_IRQHandler(void) NH7_WEAK;
void FPU_IRQHandler(void) NH7_WEAK;
void UART7_IRQHandler(void) NH7_WEAK;
void UART8_IRQHandler(void) NH7_WEAK;
void SPI4_IRQHandler(void) NH7_WEAK;
void SPI5_IRQHandler(void) NH7_WEAK;
void SPI6_IRQHandler(void) NH7_WEAK;
void SAI1_IRQHandler(void) NH7_WEAK;
void LTDC_IRQHandler(void) NH7_WEAK;
void LTDC_ER_IRQHandler(void) NH7_WEAK;
void DMA2D_IRQHandler(void) NH7_WEAK;
void SAI2_IRQHandler(void) NH7_WEAK;
void QUADSPI_IRQHandler(void) NH7_WEAK;
void LPTIM1_IRQHandler(void) NH7_WEAK;
void CEC_IRQHandler(void) NH7_WEAK;
void I2C4_EV_IRQHandler(void) NH7_WEAK;
void I2C4_ER_IRQHandler(void) NH7_WEAK;
void SPDIF_RX_IRQHandler(void) NH7_WEAK;
void OTG_FS_EP1_OUT_IRQHandler(void) NH7_WEAK;
void OTG_FS_EP1_IN_IRQHandler(void) NH7_WEAK;
void OTG_FS_WKUP_IRQHandler(void) NH7_WEAK;
void OTG_FS_IRQHandler(void) NH7_WEAK;
void DMAMUX1_OVR_IRQHandler(void) NH7_WEAK;
void HRTIM1_Master_IRQHandler(void) NH7_WEAK;
void HRTIM1_TIMA_IRQHandler(void) NH7_WEAK;
void HRTIM1_TIMB_IRQHandler(void) NH7_WEAK;
void HRTIM1_TIMC_IRQHandler(void) NH7_WEAK;
void HRTIM1_TIMD_IRQHandler(void) NH7_WEAK;
void HRTIM1_TIME_IRQHandler(void) NH7_WEAK;
void HRTIM1_FLT_IRQHandler(void) NH7_WEAK;
void DFSDM1_FLT0_IRQHandler(void) NH7_WEAK;
void DFSDM1_FLT1_IRQHandler(void) NH7_WEAK;
void DFSDM1_FLT2_IRQHandler(void) NH7_WEAK;
void DFSDM1_FLT3_IRQHandler(void) NH7_WEAK;
void SAI3_IRQHandler(void) NH7_WEAK;
void SWPMI1_IRQHandler(void) NH7_WEAK;
void TIM15_IRQHandler(void) NH7_WEAK;
void TIM16_IRQHandler(void) NH7_WEAK;
void TIM17_IRQHandler(void) NH7_WEAK;
void MDIOS_WKUP_IRQHandler(void) NH7_WEAK;
void MDIOS_IRQHandler(void) NH7_WEAK;
void JPEG_IRQHandler(void) NH7_WEAK;
void MDMA_IRQHandler(void) NH7_WEAK;
void SDMMC2_IRQHandler(void) NH7_WEAK;
void HSEM1_IRQHandler(void) NH7_WEAK;
void ADC3_IRQHandler(void) NH7_WEAK;
void DMAMUX2_OVR_IRQHandler(void) NH7_WEAK;
void BDMA_Channel0_IRQHandler(void) NH7_WEAK;
void BDMA_Channel1_IRQHandler(void) NH7_WEAK;
void BDMA_Channel2_IRQHandler(void) NH7_WEAK;
void BDMA_Channel3_IRQHandler(void) NH7_WEAK;
void BDMA_Channel4_IRQHandler(void) NH7_WEAK;
void BDMA_Channel5_IRQHandler(void) NH7_WEAK;
void BDMA_Channel6_IRQHandler(void) NH7_WEAK;
void BDMA_Channel7_IRQHandler(void) NH7_WEAK;
void COMP_IRQHandler(void) NH7_WEAK;
void LPTIM2_IRQHandler(void) NH7_WEAK;
void LPTIM3_IRQHandler(void) NH7_WEAK;
void LPTIM4_IRQHandler(void) NH7_WEAK;
void LPTIM5_IRQHandler(void) NH7_WEAK;
void LPUART1_IRQHandler(void) NH7_WEAK;
void CRS_IRQHandler(void) NH7_WEAK;
void ECC_IRQHandler(void) NH7_WEAK;
void SAI4_IRQHandler(void) NH7_WEAK;
void WAKEUP_PIN_IRQHandler(void) NH7_WEAK;

/* 16 system entries (initial SP + 15 exceptions) and IRQ 0..149. The table
 * is 166 words = 664 bytes; VTOR needs it aligned to the next power of two,
 * 1 KB, which its place at the start of flash (0x08000000) gives. */
#define NH7_NUM_IRQS 150
#define IRQ(n) [15 + (n)]

struct nh7_vector_table {
    uint32_t *initial_sp;
    nh7_handler vectors[15 + NH7_NUM_IRQS];
};

__attribute__((section(".isr_vector"), used)) const struct nh7_vector_table nh7_vector_table = {
    .initial_sp = _estack,
    .vectors = {
        [0] = Reset_Handler,
        [1] = NMI_Handler,
        [2] = HardFault_Handler,
        [3] = MemManage_Handler,
        [4] = BusFault_Handler,
        [5] = UsageFault_Handler,
        /* [6..9] reserved */
        [10] = SVC_Handler,
        [11] = DebugMon_Handler,
        /* [12] reserved */
        [13] = PendSV_Handler,
        [14] = SysTick_Handler,

        IRQ(0) = WWDG_IRQHandler,
        IRQ(1) = PVD_AVD_IRQHandler,
        IRQ(2) = TAMP_STAMP_IRQHandler,
        IRQ(3) = RTC_WKUP_IRQHandler,
        IRQ(4) = FLASH_IRQHandler,
        IRQ(5) = RCC_IRQHandler,
        IRQ(6) = EXTI0_IRQHandler,
        IRQ(7) = EXTI1_IRQHandler,
        IRQ(8) = EXTI2_IRQHandler,
        IRQ(9) = EXTI3_IRQHandler,
        IRQ(10) = EXTI4_IRQHandler,
        IRQ(11) = DMA1_Stream0_IRQHandler,
        IRQ(12) = DMA1_Stream1_IRQHandler,
        IRQ(13) = DMA1_Stream2_IRQHandler,
        IRQ(14) = DMA1_Stream3_IRQHandler,
        IRQ(15) = DMA1_Stream4_IRQHandler,
        IRQ(16) = DMA1_Stream5_IRQHandler,
        IRQ(17) = DMA1_Stream6_IRQHandler,
        IRQ(18) = ADC_IRQHandler, /* ADC1 and ADC2 */
        IRQ(19) = FDCAN1_IT0_IRQHandler,
        IRQ(20) = FDCAN2_IT0_IRQHandler,
        IRQ(21) = FDCAN1_IT1_IRQHandler,
        IRQ(22) = FDCAN2_IT1_IRQHandler,
        IRQ(23) = EXTI9_5_IRQHandler,
        IRQ(24) = TIM1_BRK_IRQHandler,
        IRQ(25) = TIM1_UP_IRQHandler,
        IRQ(26) = TIM1_TRG_COM_IRQHandler,
        IRQ(27) = TIM1_CC_IRQHandler,
        IRQ(28) = TIM2_IRQHandler,
        IRQ(29) = TIM3_IRQHandler,
        IRQ(30) = TIM4_IRQHandler,
        IRQ(31) = I2C1_EV_IRQHandler,
        IRQ(32) = I2C1_ER_IRQHandler,
        IRQ(33) = I2C2_EV_IRQHandler,
        IRQ(34) = I2C2_ER_IRQHandler,
        IRQ(35) = SPI1_IRQHandler,
        IRQ(36) = SPI2_IRQHandler,
        IRQ(37) = USART1_IRQHandler,
        IRQ(38) = USART2_IRQHandler,
        IRQ(39) = USART3_IRQHandler, /* the console; polled, never enabled in the NVIC */
        IRQ(40) = EXTI15_10_IRQHandler,
        IRQ(41) = RTC_Alarm_IRQHandler,
        /* IRQ 42 reserved */
        IRQ(43) = TIM8_BRK_TIM12_IRQHandler,
        IRQ(44) = TIM8_UP_TIM13_IRQHandler,
        IRQ(45) = TIM8_TRG_COM_TIM14_IRQHandler,
        IRQ(46) = TIM8_CC_IRQHandler,
        IRQ(47) = DMA1_Stream7_IRQHandler,
        IRQ(48) = FMC_IRQHandler,
        IRQ(49) = SDMMC1_IRQHandler,
        IRQ(50) = TIM5_IRQHandler,
        IRQ(51) = SPI3_IRQHandler,
        IRQ(52) = UART4_IRQHandler,
        IRQ(53) = UART5_IRQHandler,
        IRQ(54) = TIM6_DAC_IRQHandler,
        IRQ(55) = TIM7_IRQHandler,
        IRQ(56) = DMA2_Stream0_IRQHandler,
        IRQ(57) = DMA2_Stream1_IRQHandler,
        IRQ(58) = DMA2_Stream2_IRQHandler,
        IRQ(59) = DMA2_Stream3_IRQHandler,
        IRQ(60) = DMA2_Stream4_IRQHandler,
        IRQ(61) = ETH_IRQHandler,
        IRQ(62) = ETH_WKUP_IRQHandler,
        IRQ(63) = FDCAN_CAL_IRQHandler,
        /* IRQ 64..67 reserved */
        IRQ(68) = DMA2_Stream5_IRQHandler,
        IRQ(69) = DMA2_Stream6_IRQHandler,
        IRQ(70) = DMA2_Stream7_IRQHandler,
        IRQ(71) = USART6_IRQHandler,
        IRQ(72) = I2C3_EV_IRQHandler,
        IRQ(73) = I2C3_ER_IRQHandler,
        IRQ(74) = OTG_HS_EP1_OUT_IRQHandler,
        IRQ(75) = OTG_HS_EP1_IN_IRQHandler,
        IRQ(76) = OTG_HS_WKUP_IRQHandler,
        IRQ(77) = OTG_HS_IRQHandler,
        IRQ(78) = DCMI_IRQHandler,
        /* IRQ 79 reserved (CRYP on STM32H753) */
        IRQ(80) = RNG_IRQHandler, /* HASH_RNG on STM32H753 */
        IRQ(81) = FPU_IRQHandler,
        IRQ(82) = UART7_IRQHandler,
        IRQ(83) = UART8_IRQHandler,
        IRQ(84) = SPI4_IRQHandler,
        IRQ(85) = SPI5_IRQHandler,
        IRQ(86) = SPI6_IRQHandler,
        IRQ(87) = SAI1_IRQHandler,
        IRQ(88) = LTDC_IRQHandler,
        IRQ(89) = LTDC_ER_IRQHandler,
        IRQ(90) = DMA2D_IRQHandler,
        IRQ(91) = SAI2_IRQHandler,
        IRQ(92) = QUADSPI_IRQHandler,
        IRQ(93) = LPTIM1_IRQHandler,
        IRQ(94) = CEC_IRQHandler,
        IRQ(95) = I2C4_EV_IRQHandler,
        IRQ(96) = I2C4_ER_IRQHandler,
        IRQ(97) = SPDIF_RX_IRQHandler,
        IRQ(98) = OTG_FS_EP1_OUT_IRQHandler,
        IRQ(99) = OTG_FS_EP1_IN_IRQHandler,
        IRQ(100) = OTG_FS_WKUP_IRQHandler,
        IRQ(101) = OTG_FS_IRQHandler,
        IRQ(102) = DMAMUX1_OVR_IRQHandler,
        IRQ(103) = HRTIM1_Master_IRQHandler,
        IRQ(104) = HRTIM1_TIMA_IRQHandler,
        IRQ(105) = HRTIM1_TIMB_IRQHandler,
        IRQ(106) = HRTIM1_TIMC_IRQHandler,
        IRQ(107) = HRTIM1_TIMD_IRQHandler,
        IRQ(108) = HRTIM1_TIME_IRQHandler,
        IRQ(109) = HRTIM1_FLT_IRQHandler,
        IRQ(110) = DFSDM1_FLT0_IRQHandler,
        IRQ(111) = DFSDM1_FLT1_IRQHandler,
        IRQ(112) = DFSDM1_FLT2_IRQHandler,
        IRQ(113) = DFSDM1_FLT3_IRQHandler,
        IRQ(114) = SAI3_IRQHandler,
        IRQ(115) = SWPMI1_IRQHandler,
        IRQ(116) = TIM15_IRQHandler,
        IRQ(117) = TIM16_IRQHandler,
        IRQ(118) = TIM17_IRQHandler,
        IRQ(119) = MDIOS_WKUP_IRQHandler,
        IRQ(120) = MDIOS_IRQHandler,
        IRQ(121) = JPEG_IRQHandler,
        IRQ(122) = MDMA_IRQHandler,
        /* IRQ 123 reserved */
        IRQ(124) = SDMMC2_IRQHandler,
        IRQ(125) = HSEM1_IRQHandler,
        /* IRQ 126 reserved */
        IRQ(127) = ADC3_IRQHandler,
        IRQ(128) = DMAMUX2_OVR_IRQHandler,
        IRQ(129) = BDMA_Channel0_IRQHandler,
        IRQ(130) = BDMA_Channel1_IRQHandler,
        IRQ(131) = BDMA_Channel2_IRQHandler,
        IRQ(132) = BDMA_Channel3_IRQHandler,
        IRQ(133) = BDMA_Channel4_IRQHandler,
        IRQ(134) = BDMA_Channel5_IRQHandler,
        IRQ(135) = BDMA_Channel6_IRQHandler,
        IRQ(136) = BDMA_Channel7_IRQHandler,
        IRQ(137) = COMP_IRQHandler,
        IRQ(138) = LPTIM2_IRQHandler,
        IRQ(139) = LPTIM3_IRQHandler,
        IRQ(140) = LPTIM4_IRQHandler,
        IRQ(141) = LPTIM5_IRQHandler,
        IRQ(142) = LPUART1_IRQHandler,
        /* IRQ 143 reserved */
        IRQ(144) = CRS_IRQHandler,
        IRQ(145) = ECC_IRQHandler,
        IRQ(146) = SAI4_IRQHandler,
        /* IRQ 147, 148 reserved */
        IRQ(149) = WAKEUP_PIN_IRQHandler,
    },
};

#undef IRQ

void Reset_Handler(void)
{
    /* 1. FPU before any floating-point instruction: CP10 and CP11 full access
     *    (PM0253 ch. 4, "Floating point unit (FPU)": "Enabling the FPU"),
     *    then DSB/ISB so the next instruction sees it. Nothing above this
     *    line may touch a VFP register; this function uses none. */
    SCB_CPACR |= SCB_CPACR_CP10_CP11_FULL;
    NH7_DSB();
    NH7_ISB();

    /* The vector table is where the boot address option bytes send the core
     * (BOOT_ADD0 = 0x0800 -> 0x08000000 by default, RM0433 ch. 2 "Memory and
     * bus architecture", "Boot configuration"), which is where linker.ld puts
     * it; set VTOR anyway so a debugger that jumps here gets our table. */
    SCB_VTOR = (uint32_t)(uintptr_t)&nh7_vector_table;

    /* 2. Revision Y silicon: AXI SRAM reads can return corrupted data unless
     *    the AXI SRAM target's read issuing capability is 1 (errata ES0392,
     *    workaround as ST's own SystemInit does). The model and arena live
     *    in AXI SRAM, so before anything reads it. REV_ID: RM0433 DBGMCU_IDCODE. */
    if ((DBGMCU_IDCODE >> 16) < NH7_REV_ID_V) {
        AXI_TARG7_FN_MOD = AXI_FN_MOD_READ_ISS_OVERRIDE;
    }

    /* 3. .data from flash, .bss and .axisram (runner_model, runner_arena:
     *    static objects, so C says zero) to zero. Word loops: linker.ld aligns
     *    every bound to 4 bytes or more. */
    const uint32_t *src = _sidata;
    for (uint32_t *dst = _sdata; dst < _edata;) {
        *dst++ = *src++;
    }
    for (uint32_t *dst = _sbss; dst < _ebss;) {
        *dst++ = 0u;
    }
    for (uint32_t *dst = __axisram_start; dst < __axisram_end;) {
        *dst++ = 0u;
    }

    /* 4. Paint the main stack from its bottom up to the current SP (this
     *    function's own frame sits above it) for board_stack_used(). */
    uintptr_t sp;
    __asm__ volatile("mov %0, sp" : "=r"(sp));
    for (uint32_t *p = __stack_bottom; (uintptr_t)p < sp;) {
        *p++ = NH7_STACK_PAINT;
    }

    /* 5. Constructors (none in the runner; cheap to honour). */
    for (nh7_handler *f = __preinit_array_start; f < __preinit_array_end; ++f) {
        (*f)();
    }
    for (nh7_handler *f = __init_array_start; f < __init_array_end; ++f) {
        (*f)();
    }

    (void)main();
    nh7_uart_flush();
    nh7_system_reset(); /* there is nothing to return to */
}

/*
 * Default_Handler: every fault, NMI and unexpected interrupt. Naked, so it
 * touches no stack before it has moved off it: the faulting stack may be the
 * one that overflowed into the MPU guard. It picks the stacked frame (MSP or
 * PSP per EXC_RETURN bit 2, PM0253 ch. 2 "Exception entry and return"),
 * turns the MPU off (a MemManage handler otherwise runs with the guard still
 * armed), moves SP to the 1 KB fault stack linker.ld reserves and branches to
 * the C reporter, which never returns.
 */
__attribute__((naked)) void Default_Handler(void)
{
    __asm__ volatile(
        "tst   lr, #4\n"
        "ite   eq\n"
        "mrseq r0, msp\n"
        "mrsne r0, psp\n"
        "mov   r1, lr\n"
        "movw  r2, #:lower16:0xE000ED94\n" /* MPU_CTRL */
        "movt  r2, #:upper16:0xE000ED94\n"
        "movs  r3, #0\n"
        "str   r3, [r2]\n"
        "dsb   0xF\n"
        "isb   0xF\n"
        "movw  r2, #:lower16:__fault_stack_top\n"
        "movt  r2, #:upper16:__fault_stack_top\n"
        "mov   sp, r2\n"
        "b     nh7_fault_report\n");
}

static void put_str(const char *s)
{
    while (*s != '\0') {
        nh7_uart_putc_raw((uint8_t)*s++);
    }
}

static void put_hex(const char *label, uint32_t v)
{
    static const char digits[] = "0123456789abcdef";
    put_str(label);
    for (int shift = 28; shift >= 0; shift -= 4) {
        nh7_uart_putc_raw((uint8_t)digits[(v >> (unsigned)shift) & 0xFu]);
    }
}

static const char *exception_name(uint32_t n)
{
    switch (n) {
    case 2u: return "NMI";
    case 3u: return "HardFault";
    case 4u: return "MemManage";
    case 5u: return "BusFault";
    case 6u: return "UsageFault";
    case 11u: return "SVCall";
    case 12u: return "DebugMonitor";
    case 14u: return "PendSV";
    case 15u: return "SysTick";
    default: return n >= 16u ? "IRQ" : "reserved exception";
    }
}

/* Frames we dare read: word-aligned and inside DTCM or AXI SRAM. */
static int frame_readable(const uint32_t *frame)
{
    const uintptr_t a = (uintptr_t)frame;
    if ((a & 3u) != 0u) {
        return 0;
    }
    if (a >= NH7_DTCM_BASE && a + 32u <= NH7_DTCM_BASE + NH7_DTCM_SIZE) {
        return 1;
    }
    return a >= NH7_AXISRAM_BASE && a + 32u <= NH7_AXISRAM_BASE + NH7_AXISRAM_SIZE;
}

/*
 * The report, framed by 0x00 bytes so a host speaking the COBS protocol
 * (docs/protocol.md) sees at worst one undecodable frame and resynchronises:
 *   \0\r\n*** HardFault (exception 3) CFSR=... HFSR=... MMFAR=... BFAR=...
 *   PC=... LR=... xPSR=... SP=... EXC_RETURN=...\r\n*** reset\r\n\0
 * Fault status registers: PM0253 ch. 4, "System control block" (CFSR, HFSR,
 * MMFAR, BFAR). Then SYSRESETREQ.
 */
void nh7_fault_report(const uint32_t *frame, uint32_t exc_return)
{
    static volatile uint32_t reporting;
    if (reporting != 0u) { /* faulted while reporting: just reset */
        nh7_system_reset();
    }
    reporting = 1u;

    uint32_t ipsr;
    __asm__ volatile("mrs %0, ipsr" : "=r"(ipsr));
    ipsr &= 0x1FFu;

    if (nh7_uart_is_up()) {
        nh7_uart_putc_raw(0u);
        put_str("\r\n*** ");
        put_str(exception_name(ipsr));
        if (ipsr >= 16u) {
            put_hex(" ", ipsr - 16u);
        }
        put_hex(" exception=", ipsr);
        put_hex(" CFSR=", SCB_CFSR);
        put_hex(" HFSR=", SCB_HFSR);
        put_hex(" MMFAR=", SCB_MMFAR);
        put_hex(" BFAR=", SCB_BFAR);
        if (frame_readable(frame)) {
            put_hex("\r\n*** PC=", frame[6]);
            put_hex(" LR=", frame[5]);
            put_hex(" xPSR=", frame[7]);
        }
        put_hex(" SP=", (uint32_t)(uintptr_t)frame);
        put_hex(" EXC_RETURN=", exc_return);
        put_str("\r\n*** reset\r\n");
        nh7_uart_putc_raw(0u);
        nh7_uart_flush();
    }
    nh7_system_reset();
}
