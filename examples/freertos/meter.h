/*
 * The smart meter side of the FreeRTOS example, free of any RTOS or board
 * code (so it compiles and is tested on the host too):
 *
 *  - a synthetic meter: a built-in daily load curve in MW, one reading per
 *    half hour of simulated time, shaped by the day of the week, with a
 *    little deterministic noise;
 *  - a rolling window of the last week of readings;
 *  - the input builder: the 105 features of examples/smart_meter/forecaster.py
 *    (features()) for a day-ahead forecast issued at step t.
 *
 * The model the example expects is that forecaster (the MoE demo model:
 * `make demo` leaves it in build/smart_meter/meter_q8.clb). Its input, for a
 * forecast whose first step is t (t counts half hours from a Monday 00:00):
 *
 *   [0, 48)     readings t-48 .. t-1 (the last 24 hours), scaled
 *   [48, 96)    readings t-336 .. t-289 (the same 24 hours one week earlier), scaled
 *   [96, 103)   day of the week of step t, one-hot, Monday first
 *   [103]       sin(2 pi (t mod 48) / 48)   time of day of step t
 *   [104]       cos(2 pi (t mod 48) / 48)
 *
 * where "scaled" is (MW - METER_MEAN_MW) / METER_STD_MW. Its output is the
 * next 48 half hours (t .. t+47), scaled the same way.
 *
 * A model trained on other data needs its own METER_MEAN_MW / METER_STD_MW;
 * a model with another input layout needs its own meter_build_input().
 */
#ifndef METER_H
#define METER_H

#include <stddef.h>
#include <stdint.h>

#define METER_STEPS_PER_DAY 48u                       /* half hours */
#define METER_WEEK (7u * METER_STEPS_PER_DAY)         /* 336 readings: the history the input needs */
#define METER_HORIZON METER_STEPS_PER_DAY             /* steps forecast: the next 24 hours */
#define METER_INPUT_SIZE (2u * METER_STEPS_PER_DAY + 7u + 2u) /* 105 */

/* The forecaster's training statistics (forecaster.dataset().mean / .std:
 * England and Wales demand, June-August 2000, the training part). */
#define METER_MEAN_MW 29596.963f
#define METER_STD_MW 5602.753f

/* The last week of readings, oldest first once full. */
typedef struct meter_history {
    float mw[METER_WEEK]; /* ring buffer */
    uint32_t count;       /* readings pushed so far (saturates at UINT32_MAX) */
    uint32_t head;        /* where the next reading goes */
} meter_history;

void meter_history_init(meter_history *h);
void meter_history_push(meter_history *h, float mw);

/* Enough history for meter_build_input(): a whole week. */
int meter_history_full(const meter_history *h);

/* Reading `ago` steps back: ago = 1 is the newest. Requires 1 <= ago <= min(count, METER_WEEK). */
float meter_history_at(const meter_history *h, uint32_t ago);

/* Builds the input for a forecast whose first step is `t` from the readings
 * t-336 .. t-1 in `h` (the newest reading must be that of step t-1). Returns
 * 0, or -1 if the history is not full or n != METER_INPUT_SIZE. */
int meter_build_input(const meter_history *h, uint32_t t, float *input, size_t n);

/* Scaled model output back to MW, and MW to the model's scale. */
float meter_unscale(float y);
float meter_scale(float mw);

/* The synthetic meter: the reading of step `step` (half hours since a Monday
 * 00:00) in MW. `noise` is its state (any non-zero seed; updated). */
float meter_synthetic_mw(uint32_t step, uint32_t *noise);

#endif /* METER_H */
