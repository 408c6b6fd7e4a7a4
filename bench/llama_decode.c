/*
 * llama_decode: llama.cpp's half of `make bench-lm-scale` (bench/lm_scale.py), the peer of
 * `lm_driver decode`: the model loaded as llama.cpp loads it by default (mapped, Q4_0 repacked for
 * its kernels, flash attention "auto", f16 KV cache), the given prompt in one call, then DECODE
 * greedy steps of one token each. llama-bench feeds tokens without sampling and gives averages,
 * not each step's time, faults and the tokens themselves, hence this driver over llama.h.
 *
 *   llama_decode MODEL.gguf THREADS IDS DECODE
 *
 * IDS: comma-separated token ids. Prints one JSON line: open to first token and the mapped file's
 * resident bytes then (RssFile), each step's seconds and major faults, the tokens, and RssAnon /
 * RssFile / VmHWM at the end (/proc/self/status).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static long major_faults(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_majflt;
}

static long status_kib(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t k = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, key, k) == 0 && line[k] == ':')
            v = strtol(line + k + 1, NULL, 10);
    if (f)
        fclose(f);
    return v;
}

static llama_token argmax(const float *row, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (row[i] > row[best])
            best = i;
    return best;
}

/* Bytes this process has had read from storage so far (/proc/self/io read_bytes); -1 where unaccounted. */
static long long read_bytes(void)
{
    FILE *f = fopen("/proc/self/io", "r");
    char line[128];
    long long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "read_bytes:", 11) == 0)
            v = strtoll(line + 11, NULL, 10);
    if (f)
        fclose(f);
    return v;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: llama_decode MODEL.gguf THREADS IDS DECODE\n");
        return 2;
    }
    int threads = atoi(argv[2]);
    long decode = atol(argv[4]);
    if (threads < 1 || decode < 0) {
        fprintf(stderr, "llama_decode: THREADS must be positive and DECODE not negative\n");
        return 2;
    }
    size_t cap = 1;
    for (const char *c = argv[3]; *c; c++)
        cap += *c == ',';
    llama_token *prompt = malloc(sizeof(llama_token) * cap);
    llama_token *tokens = malloc(sizeof(llama_token) * (size_t)(decode + 1));
    double *times = malloc(sizeof(double) * (size_t)(decode + 1));
    long *faults = malloc(sizeof(long) * (size_t)(decode + 1));
    long long *reads = malloc(sizeof(long long) * (size_t)(decode + 1));
    if (!prompt || !tokens || !times || !faults || !reads)
        return 1;
    int n = 0;
    for (const char *c = argv[3]; *c;) {
        char *end;
        long v = strtol(c, &end, 10);
        if (end == c || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "llama_decode: IDS must be comma-separated token ids, got '%s'\n", argv[3]);
            return 2;
        }
        prompt[n++] = (llama_token)v;
        c = *end ? end + 1 : end;
    }

    llama_log_set(quiet, NULL);
    const long long r0 = read_bytes();
    double t0 = now();
    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "llama_decode: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n + decode + 1);
    cp.n_batch = (uint32_t)n;
    cp.n_ubatch = (uint32_t)n;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_decode: cannot create a context\n");
        return 1;
    }
    double t_open = now() - t0;
    const long long open_read = read_bytes() - r0;
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    long f0 = major_faults();
    const long long r1 = read_bytes();
    int rc = llama_decode(ctx, llama_batch_get_one(prompt, n));
    if (rc != 0) {
        fprintf(stderr, "llama_decode: llama_decode (prompt) returned %d\n", rc);
        return 1;
    }
    tokens[0] = argmax(llama_get_logits_ith(ctx, -1), vocab);
    double t_first = now() - t0;
    long prompt_faults = major_faults() - f0;
    const long long prompt_read = read_bytes() - r1;
    long first_file_kib = status_kib("RssFile");
    for (long i = 0; i < decode; i++) {
        long fa = major_faults();
        const long long ra = read_bytes();
        double ta = now();
        if ((rc = llama_decode(ctx, llama_batch_get_one(&tokens[i], 1))) != 0) {
            fprintf(stderr, "llama_decode: llama_decode (step %ld) returned %d\n", i, rc);
            return 1;
        }
        tokens[i + 1] = argmax(llama_get_logits_ith(ctx, -1), vocab);
        times[i] = now() - ta;
        faults[i] = major_faults() - fa;
        reads[i] = read_bytes() - ra;
    }
    printf("{\"open_s\": %.6f, \"first_token_s\": %.6f, \"prompt_faults\": %ld, \"first_resident_bytes\": %lld, "
           "\"open_read_bytes\": %lld, \"prompt_read_bytes\": %lld, \"rss_anon_kib\": %ld, "
           "\"rss_file_kib\": %ld, \"vm_hwm_kib\": %ld, \"tokens\": [",
           t_open, t_first, prompt_faults, (long long)first_file_kib * 1024, open_read, prompt_read, status_kib("RssAnon"), status_kib("RssFile"), status_kib("VmHWM"));
    for (long i = 0; i <= decode; i++)
        printf("%s%d", i ? ", " : "", tokens[i]);
    printf("], \"times\": [");
    for (long i = 0; i < decode; i++)
        printf("%s%.6f", i ? ", " : "", times[i]);
    printf("], \"faults\": [");
    for (long i = 0; i < decode; i++)
        printf("%s%ld", i ? ", " : "", faults[i]);
    printf("], \"read_bytes\": [");
    for (long i = 0; i < decode; i++)
        printf("%s%lld", i ? ", " : "", reads[i]);
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(prompt);
    free(tokens);
    free(times);
    free(faults);
    free(reads);
    return 0;
}
