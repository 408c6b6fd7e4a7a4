/*
 * Colibri on FreeRTOS: a smart meter forecasting tomorrow's load, on the
 * NUCLEO-H743ZI, or on QEMU's mps2-an500 Cortex-M7 (BOARD=mps2_an500, which
 * defines APP_BOARD_MPS2_AN500; README.md in this folder).
 *
 *   sensor task     one reading every half hour of simulated time
 *   (priority 3)    (METER_PERIOD_MS of real time), from meter.c's synthetic
 *        |          daily load curve, into a queue
 *        v
 *   reading queue   static, READING_QUEUE_LENGTH readings
 *        |
 *        v
 *   inference task  owns the one Colibri context (arena in AXI SRAM, model
 *   (priority 2)    image in flash from the packed model.c), keeps the last
 *                   week of readings and, at every simulated midnight once it
 *                   has a week, builds the forecaster's input, runs
 *                   colibri_forward() and prints the next 24 hours on USART3
 *                   (the ST-LINK virtual COM port); a day later it prints how
 *                   far that forecast was from the readings that came.
 *
 * Everything is static: tasks, stacks, the queue, the arena, the history.
 * There is no heap: configSUPPORT_DYNAMIC_ALLOCATION is 0, no heap_x.c is
 * linked, and the Makefile fails the link if anything references malloc.
 */
#include <stddef.h>
#include <stdint.h>

#include "FreeRTOS.h"
#include "queue.h"
#include "task.h"

#include "board.h"
#include "colibri.h"
#include "meter.h"
#include "model.h" /* from `colibri pack MODEL --c-array DIR` */

/* The packed model must be the forecaster meter.h describes. */
_Static_assert(COLIBRI_MODEL_INPUT_SIZE == METER_INPUT_SIZE,
               "model.h: the model's input is not the smart meter forecaster's 105 features (see meter.h)");
_Static_assert(COLIBRI_MODEL_OUTPUT_SIZE == METER_HORIZON,
               "model.h: the model does not forecast 48 half hours (see meter.h)");

/* ---- configuration -------------------------------------------------------- */

/* Real time per simulated half hour: a simulated day takes 48 x 100 ms =
 * 4.8 s, the first forecast comes after a simulated week (33.6 s). */
#ifndef METER_PERIOD_MS
#define METER_PERIOD_MS 100u
#endif
#define METER_PERIOD_TICKS pdMS_TO_TICKS(METER_PERIOD_MS)

/* A day-ahead forecast at every simulated midnight, as the smart meter demo
 * scores them. */
#define FORECAST_EVERY METER_STEPS_PER_DAY

/* Build options for checks (the QEMU run of tests/target/test_target_freertos.py):
 *   APP_STOP_AFTER_DAYS=n   after the n-th forecast has been scored, print
 *                           "done" and board_exit(0) (QEMU: ends the run);
 *   APP_REFERENCE_KERNELS   the engine's reference kernels instead of the
 *                           build's optimised ones (bit-for-bit the host's
 *                           colibri.Model(..., reference_kernels=True));
 *   APP_PRINT_RAW           also print each forecast's 48 model outputs as
 *                           float32 bit patterns ("raw" lines, hex). */
#ifndef APP_STOP_AFTER_DAYS
#define APP_STOP_AFTER_DAYS 0u
#endif

#define READING_QUEUE_LENGTH 8u

#define SENSOR_PRIORITY (tskIDLE_PRIORITY + 3u)    /* on time, every period */
#define INFERENCE_PRIORITY (tskIDLE_PRIORITY + 2u) /* may take its time */

/* Stack depths in words (StackType_t, 4 bytes). The inference task's deepest
 * path is colibri_init()'s image validation, roughly 1.5 KB with GCC 12 -O2
 * (-fstack-usage); colibri_forward() keeps its activations in the arena, not
 * on the stack. 4 KB leaves a wide margin; both tasks' high-water marks are
 * printed once the first forecast has been scored, and
 * configCHECK_FOR_STACK_OVERFLOW catches an overflow. */
#define SENSOR_STACK_WORDS 256u
#define INFERENCE_STACK_WORDS 1024u

/* The arena: AXI SRAM (boards/nucleo_h743zi/linker.ld, section .axisram,
 * zeroed at reset), 512 KB, leaving the 128 KB DTCM to stacks and kernel
 * data. A small model's arena also fits in DTCM (faster, never cached):
 * build with -DAPP_ARENA_SECTION='".bss.app_arena"'. */
#ifndef APP_ARENA_SECTION
#if defined(APP_BOARD_MPS2_AN500)
#define APP_ARENA_SECTION ".bss.app_arena" /* mps2-an500: plain RAM (.bss, zeroed at reset) */
#else
#define APP_ARENA_SECTION ".axisram"
#endif
#endif

/* ---- console ---------------------------------------------------------------- */

static void put_str(const char *s)
{
    size_t n = 0;
    while (s[n] != '\0') {
        ++n;
    }
    board_uart_write((const uint8_t *)s, n);
}

#if defined(APP_PRINT_RAW)
static void put_hex32(uint32_t v)
{
    char buf[8];
    for (uint32_t i = 0; i < 8u; ++i) {
        const uint32_t nibble = (v >> (28u - 4u * i)) & 15u;
        buf[i] = (char)(nibble < 10u ? '0' + nibble : 'a' + (nibble - 10u));
    }
    board_uart_write((const uint8_t *)buf, sizeof buf);
}
#endif

static void put_u32(uint32_t v)
{
    char buf[11];
    size_t i = sizeof buf;
    do {
        buf[--i] = (char)('0' + v % 10u);
        v /= 10u;
    } while (v != 0u);
    board_uart_write((const uint8_t *)&buf[i], sizeof buf - i);
}

static void put_i32(int32_t v)
{
    if (v < 0) {
        put_str("-");
        put_u32((uint32_t)0 - (uint32_t)v);
    } else {
        put_u32((uint32_t)v);
    }
}

/* Whole units, rounded half away from zero; saturated to the int32 range. */
static int32_t round_to_i32(float x)
{
    if (x >= 2147483520.0f) {
        return INT32_MAX;
    }
    if (x <= -2147483520.0f) {
        return INT32_MIN;
    }
    return (int32_t)(x < 0.0f ? x - 0.5f : x + 0.5f);
}

/* "hh:mm" of a half-hour slot of the day. */
static void put_clock(uint32_t slot)
{
    const uint32_t h = slot / 2u, m = (slot % 2u) * 30u;
    const char s[6] = {(char)('0' + h / 10u), (char)('0' + h % 10u), ':', (char)('0' + m / 10u),
                       (char)('0' + m % 10u), '\0'};
    put_str(s);
}

static const char *const weekday_name[7] = {"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"};

/* ---- fatal errors ------------------------------------------------------------ */

static void halt(void) __attribute__((noreturn));
static void halt(void)
{
    taskDISABLE_INTERRUPTS();
    for (;;) {
        __asm__ volatile("wfi");
    }
}

/* A Colibri call failed: say which and why, then stop this task (the sensor
 * keeps running; nothing else depends on the forecasts). */
static void colibri_failed(const char *what, colibri_status status) __attribute__((noreturn));
static void colibri_failed(const char *what, colibri_status status)
{
    put_str("error: ");
    put_str(what);
    put_str(": ");
    put_str(colibri_strerror(status));
    put_str(" (status ");
    put_i32((int32_t)status);
    put_str(")\r\n");
    for (;;) {
        vTaskSuspend(NULL);
    }
}

void app_assert_failed(const char *file, int line)
{
    taskDISABLE_INTERRUPTS();
    put_str("\r\n*** FreeRTOS assertion failed: ");
    put_str(file);
    put_str(":");
    put_i32((int32_t)line);
    put_str("\r\n");
    halt();
}

void vApplicationStackOverflowHook(TaskHandle_t task, char *name)
{
    (void)task;
    taskDISABLE_INTERRUPTS();
    put_str("\r\n*** stack overflow in task ");
    put_str(name);
    put_str("\r\n");
    halt();
}

/* Nothing to do: sleep until the next interrupt (the tick, at the latest).
 * Under QEMU -icount sleep=off, virtual time then jumps to that interrupt. */
void vApplicationIdleHook(void)
{
    __asm__ volatile("wfi");
}

/* ---- static memory for the kernel's own tasks (configSUPPORT_STATIC_ALLOCATION) */

void vApplicationGetIdleTaskMemory(StaticTask_t **tcb, StackType_t **stack, configSTACK_DEPTH_TYPE *words)
{
    static StaticTask_t idle_tcb;
    static StackType_t idle_stack[configMINIMAL_STACK_SIZE];
    *tcb = &idle_tcb;
    *stack = idle_stack;
    *words = configMINIMAL_STACK_SIZE;
}

void vApplicationGetTimerTaskMemory(StaticTask_t **tcb, StackType_t **stack, configSTACK_DEPTH_TYPE *words)
{
    static StaticTask_t timer_tcb;
    static StackType_t timer_stack[configTIMER_TASK_STACK_DEPTH];
    *tcb = &timer_tcb;
    *stack = timer_stack;
    *words = configTIMER_TASK_STACK_DEPTH;
}

/* ---- exception vectors --------------------------------------------------------
 *
 * install_vectors() copies the board's flash vector table to RAM (VTOR needs
 * it aligned to the next power of two above its size) and points some entries
 * at the kernel; every other entry is unchanged. The port reads the initial
 * stack pointer from entry 0 of whatever VTOR points at when it starts the
 * first task, so the copy keeps that too. */
#define SCB_CPUID (*(const volatile uint32_t *)0xE000ED00u) /* PM0253: SCB CPUID */
#define SCB_VTOR (*(volatile uint32_t *)0xE000ED08u)         /* PM0253: SCB VTOR */
#define SYST_CSR (*(volatile uint32_t *)0xE000E010u) /* PM0253: SysTick control and status */
#define SYST_CSR_TICKINT (1u << 1)
#define VECTOR_SVCALL 11u
#define VECTOR_PENDSV 14u
#define VECTOR_SYSTICK 15u

void xPortSysTickHandler(void); /* FreeRTOS port.c */

#if defined(APP_BOARD_MPS2_AN500)
/* mps2-an500: boards/mps2_an500/startup.S sends SVCall and PendSV to its
 * fault report and SysTick to its work counter (which board_work_start/stop
 * reprogram, so this example does not use them: the kernel owns SysTick).
 * The copy points the three at the port's handlers, under their own names
 * (FreeRTOSConfig.h). 16 + 64 entries (startup.S) -> 512-byte alignment. */
#define VECTOR_COUNT (16u + 64u)
#define VECTOR_ALIGN 512
void vPortSVCHandler(void);    /* FreeRTOS port.c */
void xPortPendSVHandler(void); /* FreeRTOS port.c */
#else
/* NUCLEO-H743ZI: board.c owns SysTick_Handler (it extends DWT CYCCNT to 64
 * bits for board_work_start/stop), so the flash vector table cannot point at
 * the port's xPortSysTickHandler: the copy points the SysTick entry at tick(),
 * which calls both. SVCall and PendSV use direct routing (FreeRTOSConfig.h).
 * 166 words (initial SP, 15 exceptions, STM32H743 IRQ 0..149, startup.c) ->
 * 1 KB alignment. */
#define VECTOR_COUNT (16u + 150u)
#define VECTOR_ALIGN 1024
void SysTick_Handler(void); /* boards/nucleo_h743zi/board.c */

static void tick(void)
{
    /* board_init() starts SysTick before the kernel exists; the kernel's tick
     * only once vTaskStartScheduler() has taken SysTick over. */
    if (xTaskGetSchedulerState() != taskSCHEDULER_NOT_STARTED) {
        xPortSysTickHandler();
    }
    SysTick_Handler();
}
#endif

static uint32_t ram_vectors[VECTOR_COUNT] __attribute__((aligned(VECTOR_ALIGN)));

static void install_vectors(void)
{
    const volatile uint32_t *flash_vectors = (const volatile uint32_t *)(uintptr_t)SCB_VTOR;
    for (uint32_t i = 0; i < VECTOR_COUNT; ++i) {
        ram_vectors[i] = flash_vectors[i];
    }
#if defined(APP_BOARD_MPS2_AN500)
    ram_vectors[VECTOR_SVCALL] = (uint32_t)(uintptr_t)&vPortSVCHandler;
    ram_vectors[VECTOR_PENDSV] = (uint32_t)(uintptr_t)&xPortPendSVHandler;
    ram_vectors[VECTOR_SYSTICK] = (uint32_t)(uintptr_t)&xPortSysTickHandler;
#else
    ram_vectors[VECTOR_SYSTICK] = (uint32_t)(uintptr_t)&tick;
#endif
    __asm__ volatile("cpsid i\n\tdsb\n\tisb" ::: "memory");
    SCB_VTOR = (uint32_t)(uintptr_t)ram_vectors;
    __asm__ volatile("dsb\n\tisb\n\tcpsie i" ::: "memory");
}

/* The work counter around colibri_forward(): the NUCLEO's DWT cycle counter;
 * none on mps2-an500 (the board's counter is SysTick, the kernel's tick). */
#if defined(APP_BOARD_MPS2_AN500)
#define APP_HAS_WORK_COUNTER 0
#else
#define APP_HAS_WORK_COUNTER 1
#endif

/* ---- the sensor task ------------------------------------------------------------ */

typedef struct meter_reading {
    uint32_t step; /* half hours since Monday 00:00 of simulated week 0 */
    float mw;
} meter_reading;

static StaticQueue_t reading_queue_cb;
static uint8_t reading_queue_storage[READING_QUEUE_LENGTH * sizeof(meter_reading)];
static QueueHandle_t reading_queue;

static volatile uint32_t readings_dropped; /* written by the sensor only */

static StaticTask_t sensor_tcb;
static StackType_t sensor_stack[SENSOR_STACK_WORDS];
static TaskHandle_t sensor_handle; /* for the inference task's stack report */

static void sensor_task(void *arg)
{
    (void)arg;
    uint32_t noise = 0x2545F491u;
    TickType_t wake = xTaskGetTickCount();
    for (uint32_t step = 0;; ++step) {
        const meter_reading r = {step, meter_synthetic_mw(step, &noise)};
        /* Never wait: a reading that finds the queue full is lost, counted,
         * and the inference task notices the gap. */
        if (xQueueSend(reading_queue, &r, 0) != pdPASS) {
            readings_dropped = readings_dropped + 1u;
        }
        (void)xTaskDelayUntil(&wake, METER_PERIOD_TICKS);
    }
}

/* ---- the inference task ------------------------------------------------------ */

static uint8_t arena[COLIBRI_MODEL_ARENA_SIZE] __attribute__((aligned(COLIBRI_ARENA_ALIGN), section(APP_ARENA_SECTION)));

static StaticTask_t inference_tcb;
static StackType_t inference_stack[INFERENCE_STACK_WORDS];

/* The inference task's own data (static rather than on its stack). */
static meter_history history;
static float model_input[METER_INPUT_SIZE];
static float forecast_scaled[METER_HORIZON];
static float forecast_mw[METER_HORIZON];

static void print_model(const colibri_model_info *info, size_t need)
{
    put_str("model: ");
    put_u32(info->image_size);
    put_str(" B image in flash, ");
    put_u32(info->num_experts);
    put_str(" experts in ");
    put_u32(info->num_moe_layers);
    put_str(" MoE layer(s), input ");
    put_u32(info->input_size);
    put_str(", output ");
    put_u32(info->output_size);
    put_str("; arena ");
    put_u32((uint32_t)need);
    put_str(" of ");
    put_u32((uint32_t)sizeof arena);
    put_str(" B\r\n");
}

static void print_forecast(uint32_t t, uint64_t cycles)
{
    const uint32_t day = t / METER_STEPS_PER_DAY;
    put_str("day ");
    put_u32(day);
    put_str(" (");
    put_str(weekday_name[day % 7u]);
    put_str(") forecast, MW per half hour");
#if APP_HAS_WORK_COUNTER
    put_str(", in ");
    put_u32(cycles > UINT32_MAX ? UINT32_MAX : (uint32_t)cycles);
    put_str(" cycles");
#else
    (void)cycles;
#endif
    put_str(":\r\n");
    for (uint32_t row = 0; row < METER_HORIZON; row += 12u) {
        put_str("  ");
        put_clock(row);
        for (uint32_t i = row; i < row + 12u; ++i) {
            put_str(" ");
            put_i32(round_to_i32(forecast_mw[i]));
        }
        put_str("\r\n");
    }
#if defined(APP_PRINT_RAW)
    for (uint32_t row = 0; row < METER_HORIZON; row += 12u) {
        put_str("  raw");
        for (uint32_t i = row; i < row + 12u; ++i) {
            uint32_t bits;
            __builtin_memcpy(&bits, &forecast_scaled[i], sizeof bits);
            put_str(" ");
            put_hex32(bits);
        }
        put_str("\r\n");
    }
#endif
}

/* Words of a task's stack never used so far (its high-water mark). */
static void print_stack(const char *name, TaskHandle_t task, uint32_t words)
{
    put_str(name);
    put_str(" task stack: ");
    put_u32((uint32_t)uxTaskGetStackHighWaterMark(task));
    put_str(" of ");
    put_u32(words);
    put_str(" words never used\r\n");
}

static void inference_task(void *arg)
{
    (void)arg;
    const void *image = colibri_model_image;
    const size_t image_len = colibri_model_image_len;

    colibri_model_info info;
    colibri_status st = colibri_get_info(image, image_len, &info);
    if (st != COLIBRI_OK) {
        colibri_failed("colibri_get_info", st);
    }
    size_t need = 0;
    st = colibri_model_size(image, image_len, &need);
    if (st != COLIBRI_OK) {
        colibri_failed("colibri_model_size", st);
    }
    print_model(&info, need);
    colibri_ctx *ctx = NULL;
    st = colibri_init(&ctx, arena, sizeof arena, image, image_len); /* validates the whole image */
    if (st != COLIBRI_OK) {
        colibri_failed("colibri_init", st);
    }
#if defined(APP_REFERENCE_KERNELS)
    st = colibri_set_kernels(ctx, COLIBRI_KERNELS_REFERENCE);
    if (st != COLIBRI_OK) {
        colibri_failed("colibri_set_kernels", st);
    }
#endif
    put_str("kernels: ");
    put_str(colibri_kernels_name(ctx));
    put_str("\r\n");

    meter_history_init(&history);
    uint32_t expected = 0;       /* the step of the next reading */
    uint32_t reported_drops = 0;
    int have_forecast = 0;       /* forecast_mw holds the day starting at forecast_t */
    uint32_t forecast_t = 0;
    float abs_err_sum = 0.0f, actual_sum = 0.0f;
    uint32_t days_scored = 0;

    put_str("waiting for a week of readings (");
    put_u32(METER_WEEK);
    put_str(", one every ");
    put_u32(METER_PERIOD_MS);
    put_str(" ms)\r\n");

    for (;;) {
        meter_reading r;
        if (xQueueReceive(reading_queue, &r, portMAX_DELAY) != pdPASS) {
            continue;
        }
        if (readings_dropped != reported_drops || r.step != expected) {
            /* A gap: the window no longer holds consecutive half hours. */
            reported_drops = readings_dropped;
            put_str("readings lost before step ");
            put_u32(r.step);
            put_str(": starting a new week of history\r\n");
            meter_history_init(&history);
            have_forecast = 0;
        }
        expected = r.step + 1u;
        meter_history_push(&history, r.mw);

        /* Score yesterday's forecast against the readings as they come. */
        if (have_forecast && r.step >= forecast_t && r.step < forecast_t + METER_HORIZON) {
            const float err = forecast_mw[r.step - forecast_t] - r.mw;
            abs_err_sum += err < 0.0f ? -err : err;
            actual_sum += r.mw;
            if (r.step == forecast_t + METER_HORIZON - 1u) {
                put_str("day ");
                put_u32(forecast_t / METER_STEPS_PER_DAY);
                put_str(" actual vs forecast: mean absolute error ");
                put_i32(round_to_i32(abs_err_sum / (float)METER_HORIZON));
                const int32_t tenths = round_to_i32(1000.0f * abs_err_sum / actual_sum); /* 0.1 % units */
                put_str(" MW (");
                put_i32(tenths / 10);
                put_str(".");
                put_i32(tenths % 10);
                put_str(" % of the load)\r\n");
                have_forecast = 0;
                ++days_scored;
                if (days_scored == 1u) {
                    /* Both tasks have been through their deepest paths: init
                     * and a forecast for this one, a full day of readings for
                     * the sensor. */
                    print_stack("sensor", sensor_handle, SENSOR_STACK_WORDS);
                    print_stack("inference", NULL, INFERENCE_STACK_WORDS);
                }
#if APP_STOP_AFTER_DAYS > 0
                if (days_scored >= APP_STOP_AFTER_DAYS) {
                    put_str("done\r\n");
                    vTaskDelay(pdMS_TO_TICKS(20)); /* QEMU: lets the UART's last bytes out first */
                    board_exit(0);
                }
#endif
            }
        }

        /* At midnight, with a week of history: forecast the day ahead. */
        const uint32_t t = r.step + 1u; /* the first step forecast */
        if (t % FORECAST_EVERY != 0u || !meter_history_full(&history)) {
            continue;
        }
        if (meter_build_input(&history, t, model_input, METER_INPUT_SIZE) != 0) {
            put_str("error: meter_build_input\r\n");
            continue;
        }
#if APP_HAS_WORK_COUNTER
        board_work_start();
#endif
        st = colibri_forward(ctx, 1, model_input, METER_INPUT_SIZE, forecast_scaled, METER_HORIZON);
#if APP_HAS_WORK_COUNTER
        const uint64_t cycles = board_work_stop();
#else
        const uint64_t cycles = 0;
#endif
        if (st != COLIBRI_OK) {
            colibri_failed("colibri_forward", st);
        }
        for (uint32_t i = 0; i < METER_HORIZON; ++i) {
            forecast_mw[i] = meter_unscale(forecast_scaled[i]);
        }
        forecast_t = t;
        have_forecast = 1;
        abs_err_sum = 0.0f;
        actual_sum = 0.0f;
        print_forecast(t, cycles);
    }
}

/* ---- start ------------------------------------------------------------------- */

int main(void)
{
    board_init(); /* NUCLEO: clocks, caches, USART3, cycle counter, stack guard; mps2-an500: UART0 */
    install_vectors();

    put_str("\r\ncolibri ");
    put_str(colibri_version());
    put_str(" on FreeRTOS ");
    put_str(tskKERNEL_VERSION_NUMBER);
    put_str(", ");
    put_str(board_name());
    put_str(", core r");
    put_u32((SCB_CPUID >> 20) & 15u); /* variant */
    put_str("p");
    put_u32(SCB_CPUID & 15u); /* revision: the GCC/ARM_CM7/r0p1 port is for r0p0/r0p1 (README.md) */
    put_str(" at ");
    put_u32((uint32_t)(configCPU_CLOCK_HZ / 1000000u));
    put_str(" MHz\r\n");

    reading_queue = xQueueCreateStatic(READING_QUEUE_LENGTH, sizeof(meter_reading), reading_queue_storage,
                                       &reading_queue_cb);
    const TaskHandle_t sensor = xTaskCreateStatic(sensor_task, "sensor", SENSOR_STACK_WORDS, NULL,
                                                  SENSOR_PRIORITY, sensor_stack, &sensor_tcb);
    sensor_handle = sensor;
    const TaskHandle_t inference = xTaskCreateStatic(inference_task, "inference", INFERENCE_STACK_WORDS, NULL,
                                                     INFERENCE_PRIORITY, inference_stack, &inference_tcb);
    configASSERT(reading_queue != NULL);
    configASSERT(sensor != NULL);
    configASSERT(inference != NULL);

    /* Hand SysTick over to the kernel: no tick interrupt from here until the
     * port has programmed it for 1 ms and lowered its priority, so no tick
     * can reach the kernel half-started. */
    SYST_CSR &= ~SYST_CSR_TICKINT;
    vTaskStartScheduler();

    /* vTaskStartScheduler() returns only if it could not create the idle or
     * timer task, which static allocation rules out. */
    put_str("error: the scheduler returned\r\n");
    board_exit(1);
}
