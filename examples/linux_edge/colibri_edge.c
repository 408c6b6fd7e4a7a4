/*
 * colibri_edge [-s SOCKET] [-w WORKERS] [-V full|on-use|none] LIBRARY MODEL
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
 * released. A reload that fails leaves the old model serving.
 */
#define _GNU_SOURCE 1 /* ppoll, accept4 */

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "colibri.h"
#include "colibri_file.h"
#include "colibri_pool.h"

/* Longest request line accepted (bytes, newline excluded): 1 MiB is ~60k
 * values at full f32 precision. A longer line is answered with an error and
 * skipped up to its newline; the connection stays usable. */
#define MAX_LINE (1u << 20)
#define MAX_CLIENTS 32
/* A socket client that does not read its answers for this long is dropped,
 * so one stuck client cannot stall everybody else. */
#define WRITE_TIMEOUT_MS 2000

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

typedef struct service {
    api a;
    const char *path;
    uint32_t verify; /* colibri_file_verify_mode for every open */
    size_t workers;
    colibri_pool *pool;
    model m;
} service;

static void logf_(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("colibri_edge: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
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
static void reload(service *s)
{
    model next;
    char why[160];
    const colibri_status st = load(s, &next, why, sizeof why);
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
            logf_("%s changed size under its mapping: replace it by rename and send SIGHUP", s->path);
    }
    *text = err;
    int n = snprintf(err, sizeof err, "error %d %s%s%s\n", (int)st, s->a.strerror(st), detail[0] ? ": " : "", detail);
    return n < (int)sizeof err ? (size_t)n : sizeof err - 1;
}

/* ---- connections --------------------------------------------------------------------------- */

typedef struct conn {
    int in_fd, out_fd; /* stdin/stdout, or the same socket */
    char *buf;         /* the pending partial line */
    size_t len;
    int overlong;      /* skipping the rest of an overlong line */
} conn;

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

/* Writes all of it; 0 when the peer is gone or stalled (the caller drops it). */
static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf = {fd, POLLOUT, 0};
            if (poll(&pf, 1, WRITE_TIMEOUT_MS) <= 0)
                return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

/* Answers every complete line in c->buf; 0 if the connection must close. */
static int serve_lines(service *s, conn *c, int at_eof)
{
    size_t start = 0;
    for (;;) {
        char *nl = memchr(c->buf + start, '\n', c->len - start);
        size_t end = nl ? (size_t)(nl - c->buf) : c->len;
        if (!nl && !(at_eof && end > start))
            break;
        size_t n = end - start;
        if (n && c->buf[start + n - 1] == '\r')
            n--;
        /* strtof needs a terminator (buf has a spare byte past MAX_LINE); the
         * newline it replaces has been found already. */
        c->buf[start + n] = '\0';
        char *text;
        size_t tn = answer(s, c->buf + start, n, &text);
        if (!send_all(c->out_fd, text, tn))
            return 0;
        start = nl ? end + 1 : end;
    }
    memmove(c->buf, c->buf + start, c->len - start);
    c->len -= start;
    if (c->len == MAX_LINE) { /* no newline in a full buffer */
        char text[128];
        int n = snprintf(text, sizeof text, "error %d %s: request longer than %u bytes\n", COLIBRI_E_BUFFER_SIZE,
                         s->a.strerror(COLIBRI_E_BUFFER_SIZE), MAX_LINE);
        if (!send_all(c->out_fd, text, (size_t)n))
            return 0;
        c->len = 0;
        c->overlong = 1;
    }
    return 1;
}

/* Reads what is there; 0 at EOF or error (after answering a last unterminated line).
 * An overlong line was answered when the buffer filled: its rest is dropped here. */
static int serve_read(service *s, conn *c)
{
    ssize_t r = read(c->in_fd, c->buf + c->len, MAX_LINE - c->len);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        return 1;
    if (r <= 0) {
        if (!c->overlong)
            serve_lines(s, c, 1);
        return 0;
    }
    if (c->overlong) { /* drop bytes up to the overlong line's newline */
        char *nl = memchr(c->buf + c->len, '\n', (size_t)r);
        if (!nl)
            return 1;
        size_t keep = (size_t)r - (size_t)(nl + 1 - (c->buf + c->len));
        memmove(c->buf, nl + 1, keep);
        c->len = keep;
        c->overlong = 0;
    } else {
        c->len += (size_t)r;
    }
    return serve_lines(s, c, 0);
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
    fprintf(stderr, "usage: colibri_edge [-s SOCKET] [-w WORKERS] [-V full|on-use|none] LIBRARY MODEL\n"
                    "  -s SOCKET  also answer on this Unix domain socket\n"
                    "  -w N       run each layer's experts on N workers (default 1)\n"
                    "  -V MODE    payload checks at every (re)load: full (default: a corrupted\n"
                    "             new file never replaces the old model), on-use (per expert,\n"
                    "             at first use; opening reads no weights), none\n");
}

int main(int argc, char **argv)
{
    service s;
    const char *sock_path = NULL;
    int opt;
    memset(&s, 0, sizeof s);
    s.workers = 1;
    s.verify = COLIBRI_VERIFY_FULL;
    while ((opt = getopt(argc, argv, "s:w:V:h")) != -1) {
        char *e;
        switch (opt) {
        case 's':
            sock_path = optarg;
            break;
        case 'w':
            s.workers = (size_t)strtoul(optarg, &e, 10);
            if (*e || !*optarg || s.workers < 1 || s.workers > 64) {
                fprintf(stderr, "colibri_edge: -w takes 1..64 workers, not '%s'\n", optarg);
                return 2;
            }
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
    char why[160];
    if (s.workers > 1 && (st = s.a.pool_create(&s.pool, s.workers)) != COLIBRI_OK) {
        logf_("thread pool of %zu: status %d (%s)", s.workers, (int)st, s.a.strerror(st));
        return 1;
    }
    if ((st = load(&s, &s.m, why, sizeof why)) != COLIBRI_OK) {
        logf_("%s: status %d (%s)%s%s", s.path, (int)st, s.a.strerror(st), why[0] ? ", " : "", why);
        return 1;
    }
    s.m.generation = 1;

    int listen_fd = -1;
    if (sock_path && (listen_fd = listen_unix(sock_path)) < 0)
        return 1;
    conn conns[1 + MAX_CLIENTS];
    size_t nconns = 0;
    conn *in = &conns[nconns++];
    *in = (conn){STDIN_FILENO, STDOUT_FILENO, malloc(MAX_LINE + 1), 0, 0};
    int stdin_open = 1;
    if (!in->buf) {
        logf_("out of memory");
        return 1;
    }
    describe_model(&s, "serving");
    if (sock_path)
        logf_("listening on %s", sock_path);
    logf_("ready (colibri %s)", s.a.version());

    while (!stop_requested && (stdin_open || listen_fd >= 0)) {
        if (reload_requested) {
            reload_requested = 0;
            reload(&s);
        }
        struct pollfd pf[2 + MAX_CLIENTS];
        nfds_t n = 0;
        pf[n++] = (struct pollfd){listen_fd, POLLIN, 0}; /* -1: ignored by poll */
        for (size_t i = 0; i < nconns; i++)
            pf[n++] = (struct pollfd){i == 0 && !stdin_open ? -1 : conns[i].in_fd, POLLIN, 0};
        if (ppoll(pf, n, NULL, &during_wait) < 0) {
            if (errno == EINTR)
                continue;
            logf_("poll: %s", strerror(errno));
            break;
        }
        for (size_t i = nconns; i-- > 0;) {
            if (!(pf[1 + i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (serve_read(&s, &conns[i]))
                continue;
            if (i == 0) {
                stdin_open = 0;
                in->len = 0;
                continue;
            }
            close(conns[i].in_fd);
            free(conns[i].buf);
            conns[i] = conns[--nconns]; /* order of the others does not matter */
        }
        if (listen_fd >= 0 && (pf[0].revents & POLLIN)) {
            int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            char *buf = fd >= 0 && nconns < 1 + MAX_CLIENTS ? malloc(MAX_LINE + 1) : NULL;
            if (buf) {
                conns[nconns++] = (conn){fd, fd, buf, 0, 0};
            } else if (fd >= 0) {
                logf_("refused a client: %s", nconns == 1 + MAX_CLIENTS ? "too many clients" : "out of memory");
                close(fd);
            }
        }
    }

    logf_("stopping (generation %u)", s.m.generation);
    for (size_t i = 1; i < nconns; i++) {
        close(conns[i].in_fd);
        free(conns[i].buf);
    }
    free(in->buf);
    if (listen_fd >= 0) {
        close(listen_fd);
        unlink(sock_path);
    }
    unload(&s, &s.m);
    s.a.pool_destroy(s.pool);
    dlclose(lib);
    return 0;
}
