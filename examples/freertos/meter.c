/*
 * Synthetic meter, rolling window and input builder: meter.h.
 * Plain C11 with libm (sinf, cosf); no RTOS, no board, no heap.
 */
#include "meter.h"

#include <math.h>

/* A summer weekday-average load curve in MW per half hour from 00:00
 * (rounded to 100 MW; the shape of the forecaster's training data: a night
 * trough near 22 GW, a morning ramp, a midday plateau near 35 GW). */
static const float daily_mw[METER_STEPS_PER_DAY] = {
    24000.0f, 23300.0f, 23200.0f, 23200.0f, 22900.0f, 22500.0f, 22300.0f, 22200.0f, /* 00:00 */
    22000.0f, 21700.0f, 21700.0f, 22100.0f, 23800.0f, 25800.0f, 28500.0f, 30600.0f, /* 04:00 */
    32300.0f, 33100.0f, 34000.0f, 34500.0f, 34700.0f, 34900.0f, 35100.0f, 35200.0f, /* 08:00 */
    35200.0f, 34800.0f, 34400.0f, 34000.0f, 33800.0f, 33600.0f, 33400.0f, 33500.0f, /* 12:00 */
    33800.0f, 34100.0f, 34000.0f, 33300.0f, 32500.0f, 31900.0f, 31200.0f, 30600.0f, /* 16:00 */
    30100.0f, 29900.0f, 30200.0f, 30600.0f, 30300.0f, 29100.0f, 27300.0f, 25500.0f, /* 20:00 */
};

/* Day of the week factors, Monday first: weekdays above the curve, the weekend well below. */
static const float day_factor[7] = {1.04f, 1.06f, 1.06f, 1.06f, 1.03f, 0.89f, 0.85f};

#define METER_NOISE 0.01f /* +-1 % */
#define METER_TWO_PI 6.28318530717958647692f

void meter_history_init(meter_history *h)
{
    for (uint32_t i = 0; i < METER_WEEK; ++i) {
        h->mw[i] = 0.0f;
    }
    h->count = 0u;
    h->head = 0u;
}

void meter_history_push(meter_history *h, float mw)
{
    h->mw[h->head] = mw;
    h->head = (h->head + 1u) % METER_WEEK;
    if (h->count != UINT32_MAX) {
        h->count += 1u;
    }
}

int meter_history_full(const meter_history *h)
{
    return h->count >= METER_WEEK;
}

float meter_history_at(const meter_history *h, uint32_t ago)
{
    return h->mw[(h->head + METER_WEEK - ago) % METER_WEEK];
}

float meter_scale(float mw)
{
    return (mw - METER_MEAN_MW) / METER_STD_MW;
}

float meter_unscale(float y)
{
    return y * METER_STD_MW + METER_MEAN_MW;
}

int meter_build_input(const meter_history *h, uint32_t t, float *input, size_t n)
{
    if (n != METER_INPUT_SIZE || !meter_history_full(h)) {
        return -1;
    }
    float *last_day = input;                           /* t-48 .. t-1 */
    float *last_week = input + METER_STEPS_PER_DAY;    /* t-336 .. t-289 */
    float *weekday = input + 2u * METER_STEPS_PER_DAY; /* one-hot, Monday first */
    float *clock = weekday + 7;                        /* sin, cos of the time of day */
    for (uint32_t i = 0; i < METER_STEPS_PER_DAY; ++i) {
        last_day[i] = meter_scale(meter_history_at(h, METER_STEPS_PER_DAY - i));
        last_week[i] = meter_scale(meter_history_at(h, METER_WEEK - i));
    }
    const uint32_t day = (t / METER_STEPS_PER_DAY) % 7u;
    for (uint32_t d = 0; d < 7u; ++d) {
        weekday[d] = d == day ? 1.0f : 0.0f;
    }
    const float phase = METER_TWO_PI * (float)(t % METER_STEPS_PER_DAY) / (float)METER_STEPS_PER_DAY;
    clock[0] = sinf(phase);
    clock[1] = cosf(phase);
    return 0;
}

/* xorshift32 (Marsaglia): deterministic, no state beyond the caller's word. */
static uint32_t xorshift32(uint32_t *state)
{
    uint32_t x = *state != 0u ? *state : 0x9E3779B9u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    *state = x;
    return x;
}

float meter_synthetic_mw(uint32_t step, uint32_t *noise)
{
    const uint32_t slot = step % METER_STEPS_PER_DAY;
    const uint32_t day = (step / METER_STEPS_PER_DAY) % 7u;
    /* 24 random bits -> [-1, 1) */
    const float u = (float)(xorshift32(noise) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    return daily_mw[slot] * day_factor[day] * (1.0f + METER_NOISE * u);
}
