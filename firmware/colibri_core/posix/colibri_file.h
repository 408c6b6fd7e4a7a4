/*
 * Colibri on Linux: a model file mapped read-only, not copied (issue 11).
 *
 * This layer sits beside the core (firmware/colibri_core/src stays free of
 * OS calls; the microcontroller build never sees this file). It opens a model
 * file, validates its structure (COLIBRI_CHECK_STRUCTURE: header, metadata
 * CRC, tables, every offset and reference; no weight is read), maps it
 * read-only with MADV_RANDOM over the whole mapping, and can:
 *
 *   - ask the kernel ahead of use to read the pages of the experts routing
 *     selected that are not resident (POSIX_FADV_WILLNEED in requests the
 *     kernel carries out whole): colibri_file_will_need(), called from the
 *     engine's on_route callback before an MoE layer runs its experts;
 *   - pin experts that must never fault (mlock): all, none, or a named set;
 *   - verify payload integrity per expert on first use (format v3 keeps one
 *     CRC-32 per tensor), or everything at open (COLIBRI_VERIFY_FULL), or at
 *     any time (colibri_file_verify());
 *   - tell a file changed under the mapping (truncated or rewritten in place:
 *     COLIBRI_E_FILE_CHANGED, instead of a SIGBUS later where it can) and a
 *     file replaced by rename (colibri_file_replaced(): reopen to pick it up).
 *
 * The safe update procedure (README "Linux edge"): write the new model to a
 * temporary file in the same directory, fsync it, rename() it over the old
 * name. A process serving the old file keeps its mapping of the old inode,
 * valid until colibri_file_close(); a reopen maps the new one. Never truncate
 * or rewrite a served model file in place: pages past the new end raise
 * SIGBUS in every process mapping it.
 *
 *   colibri_file *f;
 *   colibri_file_open(&f, "model.bin", NULL, NULL);
 *   colibri_init_ex(&ctx, arena, need, colibri_file_data(f), colibri_file_size(f),
 *                   COLIBRI_CHECK_STRUCTURE);
 *   ... colibri_file_will_need(f, layer, experts, n) from on_route ...
 *   colibri_file_close(f);   // after colibri_free(ctx)
 *
 * Thread safety: open, close and the lock options are the owner's; will_need
 * and verify_expert may be called from several threads at once (the verified
 * marks are atomic: at worst two threads verify the same expert).
 */
#ifndef COLIBRI_FILE_H
#define COLIBRI_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct colibri_file colibri_file;

/* One expert: the MoE layer (0 = the program's first MOE layer, in program
 * order) and its expert slot (routed 0..N-1, then shared N..N+S-1). */
typedef struct colibri_expert_id {
    uint32_t layer;
    uint32_t expert;
} colibri_expert_id;

typedef enum colibri_file_lock_mode {
    COLIBRI_LOCK_NONE = 0,    /* nothing pinned */
    COLIBRI_LOCK_ALL = 1,     /* the whole mapping */
    COLIBRI_LOCK_EXPERTS = 2, /* the pages of lock_experts[0..lock_count) */
    COLIBRI_LOCK_DENSE = 3,   /* every tensor that is no expert's: embeddings, attention, norms, routers, head */
} colibri_file_lock_mode;

typedef enum colibri_file_verify_mode {
    COLIBRI_VERIFY_ON_USE = 0, /* at open: the non-expert tensors and locked experts;
                                  each other expert on its first will_need / verify_expert */
    COLIBRI_VERIFY_FULL = 1,   /* every payload at open (reads the whole file) */
    COLIBRI_VERIFY_NONE = 2,   /* structure only; colibri_file_verify() on demand */
} colibri_file_verify_mode;

typedef struct colibri_file_options {
    uint32_t lock;                        /* colibri_file_lock_mode */
    const colibri_expert_id *lock_experts; /* with COLIBRI_LOCK_EXPERTS */
    size_t lock_count;
    uint32_t verify;                      /* colibri_file_verify_mode */
} colibri_file_options;

/* What a failure was, beyond its status (any field may be 0). */
typedef struct colibri_file_diag {
    int sys_errno;          /* errno of the failing call */
    uint64_t memlock_limit; /* MLOCK_FAILED: RLIMIT_MEMLOCK soft limit, bytes (UINT64_MAX: unlimited) */
    uint64_t lock_bytes;    /* MLOCK_FAILED: bytes the options asked to lock */
    colibri_expert_id expert; /* BAD_PAYLOAD_CRC, NO_SUCH_EXPERT: which one */
} colibri_file_diag;

/* Opens, validates and maps `path`. opts NULL: no lock, verify on use.
 * diag, if not NULL, says more about a failure. Statuses: FILE_NOT_FOUND,
 * FILE_OPEN (permission, a directory, an I/O error), TRUNCATED / BAD_MAGIC /
 * ... (not a model: the validator's status), MMAP_FAILED, MLOCK_FAILED,
 * NO_SUCH_EXPERT (a named lock expert), BAD_PAYLOAD_CRC (verification). */
COLIBRI_API colibri_status colibri_file_open(colibri_file **out, const char *path, const colibri_file_options *opts,
                                 colibri_file_diag *diag);

/* Unmaps and closes (after colibri_free of every context over it). NULL is a no-op. */
COLIBRI_API void colibri_file_close(colibri_file *f);

/* The mapped image and its length (image_size), for colibri_init_ex. */
COLIBRI_API const void *colibri_file_data(const colibri_file *f);
COLIBRI_API size_t colibri_file_size(const colibri_file *f);

/* Read-ahead requests for the missing pages of these experts of MoE layer `layer` (ids
 * as colibri_expert_id), verifying each one's payload CRCs on first use
 * (COLIBRI_VERIFY_ON_USE). NO_SUCH_EXPERT for an id out of range,
 * BAD_PAYLOAD_CRC for a corrupted expert. */
COLIBRI_API colibri_status colibri_file_will_need(colibri_file *f, uint32_t layer, const uint32_t *experts, size_t n);

/* The engine's on_route callback (colibri_exec, include/colibri.h): with
 *   exec.on_route = colibri_file_on_route; exec.on_route_user = file;
 * colibri_forward_ex and colibri_lm_forward_ex advise (and verify on first
 * use) the routed experts the batch selected and the layer's shared experts
 * before they run, then advise the stages ahead (colibri_file_set_ahead),
 * so a corrupted expert stops the forward pass with BAD_PAYLOAD_CRC,
 * and a file whose size changed under the mapping with FILE_CHANGED
 * (colibri_file_check, before each MoE layer's experts touch their pages). */
COLIBRI_API colibri_status colibri_file_on_route(void *file, const colibri_route *route);

/* Advice ahead (on by default, 1 stage): after colibri_file_on_route has advised (and verified on first
 * use) the experts of MoE layer L, it advises with MADV_WILLNEED what the next `stages` stages read that
 * is known before their routing: stage L + 1 is the layers after MoE layer L up to MoE layer L + 1's
 * router (attention, norms, dense layers) and that layer's shared experts; the stage after the last MoE
 * layer is the rest of the program (final norm, the head), and the stage after it the next token's first
 * one (an EMBED table excepted: a token reads one row). 0 turns it off. The pages are read in while
 * layer L's experts compute; docs/linux-edge.md gives what it measured. */
COLIBRI_API colibri_status colibri_file_set_ahead(colibri_file *f, uint32_t stages);

/* The advice so far: colibri_file_will_need's ranges (one a selected expert, on_route's included) and
 * the advice ahead's (one a merged page range of a stage), counted as asked; *_advised the bytes of
 * those that were requested from the kernel (only the pages mincore says are not resident: asking for
 * resident pages costs a page walk and brings nothing); requests the POSIX_FADV_WILLNEED calls made
 * for them (and for the open's and mlock's ranges), each of at most request_bytes. For tests and
 * benches. */
typedef struct colibri_file_advice {
    uint64_t route_calls, route_bytes; /* experts routing selected */
    uint64_t ahead_calls, ahead_bytes; /* ranges of the stages ahead */
    uint64_t route_advised, ahead_advised; /* bytes requested (not resident when asked) */
    uint64_t requests;      /* read-ahead requests made */
    uint64_t request_bytes; /* the most one request asks for (colibri_file_set_request_bytes) */
} colibri_file_advice;
COLIBRI_API colibri_status colibri_file_advice_counts(const colibri_file *f, colibri_file_advice *out);

/* The size of one read-ahead request, a whole number of pages. Linux reads at most the larger of the
 * device's read_ahead_kb and max_sectors_kb of one request and ignores the rest of it, so a range is
 * asked for in pieces of that size; open reads it from sysfs (128 KiB where it cannot). Smaller pieces
 * cost more calls and read the same pages. UNSUPPORTED for 0 or a size that is not whole pages. */
COLIBRI_API colibri_status colibri_file_set_request_bytes(colibri_file *f, size_t bytes);

/* The merged page ranges of stage `stage` (0 .. colibri_file_moe_layers(f)) that the advice ahead
 * covers: *count ranges; the first capacity / 2 written as (start, end) byte offsets into ranges. */
COLIBRI_API colibri_status colibri_file_ahead_ranges(const colibri_file *f, uint32_t stage, size_t *count,
                                                     uint64_t *ranges, size_t capacity);

/* Verifies one expert's payload CRCs now (a no-op once verified). */
COLIBRI_API colibri_status colibri_file_verify_expert(colibri_file *f, uint32_t layer, uint32_t expert);

/* Verifies every payload now (colibri_validate: reads the whole file). */
COLIBRI_API colibri_status colibri_file_verify(colibri_file *f);

/* Byte range [*offset, *offset + *size) of an expert's payloads in the image. */
COLIBRI_API colibri_status colibri_file_expert_range(const colibri_file *f, uint32_t layer, uint32_t expert,
                                         size_t *offset, size_t *size);

/* MoE layers of the program, and slots (routed + shared) of one of them (0 if none). */
COLIBRI_API uint32_t colibri_file_moe_layers(const colibri_file *f);
COLIBRI_API uint32_t colibri_file_layer_experts(const colibri_file *f, uint32_t layer);

/* COLIBRI_OK while the file still has the size that was mapped, FILE_CHANGED
 * once it was truncated or extended in place (the mapping's pages past a new
 * end would SIGBUS: stop using the model, reopen). Call it before a forward
 * pass, as the Python binding does; a truncation racing a running forward
 * pass cannot be caught, hence the rename procedure above. */
COLIBRI_API colibri_status colibri_file_check(const colibri_file *f);

/* 1 if `path` (the name it was opened by) now names another file or none
 * (replaced by rename, deleted): a reopen maps the new model. 0 if it is
 * still the mapped file. */
COLIBRI_API int colibri_file_replaced(const colibri_file *f);

/* Bytes of the mapping resident in memory now (mincore), or -1. */
COLIBRI_API long long colibri_file_resident(const colibri_file *f);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_FILE_H */
