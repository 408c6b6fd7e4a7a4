/*
 * colibri_edge [-s SOCKET] [-w WORKERS] [-V full|on-use|none] [-A]
 *              [-c CLIENTS] [-o BYTES] [-t MS] [-r MS] [-i MS] [-L MS] LIBRARY MODEL
 *
 * A small inference service for a Linux edge board. It loads libcolibri.so at
 * run time (dlopen, every call resolved with dlsym), maps MODEL through the
 * library's POSIX file layer (colibri_file_open: mmap'd read-only, not
 * copied), and answers requests on stdin and, with -s, on a Unix domain
 * stream socket. SIGHUP reloads MODEL (replace it by rename first); SIGTERM
 * or SIGINT stop the service. The protocol and the update procedure are in
 * README.md beside this file.
 *
 * Request: one line, rows separated by ';', a row's input_size values by ','
 *   0.5,-1,2.25;1,0,0          (2 tokens of a 3-input model)
 * Answer: one line, the output rows the same way (%.9g: f32 round-trips), or
 *   error STATUS TEXT[: DETAIL]
 * with STATUS the engine's status code and TEXT its colibri_strerror().
 * Every request line gets exactly one answer line, in order.
 *
 * Threading: one thread runs the event loop and every forward pass (with -w
 * the experts of a layer run on the library's thread pool, inside the call).
 * Signal handlers only set flags; the loop acts on them between requests, so
 * a reload never swaps the model under a running forward pass, and the new
 * model is opened, validated and given its context before the old one is
 * released. A reload that fails, or whose model would not answer the same
 * requests (a token model; other widths without -A), leaves the old model
 * serving.
 *
 * Clients: every descriptor is non-blocking and one ppoll waits for all.
 * Each client has its own input and output buffers; the loop answers
 * requests by fair queueing (serve_fairly), stops reading a client whose queued answers
 * reach -o, and drops one whose answers make no progress for -t, whose
 * request line is not complete within -r, or that is idle for -i. At -c
 * connections an idle one makes room for a newcomer, else the newcomer is
 * refused. Events a peer can cause at any rate are logged at a bounded rate
 * (-L). README.md, "Slow, silent and hostile clients".
 */
#define _GNU_SOURCE 1 /* ppoll, accept4, memrchr, getopt_long */

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "colibri.h"
#include "colibri_file.h"
#include "colibri_pool.h"

/* Longest request line accepted (bytes; the newline, and a '\r' before it,
 * not counted): 1 MiB is ~60k values at full f32 precision. A longer line is
 * answered with an error and skipped up to its newline; the connection stays
 * usable. The input buffer holds such a line, its "\r\n" and the NUL that
 * strtof needs. */
#define MAX_LINE (1u << 20)
#define IN_BUF_MAX ((size_t)MAX_LINE + 3)
/* Buffers start small and grow only for what a client has in flight, so idle
 * and well-behaved connections cost a page or two, not a megabyte. */
#define IN_BUF_START 4096
#define BUF_KEEP (64u << 10) /* a buffer emptied above this size is released */
#define ACCEPTS_PER_ROUND 16 /* a connection flood cannot starve the clients already served */
#define LOG_BURST 3          /* lines per kind of event per log interval; the rest are counted */

/* ---- the library, resolved at run time ---------------------------------------------------- */

typedef struct api {
    const char *(*version)(void);
    const char *(*strerror)(int);
    colibri_status (*get_info)(const void *, size_t, colibri_model_info *);
    colibri_status (*model_size_ex)(const void *, size_t, size_t, size_t *);
    colibri_status (*init_ex)(colibri_ctx **, void *, size_t, const void *, size_t, uint32_t);
    colibri_status (*forward_ex)(colibri_ctx *, const colibri_exec *, size_t, const float *, size_t, float *, size_t);
    const char *(*kernels_name)(const colibri_ctx *);
    colibri_status (*free_ctx)(colibri_ctx *);
    colibri_status (*file_open)(colibri_file **, const char *, const colibri_file_options *, colibri_file_diag *);
    void (*file_close)(colibri_file *);
    const void *(*file_data)(const colibri_file *);
    size_t (*file_size)(const colibri_file *);
    colibri_status (*file_on_route)(void *, const colibri_route *);
    colibri_status (*file_check)(const colibri_file *);
    colibri_status (*pool_create)(colibri_pool **, size_t);
    void (*pool_attach)(colibri_pool *, colibri_exec *);
    void (*pool_destroy)(colibri_pool *);
} api;

/* dlsym into a function pointer (ISO C has no object-to-function cast). */
static int resolve(void *lib, const char *name, void *fn, size_t size)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "colibri_edge: %s: %s\n", name, dlerror());
        return 0;
    }
    memcpy(fn, &p, size);
    return 1;
}
#define RESOLVE(lib, name, field) resolve(lib, name, &(field), sizeof(field))

static int load_api(void *lib, api *a)
{
    return RESOLVE(lib, "colibri_version", a->version) && RESOLVE(lib, "colibri_strerror", a->strerror) &&
           RESOLVE(lib, "colibri_get_info", a->get_info) && RESOLVE(lib, "colibri_model_size_ex", a->model_size_ex) &&
           RESOLVE(lib, "colibri_init_ex", a->init_ex) && RESOLVE(lib, "colibri_forward_ex", a->forward_ex) &&
           RESOLVE(lib, "colibri_kernels_name", a->kernels_name) && RESOLVE(lib, "colibri_free", a->free_ctx) &&
           RESOLVE(lib, "colibri_file_open", a->file_open) && RESOLVE(lib, "colibri_file_close", a->file_close) &&
           RESOLVE(lib, "colibri_file_data", a->file_data) && RESOLVE(lib, "colibri_file_size", a->file_size) &&
           RESOLVE(lib, "colibri_file_on_route", a->file_on_route) && RESOLVE(lib, "colibri_file_check", a->file_check) &&
           RESOLVE(lib, "colibri_pool_create", a->pool_create) && RESOLVE(lib, "colibri_pool_attach", a->pool_attach) &&
           RESOLVE(lib, "colibri_pool_destroy", a->pool_destroy);
}

/* ---- the model being served ---------------------------------------------------------------- */

typedef struct model {
    colibri_file *file;
    void *arena;
    colibri_ctx *ctx;
    colibri_model_info info;
    float *in, *out;   /* [max_batch * input_size], [max_batch * output_size] */
    char *answer;      /* the formatted output line */
    size_t answer_cap;
    unsigned generation;
} model;

/* What one client may cost the others, and how long it may take (-c, -o, -i, -r, -t; README.md). */
typedef struct limits {
    size_t max_clients;   /* socket connections at once */
    size_t output_buffer; /* answer bytes queued for a client before it is no longer read */
    long idle_ms;         /* a connection with nothing in flight is closed after this */
    long request_ms;      /* a request line must be complete this long after its first byte */
    long send_ms;         /* queued answers must make progress within this */
    long log_interval_ms; /* at most LOG_BURST lines of a kind per interval, then one summary */
    int reload_any_shape; /* -A: a reload may change input_size/output_size */
} limits;

/* Events that a hostile or broken peer can cause at any rate: logged at most
 * LOG_BURST times per interval each, the rest counted into one summary line. */
enum event { EV_REFUSED, EV_EVICTED, EV_IDLE, EV_REQUEST_TIMEOUT, EV_SEND_TIMEOUT, EV_NO_MEMORY, EV_ACCEPT_FAILED,
             EV_FILE_CHANGED, EV_COUNT };
static const char *const event_summary[EV_COUNT] = {
    "clients refused (every slot busy, none idle)", "idle clients evicted for new ones",
    "clients closed after the idle timeout", "clients dropped: request incomplete at the request timeout",
    "clients dropped: answers unread at the send timeout", "clients dropped: out of memory for their buffers",
    "accept failures", "requests answered -29 (file changed size)"};

typedef struct rate_log {
    long window_start_ms;
    unsigned logged[EV_COUNT];
    unsigned long suppressed[EV_COUNT];
} rate_log;

typedef struct service {
    api a;
    const char *path;
    uint32_t verify; /* colibri_file_verify_mode for every open */
    size_t workers;
    colibri_pool *pool;
    model m;
    limits lim;
    rate_log log;
    unsigned long vclock; /* fair queueing's virtual time, in tokens (serve_fairly) */
} service;

static long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void vlog(const char *fmt, va_list ap)
{
    fputs("colibri_edge: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    fflush(stderr);
}

static void logf_(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

/* Ends the current log interval if it is over: one line with the counts of
 * what was not logged one by one in it. */
static void log_tick(service *s, long now)
{
    rate_log *l = &s->log;
    if (now - l->window_start_ms < s->lim.log_interval_ms)
        return;
    char line[1024];
    size_t n = 0;
    for (int e = 0; e < EV_COUNT; e++)
        if (l->suppressed[e] && n < sizeof line)
            n += (size_t)snprintf(line + n, sizeof line - n, "%s%lu %s", n ? ", " : "", l->suppressed[e],
                                  event_summary[e]);
    if (n)
        logf_("in the last %.1f s, not logged one by one: %s", (double)(now - l->window_start_ms) / 1000, line);
    memset(l, 0, sizeof *l);
    l->window_start_ms = now;
}

/* The next time log_tick has something to say (-1: nothing suppressed). */
static long log_deadline(const service *s)
{
    for (int e = 0; e < EV_COUNT; e++)
        if (s->log.suppressed[e])
            return s->log.window_start_ms + s->lim.log_interval_ms;
    return -1;
}

static void note(service *s, enum event e, const char *fmt, ...)
{
    log_tick(s, now_ms());
    if (s->log.logged[e] >= LOG_BURST) {
        s->log.suppressed[e]++;
        return;
    }
    s->log.logged[e]++;
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

static void unload(const service *s, model *m)
{
    if (m->ctx)
        s->a.free_ctx(m->ctx);
    s->a.file_close(m->file); /* after the context: it reads the mapping */
    free(m->arena);
    free(m->in);
    free(m->out);
    free(m->answer);
    memset(m, 0, sizeof *m);
}

/* Opens, validates and maps the model file and builds a context over it, all
 * into `m`; on failure nothing is kept and *why says more than the status
 * (the errno of a failed open or mmap). */
static colibri_status load(const service *s, model *m, char *why, size_t why_len)
{
    const colibri_file_options opts = {COLIBRI_LOCK_NONE, NULL, 0, s->verify};
    colibri_file_diag diag;
    colibri_status st;
    size_t need;
    memset(m, 0, sizeof *m);
    memset(&diag, 0, sizeof diag);
    why[0] = '\0';
    st = s->a.file_open(&m->file, s->path, &opts, &diag);
    if (st != COLIBRI_OK) {
        m->file = NULL;
        if (diag.sys_errno) /* nothing is locked here, so errno is all the diagnosis says */
            snprintf(why, why_len, "%s", strerror(diag.sys_errno));
        return st;
    }
    const void *data = s->a.file_data(m->file);
    const size_t len = s->a.file_size(m->file);
    if ((st = s->a.get_info(data, len, &m->info)) != COLIBRI_OK ||
        (st = s->a.model_size_ex(data, len, s->workers, &need)) != COLIBRI_OK)
        goto fail;
    const colibri_model_info *i = &m->info;
    m->arena = aligned_alloc(COLIBRI_ARENA_ALIGN, (need + COLIBRI_ARENA_ALIGN - 1) & ~(size_t)(COLIBRI_ARENA_ALIGN - 1));
    m->in = malloc((size_t)i->max_batch * i->input_size * sizeof *m->in);
    m->out = malloc((size_t)i->max_batch * i->output_size * sizeof *m->out);
    /* "%.9g" is at most 15 characters (-1.23456789e-38), plus a separator. */
    m->answer_cap = (size_t)i->max_batch * i->output_size * 16 + 2;
    m->answer = malloc(m->answer_cap);
    if (!m->arena || !m->in || !m->out || !m->answer) {
        st = COLIBRI_E_ARENA_TOO_SMALL;
        snprintf(why, why_len, "out of memory (%zu arena bytes)", need);
        goto fail;
    }
    /* The file layer validated the structure (and with -V full every payload):
     * the context need not read the weights again. */
    if ((st = s->a.init_ex(&m->ctx, m->arena, need, data, len, COLIBRI_CHECK_STRUCTURE)) != COLIBRI_OK) {
        m->ctx = NULL;
        goto fail;
    }
    return COLIBRI_OK;
fail:
    unload(s, m);
    return st;
}

static void describe_model(const service *s, const char *what)
{
    const colibri_model_info *i = &s->m.info;
    logf_("%s %s: generation %u, format v%u, %u bytes, in %u, out %u, max batch %u, %u routed experts, "
          "kernels %s, %zu worker%s",
          what, s->path, s->m.generation, i->format_version, i->image_size, i->input_size, i->output_size, i->max_batch,
          i->num_experts, s->a.kernels_name(s->m.ctx), s->workers, s->workers == 1 ? "" : "s");
}

/* SIGHUP: the new model completely ready (mapped, validated, context built)
 * before the old one goes; called between requests only. */
/* Whether `next` can answer the requests `now` answers: this service reads
 * feature rows, so a token model (token ids in, colibri_lm_*) never can; and
 * unless -A, the widths must stay, or every client's request would fail. */
static colibri_status servable(const service *s, const model *next, const model *now, char *why, size_t why_len)
{
    const colibri_model_info *n = &next->info;
    if (n->vocab_size) {
        snprintf(why, why_len, "a token model (vocabulary %u): this service answers feature rows", n->vocab_size);
        return COLIBRI_E_MODEL_KIND;
    }
    if (now && !s->lim.reload_any_shape &&
        (n->input_size != now->info.input_size || n->output_size != now->info.output_size)) {
        snprintf(why, why_len, "in %u, out %u where the served model has in %u, out %u; -A allows a change of widths",
                 n->input_size, n->output_size, now->info.input_size, now->info.output_size);
        return COLIBRI_E_BUFFER_SIZE;
    }
    return COLIBRI_OK;
}

static void reload(service *s)
{
    model next;
    char why[200];
    colibri_status st = load(s, &next, why, sizeof why);
    if (st == COLIBRI_OK && (st = servable(s, &next, &s->m, why, sizeof why)) != COLIBRI_OK)
        unload(s, &next);
    if (st != COLIBRI_OK) {
        logf_("reload of %s failed: status %d (%s)%s%s: still serving generation %u", s->path, (int)st,
              s->a.strerror(st), why[0] ? ", " : "", why, s->m.generation);
        return;
    }
    next.generation = s->m.generation + 1;
    unload(s, &s->m);
    s->m = next;
    describe_model(s, "reloaded");
}

/* ---- requests ------------------------------------------------------------------------------ */

/* Parses "v,v,...;v,v,..." into m->in. Returns COLIBRI_OK and the batch, or
 * the status the engine gives such an input (BAD_BATCH: no rows or more than
 * max_batch; BUFFER_SIZE: a row that is not input_size numbers) with a detail. */
static colibri_status parse(const model *m, const char *line, size_t len, size_t *batch, char *detail, size_t dlen)
{
    const size_t width = m->info.input_size, rows_max = m->info.max_batch;
    size_t row = 0, col = 0;
    const char *p = line, *end = line + len;
    if (memchr(line, '\0', len)) {
        snprintf(detail, dlen, "the request holds a NUL byte");
        return COLIBRI_E_BUFFER_SIZE;
    }
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    if (p == end) {
        snprintf(detail, dlen, "empty request (0 tokens)");
        return COLIBRI_E_BAD_BATCH;
    }
    for (;;) {
        char *after;
        if (row == rows_max) {
            snprintf(detail, dlen, "more than %zu rows", rows_max);
            return COLIBRI_E_BAD_BATCH;
        }
        errno = 0;
        const float v = strtof(p, &after);
        if (after == p) {
            int n = 0;
            while (p + n < end && n < 16 && p[n] != ',' && p[n] != ';')
                n++;
            snprintf(detail, dlen, "row %zu value %zu is not a number ('%.*s')", row + 1, col + 1, n, p);
            return COLIBRI_E_BUFFER_SIZE;
        }
        if (col == width) {
            snprintf(detail, dlen, "row %zu has more than %zu values", row + 1, width);
            return COLIBRI_E_BUFFER_SIZE;
        }
        m->in[row * width + col++] = v; /* ERANGE: strtof's ±HUGE_VALF or denormal, as the text asked */
        p = after;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p == end || *p == ';') {
            if (col != width) {
                snprintf(detail, dlen, "row %zu has %zu values, the model takes %zu", row + 1, col, width);
                return COLIBRI_E_BUFFER_SIZE;
            }
            row++;
            col = 0;
            if (p < end)
                p++;
            while (p < end && (*p == ' ' || *p == '\t'))
                p++;
            if (p == end)
                break; /* a trailing ';' is allowed */
            continue;
        }
        snprintf(detail, dlen, "row %zu: unexpected character 0x%02x after value %zu", row + 1, (unsigned char)*p, col);
        return COLIBRI_E_BUFFER_SIZE;
    }
    *batch = row;
    return COLIBRI_OK;
}

/* Answers one request line (NUL-terminated at line[len]): *text is the answer, its length returned. */
static size_t answer(service *s, const char *line, size_t len, char **text)
{
    static char err[512]; /* single-threaded loop: one answer at a time */
    model *m = &s->m;
    char detail[160] = "";
    size_t batch = 0;
    colibri_status st = parse(m, line, len, &batch, detail, sizeof detail);
    if (st == COLIBRI_OK) {
        colibri_exec exec = COLIBRI_EXEC_INIT;
        /* The file layer's on_route: MADV_WILLNEED (and the per-expert CRC on
         * first use) for the experts routing picked, and FILE_CHANGED instead of
         * a SIGBUS if the file was truncated in place. */
        exec.on_route = s->a.file_on_route;
        exec.on_route_user = m->file;
        if (s->pool)
            s->a.pool_attach(s->pool, &exec);
        const size_t out_n = batch * m->info.output_size;
        /* Before the pass as well as in on_route: the layers ahead of the first
         * MoE layer read the mapping too (a file truncated to 0 would SIGBUS there). */
        st = s->a.file_check(m->file);
        if (st == COLIBRI_OK)
            st = s->a.forward_ex(m->ctx, &exec, batch, m->in, batch * m->info.input_size, m->out, out_n);
        if (st == COLIBRI_OK) {
            size_t n = 0;
            for (size_t k = 0; k < out_n; k++) {
                const char sep = k + 1 == out_n ? '\n' : (k + 1) % m->info.output_size ? ',' : ';';
                n += (size_t)snprintf(m->answer + n, m->answer_cap - n, "%.9g%c", (double)m->out[k], sep);
            }
            *text = m->answer;
            return n;
        }
        if (st == COLIBRI_E_FILE_CHANGED)
            note(s, EV_FILE_CHANGED, "%s changed size under its mapping: replace it by rename and send SIGHUP",
                 s->path);
    }
    *text = err;
    int n = snprintf(err, sizeof err, "error %d %s%s%s\n", (int)st, s->a.strerror(st), detail[0] ? ": " : "", detail);
    return n < (int)sizeof err ? (size_t)n : sizeof err - 1;
}

/* ---- clients ------------------------------------------------------------------------------- */

/* One peer: stdin/stdout (the operator's channel: backpressure, but no
 * timeouts and no eviction) or a socket connection. Everything is
 * non-blocking; a client's bytes wait in its buffers, never in a call. */
typedef struct client {
    int in_fd, out_fd; /* stdin/stdout, or the same socket */
    int is_stdio;
    int at_eof;   /* the peer sent all it will: answer what is buffered, flush, close */
    int broken;   /* a read or write failed: close */
    int skipping; /* dropping the rest of an overlong line up to its newline */
    char *in;     /* received bytes; [in_start, in_len) not yet answered */
    size_t in_cap, in_start, in_len;
    size_t scanned; /* no '\n' in [in_start, scanned) */
    char *out;      /* answers; [out_sent, out_len) not yet written */
    size_t out_cap, out_sent, out_len;
    /* CLOCK_MONOTONIC milliseconds (never 0 after boot, so 0 means "none") */
    long last_active_ms;   /* last byte read or written */
    long request_start_ms; /* first byte of the unterminated request at the tail of `in` */
    long progress_ms;      /* output queued: its last write that took bytes, or when it was queued */
    long paused_ms;        /* over its output buffer, so not read, since */
    int has_sent;          /* sent a byte since it connected */
    int ready;             /* had a request to answer at the last scheduling pass */
    unsigned long vstart;  /* virtual start of its next request (serve_fairly) */
    size_t cost_of;        /* in_start + 1 of the request `cost` was counted for; 0: none */
    unsigned long cost;
} client;

typedef struct clients {
    client **c;
    size_t n, sockets;
} clients;

static volatile sig_atomic_t reload_requested, stop_requested;

static void on_hup(int sig)
{
    (void)sig;
    reload_requested = 1;
}

static void on_stop(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static size_t out_pending(const client *c)
{
    return c->out_len - c->out_sent;
}

static int paused(const service *s, const client *c)
{
    return out_pending(c) >= s->lim.output_buffer;
}

static int idle(const client *c)
{
    return !out_pending(c) && c->in_start == c->in_len && !c->skipping && !c->at_eof && !c->request_start_ms;
}

enum work { NO_WORK, LINE, OVERLONG_PART, LAST_LINE };

static enum work pending_work(client *c)
{
    if (c->broken)
        return NO_WORK;
    char *nl = c->in_len > c->scanned ? memchr(c->in + c->scanned, '\n', c->in_len - c->scanned) : NULL;
    c->scanned = nl ? (size_t)(nl - c->in) : c->in_len;
    if (nl)
        return LINE;
    const size_t part = c->in_len - c->in_start;
    /* MAX_LINE bytes may still be followed by "\r\n": only more is too long. */
    if (part > MAX_LINE + 1 || (part == MAX_LINE + 1 && c->in[c->in_len - 1] != '\r'))
        return OVERLONG_PART;
    return c->at_eof && part ? LAST_LINE : NO_WORK;
}

static int wants_read(const service *s, client *c)
{
    return !c->at_eof && !c->broken && !paused(s, c) && pending_work(c) == NO_WORK;
}

static void release_if_large(char **buf, size_t *cap)
{
    if (*cap > BUF_KEEP) {
        free(*buf);
        *buf = NULL;
        *cap = 0;
    }
}

/* Writes what the peer takes now; the rest waits for POLLOUT. */
static void flush(const service *s, client *c, long now)
{
    while (out_pending(c)) {
        ssize_t w = write(c->out_fd, c->out + c->out_sent, out_pending(c));
        if (w > 0) {
            c->out_sent += (size_t)w;
            c->progress_ms = c->last_active_ms = now;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else {
            if (!(w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) {
                if (c->is_stdio)
                    logf_("stdout: %s: no longer reading stdin", w < 0 ? strerror(errno) : "closed");
                c->broken = 1;
            }
            break;
        }
    }
    if (!out_pending(c)) {
        c->out_sent = c->out_len = 0;
        release_if_large(&c->out, &c->out_cap);
    }
    if (c->paused_ms && !paused(s, c)) { /* the request clock does not run while we do not read */
        if (c->request_start_ms)
            c->request_start_ms += now - c->paused_ms;
        c->paused_ms = 0;
    }
}

static void queue(service *s, client *c, const char *text, size_t n, long now)
{
    if (!out_pending(c))
        c->out_sent = c->out_len = 0, c->progress_ms = now;
    if (c->out_len + n > c->out_cap) {
        if (c->out_sent)
            memmove(c->out, c->out + c->out_sent, out_pending(c));
        c->out_len -= c->out_sent;
        c->out_sent = 0;
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_len + n)
            cap *= 2;
        char *grown = realloc(c->out, cap);
        if (!grown) {
            note(s, EV_NO_MEMORY, "dropped a client: no memory for %zu bytes of answers", cap);
            c->broken = 1;
            return;
        }
        c->out = grown;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, text, n);
    c->out_len += n;
    if (paused(s, c) && !c->paused_ms)
        c->paused_ms = now;
}

/* Answers the client's next request, if it has one and room for the answer. */
static int serve_one(service *s, client *c, long now)
{
    if (paused(s, c))
        return 0;
    const enum work w = pending_work(c);
    if (w == NO_WORK)
        return 0;
    char overlong[128];
    int on = snprintf(overlong, sizeof overlong, "error %d %s: request longer than %u bytes\n",
                      COLIBRI_E_BUFFER_SIZE, s->a.strerror(COLIBRI_E_BUFFER_SIZE), MAX_LINE);
    if (w == OVERLONG_PART) { /* answered now, in order; its rest is dropped as it comes */
        queue(s, c, overlong, (size_t)on, now);
        c->in_start = c->in_len = c->scanned = 0;
        c->skipping = 1;
        return 1;
    }
    const size_t end = w == LINE ? c->scanned : c->in_len;
    size_t n = end - c->in_start;
    if (n && c->in[c->in_start + n - 1] == '\r')
        n--;
    if (n > MAX_LINE) {
        queue(s, c, overlong, (size_t)on, now);
    } else {
        /* strtof needs a terminator: it replaces the newline (or '\r'), or at
         * the end of input uses the spare byte every read leaves. */
        c->in[c->in_start + n] = '\0';
        char *text;
        const size_t tn = answer(s, c->in + c->in_start, n, &text);
        queue(s, c, text, tn, now);
    }
    c->in_start = c->scanned = w == LINE ? end + 1 : end;
    c->cost_of = 0;
    if (c->in_start == c->in_len) {
        c->in_start = c->in_len = c->scanned = 0;
        release_if_large(&c->in, &c->in_cap);
    }
    return 1;
}

/* What the client's next request costs, in tokens: its rows, counted up to
 * max_batch + 1, where parsing stops. (An error answer costs less; the count
 * is only the unit of fairness.) */
static unsigned long request_cost(const service *s, client *c, enum work w)
{
    if (w != LINE && w != LAST_LINE)
        return 1;
    if (c->cost_of == c->in_start + 1)
        return c->cost;
    const char *p = c->in + c->in_start, *const end = c->in + (w == LINE ? c->scanned : c->in_len);
    const unsigned long most = (unsigned long)s->m.info.max_batch + 1;
    unsigned long rows = 1;
    while (rows < most && p < end && (p = memchr(p, ';', (size_t)(end - p))) != NULL) {
        p++;
        rows++;
    }
    c->cost_of = c->in_start + 1;
    return c->cost = rows;
}

/* Start-time fair queueing over the clients with a request to answer (and
 * room for its answer): each request is tagged with its client's virtual
 * start, the later of where the client's last request ended and the virtual
 * clock; the smallest tag goes first, and advances its client by the
 * request's cost in tokens. A client sending a few tokens now and then is so
 * answered ahead of clients pipelining full batches, which share the rest;
 * a client cannot bank credit while it has nothing to send. Serves up to
 * max_batch tokens, then returns, so that the loop polls again. */
static void serve_fairly(service *s, clients *cs, long now)
{
    unsigned long budget = s->m.info.max_batch;
    for (;;) {
        client *best = NULL;
        enum work best_work = NO_WORK;
        for (size_t i = 0; i < cs->n; i++) {
            client *c = cs->c[i];
            const enum work w = paused(s, c) ? NO_WORK : pending_work(c);
            if (w != NO_WORK && !c->ready && c->vstart < s->vclock)
                c->vstart = s->vclock;
            c->ready = w != NO_WORK;
            if (c->ready && (!best || c->vstart < best->vstart)) {
                best = c;
                best_work = w;
            }
        }
        if (!best)
            return;
        const unsigned long cost = request_cost(s, best, best_work);
        s->vclock = best->vstart;
        best->vstart += cost;
        serve_one(s, best, now);
        flush(s, best, now);
        if (cost >= budget)
            return;
        budget -= cost;
    }
}

static void read_some(service *s, client *c, long now)
{
    if (c->in_start) {
        memmove(c->in, c->in + c->in_start, c->in_len - c->in_start);
        c->in_len -= c->in_start;
        c->scanned -= c->in_start;
        c->in_start = 0;
    }
    if (c->in_len + 1 >= c->in_cap) { /* only a partial line is buffered, and it fills the buffer */
        size_t cap = c->in_cap ? 2 * c->in_cap : IN_BUF_START;
        if (cap > IN_BUF_MAX)
            cap = IN_BUF_MAX;
        if (cap <= c->in_cap) /* cannot happen: a line this long is overlong, answered before any read */
            return;
        char *grown = realloc(c->in, cap);
        if (!grown) {
            note(s, EV_NO_MEMORY, "dropped a client: no memory for a %zu-byte request buffer", cap);
            c->broken = 1;
            return;
        }
        c->in = grown;
        c->in_cap = cap;
    }
    char *chunk = c->in + c->in_len;
    ssize_t r = read(c->in_fd, chunk, c->in_cap - c->in_len - 1); /* a spare byte for the NUL */
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        return;
    if (r <= 0) { /* an error (a reset connection) ends the input as EOF does */
        c->at_eof = 1;
        c->request_start_ms = 0;
        return;
    }
    c->last_active_ms = now;
    c->has_sent = 1;
    size_t got = (size_t)r;
    if (c->skipping) {
        char *nl = memchr(chunk, '\n', got);
        if (!nl) {
            if (!c->request_start_ms)
                c->request_start_ms = now;
            return;
        }
        got -= (size_t)(nl + 1 - chunk);
        memmove(chunk, nl + 1, got);
        c->skipping = 0;
        c->request_start_ms = 0;
    }
    c->in_len += got;
    const char *last_nl = memrchr(chunk, '\n', got);
    if (last_nl)
        c->request_start_ms = last_nl + 1 == chunk + got ? 0 : now;
    else if (got && !c->request_start_ms)
        c->request_start_ms = now;
}

/* Why a socket client must go now, or NULL; *when: its next deadline (-1: none). */
static const char *expired(const service *s, const client *c, long now, enum event *ev, long *when)
{
    const limits *l = &s->lim;
    const char *why = NULL;
    long d = -1;
#define DEADLINE(cond, at, e, text)                                                                                    \
    if (cond) {                                                                                                        \
        if (now >= (at) && !why)                                                                                       \
            why = (text), *ev = (e);                                                                                   \
        d = d < 0 || (at) < d ? (at) : d;                                                                              \
    }
    DEADLINE(l->send_ms && out_pending(c), c->progress_ms + l->send_ms, EV_SEND_TIMEOUT, "answers unread")
    DEADLINE(l->request_ms && c->request_start_ms && !c->paused_ms && !c->at_eof, c->request_start_ms + l->request_ms,
             EV_REQUEST_TIMEOUT, "request incomplete")
    DEADLINE(l->idle_ms && idle(c), c->last_active_ms + l->idle_ms, EV_IDLE, "idle")
#undef DEADLINE
    *when = d;
    return why;
}

static void drop(clients *cs, size_t i)
{
    client *c = cs->c[i];
    if (!c->is_stdio) {
        close(c->in_fd);
        cs->sockets--;
    }
    free(c->in);
    free(c->out);
    free(c);
    cs->c[i] = cs->c[--cs->n]; /* the order of the others does not matter: each gets a turn per round */
}

static client *add(clients *cs, int in_fd, int out_fd, int is_stdio, long now)
{
    client *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->in_fd = in_fd;
    c->out_fd = out_fd;
    c->is_stdio = is_stdio;
    c->last_active_ms = now;
    cs->c[cs->n++] = c;
    cs->sockets += !is_stdio;
    return c;
}

/* The idle socket client to close for a newcomer, or cs->n for none: one that
 * never sent a byte before one that did (so a flood of empty connections
 * churns through itself, not through clients between two requests), each
 * kind the one idle the longest first. */
static size_t eviction_victim(const clients *cs)
{
    size_t v = cs->n;
    for (size_t i = 0; i < cs->n; i++) {
        const client *c = cs->c[i];
        if (c->is_stdio || !idle(c))
            continue;
        if (v == cs->n || c->has_sent < cs->c[v]->has_sent ||
            (c->has_sent == cs->c[v]->has_sent && c->last_active_ms < cs->c[v]->last_active_ms))
            v = i;
    }
    return v;
}

/* Takes the waiting connections (a bounded number per round). At the limit,
 * an idle client makes room (eviction_victim); with none idle, the new one is
 * refused. Returns when to accept again after running out of descriptors. */
static long accept_clients(service *s, clients *cs, int listen_fd, long now)
{
    for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            note(s, EV_ACCEPT_FAILED, "accept: %s: accepting again in 100 ms", strerror(errno));
            return now + 100; /* EMFILE and the like: the connection stays queued, poll would spin */
        }
        if (cs->sockets == s->lim.max_clients) {
            const size_t victim = eviction_victim(cs);
            if (victim == cs->n) {
                note(s, EV_REFUSED, "refused a client: %zu connected (-c), none idle", cs->sockets);
                close(fd);
                continue;
            }
            note(s, EV_EVICTED, "evicted a client idle for %ld ms%s to take a new one (%zu connected, -c)",
                 now - cs->c[victim]->last_active_ms, cs->c[victim]->has_sent ? "" : ", silent since it connected,",
                 cs->sockets);
            drop(cs, victim);
        }
        if (!add(cs, fd, fd, 0, now)) {
            note(s, EV_NO_MEMORY, "refused a client: out of memory");
            close(fd);
        }
    }
    return 0;
}

static int listen_unix(const char *path)
{
    struct sockaddr_un addr;
    struct stat st;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) {
        logf_("socket path too long (%zu bytes, at most %zu): %s", strlen(path), sizeof addr.sun_path - 1, path);
        return -1;
    }
    strcpy(addr.sun_path, path);
    /* A socket file left by a previous run (never any other kind of file). */
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
        unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 16) != 0) {
        logf_("socket %s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: colibri_edge [OPTIONS] LIBRARY MODEL\n"
            "  -s, --socket PATH          also answer on this Unix domain socket\n"
            "  -w, --workers N            run each layer's experts on N workers (default 1)\n"
            "  -V, --verify MODE          payload checks at every (re)load: full (default: a corrupted\n"
            "                             new file never replaces the old model), on-use (per expert,\n"
            "                             at first use; opening reads no weights), none\n"
            "  -A, --reload-any-shape     let a reload change the model's input or output width\n"
            "socket clients (README.md, \"Slow, silent and hostile clients\"):\n"
            "  -c, --max-clients N        connections at once (default 64); when full, the one idle\n"
            "                             longest is closed for a new one, else the new one is refused\n"
            "  -o, --output-buffer BYTES  answers queued for a client before it is no longer read\n"
            "                             (default 262144)\n"
            "  -t, --send-timeout MS      drop a client whose queued answers take no byte for this\n"
            "                             long (default 10000; 0: never)\n"
            "  -r, --request-timeout MS   drop a client whose request line is not complete this long\n"
            "                             after its first byte (default 10000; 0: never)\n"
            "  -i, --idle-timeout MS      close a connection with nothing in flight for this long\n"
            "                             (default 60000; 0: never)\n"
            "  -L, --log-interval MS      log each kind of client event at most %d times per interval,\n"
            "                             then one line of counts (default 10000)\n",
            LOG_BURST);
}

/* A decimal option value in [lo, hi], or exit 2 saying which option. */
static unsigned long option_value(const char *name, const char *text, unsigned long lo, unsigned long hi)
{
    char *end;
    errno = 0;
    const unsigned long v = strtoul(text, &end, 10);
    if (errno || end == text || *end || text[0] == '-' || v < lo || v > hi) {
        fprintf(stderr, "colibri_edge: %s takes a number in %lu..%lu, not '%s'\n", name, lo, hi, text);
        exit(2);
    }
    return v;
}

/* A pipe or socket on stdin/stdout becomes non-blocking for the loop, and
 * gets its flags back on the way out (the open file may be shared). */
static int make_nonblocking(int fd)
{
    struct stat st;
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fstat(fd, &st) != 0 || !(S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)))
        return -1;
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    return flags;
}

int main(int argc, char **argv)
{
    static const struct option long_options[] = {
        {"socket", required_argument, NULL, 's'},        {"workers", required_argument, NULL, 'w'},
        {"verify", required_argument, NULL, 'V'},        {"reload-any-shape", no_argument, NULL, 'A'},
        {"max-clients", required_argument, NULL, 'c'},   {"output-buffer", required_argument, NULL, 'o'},
        {"send-timeout", required_argument, NULL, 't'},  {"request-timeout", required_argument, NULL, 'r'},
        {"idle-timeout", required_argument, NULL, 'i'},  {"log-interval", required_argument, NULL, 'L'},
        {"help", no_argument, NULL, 'h'},                {NULL, 0, NULL, 0}};
    static const unsigned long hour_ms = 3600000;
    service s;
    const char *sock_path = NULL;
    int opt;
    memset(&s, 0, sizeof s);
    s.workers = 1;
    s.verify = COLIBRI_VERIFY_FULL;
    s.lim = (limits){64, 256u << 10, 60000, 10000, 10000, 10000, 0};
    while ((opt = getopt_long(argc, argv, "s:w:V:Ac:o:t:r:i:L:h", long_options, NULL)) != -1) {
        switch (opt) {
        case 's':
            sock_path = optarg;
            break;
        case 'w':
            s.workers = option_value("-w", optarg, 1, 64);
            break;
        case 'V':
            if (!strcmp(optarg, "full"))
                s.verify = COLIBRI_VERIFY_FULL;
            else if (!strcmp(optarg, "on-use"))
                s.verify = COLIBRI_VERIFY_ON_USE;
            else if (!strcmp(optarg, "none"))
                s.verify = COLIBRI_VERIFY_NONE;
            else {
                fprintf(stderr, "colibri_edge: -V takes full, on-use or none, not '%s'\n", optarg);
                return 2;
            }
            break;
        case 'A':
            s.lim.reload_any_shape = 1;
            break;
        case 'c':
            s.lim.max_clients = option_value("-c", optarg, 1, 100000);
            break;
        case 'o':
            s.lim.output_buffer = option_value("-o", optarg, 1, 1ul << 30);
            break;
        case 't':
            s.lim.send_ms = (long)option_value("-t", optarg, 0, hour_ms);
            break;
        case 'r':
            s.lim.request_ms = (long)option_value("-r", optarg, 0, hour_ms);
            break;
        case 'i':
            s.lim.idle_ms = (long)option_value("-i", optarg, 0, hour_ms);
            break;
        case 'L':
            s.lim.log_interval_ms = (long)option_value("-L", optarg, 1, hour_ms);
            break;
        default:
            usage();
            return 2;
        }
    }
    if (argc - optind != 2) {
        usage();
        return 2;
    }
    s.path = argv[optind + 1];
    struct rlimit files;
    if (sock_path && getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY &&
        s.lim.max_clients + 16 > files.rlim_cur) {
        logf_("-c %zu needs %zu file descriptors, ulimit -n is %llu", s.lim.max_clients, s.lim.max_clients + 16,
              (unsigned long long)files.rlim_cur);
        return 2;
    }

    /* Handlers only set flags. The signals stay blocked except inside ppoll,
     * so one arriving between the flag check and the wait still wakes it (and
     * a SIGHUP during the first load is a reload right after it, not death). */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_hup;
    sigaction(SIGHUP, &sa, NULL);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN; /* a client gone: EPIPE from write, not death */
    sigaction(SIGPIPE, &sa, NULL);
    sigset_t blocked, during_wait;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGHUP);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigprocmask(SIG_BLOCK, &blocked, &during_wait);
    sigdelset(&during_wait, SIGHUP);
    sigdelset(&during_wait, SIGTERM);
    sigdelset(&during_wait, SIGINT);

    void *lib = dlopen(argv[optind], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        logf_("%s", dlerror());
        return 1;
    }
    if (!load_api(lib, &s.a))
        return 1;
    colibri_status st;
    char why[200];
    if (s.workers > 1 && (st = s.a.pool_create(&s.pool, s.workers)) != COLIBRI_OK) {
        logf_("thread pool of %zu: status %d (%s)", s.workers, (int)st, s.a.strerror(st));
        return 1;
    }
    if ((st = load(&s, &s.m, why, sizeof why)) == COLIBRI_OK && (st = servable(&s, &s.m, NULL, why, sizeof why)))
        unload(&s, &s.m);
    if (st != COLIBRI_OK) {
        logf_("%s: status %d (%s)%s%s", s.path, (int)st, s.a.strerror(st), why[0] ? ", " : "", why);
        return 1;
    }
    s.m.generation = 1;

    int listen_fd = -1;
    if (sock_path && (listen_fd = listen_unix(sock_path)) < 0)
        return 1;
    clients cs = {calloc(s.lim.max_clients + 1, sizeof(client *)), 0, 0};
    struct pollfd *pf = calloc(2 * (s.lim.max_clients + 1) + 1, sizeof *pf);
    const int stdin_flags = make_nonblocking(STDIN_FILENO), stdout_flags = make_nonblocking(STDOUT_FILENO);
    if (!cs.c || !pf || !add(&cs, STDIN_FILENO, STDOUT_FILENO, 1, now_ms())) {
        logf_("out of memory");
        return 1;
    }
    describe_model(&s, "serving");
    if (sock_path)
        logf_("listening on %s", sock_path);
    logf_("ready (colibri %s)", s.a.version());

    long accept_again_ms = 0;
    s.log.window_start_ms = now_ms();
    while (!stop_requested) {
        if (reload_requested) {
            reload_requested = 0;
            reload(&s);
        }
        long now = now_ms(), next = -1;
        log_tick(&s, now);
        int busy = 0;
        for (size_t i = cs.n; i-- > 0;) {
            client *c = cs.c[i];
            enum event ev;
            long when = -1;
            const char *why_out = c->is_stdio ? NULL : expired(&s, c, now, &ev, &when);
            if (why_out) {
                note(&s, ev, "dropped a client: %s for %ld ms (%s)", why_out,
                     now - (ev == EV_SEND_TIMEOUT ? c->progress_ms
                            : ev == EV_IDLE     ? c->last_active_ms
                                                : c->request_start_ms),
                     ev == EV_SEND_TIMEOUT ? "-t" : ev == EV_IDLE ? "-i" : "-r");
                drop(&cs, i);
                continue;
            }
            if (when >= 0 && (next < 0 || when < next))
                next = when;
        }
        if (!cs.n && listen_fd < 0)
            break; /* stdin ended, every answer written, and no socket */
        const long log_due = log_deadline(&s); /* after the drops above, which it may count */
        if (log_due >= 0 && (next < 0 || log_due < next))
            next = log_due;

        nfds_t n = 0;
        const int accepting = listen_fd >= 0 && now >= accept_again_ms;
        pf[n++] = (struct pollfd){accepting ? listen_fd : -1, POLLIN, 0};
        if (listen_fd >= 0 && !accepting && (next < 0 || accept_again_ms < next))
            next = accept_again_ms;
        for (size_t i = 0; i < cs.n; i++) {
            client *c = cs.c[i];
            pf[n++] = (struct pollfd){wants_read(&s, c) ? c->in_fd : -1, POLLIN, 0};
            pf[n++] = (struct pollfd){out_pending(c) ? c->out_fd : -1, POLLOUT, 0};
            busy |= !paused(&s, c) && pending_work(c) != NO_WORK;
        }
        struct timespec wait = {0, 0};
        if (!busy && next >= 0) {
            const long ms = next > now ? next - now : 0;
            wait = (struct timespec){ms / 1000, (ms % 1000) * 1000000};
        }
        if (ppoll(pf, n, busy || next >= 0 ? &wait : NULL, &during_wait) < 0) {
            if (errno == EINTR)
                continue;
            logf_("poll: %s", strerror(errno));
            break;
        }
        now = now_ms();
        const size_t polled = cs.n;
        for (size_t i = 0; i < polled; i++) {
            client *c = cs.c[i];
            if (pf[2 + 2 * i].revents)
                flush(&s, c, now);
            if (pf[1 + 2 * i].revents)
                read_some(&s, c, now);
        }
        if (pf[0].revents & POLLIN)
            accept_again_ms = accept_clients(&s, &cs, listen_fd, now);
        serve_fairly(&s, &cs, now);
        for (size_t i = cs.n; i-- > 0;) {
            client *c = cs.c[i];
            if (c->broken || (c->at_eof && pending_work(c) == NO_WORK && !out_pending(c)))
                drop(&cs, i);
        }
    }

    logf_("stopping (generation %u)", s.m.generation);
    log_tick(&s, now_ms() + s.lim.log_interval_ms);
    while (cs.n)
        drop(&cs, cs.n - 1);
    free(cs.c);
    free(pf);
    if (stdin_flags >= 0)
        fcntl(STDIN_FILENO, F_SETFL, stdin_flags);
    if (stdout_flags >= 0)
        fcntl(STDOUT_FILENO, F_SETFL, stdout_flags);
    if (listen_fd >= 0) {
        close(listen_fd);
        unlink(sock_path);
    }
    unload(&s, &s.m);
    s.a.pool_destroy(s.pool);
    dlclose(lib);
    return 0;
}
