/*
 * lm_driver: a token-model image through libcolibri in a process of its own, for `make bench-lm`
 * (bench/lm_vs_llama_cpp.py). The model file is mapped (posix/colibri_file), not copied, so the
 * process's peak RSS is what a C program serving the model needs: the touched pages of the image,
 * the arena and this driver.
 *
 *   lm_driver logits IMAGE WORKERS IDS.i32 WINDOW OUT.f32 [ROUTES]
 *       Every consecutive WINDOW tokens of IDS (int32, native order) from an empty cache, fed in
 *       calls of up to the image's max_batch tokens; writes every position's logits (f32,
 *       [windows * WINDOW, vocab]) to OUT. ROUTES, if given, gets what routing chose, one record
 *       per MoE layer and call (from on_route): int32 layer, routed experts E, tokens T, then a
 *       T x E byte matrix, 1 where the token goes to that expert.
 *   lm_driver speed IMAGE WORKERS PROMPT DECODE PREFILL ROUNDS
 *       Random token ids (fixed seed). Decode: PROMPT tokens in one call, then DECODE calls of one
 *       token each; prefill: PREFILL tokens in one call from an empty cache. Each call asks for its
 *       last token's logits only, as llama-bench does (its batches mark the last token as the one
 *       output), so both engines do the same work: the full pass up to the last attention layer
 *       for every token, the rest and the LM head for the last one. ROUNDS of each after
 *       one warm-up; prints one JSON line with the median tokens/s of each, the CPU time the
 *       process got over the wall time of each (decode_cpus, prefill_cpus) and per decode token,
 *       the parallel loops (parallel_for calls) and their tasks per decode step and the mean wall
 *       time of a loop, the arena and the kernels. The bench takes the peak RSS from outside (GNU
 *       time): Linux keeps a process's high-water mark across exec, so this
 *       process's own getrusage would include its launcher's.
 *
 *   lm_driver decode IMAGE WORKERS IDS DECODE LOCK
 *       The mapped edge runtime as a service runs it (make bench-lm-scale, bench/lm_scale.py): the
 *       file opened with verify on use, colibri_file_on_route advising (and verifying) the experts
 *       routing picks and the stages ahead; IDS (comma-separated token ids) as one prompt call,
 *       then DECODE greedy steps of one token each. LOCK: "none", "dense" (every non-expert
 *       tensor) or "L:E,L:E,..." (those experts mlock'd). Prints one JSON line: open to first
 *       token and the file's resident bytes then, the bytes read from storage by the open and
 *       the prompt, each step's seconds, major faults and bytes read (/proc/self/io), the
 *       file layer's read-ahead requests, the tokens, and RssAnon / RssFile / VmHWM at the end
 *       (/proc/self/status). Exit 3 when the lock is refused.
 *   lm_driver hot IMAGE IDS
 *       Counts, over the prompt IDS, the tokens routing sends to each expert: one JSON line of
 *       [layer, expert, tokens, bytes] rows, for choosing the experts to pin.
 *
 * WORKERS > 1 runs colibri_lm_forward_ex over a colibri_pool of that many workers.
 */
#include <sys/resource.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"
#include "colibri_file.h"
#include "colibri_pool.h"

#define MAX_ROUNDS 64

/* The pool's parallel_for as the engine sees it, counted: the parallel regions a forward pass opens,
 * their tasks and the wall time the calling thread spends in them (the bench's regions per token). */
typedef struct counted_pool {
    colibri_pool *pool;
    uint64_t regions, tasks;
    double seconds;
} counted_pool;

static colibri_status counted_parallel_for(void *user, colibri_task_fn fn, void *arg, size_t n_tasks);

typedef struct lm {
    colibri_file *file;
    colibri_pool *pool;
    counted_pool counted;
    colibri_exec exec;
    colibri_ctx *ctx;
    void *arena;
    colibri_model_info info;
    float *logits; /* max_batch rows */
} lm;

static void die(const char *what, int status)
{
    fprintf(stderr, "lm_driver: %s: %s (%d)\n", what, colibri_strerror(status), status);
    exit(1);
}

static double seconds(clockid_t clock)
{
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void lm_open(lm *m, const char *path, size_t workers)
{
    memset(m, 0, sizeof *m);
    colibri_file_options opts = {COLIBRI_LOCK_NONE, NULL, 0, COLIBRI_VERIFY_NONE};
    colibri_status st = colibri_file_open(&m->file, path, &opts, NULL);
    if (st != COLIBRI_OK)
        die(path, st);
    const void *image = colibri_file_data(m->file);
    size_t len = colibri_file_size(m->file);
    if ((st = colibri_get_info(image, len, &m->info)) != COLIBRI_OK)
        die("colibri_get_info", st);
    if (m->info.vocab_size == 0) {
        fprintf(stderr, "lm_driver: %s is not a token model\n", path);
        exit(1);
    }
    size_t need;
    if ((st = colibri_model_size_ex(image, len, workers, &need)) != COLIBRI_OK)
        die("colibri_model_size_ex", st);
    m->arena = aligned_alloc(64, (need + 63) / 64 * 64);
    m->logits = malloc(sizeof(float) * m->info.max_batch * m->info.vocab_size);
    if (!m->arena || !m->logits) {
        fprintf(stderr, "lm_driver: out of memory\n");
        exit(1);
    }
    m->info.arena_size = need;
    if ((st = colibri_init_ex(&m->ctx, m->arena, need, image, len, COLIBRI_CHECK_STRUCTURE)) != COLIBRI_OK)
        die("colibri_init_ex", st);
    colibri_exec init = COLIBRI_EXEC_INIT;
    m->exec = init;
    if (workers > 1) {
        if ((st = colibri_pool_create(&m->pool, workers)) != COLIBRI_OK)
            die("colibri_pool_create", st);
        colibri_pool_attach(m->pool, &m->exec);
        m->counted.pool = m->pool;
        m->exec.parallel_for = counted_parallel_for;
        m->exec.parallel_for_user = &m->counted;
    }
}

static void lm_close(lm *m)
{
    colibri_free(m->ctx);
    colibri_pool_destroy(m->pool);
    colibri_file_close(m->file);
    free(m->arena);
    free(m->logits);
}

/* Runs n tokens in calls of up to max_batch; out (if not NULL) gets their logits. Without out each call
 * asks for its last token's logits only, as llama-bench's prompt and a generator's prompt do. */
static void lm_run(lm *m, const int32_t *ids, size_t n, float *out)
{
    size_t vocab = m->info.vocab_size;
    for (size_t i = 0; i < n;) {
        uint32_t k = (uint32_t)(n - i < m->info.max_batch ? n - i : m->info.max_batch);
        colibri_status st = colibri_lm_forward_ex(m->ctx, &m->exec, ids + i, k, m->logits, out ? k * vocab : vocab);
        if (st != COLIBRI_OK)
            die("colibri_lm_forward_ex", st);
        if (out)
            memcpy(out + i * vocab, m->logits, sizeof(float) * k * vocab);
        i += k;
    }
}

static colibri_status counted_parallel_for(void *user, colibri_task_fn fn, void *arg, size_t n_tasks)
{
    counted_pool *c = user;
    const double t0 = seconds(CLOCK_MONOTONIC);
    const colibri_status st = colibri_pool_parallel_for(c->pool, fn, arg, n_tasks);
    c->seconds += seconds(CLOCK_MONOTONIC) - t0;
    c->regions++;
    c->tasks += n_tasks;
    return st;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static long parse(const char *s, long lo, long hi, const char *what)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "lm_driver: %s must be an integer in %ld..%ld, got '%s'\n", what, lo, hi, s);
        exit(2);
    }
    return v;
}

/* on_route for the logits mode's ROUTES file: the slots' token lists turned into a token x expert
 * matrix (the bench compares each token's chosen experts with llama.cpp's). */
static colibri_status write_route(void *user, const colibri_route *r)
{
    FILE *routes = user;
    int32_t head[3] = {(int32_t)r->layer, (int32_t)r->experts, (int32_t)r->batch};
    uint8_t *chosen = calloc(r->batch * r->experts + 1, 1);
    if (!chosen)
        return COLIBRI_E_BAD_EXEC;
    for (uint32_t s = 0; s < r->experts; s++)
        for (uint32_t i = 0; i < r->tokens[s]; i++)
            chosen[(size_t)r->token[s * r->batch + i] * r->experts + s] = 1;
    int ok = fwrite(head, sizeof head, 1, routes) == 1 &&
             fwrite(chosen, 1, r->batch * r->experts, routes) == r->batch * r->experts;
    free(chosen);
    return ok ? COLIBRI_OK : COLIBRI_E_BAD_EXEC;
}

static int logits_mode(const char *image, size_t workers, const char *ids_path, long window, const char *out_path,
                       const char *routes_path)
{
    FILE *f = fopen(ids_path, "rb");
    if (!f) {
        perror(ids_path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f) / sizeof(int32_t);
    rewind(f);
    int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
    if (!ids || fread(ids, sizeof(int32_t), n, f) != n) {
        fprintf(stderr, "lm_driver: cannot read %s\n", ids_path);
        return 1;
    }
    fclose(f);
    if (n == 0 || n % (size_t)window) {
        fprintf(stderr, "lm_driver: %zu ids is not a whole number of %ld-token windows\n", n, window);
        return 2;
    }
    lm m;
    lm_open(&m, image, workers);
    FILE *routes = NULL;
    if (routes_path) {
        if (!(routes = fopen(routes_path, "wb"))) {
            perror(routes_path);
            return 1;
        }
        m.exec.on_route = write_route;
        m.exec.on_route_user = routes;
    }
    size_t vocab = m.info.vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)window * vocab);
    FILE *out = fopen(out_path, "wb");
    if (!logits || !out) {
        perror(out_path);
        return 1;
    }
    for (size_t w = 0; w < n; w += (size_t)window) {
        colibri_status st = colibri_lm_reset(m.ctx);
        if (st != COLIBRI_OK)
            die("colibri_lm_reset", st);
        lm_run(&m, ids + w, (size_t)window, logits);
        if (fwrite(logits, sizeof(float) * vocab, (size_t)window, out) != (size_t)window) {
            perror(out_path);
            return 1;
        }
    }
    if (fclose(out) != 0) {
        perror(out_path);
        return 1;
    }
    if (routes && fclose(routes) != 0) {
        perror(routes_path);
        return 1;
    }
    lm_close(&m);
    free(logits);
    free(ids);
    return 0;
}

static int speed_mode(const char *image, size_t workers, long prompt, long decode, long prefill, long rounds)
{
    lm m;
    lm_open(&m, image, workers);
    long total = prompt + decode > prefill ? prompt + decode : prefill;
    if ((uint64_t)total > m.info.max_seq_len || (uint64_t)prompt > m.info.max_batch ||
        (uint64_t)prefill > m.info.max_batch) {
        fprintf(stderr,
                "lm_driver: the image holds %u positions and %u tokens a call; asked for a %ld-token "
                "prompt + %ld decode and a %ld-token prefill\n",
                m.info.max_seq_len, m.info.max_batch, prompt, decode, prefill);
        return 2;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)total);
    if (!ids)
        return 1;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (long i = 0; i < total; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((s >> 33) % m.info.vocab_size);
    }
    double dec[MAX_ROUNDS], pre[MAX_ROUNDS], busy[MAX_ROUNDS], pre_busy[MAX_ROUNDS], cpu_ms[MAX_ROUNDS];
    counted_pool seen = {NULL, 0, 0, 0.0}; /* the decode steps' regions over every round */
    for (long r = -1; r < rounds; r++) { /* round -1 warms the caches and the pool's threads */
        colibri_status st = colibri_lm_reset(m.ctx);
        if (st != COLIBRI_OK)
            die("colibri_lm_reset", st);
        lm_run(&m, ids, (size_t)prompt, NULL);
        const counted_pool before = m.counted;
        double t0 = seconds(CLOCK_MONOTONIC), c0 = seconds(CLOCK_PROCESS_CPUTIME_ID);
        for (long i = 0; i < decode; i++)
            lm_run(&m, ids + prompt + i, 1, NULL);
        double t1 = seconds(CLOCK_MONOTONIC), c1 = seconds(CLOCK_PROCESS_CPUTIME_ID);
        if (r >= 0) {
            seen.regions += m.counted.regions - before.regions;
            seen.tasks += m.counted.tasks - before.tasks;
            seen.seconds += m.counted.seconds - before.seconds;
        }
        if ((st = colibri_lm_reset(m.ctx)) != COLIBRI_OK)
            die("colibri_lm_reset", st);
        double t2 = seconds(CLOCK_MONOTONIC), c2 = seconds(CLOCK_PROCESS_CPUTIME_ID);
        lm_run(&m, ids, (size_t)prefill, NULL);
        double t3 = seconds(CLOCK_MONOTONIC), c3 = seconds(CLOCK_PROCESS_CPUTIME_ID);
        if (r >= 0) {
            dec[r] = (double)decode / (t1 - t0);
            pre[r] = (double)prefill / (t3 - t2);
            busy[r] = (c1 - c0) / (t1 - t0);
            pre_busy[r] = (c3 - c2) / (t3 - t2);
            cpu_ms[r] = (c1 - c0) * 1e3 / (double)decode;
        }
    }
    const double steps = (double)decode * (double)rounds;
    printf("{\"decode_tps\": %.3f, \"prefill_tps\": %.3f, \"decode_cpus\": %.3f, \"prefill_cpus\": %.3f, "
           "\"decode_cpu_ms\": %.4f, \"decode_regions\": %.2f, \"decode_tasks\": %.1f, \"decode_region_us\": %.2f, "
           "\"workers\": %zu, \"arena_bytes\": %zu, \"kv_cache_bytes\": %zu, \"image_bytes\": %zu, "
           "\"kernels\": \"%s\"}\n",
           median(dec, (int)rounds), median(pre, (int)rounds), median(busy, (int)rounds), median(pre_busy, (int)rounds),
           median(cpu_ms, (int)rounds), (double)seen.regions / steps, (double)seen.tasks / steps,
           seen.regions ? seen.seconds * 1e6 / (double)seen.regions : 0.0, workers, m.info.arena_size,
           m.info.kv_cache_bytes, colibri_file_size(m.file), colibri_kernels_name(m.ctx));
    lm_close(&m);
    free(ids);
    return 0;
}

/* Comma-separated token ids; the count in *n. */
static int32_t *parse_ids(const char *text, size_t *n)
{
    size_t cap = 1;
    for (const char *c = text; *c; c++)
        cap += *c == ',';
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    if (!ids)
        exit(1);
    *n = 0;
    for (const char *c = text; *c;) {
        char *end;
        long v = strtol(c, &end, 10);
        if (end == c || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "lm_driver: IDS must be comma-separated token ids, got '%s'\n", text);
            exit(2);
        }
        ids[(*n)++] = (int32_t)v;
        c = *end ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "lm_driver: IDS is empty\n");
        exit(2);
    }
    return ids;
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

static long major_faults(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_majflt;
}

/* Bytes this process has had read from storage so far (/proc/self/io read_bytes: what its faults and its
 * read-ahead requests submitted); -1 where the kernel does not account it. */
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

static int32_t argmax(const float *row, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (row[i] > row[best])
            best = i;
    return (int32_t)best;
}

/* LOCK: "none", "dense" or "L:E,L:E,...". */
static colibri_file_options lock_options(const char *text, colibri_expert_id **ids)
{
    colibri_file_options opts = {COLIBRI_LOCK_NONE, NULL, 0, COLIBRI_VERIFY_ON_USE};
    *ids = NULL;
    if (strcmp(text, "none") == 0)
        return opts;
    if (strcmp(text, "dense") == 0) {
        opts.lock = COLIBRI_LOCK_DENSE;
        return opts;
    }
    size_t cap = 1;
    for (const char *c = text; *c; c++)
        cap += *c == ',';
    *ids = malloc(sizeof **ids * cap);
    if (!*ids)
        exit(1);
    size_t n = 0;
    for (const char *c = text; *c;) {
        unsigned layer, expert;
        int used;
        if (sscanf(c, "%u:%u%n", &layer, &expert, &used) != 2 || (c[used] != ',' && c[used] != '\0')) {
            fprintf(stderr, "lm_driver: LOCK must be none, dense or L:E,L:E,..., got '%s'\n", text);
            exit(2);
        }
        (*ids)[n].layer = layer;
        (*ids)[n++].expert = expert;
        c += used + (c[used] == ',');
    }
    opts.lock = COLIBRI_LOCK_EXPERTS;
    opts.lock_experts = *ids;
    opts.lock_count = n;
    return opts;
}

/* lm_open's arena and context over a file already open. */
static void lm_attach(lm *m, colibri_file *file, size_t workers)
{
    m->file = file;
    const void *image = colibri_file_data(file);
    size_t len = colibri_file_size(file);
    colibri_status st;
    if ((st = colibri_get_info(image, len, &m->info)) != COLIBRI_OK)
        die("colibri_get_info", st);
    if (m->info.vocab_size == 0) {
        fprintf(stderr, "lm_driver: the image is not a token model\n");
        exit(1);
    }
    size_t need;
    if ((st = colibri_model_size_ex(image, len, workers, &need)) != COLIBRI_OK)
        die("colibri_model_size_ex", st);
    m->arena = aligned_alloc(64, (need + 63) / 64 * 64);
    m->logits = malloc(sizeof(float) * m->info.max_batch * m->info.vocab_size);
    if (!m->arena || !m->logits) {
        fprintf(stderr, "lm_driver: out of memory\n");
        exit(1);
    }
    m->info.arena_size = need;
    if ((st = colibri_init_ex(&m->ctx, m->arena, need, image, len, COLIBRI_CHECK_STRUCTURE)) != COLIBRI_OK)
        die("colibri_init_ex", st);
    colibri_exec init = COLIBRI_EXEC_INIT;
    m->exec = init;
    m->exec.on_route = colibri_file_on_route;
    m->exec.on_route_user = file;
    if (workers > 1) {
        if ((st = colibri_pool_create(&m->pool, workers)) != COLIBRI_OK)
            die("colibri_pool_create", st);
        colibri_pool_attach(m->pool, &m->exec);
        m->counted.pool = m->pool;
        m->exec.parallel_for = counted_parallel_for;
        m->exec.parallel_for_user = &m->counted;
    }
}

static int decode_mode(const char *image, size_t workers, const char *ids_text, long decode, const char *lock)
{
    size_t n;
    int32_t *prompt = parse_ids(ids_text, &n);
    colibri_expert_id *lock_ids;
    colibri_file_options opts = lock_options(lock, &lock_ids);
    const long long r0 = read_bytes();
    double t0 = seconds(CLOCK_MONOTONIC);
    colibri_file *file;
    colibri_file_diag diag = {0};
    colibri_status st = colibri_file_open(&file, image, &opts, &diag);
    if (st == COLIBRI_E_MLOCK_FAILED) {
        fprintf(stderr, "lm_driver: mlock of %llu bytes refused: %s (errno %d, RLIMIT_MEMLOCK %llu)\n",
                (unsigned long long)diag.lock_bytes, colibri_strerror(st), diag.sys_errno,
                (unsigned long long)diag.memlock_limit);
        return 3;
    }
    if (st != COLIBRI_OK)
        die(image, st);
    lm m;
    memset(&m, 0, sizeof m);
    lm_attach(&m, file, workers);
    double t_open = seconds(CLOCK_MONOTONIC) - t0;
    const long long open_read = read_bytes() - r0;
    if (n > m.info.max_batch || (uint64_t)n + (uint64_t)decode > m.info.max_seq_len) {
        fprintf(stderr, "lm_driver: the image holds %u positions and %u tokens a call; asked for a %zu-token prompt + "
                        "%ld steps\n", m.info.max_seq_len, m.info.max_batch, n, decode);
        return 2;
    }
    size_t vocab = m.info.vocab_size;
    long f0 = major_faults();
    const long long r1 = read_bytes();
    if ((st = colibri_lm_forward_ex(m.ctx, &m.exec, prompt, (uint32_t)n, m.logits, n * vocab)) != COLIBRI_OK)
        die("colibri_lm_forward_ex (prompt)", st);
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)(decode + 1));
    double *times = malloc(sizeof(double) * (size_t)(decode + 1));
    long *faults = malloc(sizeof(long) * (size_t)(decode + 1));
    long long *reads = malloc(sizeof(long long) * (size_t)(decode + 1));
    if (!tokens || !times || !faults || !reads)
        return 1;
    tokens[0] = argmax(m.logits + (n - 1) * vocab, vocab);
    double t_first = seconds(CLOCK_MONOTONIC) - t0;
    long prompt_faults = major_faults() - f0;
    const long long prompt_read = read_bytes() - r1;
    long long first_resident = colibri_file_resident(file);
    for (long i = 0; i < decode; i++) {
        long fa = major_faults();
        const long long ra = read_bytes();
        double ta = seconds(CLOCK_MONOTONIC);
        if ((st = colibri_lm_forward_ex(m.ctx, &m.exec, &tokens[i], 1, m.logits, vocab)) != COLIBRI_OK)
            die("colibri_lm_forward_ex (decode)", st);
        tokens[i + 1] = argmax(m.logits, vocab);
        times[i] = seconds(CLOCK_MONOTONIC) - ta;
        faults[i] = major_faults() - fa;
        reads[i] = read_bytes() - ra;
    }
    colibri_file_advice advice;
    colibri_file_advice_counts(file, &advice);
    printf("{\"open_s\": %.6f, \"first_token_s\": %.6f, \"prompt_faults\": %ld, \"first_resident_bytes\": %lld, "
           "\"open_read_bytes\": %lld, \"prompt_read_bytes\": %lld, \"requests\": %llu, \"request_bytes\": %llu, "
           "\"kernels\": \"%s\", "
           "\"image_bytes\": %zu, \"arena_bytes\": %zu, \"resident_bytes\": %lld, \"rss_anon_kib\": %ld, "
           "\"rss_file_kib\": %ld, \"vm_hwm_kib\": %ld, \"tokens\": [",
           t_open, t_first, prompt_faults, first_resident, open_read, prompt_read,
           (unsigned long long)advice.requests, (unsigned long long)advice.request_bytes, colibri_kernels_name(m.ctx), colibri_file_size(file), m.info.arena_size,
           colibri_file_resident(file), status_kib("RssAnon"), status_kib("RssFile"), status_kib("VmHWM"));
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
    lm_close(&m);
    free(lock_ids);
    free(prompt);
    free(tokens);
    free(times);
    free(faults);
    free(reads);
    return 0;
}

typedef struct expert_counts {
    colibri_file *file;
    uint64_t *tokens; /* [layer * stride + slot] */
    uint32_t stride;
} expert_counts;

static colibri_status count_route(void *user, const colibri_route *route)
{
    expert_counts *c = user;
    for (uint32_t s = 0; s < route->experts; s++)
        c->tokens[(size_t)route->layer * c->stride + s] += route->tokens[s];
    return colibri_file_on_route(c->file, route);
}

static int hot_mode(const char *image, const char *ids_text)
{
    size_t n;
    int32_t *prompt = parse_ids(ids_text, &n);
    colibri_file_options opts = {COLIBRI_LOCK_NONE, NULL, 0, COLIBRI_VERIFY_NONE};
    colibri_file *file;
    colibri_status st = colibri_file_open(&file, image, &opts, NULL);
    if (st != COLIBRI_OK)
        die(image, st);
    lm m;
    memset(&m, 0, sizeof m);
    lm_attach(&m, file, 1);
    uint32_t layers = colibri_file_moe_layers(file), stride = 0;
    for (uint32_t l = 0; l < layers; l++)
        if (colibri_file_layer_experts(file, l) > stride)
            stride = colibri_file_layer_experts(file, l);
    expert_counts counts = {file, calloc((size_t)layers * stride + 1, sizeof(uint64_t)), stride};
    if (!counts.tokens)
        return 1;
    m.exec.on_route = count_route;
    m.exec.on_route_user = &counts;
    if (n > m.info.max_batch) {
        fprintf(stderr, "lm_driver: a %zu-token prompt is more than the image's %u tokens a call\n", n,
                m.info.max_batch);
        return 2;
    }
    if ((st = colibri_lm_forward_ex(m.ctx, &m.exec, prompt, (uint32_t)n, m.logits, n * m.info.vocab_size)) !=
        COLIBRI_OK)
        die("colibri_lm_forward_ex", st);
    printf("[");
    int first = 1;
    for (uint32_t l = 0; l < layers; l++)
        for (uint32_t e = 0; e < colibri_file_layer_experts(file, l); e++) {
            size_t offset, size;
            if ((st = colibri_file_expert_range(file, l, e, &offset, &size)) != COLIBRI_OK)
                die("colibri_file_expert_range", st);
            printf("%s[%u, %u, %llu, %zu]", first ? "" : ", ", l, e,
                   (unsigned long long)counts.tokens[(size_t)l * stride + e], size);
            first = 0;
        }
    printf("]\n");
    lm_close(&m);
    free(counts.tokens);
    free(prompt);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[1], "decode") == 0)
        return decode_mode(argv[2], (size_t)parse(argv[3], 1, COLIBRI_POOL_MAX_WORKERS, "WORKERS"), argv[4],
                           parse(argv[5], 0, 1L << 20, "DECODE"), argv[6]);
    if (argc == 4 && strcmp(argv[1], "hot") == 0)
        return hot_mode(argv[2], argv[3]);
    if ((argc == 7 || argc == 8) && strcmp(argv[1], "logits") == 0)
        return logits_mode(argv[2], (size_t)parse(argv[3], 1, COLIBRI_POOL_MAX_WORKERS, "WORKERS"), argv[4],
                           parse(argv[5], 1, 1L << 20, "WINDOW"), argv[6], argc == 8 ? argv[7] : NULL);
    if (argc == 8 && strcmp(argv[1], "speed") == 0)
        return speed_mode(argv[2], (size_t)parse(argv[3], 1, COLIBRI_POOL_MAX_WORKERS, "WORKERS"),
                          parse(argv[4], 1, 1L << 20, "PROMPT"), parse(argv[5], 0, 1L << 20, "DECODE"),
                          parse(argv[6], 1, 1L << 20, "PREFILL"), parse(argv[7], 1, MAX_ROUNDS, "ROUNDS"));
    fprintf(stderr, "usage: lm_driver logits IMAGE WORKERS IDS.i32 WINDOW OUT.f32 [ROUTES]\n"
                    "       lm_driver speed IMAGE WORKERS PROMPT DECODE PREFILL ROUNDS\n"
                    "       lm_driver decode IMAGE WORKERS IDS DECODE LOCK\n"
                    "       lm_driver hot IMAGE IDS\n");
    return 2;
}
