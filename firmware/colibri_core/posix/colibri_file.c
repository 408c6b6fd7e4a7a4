/*
 * The POSIX file layer: open, validate, mmap, madvise, mlock, verify per
 * expert (colibri_file.h). Outside the core: the core has no OS calls.
 */
#define _DEFAULT_SOURCE 1 /* madvise, MADV_*, mincore */

#include "colibri_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h> /* major, minor */
#include <unistd.h>

#include "../src/colibri_internal.h"

/* One expert slot: its record and the byte range of its payloads. */
typedef struct file_expert {
    uint32_t record;    /* expert record index */
    uint64_t start, end;
    atomic_uchar verified;
} file_expert;

/* Pages [start, end) of the mapping, page-aligned. */
typedef struct file_range {
    uint64_t start, end;
} file_range;

struct colibri_file {
    int fd;
    char *path;
    dev_t dev;
    ino_t ino;
    const uint8_t *base;
    size_t map_len;     /* bytes mapped: the file's size at open */
    size_t image_size;
    size_t page;
    colibri_model model;
    uint32_t verify;
    uint32_t moe_layers;
    uint32_t *layer_first; /* [moe_layers + 1]: slots of layer L are experts[layer_first[L] .. layer_first[L+1]) */
    file_expert *experts;
    /* What each stage of the program reads besides routed experts, for the advice ahead: stage s < moe_layers
     * is the layers after MoE layer s - 1 up to MoE layer s's router (attention, norms, dense layers) and
     * that layer's shared experts; stage moe_layers the layers after the last one (final norm, head). Its
     * page ranges are dense[dense_first[s] .. dense_first[s + 1]), merged, in file order. */
    uint32_t *dense_first;
    file_range *dense;
    uint32_t ahead;     /* stages advised past the one routing ran for (colibri_file_set_ahead) */
    size_t chunk;       /* bytes of one read-ahead request (prefetch_range) */
    atomic_ullong advice[7]; /* colibri_file_advice's counters, in order */
};

static void set_diag(colibri_file_diag *d, int err)
{
    if (d)
        d->sys_errno = err;
}

const void *colibri_file_data(const colibri_file *f)
{
    return f ? f->base : NULL;
}

size_t colibri_file_size(const colibri_file *f)
{
    return f ? f->image_size : 0;
}

uint32_t colibri_file_moe_layers(const colibri_file *f)
{
    return f ? f->moe_layers : 0;
}

uint32_t colibri_file_layer_experts(const colibri_file *f, uint32_t layer)
{
    if (!f || layer >= f->moe_layers)
        return 0;
    return f->layer_first[layer + 1] - f->layer_first[layer];
}

/* Tensors of an expert record: w1 b1 w2 b2 w3 b3 and the companions of the
 * I8 ones; NONE for absent. Returns how many slots were written (12). */
static unsigned expert_tensors(const colibri_file *f, uint32_t record, uint32_t out[12])
{
    colibri_expert e;
    colibri_read_expert(f->base, &f->model.hdr, record, &e);
    const uint32_t refs[6] = {e.w1, e.b1, e.w2, e.b2, e.w3, e.b3};
    const uint32_t count = f->model.hdr.tensor_count;
    unsigned n = 0;
    for (unsigned i = 0; i < 6; i++) {
        /* The records are read again from the mapping, which may have changed
         * since it was validated: a reference past the table is kept as such
         * (verify_tensor refuses it), never followed. */
        out[n++] = refs[i];
        uint32_t aux = COLIBRI_NONE;
        if (refs[i] != COLIBRI_NONE && refs[i] < count) {
            colibri_tensor t;
            colibri_read_tensor(f->base, &f->model.hdr, refs[i], &t);
            if (t.dtype == COLIBRI_DTYPE_I8 || t.dtype == COLIBRI_DTYPE_I4)
                aux = t.aux; /* Q8_PARAMS / Q4_PARAMS: read with the matrix, so part of the expert */
        }
        out[n++] = aux;
    }
    return n;
}

/* CRC of tensor `index` against the CRC table (v3); OK before v3, where the
 * one image CRC was checked at open. */
static colibri_status verify_tensor(const colibri_file *f, uint32_t index)
{
    const colibri_header *h = &f->model.hdr;
    if (index == COLIBRI_NONE || h->version < COLIBRI_TENSOR_CRC_VERSION)
        return COLIBRI_OK;
    /* Validated at open; bounded again, as the table is read in place. */
    if (index >= h->tensor_count)
        return COLIBRI_E_BAD_REF;
    colibri_tensor t;
    colibri_read_tensor(f->base, h, index, &t);
    if (t.offset > f->image_size || t.nbytes > f->image_size - t.offset) /* no wrap with v7's u64 fields */
        return COLIBRI_E_TENSOR_BOUNDS;
    const uint32_t want = colibri_rd_u32(f->base + h->crc_offset + 4u * (size_t)index);
    return colibri_crc32(f->base + (size_t)t.offset, (size_t)t.nbytes) == want ? COLIBRI_OK : COLIBRI_E_BAD_PAYLOAD_CRC;
}

static colibri_status verify_slot(colibri_file *f, file_expert *x)
{
    if (atomic_load(&x->verified))
        return COLIBRI_OK;
    uint32_t ts[12];
    const unsigned n = expert_tensors(f, x->record, ts);
    for (unsigned i = 0; i < n; i++) {
        colibri_status st = verify_tensor(f, ts[i]);
        if (st != COLIBRI_OK)
            return st;
    }
    atomic_store(&x->verified, 1);
    return COLIBRI_OK;
}

static file_expert *slot(const colibri_file *f, uint32_t layer, uint32_t expert)
{
    if (layer >= f->moe_layers || expert >= f->layer_first[layer + 1] - f->layer_first[layer])
        return NULL;
    return &f->experts[f->layer_first[layer] + expert];
}

/* Walks the (validated) program: the expert slots of each MOE layer, their
 * payload ranges, and which tensors belong to experts (owned, a bit set). */
static colibri_status index_experts(colibri_file *f, uint8_t *owned)
{
    const colibri_header *h = &f->model.hdr;
    const uint32_t slots = f->model.routed_experts + f->model.shared_experts;
    f->moe_layers = f->model.moe_layers;
    f->layer_first = calloc((size_t)f->moe_layers + 1u, sizeof *f->layer_first);
    f->experts = calloc(slots ? slots : 1u, sizeof *f->experts);
    if (!f->layer_first || !f->experts)
        return COLIBRI_E_FILE_OPEN;
    uint32_t L = 0, k = 0;
    for (uint32_t i = 0; i < h->layer_count; i++) {
        colibri_layer l;
        colibri_read_layer(f->base, h, i, &l);
        if (l.op != COLIBRI_OP_MOE)
            continue;
        colibri_moe m;
        colibri_read_moe(f->base, h, l.t0, &m);
        f->layer_first[L] = k;
        const uint32_t used = m.expert_count + m.shared_count;
        for (uint32_t j = 0; j < used; j++, k++) {
            file_expert *x = &f->experts[k];
            x->record = m.first_expert + j;
            x->start = UINT64_MAX;
            x->end = 0;
            uint32_t ts[12];
            const unsigned n = expert_tensors(f, x->record, ts);
            for (unsigned t = 0; t < n; t++) {
                if (ts[t] == COLIBRI_NONE)
                    continue;
                colibri_tensor rec;
                colibri_read_tensor(f->base, h, ts[t], &rec);
                if (rec.offset < x->start)
                    x->start = rec.offset;
                if ((uint64_t)rec.offset + rec.nbytes > x->end)
                    x->end = (uint64_t)rec.offset + rec.nbytes;
                owned[ts[t] / 8u] = (uint8_t)(owned[ts[t] / 8u] | (1u << (ts[t] % 8u)));
            }
            atomic_init(&x->verified, 0);
        }
        L++;
    }
    f->layer_first[L] = k;
    return COLIBRI_OK;
}

/* A stage's ranges as they are collected (colibri_file's dense): one per tensor, then merged. */
typedef struct range_list {
    file_range *r;
    size_t n, cap;
} range_list;

static int push_range(range_list *l, uint64_t start, uint64_t end)
{
    if (start >= end)
        return 1;
    if (l->n == l->cap) {
        const size_t cap = l->cap ? 2u * l->cap : 64u;
        file_range *r = realloc(l->r, cap * sizeof *r);
        if (!r)
            return 0;
        l->r = r;
        l->cap = cap;
    }
    l->r[l->n++] = (file_range){start, end};
    return 1;
}

/* A tensor and, for an I8 / I4 matrix, its Q8_PARAMS / Q4_PARAMS companion. */
static int push_tensor(const colibri_file *f, range_list *l, uint32_t index)
{
    const colibri_header *h = &f->model.hdr;
    for (int k = 0; k < 2 && index != COLIBRI_NONE && index < h->tensor_count; k++) {
        colibri_tensor t;
        colibri_read_tensor(f->base, h, index, &t);
        if (!push_range(l, t.offset, (uint64_t)t.offset + t.nbytes))
            return 0;
        index = t.dtype == COLIBRI_DTYPE_I8 || t.dtype == COLIBRI_DTYPE_I4 ? t.aux : COLIBRI_NONE;
    }
    return 1;
}

static int by_start(const void *a, const void *b)
{
    const file_range *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* Page-rounds, sorts and merges l->r[from ..) in place; returns the new count. */
static size_t merge_ranges(const colibri_file *f, range_list *l, size_t from)
{
    const uint64_t page = f->page;
    for (size_t i = from; i < l->n; i++) {
        l->r[i].start &= ~(page - 1u);
        l->r[i].end = (l->r[i].end + page - 1u) & ~(page - 1u);
    }
    qsort(l->r + from, l->n - from, sizeof *l->r, by_start);
    size_t out = from;
    for (size_t i = from; i < l->n; i++) {
        if (out > from && l->r[i].start <= l->r[out - 1u].end) {
            if (l->r[i].end > l->r[out - 1u].end)
                l->r[out - 1u].end = l->r[i].end;
        } else {
            l->r[out++] = l->r[i];
        }
    }
    return out;
}

/* The pages each stage reads besides its routed experts (struct colibri_file's dense): the tensors of
 * its layers in program order, an EMBED table excepted (a token reads one row of it), and the shared
 * experts of the stage's MoE layer. Run after index_experts. */
static colibri_status index_stages(colibri_file *f)
{
    const colibri_header *h = &f->model.hdr;
    range_list l = {NULL, 0, 0};
    f->dense_first = calloc((size_t)f->moe_layers + 2u, sizeof *f->dense_first);
    if (!f->dense_first)
        return COLIBRI_E_FILE_OPEN;
    uint32_t stage = 0;
    size_t from = 0;
    int ok = 1;
    for (uint32_t i = 0; ok && i < h->layer_count; i++) {
        colibri_layer ly;
        colibri_read_layer(f->base, h, i, &ly);
        switch (ly.op) {
        case COLIBRI_OP_LINEAR:
        case COLIBRI_OP_LAYERNORM:
            ok = push_tensor(f, &l, ly.t0) && push_tensor(f, &l, ly.t1);
            break;
        case COLIBRI_OP_RMSNORM:
            ok = push_tensor(f, &l, ly.t0);
            break;
        case COLIBRI_OP_ATTENTION: {
            colibri_attention a;
            colibri_read_attention(f->base, h, ly.t0, &a);
            const uint32_t refs[10] = {a.q_w, a.q_b, a.k_w, a.k_b, a.v_w, a.v_b, a.o_w, a.o_b, a.q_norm, a.k_norm};
            for (unsigned k = 0; ok && k < 10; k++)
                ok = push_tensor(f, &l, refs[k]);
            break;
        }
        case COLIBRI_OP_MOE: {
            colibri_moe m;
            colibri_read_moe(f->base, h, ly.t0, &m);
            ok = push_tensor(f, &l, m.router_weight) && push_tensor(f, &l, m.router_bias) &&
                 push_tensor(f, &l, m.expert_map) && push_tensor(f, &l, m.shared_gate);
            for (uint32_t j = m.expert_count; ok && stage < f->moe_layers && j < m.expert_count + m.shared_count; j++) {
                const file_expert *x = &f->experts[f->layer_first[stage] + j];
                ok = push_range(&l, x->start, x->end);
            }
            if (ok) {
                l.n = merge_ranges(f, &l, from);
                f->dense_first[++stage] = (uint32_t)l.n;
                from = l.n;
            }
            break;
        }
        default: /* EMBED (one row a token), ACTIVATION, RESIDUAL_*: nothing to advise */
            break;
        }
    }
    if (ok) {
        l.n = merge_ranges(f, &l, from);
        f->dense_first[stage + 1u] = (uint32_t)l.n;
    }
    f->dense = l.r;
    return ok ? COLIBRI_OK : COLIBRI_E_FILE_OPEN;
}

/* Page range of [start, end) inside the mapping. */
static void page_range(const colibri_file *f, uint64_t start, uint64_t end, void **addr, size_t *len)
{
    const uint64_t a = start & ~((uint64_t)f->page - 1u);
    uint64_t b = (end + f->page - 1u) & ~((uint64_t)f->page - 1u);
    if (b > f->map_len)
        b = f->map_len;
    *addr = (void *)(uintptr_t)(f->base + a);
    *len = (size_t)(b - a);
}

/* The most one POSIX_FADV_WILLNEED (or MADV_WILLNEED, or readahead(2)) call reads: Linux cuts the request
 * to the larger of the device's read_ahead_kb and max_sectors_kb and drops the rest of the range without a
 * word. With one call per 19.5 MB expert and read_ahead_kb 8192, 8 MiB of it was read ahead and the other
 * 11.5 MiB faulted in 4 KiB at a time under MADV_RANDOM (25 MB/s against 1.2 GB/s for the whole range in
 * requests of the cap, docs/linux-edge.md). Read from sysfs for the file's device (a partition's queue is
 * its disk's); 128 KiB, the kernel's default read_ahead_kb, where sysfs says nothing. */
static size_t readahead_cap(dev_t dev)
{
    static const char *const where[] = {"/sys/dev/block/%u:%u/queue/%s", "/sys/dev/block/%u:%u/../queue/%s"};
    static const char *const knobs[] = {"read_ahead_kb", "max_sectors_kb"};
    unsigned long best = 0;
    for (unsigned w = 0; w < 2 && !best; w++)
        for (unsigned k = 0; k < 2; k++) {
            char path[128];
            snprintf(path, sizeof path, where[w], major(dev), minor(dev), knobs[k]);
            FILE *fp = fopen(path, "re");
            unsigned long kib = 0;
            if (fp) {
                if (fscanf(fp, "%lu", &kib) == 1 && kib > best && kib <= (1ul << 20))
                    best = kib;
                fclose(fp);
            }
        }
    return best ? (size_t)best * 1024u : (size_t)128u * 1024u;
}

/* Asks the kernel to read the pages of [start, end) that are not resident, in requests of f->chunk bytes
 * (readahead_cap), without waiting for them: the compute that follows finds them in flight or read,
 * where a fault under MADV_RANDOM reads one page and waits for it. Residency comes from mincore over the
 * whole range, so a partly evicted range gets its missing pages back and a resident one costs a few us
 * (mincore over mapped pages: 4 us for 20 MB here). Returns the bytes requested (0: all resident). */
static size_t prefetch_range(colibri_file *f, uint64_t start, uint64_t end)
{
    void *addr;
    size_t len;
    page_range(f, start, end, &addr, &len);
    if (!len)
        return 0;
    enum { WINDOW = 4096 }; /* pages asked of mincore at once */
    unsigned char vec[WINDOW];
    const size_t pages = (len + f->page - 1u) / f->page;
    const uint64_t first = (uint64_t)((const uint8_t *)addr - f->base);
    size_t requested = 0, run = 0; /* run: pages of the missing run that ends before page p */
    for (size_t w = 0; w < pages; w += WINDOW) {
        const size_t n = pages - w < WINDOW ? pages - w : WINDOW;
        const int known = mincore((uint8_t *)addr + w * f->page, n * f->page, vec) == 0;
        for (size_t i = 0; i <= n; i++) {
            const size_t p = w + i;
            const int missing = i < n && (!known || !(vec[i] & 1u));
            if (missing) {
                run++;
                continue;
            }
            if (i == n && p < pages)
                break; /* the run may go on in the next window */
            for (uint64_t o = first + (uint64_t)(p - run) * f->page, stop = first + (uint64_t)p * f->page; o < stop;) {
                const uint64_t piece = stop - o < f->chunk ? stop - o : f->chunk;
                const uint64_t piece_end = o + piece < f->map_len ? o + piece : f->map_len;
                (void)posix_fadvise(f->fd, (off_t)o, (off_t)(piece_end - o), POSIX_FADV_WILLNEED); /* advice */
                atomic_fetch_add_explicit(&f->advice[6], 1u, memory_order_relaxed);
                requested += (size_t)(piece_end - o);
                o += piece;
            }
            run = 0;
        }
    }
    return requested;
}

/* Besides its tables, the structure check reads every I8 / I4 matrix's companion (the scales, the sparse
 * terms' row pointers and columns) and the tokenizer. They lie all over the file, beside their matrices:
 * for a 7 B q4 model some 400 MB of group scales in 720 KB pieces, which under MADV_RANDOM the check
 * faulted in a page at a time (the 22-49 s of a cold open). Requested first, from the tensor table as it
 * is: nothing here is validated yet, so every range is clamped to the mapping and a bad one costs at
 * most a useless read; the check that follows decides. */
static void prefetch_checked(colibri_file *f)
{
    colibri_header h;
    colibri_read_header(f->base, &h);
    const size_t record = h.version >= COLIBRI_WIDE_VERSION ? COLIBRI_TENSOR_WIDE_SIZE : COLIBRI_TENSOR_SIZE;
    if (h.tensor_offset > f->map_len || h.tensor_count > (f->map_len - h.tensor_offset) / record)
        return;
    prefetch_range(f, h.tensor_offset, (uint64_t)h.tensor_offset + (uint64_t)h.tensor_count * record);
    for (uint32_t i = 0; i < h.tensor_count; i++) {
        colibri_tensor t;
        colibri_read_tensor(f->base, &h, i, &t);
        if ((t.dtype == COLIBRI_DTYPE_Q8_PARAMS || t.dtype == COLIBRI_DTYPE_Q4_PARAMS ||
             t.dtype == COLIBRI_DTYPE_TOKENIZER) && t.offset < f->map_len)
            prefetch_range(f, t.offset, t.nbytes < f->map_len - t.offset ? t.offset + t.nbytes : f->map_len);
    }
}

static colibri_status lock_range(colibri_file *f, uint64_t start, uint64_t end, colibri_file_diag *diag,
                                 uint64_t total)
{
    void *addr;
    size_t len;
    page_range(f, start, end, &addr, &len);
    prefetch_range(f, start, end); /* mlock faults the range in: under MADV_RANDOM, a page per read */
    if (len && mlock(addr, len) != 0) {
        const int err = errno;
        if (diag) {
            struct rlimit rl;
            diag->sys_errno = err;
            diag->lock_bytes = total;
            if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0)
                diag->memlock_limit = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur;
        }
        return COLIBRI_E_MLOCK_FAILED;
    }
    return COLIBRI_OK;
}

/* Every payload against its CRC (colibri_validate), the mapping read sequentially meanwhile (readahead in
 * large requests, pages dropped behind), then random access again. */
static colibri_status verify_all(colibri_file *f)
{
    (void)madvise((void *)(uintptr_t)f->base, f->map_len, MADV_SEQUENTIAL);
    const colibri_status st = colibri_validate(f->base, f->image_size);
    (void)madvise((void *)(uintptr_t)f->base, f->map_len, MADV_RANDOM);
    if (st == COLIBRI_OK)
        for (uint32_t i = 0; i < f->model.routed_experts + f->model.shared_experts; i++)
            atomic_store(&f->experts[i].verified, 1);
    return st;
}

static colibri_status apply_options(colibri_file *f, const colibri_file_options *o, colibri_file_diag *diag,
                                    const uint8_t *owned)
{
    const colibri_header *h = &f->model.hdr;
    colibri_status st;
    if (f->verify == COLIBRI_VERIFY_FULL) {
        if ((st = verify_all(f)) != COLIBRI_OK)
            return st;
    } else if (f->verify == COLIBRI_VERIFY_ON_USE) {
        /* Everything but the experts: embeddings, attention, routers, dense layers, norms, maps. Requested
         * first, all of it: the kernel then reads them in large requests, where the CRC's faults under
         * MADV_RANDOM would read a page at a time (a cold open: about 10x slower, bench/lm_open.py). */
        for (int pass = 0; pass < 2; pass++)
            for (uint32_t i = 0; i < h->tensor_count; i++) {
                if (owned[i / 8u] & (1u << (i % 8u)))
                    continue;
                if (pass == 1) {
                    if ((st = verify_tensor(f, i)) != COLIBRI_OK)
                        return st;
                    continue;
                }
                colibri_tensor t;
                colibri_read_tensor(f->base, h, i, &t);
                if (t.offset < f->map_len)
                    prefetch_range(f, t.offset, (uint64_t)t.offset + t.nbytes);
            }
    }
    if (!o || o->lock == COLIBRI_LOCK_NONE)
        return COLIBRI_OK;
    if (o->lock == COLIBRI_LOCK_ALL)
        return lock_range(f, 0, f->map_len, diag, f->map_len);
    if (o->lock == COLIBRI_LOCK_DENSE) {
        uint64_t want = 0;
        for (int pass = 0; pass < 2; pass++)
            for (uint32_t i = 0; i < h->tensor_count; i++) {
                if (owned[i / 8u] & (1u << (i % 8u)))
                    continue;
                colibri_tensor t;
                colibri_read_tensor(f->base, h, i, &t);
                if (pass == 0)
                    want += t.nbytes;
                else if ((st = lock_range(f, t.offset, (uint64_t)t.offset + t.nbytes, diag, want)) != COLIBRI_OK)
                    return st;
            }
        return COLIBRI_OK;
    }
    if (o->lock != COLIBRI_LOCK_EXPERTS || (o->lock_count && !o->lock_experts))
        return COLIBRI_E_NULL_ARG;
    uint64_t total = 0;
    for (size_t i = 0; i < o->lock_count; i++) {
        const file_expert *x = slot(f, o->lock_experts[i].layer, o->lock_experts[i].expert);
        if (!x) {
            if (diag)
                diag->expert = o->lock_experts[i];
            return COLIBRI_E_NO_SUCH_EXPERT;
        }
        total += x->end - x->start;
    }
    for (size_t i = 0; i < o->lock_count; i++) {
        file_expert *x = slot(f, o->lock_experts[i].layer, o->lock_experts[i].expert);
        if ((st = lock_range(f, x->start, x->end, diag, total)) != COLIBRI_OK)
            return st;
        /* Pinned pages are resident: verify them now rather than mid-forward. */
        if (f->verify == COLIBRI_VERIFY_ON_USE && (st = verify_slot(f, x)) != COLIBRI_OK) {
            if (diag)
                diag->expert = o->lock_experts[i];
            return st;
        }
    }
    return COLIBRI_OK;
}

colibri_status colibri_file_open(colibri_file **out, const char *path, const colibri_file_options *opts,
                                 colibri_file_diag *diag)
{
    if (diag)
        memset(diag, 0, sizeof *diag);
    if (!out)
        return COLIBRI_E_NULL_ARG;
    *out = NULL;
    if (!path)
        return COLIBRI_E_NULL_ARG;
    const uint32_t verify = opts ? opts->verify : COLIBRI_VERIFY_ON_USE;
    if (verify > COLIBRI_VERIFY_NONE || (opts && opts->lock > COLIBRI_LOCK_DENSE))
        return COLIBRI_E_UNSUPPORTED;

    colibri_file *f = calloc(1, sizeof *f);
    if (!f)
        return COLIBRI_E_FILE_OPEN;
    f->fd = -1;
    f->verify = verify;
    f->page = (size_t)sysconf(_SC_PAGESIZE);
    colibri_status st = COLIBRI_OK;
    uint8_t *owned = NULL;

    /* O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer;
     * anything but a regular file is refused below, before a byte is read.
     * The flag changes nothing for a regular file's reads or its mapping. */
    f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f->fd < 0) {
        set_diag(diag, errno);
        st = errno == ENOENT || errno == ENOTDIR ? COLIBRI_E_FILE_NOT_FOUND : COLIBRI_E_FILE_OPEN;
        goto fail;
    }
    struct stat sb;
    if (fstat(f->fd, &sb) != 0) {
        set_diag(diag, errno);
        st = COLIBRI_E_FILE_OPEN;
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        /* EISDIR for a directory, ENODEV for a FIFO, socket or device: no mapping of it is a model. */
        set_diag(diag, S_ISDIR(sb.st_mode) ? EISDIR : ENODEV);
        st = COLIBRI_E_FILE_OPEN;
        goto fail;
    }
    f->dev = sb.st_dev;
    f->ino = sb.st_ino;
    if ((uint64_t)sb.st_size < COLIBRI_HEADER_SIZE) {
        st = COLIBRI_E_TRUNCATED; /* not a model: too short for the header */
        goto fail;
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        st = COLIBRI_E_IMAGE_TOO_LARGE; /* a 32-bit build cannot map it (format v7 images past 4 GiB) */
        goto fail;
    }
    f->map_len = (size_t)sb.st_size;
    void *map = mmap(NULL, f->map_len, PROT_READ, MAP_SHARED, f->fd, 0);
    if (map == MAP_FAILED) {
        set_diag(diag, errno);
        st = COLIBRI_E_MMAP_FAILED;
        goto fail;
    }
    f->base = map;
    /* Random access by default: no readahead of neighbouring experts. */
    (void)madvise(map, f->map_len, MADV_RANDOM);
    f->chunk = readahead_cap(sb.st_dev);
    prefetch_checked(f);

    uint64_t work;
    if ((st = colibri_check_level(f->base, f->map_len, &f->model, &work, COLIBRI_CHECK_STRUCTURE)) != COLIBRI_OK)
        goto fail;
    f->image_size = (size_t)f->model.hdr.image_bytes; /* <= map_len, validated */
    f->path = strdup(path);
    owned = calloc((size_t)f->model.hdr.tensor_count / 8u + 1u, 1);
    if (!f->path || !owned) {
        st = COLIBRI_E_FILE_OPEN;
        goto fail;
    }
    f->ahead = 1;
    if ((st = index_experts(f, owned)) != COLIBRI_OK || (st = index_stages(f)) != COLIBRI_OK ||
        (st = apply_options(f, opts, diag, owned)) != COLIBRI_OK)
        goto fail;
    free(owned);
    *out = f;
    return COLIBRI_OK;

fail:
    free(owned);
    colibri_file_close(f);
    return st;
}

void colibri_file_close(colibri_file *f)
{
    if (!f)
        return;
    if (f->base)
        munmap((void *)(uintptr_t)f->base, f->map_len); /* also drops its mlocks */
    if (f->fd >= 0)
        close(f->fd);
    free(f->layer_first);
    free(f->experts);
    free(f->dense_first);
    free(f->dense);
    free(f->path);
    free(f);
}

colibri_status colibri_file_will_need(colibri_file *f, uint32_t layer, const uint32_t *experts, size_t n)
{
    if (!f || (n && !experts))
        return COLIBRI_E_NULL_ARG;
    for (size_t i = 0; i < n; i++) {
        file_expert *x = slot(f, layer, experts[i]);
        if (!x)
            return COLIBRI_E_NO_SUCH_EXPERT;
        const size_t len = prefetch_range(f, x->start, x->end);
        atomic_fetch_add_explicit(&f->advice[0], 1u, memory_order_relaxed);
        atomic_fetch_add_explicit(&f->advice[1], (uint64_t)(x->end - x->start), memory_order_relaxed);
        atomic_fetch_add_explicit(&f->advice[4], len, memory_order_relaxed);
    }
    if (f->verify != COLIBRI_VERIFY_ON_USE)
        return COLIBRI_OK;
    for (size_t i = 0; i < n; i++) {
        colibri_status st = verify_slot(f, slot(f, layer, experts[i]));
        if (st != COLIBRI_OK)
            return st;
    }
    return COLIBRI_OK;
}

/* Read-ahead requests for what the next f->ahead stages read besides their routed experts, known before their
 * routing is: the attention and norms ahead of each MoE layer, its router and its shared experts, and
 * after the last one the head; past the head, the next token's first stages. The kernel reads them in
 * while this layer's experts compute. Advice only: verification stays with each expert's own layer. */
static void advise_ahead(colibri_file *f, uint32_t layer)
{
    const uint32_t stages = f->moe_layers + 1u;
    const uint32_t ahead = f->ahead < stages - 1u ? f->ahead : stages - 1u;
    for (uint32_t k = 1; k <= ahead; k++) {
        const uint32_t s = (layer + k) % stages;
        for (uint32_t i = f->dense_first[s]; i < f->dense_first[s + 1u]; i++) {
            const uint64_t end = f->dense[i].end < f->map_len ? f->dense[i].end : f->map_len;
            const size_t len = prefetch_range(f, f->dense[i].start, end);
            atomic_fetch_add_explicit(&f->advice[2], 1u, memory_order_relaxed);
            atomic_fetch_add_explicit(&f->advice[3], end - f->dense[i].start, memory_order_relaxed);
            atomic_fetch_add_explicit(&f->advice[5], len, memory_order_relaxed);
        }
    }
}

colibri_status colibri_file_set_ahead(colibri_file *f, uint32_t stages)
{
    if (!f)
        return COLIBRI_E_NULL_ARG;
    f->ahead = stages;
    return COLIBRI_OK;
}

colibri_status colibri_file_advice_counts(const colibri_file *f, colibri_file_advice *out)
{
    if (!f || !out)
        return COLIBRI_E_NULL_ARG;
    colibri_file *m = (colibri_file *)(uintptr_t)f; /* atomic loads take a non-const pointer in C11 */
    out->route_calls = atomic_load_explicit(&m->advice[0], memory_order_relaxed);
    out->route_bytes = atomic_load_explicit(&m->advice[1], memory_order_relaxed);
    out->ahead_calls = atomic_load_explicit(&m->advice[2], memory_order_relaxed);
    out->ahead_bytes = atomic_load_explicit(&m->advice[3], memory_order_relaxed);
    out->route_advised = atomic_load_explicit(&m->advice[4], memory_order_relaxed);
    out->ahead_advised = atomic_load_explicit(&m->advice[5], memory_order_relaxed);
    out->requests = atomic_load_explicit(&m->advice[6], memory_order_relaxed);
    out->request_bytes = m->chunk;
    return COLIBRI_OK;
}

colibri_status colibri_file_set_request_bytes(colibri_file *f, size_t bytes)
{
    if (!f)
        return COLIBRI_E_NULL_ARG;
    if (bytes < f->page || bytes % f->page)
        return COLIBRI_E_UNSUPPORTED;
    f->chunk = bytes;
    return COLIBRI_OK;
}

colibri_status colibri_file_ahead_ranges(const colibri_file *f, uint32_t stage, size_t *count, uint64_t *ranges,
                                         size_t capacity)
{
    if (!f || !count || (capacity && !ranges))
        return COLIBRI_E_NULL_ARG;
    if (stage > f->moe_layers)
        return COLIBRI_E_NO_SUCH_EXPERT;
    const uint32_t a = f->dense_first[stage], b = f->dense_first[stage + 1u];
    *count = b - a;
    for (size_t i = 0; i < *count && i < capacity / 2u; i++) {
        ranges[2u * i] = f->dense[a + i].start;
        ranges[2u * i + 1u] = f->dense[a + i].end < f->map_len ? f->dense[a + i].end : f->map_len;
    }
    return COLIBRI_OK;
}

colibri_status colibri_file_on_route(void *file, const colibri_route *route)
{
    colibri_file *f = file;
    if (!f || !route)
        return COLIBRI_E_NULL_ARG;
    /* A file truncated in place would SIGBUS the experts about to run: stop
     * the forward pass with FILE_CHANGED instead (one fstat per MoE layer). */
    colibri_status changed = colibri_file_check(f);
    if (changed != COLIBRI_OK)
        return changed;
    /* The selected routed slots, then every shared one, in chunks (no allocation). */
    enum { CHUNK = 64 };
    uint32_t ids[CHUNK];
    size_t n = 0;
    const uint32_t total = route->experts + route->shared;
    for (uint32_t s = 0; s < total; s++) {
        if (s < route->experts && (!route->tokens || route->tokens[s] == 0))
            continue;
        ids[n++] = s;
        if (n == CHUNK || s + 1u == total) {
            colibri_status st = colibri_file_will_need(f, route->layer, ids, n);
            if (st != COLIBRI_OK)
                return st;
            n = 0;
        }
    }
    colibri_status st = n ? colibri_file_will_need(f, route->layer, ids, n) : COLIBRI_OK;
    if (st == COLIBRI_OK)
        advise_ahead(f, route->layer);
    return st;
}

colibri_status colibri_file_verify_expert(colibri_file *f, uint32_t layer, uint32_t expert)
{
    if (!f)
        return COLIBRI_E_NULL_ARG;
    file_expert *x = slot(f, layer, expert);
    return x ? verify_slot(f, x) : COLIBRI_E_NO_SUCH_EXPERT;
}

colibri_status colibri_file_verify(colibri_file *f)
{
    if (!f)
        return COLIBRI_E_NULL_ARG;
    colibri_status st = colibri_file_check(f);
    if (st != COLIBRI_OK)
        return st;
    return verify_all(f);
}

colibri_status colibri_file_expert_range(const colibri_file *f, uint32_t layer, uint32_t expert, size_t *offset,
                                         size_t *size)
{
    if (!f || !offset || !size)
        return COLIBRI_E_NULL_ARG;
    const file_expert *x = slot(f, layer, expert);
    if (!x)
        return COLIBRI_E_NO_SUCH_EXPERT;
    *offset = (size_t)x->start;
    *size = (size_t)(x->end - x->start);
    return COLIBRI_OK;
}

colibri_status colibri_file_check(const colibri_file *f)
{
    if (!f)
        return COLIBRI_E_NULL_ARG;
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return COLIBRI_E_FILE_OPEN;
    return (uint64_t)sb.st_size == (uint64_t)f->map_len ? COLIBRI_OK : COLIBRI_E_FILE_CHANGED;
}

int colibri_file_replaced(const colibri_file *f)
{
    struct stat sb;
    if (!f)
        return 0;
    if (stat(f->path, &sb) != 0)
        return 1;
    return sb.st_dev != f->dev || sb.st_ino != f->ino;
}

long long colibri_file_resident(const colibri_file *f)
{
    if (!f)
        return -1;
    const size_t pages = (f->map_len + f->page - 1u) / f->page;
    unsigned char *vec = malloc(pages ? pages : 1u);
    if (!vec)
        return -1;
    long long resident = -1;
    if (mincore((void *)(uintptr_t)f->base, f->map_len, vec) == 0) {
        resident = 0;
        for (size_t i = 0; i < pages; i++)
            resident += (vec[i] & 1u) ? (long long)f->page : 0;
    }
    free(vec);
    return resident;
}
