/* Seeded pseudo-random numbers for the C test drivers and the benches (not part of the engine).
 *
 * Each driver's cases are reproducible from its seed, so each keeps the generator its cases and
 * tolerances were written with; what is shared is the one definition of each generator. Only
 * <stdint.h>: the Cortex-M7 driver (tests/c/cm7) includes it too, on bare metal. */
#ifndef COLIBRI_TEST_RNG_H
#define COLIBRI_TEST_RNG_H

#include <stdint.h>

/* SplitMix64 (Steele, Lea and Flood 2014): the state advances by the golden-ratio increment and
 * each output is that state, mixed. */
static inline uint64_t colibri_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

/* Marsaglia's xorshift64 (shifts 13, 7, 17): returns the new state; callers take its high bits,
 * the better mixed ones. */
static inline uint64_t colibri_xorshift64(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Marsaglia's xorshift32 (shifts 13, 17, 5), for 32-bit targets: returns the new state. */
static inline uint32_t colibri_xorshift32(uint32_t *state)
{
    uint32_t x = *state;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *state = x;
}

#endif
