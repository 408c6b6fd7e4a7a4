/*
 * Encoding text to token ids from the tokenizer section (docs/lm.md
 * "Encoding"), read in place: colibri_tokenizer.h.
 *
 * Each kind follows the library the host encodes with, step for step, so
 * the ids agree with it: byte-level BPE as `tokenizers` (added tokens split
 * out leftmost-longest, special ones first; the pre-tokenizer's regular
 * expression; merges by rank, the leftmost of equal ranks first), and
 * SentencePiece as `sentencepiece` (its identity normaliser; BPE merging the
 * best-scored pair, the leftmost of equal scores first; unigram's Viterbi
 * with its scores' float and double arithmetic; byte fallback). Pieces are
 * found by binary search in the section's token index (section version 2).
 * The section was validated at open, so every offset read here is inside it.
 */
#include "colibri_tokenizer.h"

#include "colibri_internal.h"

#if defined(COLIBRI_NO_TOKENIZER) || defined(COLIBRI_NO_TOKENIZER_ENCODE)

colibri_status colibri_tokenizer_encode(const colibri_tokenizer *tok, const uint8_t *text, size_t text_len,
                                        int32_t *ids, size_t ids_cap, size_t *n_ids, void *work, size_t work_bytes)
{
    (void)tok, (void)text, (void)text_len, (void)ids, (void)ids_cap, (void)n_ids, (void)work, (void)work_bytes;
#ifdef COLIBRI_NO_TOKENIZER
    return COLIBRI_E_NO_TOKENIZER;
#else
    return COLIBRI_E_UNSUPPORTED;
#endif
}

#else

#include <float.h>

#include "colibri_unicode_classes.h"

/* Section header fields (docs/lm.md "Tokenizer section"). */
enum {
    AT_MERGE_COUNT = 12,
    AT_OFFSETS = 36,
    AT_BYTES = 40,
    AT_TYPES = 48,
    AT_SCORES = 52,
    AT_MERGES = 56,
    AT_ORDER = 60,
    AT_BYTE_IDS = 64,
    AT_PATTERN = 68,
    AT_PATTERN_SIZE = 72,
    AT_INDEX = 76,
};

enum { OTHER = 0, LETTER = 1, NUMBER = 2, SPACE = 3, NFC_MAY_CHANGE = 4 };
enum { SPLIT_GPT2 = 1, SPLIT_QWEN2, SPLIT_LLAMA3 };

#define TYPE_BIT(t) (1u << (t))
#define MODEL_PIECES (TYPE_BIT(COLIBRI_TOKEN_NORMAL) | TYPE_BIT(COLIBRI_TOKEN_USER_DEFINED))
#define SP_PIECES (MODEL_PIECES | TYPE_BIT(COLIBRI_TOKEN_UNUSED)) /* sentencepiece's pieces_ */
#define SP_RESERVED (TYPE_BIT(COLIBRI_TOKEN_CONTROL) | TYPE_BIT(COLIBRI_TOKEN_UNKNOWN))
#define BPE_VOCAB (TYPE_BIT(COLIBRI_TOKEN_NORMAL) | TYPE_BIT(COLIBRI_TOKEN_UNKNOWN))

static const uint8_t space_symbol[] = {0xE2, 0x96, 0x81}; /* U+2581, SentencePiece's space */

typedef struct encoder {
    const colibri_tokenizer *tok;
    const uint8_t *p, *offsets, *blob, *types, *index;
    int32_t *ids;
    size_t cap, n; /* n counts every id; those past cap are not written */
    uint8_t *work, *work_end;
    int split;
} encoder;

static void emit(encoder *e, uint32_t id)
{
    if (e->n < e->cap)
        e->ids[e->n] = (int32_t)id;
    e->n++;
}

static const uint8_t *token(const encoder *e, uint32_t id, uint32_t *len)
{
    const uint32_t at = colibri_rd_u32(e->offsets + 4u * (size_t)id);
    *len = colibri_rd_u32(e->offsets + 4u * (size_t)id + 4u) - at;
    return e->blob + at;
}

/* Carves `bytes` (4-aligned) from the work buffer, NULL once it is spent. */
static void *take(encoder *e, size_t bytes)
{
    uint8_t *at = e->work + ((4u - ((uintptr_t)e->work & 3u)) & 3u);
    if (at > e->work_end || bytes > (size_t)(e->work_end - at))
        return NULL;
    e->work = at + bytes;
    return at;
}

/* The first index position whose token is not below key[0..len). */
static uint32_t lower_bound(const encoder *e, const uint8_t *key, uint32_t len)
{
    uint32_t lo = 0, hi = e->tok->vocab;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2u, id = colibri_rd_u32(e->index + 4u * (size_t)mid);
        uint32_t n;
        const uint8_t *t = token(e, id, &n);
        if (colibri_bytes_compare(t, n, key, len) < 0)
            lo = mid + 1u;
        else
            hi = mid;
    }
    return lo;
}

/* Prefix search: the lowest id whose bytes are key[0..len) and whose type is
 * in `types` (NONE if none), and in *more whether any token at all has
 * key[0..len) as a prefix (a longer key can then still match). */
static uint32_t find(const encoder *e, const uint8_t *key, uint32_t len, uint32_t types, int *more)
{
    uint32_t i = lower_bound(e, key, len);
    if (more != NULL)
        *more = 0;
    for (; i < e->tok->vocab; i++) {
        const uint32_t id = colibri_rd_u32(e->index + 4u * (size_t)i);
        uint32_t n;
        const uint8_t *t = token(e, id, &n);
        if (n < len || colibri_bytes_compare(t, len, key, len) != 0)
            break;
        if (more != NULL)
            *more = 1;
        if (n != len)
            break;
        if (types & TYPE_BIT(e->types[id]))
            return id;
    }
    return COLIBRI_NONE;
}

/* The longest token of a type in `types` that s[0..n) starts with: its
 * length (0 if none) and *id. */
static uint32_t longest_prefix(const encoder *e, const uint8_t *s, size_t n, uint32_t types, uint32_t *id)
{
    uint32_t best = 0;
    int more = 1;
    for (uint32_t len = 1; len <= n && more; len++) {
        const uint32_t t = find(e, s, len, types, &more);
        if (t != COLIBRI_NONE) {
            best = len;
            *id = t;
        }
    }
    return best;
}

/* ---- UTF-8 and character classes ---- */

/* The code point at s (well-formed, checked before) and its length. */
static uint32_t decode_char(const uint8_t *s, uint32_t *len)
{
    const uint8_t b = s[0];
    if (b < 0x80u) {
        *len = 1;
        return b;
    }
    if (b < 0xE0u) {
        *len = 2;
        return (uint32_t)(b & 0x1Fu) << 6 | (s[1] & 0x3Fu);
    }
    if (b < 0xF0u) {
        *len = 3;
        return (uint32_t)(b & 0x0Fu) << 12 | (uint32_t)(s[1] & 0x3Fu) << 6 | (s[2] & 0x3Fu);
    }
    *len = 4;
    return (uint32_t)(b & 0x07u) << 18 | (uint32_t)(s[1] & 0x3Fu) << 12 | (uint32_t)(s[2] & 0x3Fu) << 6 |
           (s[3] & 0x3Fu);
}

static uint32_t run_at(uint32_t i)
{
    const uint8_t *r = colibri_unicode_runs + 3u * i;
    return (uint32_t)r[0] | (uint32_t)r[1] << 8 | (uint32_t)r[2] << 16;
}

/* The class bits of code point c (colibri_unicode_classes.h). */
static uint32_t char_class(uint32_t c)
{
    uint32_t lo = 0, hi = COLIBRI_UNICODE_RUNS; /* the last run starting at or before c */
    while (hi - lo > 1u) {
        const uint32_t mid = lo + (hi - lo) / 2u;
        if ((run_at(mid) >> 3) <= c)
            lo = mid;
        else
            hi = mid;
    }
    return run_at(lo) & 7u;
}

/* The class of the character at s[i] (i < n) and its length. */
static uint32_t class_at(const uint8_t *s, size_t i, uint32_t *len)
{
    return char_class(decode_char(s + i, len)) & 3u;
}

/* ---- Byte-level BPE (tokenizers' BPE model over the ByteLevel alphabet) ---- */

/* The rank (merge index) of the pair (left, right) and its result, or NONE. */
static uint32_t merge_rank(const encoder *e, uint32_t left, uint32_t right, uint32_t *result)
{
    const uint8_t *merges = e->p + colibri_rd_u32(e->p + AT_MERGES), *order = e->p + colibri_rd_u32(e->p + AT_ORDER);
    uint32_t lo = 0, hi = colibri_rd_u32(e->p + AT_MERGE_COUNT);
    const uint64_t key = (uint64_t)left << 32 | right;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2u, rank = colibri_rd_u32(order + 4u * (size_t)mid);
        const uint8_t *rec = merges + 12u * (size_t)rank;
        const uint64_t k = (uint64_t)colibri_rd_u32(rec) << 32 | colibri_rd_u32(rec + 4);
        if (k == key) {
            *result = colibri_rd_u32(rec + 8);
            return rank;
        }
        if (k < key)
            lo = mid + 1u;
        else
            hi = mid;
    }
    return COLIBRI_NONE;
}

/* One pre-tokenized word: its bytes (a space first if `space`) to ids. */
static colibri_status bpe_word(encoder *e, int space, const uint8_t *s, size_t n)
{
    const size_t len = n + (space ? 1u : 0u);
    if (len == 0)
        return COLIBRI_OK;
    uint8_t *mark = e->work;
    uint32_t *sym = take(e, 4u * len), *rank = take(e, 4u * len), *result = take(e, 4u * len);
    if (sym == NULL || rank == NULL || result == NULL)
        return COLIBRI_E_ARENA_TOO_SMALL;
    const uint8_t *byte_ids = e->p + colibri_rd_u32(e->p + AT_BYTE_IDS);
    for (size_t i = 0; i < len; i++) {
        const uint8_t b = space ? (i == 0 ? 0x20u : s[i - 1u]) : s[i];
        sym[i] = colibri_rd_u32(byte_ids + 4u * b);
    }
    if (e->tok->flags & COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES) { /* a word in the vocabulary is not merged */
        uint8_t *word = take(e, len);
        if (word == NULL)
            return COLIBRI_E_ARENA_TOO_SMALL;
        for (size_t i = 0; i < len; i++)
            word[i] = space ? (i == 0 ? 0x20u : s[i - 1u]) : s[i];
        const uint32_t id = find(e, word, (uint32_t)len, BPE_VOCAB, NULL);
        if (id != COLIBRI_NONE) {
            emit(e, id);
            e->work = mark;
            return COLIBRI_OK;
        }
    }
    size_t count = len;
    for (size_t i = 0; i + 1u < count; i++)
        rank[i] = merge_rank(e, sym[i], sym[i + 1u], &result[i]);
    for (;;) {
        size_t best = count;
        for (size_t i = 0; i + 1u < count; i++)
            if (rank[i] != COLIBRI_NONE && (best == count || rank[i] < rank[best]))
                best = i;
        if (best == count)
            break;
        sym[best] = result[best];
        for (size_t i = best + 1u; i + 1u < count; i++) {
            sym[i] = sym[i + 1u];
            rank[i] = rank[i + 1u];
            result[i] = result[i + 1u];
        }
        count--;
        if (best > 0)
            rank[best - 1u] = merge_rank(e, sym[best - 1u], sym[best], &result[best - 1u]);
        if (best + 1u < count)
            rank[best] = merge_rank(e, sym[best], sym[best + 1u], &result[best]);
    }
    for (size_t i = 0; i < count; i++)
        emit(e, sym[i]);
    e->work = mark;
    return COLIBRI_OK;
}

/* Length of the run of characters of class `cls` at s[i..n). */
static size_t class_run(const uint8_t *s, size_t i, size_t n, uint32_t cls)
{
    size_t at = i;
    while (at < n) {
        uint32_t len;
        if (class_at(s, at, &len) != cls)
            break;
        at += len;
    }
    return at - i;
}

static int is_newline(uint8_t b)
{
    return b == '\r' || b == '\n';
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) (case-sensitive for GPT-2): the match's bytes at s[i] or 0. */
static size_t contraction(const uint8_t *s, size_t i, size_t n, int fold)
{
    if (s[i] != '\'' || i + 1u >= n)
        return 0;
    uint8_t c[2] = {s[i + 1u], i + 2u < n ? s[i + 2u] : 0u};
    if (fold) {
        c[0] |= (uint8_t)(c[0] >= 'A' && c[0] <= 'Z' ? 0x20u : 0u);
        c[1] |= (uint8_t)(c[1] >= 'A' && c[1] <= 'Z' ? 0x20u : 0u);
        if (s[i + 1u] == 0xC5u && i + 2u < n && s[i + 2u] == 0xBFu) /* U+017F LONG S folds to s */
            return 3;
    }
    if (c[0] == 's' || c[0] == 't' || c[0] == 'm' || c[0] == 'd')
        return 2;
    if ((c[0] == 'r' && c[1] == 'e') || (c[0] == 'v' && c[1] == 'e') || (c[0] == 'l' && c[1] == 'l'))
        return 3;
    return 0;
}

/* \s+(?!\S) then \s+, at a whitespace character s[i]: the run, less its
 * last character when a non-space follows a run of two or more. */
static size_t space_run(const uint8_t *s, size_t i, size_t n)
{
    size_t at = i, last = i;
    while (at < n) {
        uint32_t len;
        if (class_at(s, at, &len) != SPACE)
            break;
        last = at;
        at += len;
    }
    return at == n || last == i ? at - i : last - i;
}

/* The length of the pre-token at s[i] (i < n) under e->split. */
static size_t next_piece(const encoder *e, const uint8_t *s, size_t i, size_t n)
{
    uint32_t len, next_len = 0;
    const uint32_t cls = class_at(s, i, &len);
    const uint32_t next = i + len < n ? class_at(s, i + len, &next_len) : OTHER;
    const int has_next = i + len < n;
    size_t m = contraction(s, i, n, e->split != SPLIT_GPT2);
    if (m != 0)
        return m;
    if (e->split == SPLIT_GPT2) {
        const size_t lead = s[i] == ' ' && has_next && next != SPACE ? 1u : 0u; /* ' ?' */
        const uint32_t body = lead ? next : cls;
        if (body != SPACE)
            return lead + class_run(s, i + lead, n, body);
        return space_run(s, i, n);
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (cls == LETTER)
        return class_run(s, i, n, LETTER);
    if (cls != NUMBER && !is_newline(s[i]) && has_next && next == LETTER)
        return len + class_run(s, i + len, n, LETTER);
    if (cls == NUMBER) { /* \p{N} or \p{N}{1,3} */
        size_t at = i + len;
        for (int k = 1; k < (e->split == SPLIT_LLAMA3 ? 3 : 1) && at < n; k++) {
            uint32_t l;
            if (class_at(s, at, &l) != NUMBER)
                break;
            at += l;
        }
        return at - i;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    const size_t lead = s[i] == ' ' && has_next && next == OTHER ? 1u : 0u;
    if (lead || cls == OTHER) {
        size_t at = i + lead;
        at += class_run(s, at, n, OTHER);
        while (at < n && is_newline(s[at]))
            at++;
        return at - i;
    }
    /* \s*[\r\n]+: whitespace through its last newline */
    size_t at = i, through = 0;
    while (at < n) {
        uint32_t l;
        if (class_at(s, at, &l) != SPACE)
            break;
        if (is_newline(s[at]))
            through = at + 1u - i;
        at += l;
    }
    return through != 0 ? through : space_run(s, i, n);
}

/* Text between added tokens: the normaliser's check, the pre-tokenizer, the model. */
static colibri_status bpe_segment(encoder *e, const uint8_t *s, size_t n)
{
    if (n == 0)
        return COLIBRI_OK;
    const int prefix = (e->tok->flags & COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE) != 0;
    const uint8_t *text = s;
    size_t len = n;
    uint8_t *mark = e->work;
    if (e->split == SPLIT_GPT2 && prefix && s[0] != ' ') { /* ByteLevel: a space before the segment, then its split */
        uint8_t *copy = take(e, n + 1u);
        if (copy == NULL)
            return COLIBRI_E_ARENA_TOO_SMALL;
        copy[0] = ' ';
        for (size_t i = 0; i < n; i++)
            copy[i + 1u] = s[i];
        text = copy;
        len = n + 1u;
    }
    colibri_status st = COLIBRI_OK;
    for (size_t i = 0; i < len && st == COLIBRI_OK;) {
        const size_t m = next_piece(e, text, i, len);
        /* Split then ByteLevel(use_regex=False): each piece gets its own space */
        st = bpe_word(e, e->split != SPLIT_GPT2 && prefix && text[i] != ' ', text + i, m);
        i += m;
    }
    e->work = mark;
    return st;
}

/* Leftmost-longest added tokens of `types` split s[0..n): each is its id, the
 * text between goes to `between` (special tokens are found first, on the
 * raw text; the others in what lies between them). */
static colibri_status split_added(encoder *e, const uint8_t *s, size_t n, uint32_t types,
                                  colibri_status (*between)(encoder *, const uint8_t *, size_t))
{
    size_t start = 0;
    for (size_t i = 0; i < n;) {
        uint32_t id = COLIBRI_NONE;
        const uint32_t m = longest_prefix(e, s + i, n - i, types, &id);
        if (m == 0) {
            i++;
            continue;
        }
        colibri_status st = between(e, s + start, i - start);
        if (st != COLIBRI_OK)
            return st;
        emit(e, id);
        i += m;
        start = i;
    }
    return between(e, s + start, n - start);
}

/* Text between special tokens: normalised (NFC: only checked to be its own
 * NFC), then split by the other added tokens. */
static colibri_status bpe_normalized(encoder *e, const uint8_t *s, size_t n)
{
    if (e->p[32] == COLIBRI_NORMALIZER_NFC)
        for (size_t i = 0; i < n;) {
            uint32_t len;
            if (char_class(decode_char(s + i, &len)) & NFC_MAY_CHANGE)
                return COLIBRI_E_TEXT_NOT_NORMALIZED;
            i += len;
        }
    return split_added(e, s, n, TYPE_BIT(COLIBRI_TOKEN_USER_DEFINED), bpe_segment);
}

/* ---- SentencePiece ---- */

/* sentencepiece's identity normaliser with add_dummy_prefix and
 * remove_extra_whitespaces, spaces kept as 0x20 (the section's U+2581):
 * a text space and a text U+2581 both become one, only the first collapses. */
static size_t sp_normalize(const encoder *e, const uint8_t *s, size_t n, uint8_t *out)
{
    const int squeeze = (e->tok->flags & COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES) != 0;
    size_t i = 0, m = 0;
    if (squeeze)
        while (i < n && s[i] == ' ')
            i++;
    if (i == n)
        return 0;
    if (e->tok->flags & COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX)
        out[m++] = ' ';
    int prev_space = squeeze;
    while (i < n) {
        uint32_t len;
        decode_char(s + i, &len);
        if (s[i] == ' ') {
            if (!prev_space)
                out[m++] = ' ';
            prev_space = squeeze;
        } else if (len == 3 && s[i] == space_symbol[0] && s[i + 1] == space_symbol[1] && s[i + 2] == space_symbol[2]) {
            out[m++] = ' ';
            prev_space = 0;
        } else {
            for (uint32_t k = 0; k < len; k++)
                out[m++] = s[i + k];
            prev_space = 0;
        }
        i += len;
    }
    if (squeeze)
        while (m > 0 && out[m - 1u] == ' ')
            m--;
    return m;
}

/* A final piece: its id, or its bytes (byte fallback), or unknown (a run of
 * unknowns is one, without byte fallback). */
static colibri_status sp_emit(encoder *e, const uint8_t *piece, uint32_t len, uint32_t id, int *prev_unknown)
{
    const int unknown = id == COLIBRI_NONE || e->types[id] == COLIBRI_TOKEN_UNKNOWN;
    if (!unknown) {
        if (e->types[id] == COLIBRI_TOKEN_UNUSED) /* sentencepiece resegments it: refused when built */
            return COLIBRI_E_UNSUPPORTED;
        emit(e, id);
    } else if (e->tok->flags & COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK) {
        const uint8_t *byte_ids = e->p + colibri_rd_u32(e->p + AT_BYTE_IDS);
        for (uint32_t i = 0; i < len; i++)
            if (piece[i] == ' ')
                for (uint32_t k = 0; k < sizeof space_symbol; k++)
                    emit(e, colibri_rd_u32(byte_ids + 4u * space_symbol[k]));
            else
                emit(e, colibri_rd_u32(byte_ids + 4u * piece[i]));
    } else if (!*prev_unknown) {
        if (e->tok->unk < 0)
            return COLIBRI_E_UNSUPPORTED;
        emit(e, (uint32_t)e->tok->unk);
    }
    *prev_unknown = unknown;
    return COLIBRI_OK;
}

/* sentencepiece's PieceToId: control and unknown pieces first, then the others. */
static uint32_t sp_piece_id(const encoder *e, const uint8_t *s, uint32_t len)
{
    const uint32_t id = find(e, s, len, SP_RESERVED, NULL);
    return id != COLIBRI_NONE ? id : find(e, s, len, SP_PIECES, NULL);
}

#define FROZEN 0x80000000u /* a user-defined symbol: never merged */

/* The score of merging symbols i and i+1 into score[i], has[i] whether they merge. */
static void pair_score(const encoder *e, const uint8_t *norm, const uint32_t *start, const uint32_t *len, size_t i,
                       float *score, uint8_t *has)
{
    has[i] = 0;
    if ((len[i] | len[i + 1u]) & FROZEN)
        return;
    const uint32_t id = find(e, norm + start[i], len[i] + len[i + 1u], SP_PIECES, NULL);
    if (id == COLIBRI_NONE)
        return;
    has[i] = 1;
    score[i] = colibri_rd_f32(e->p + colibri_rd_u32(e->p + AT_SCORES) + 4u * (size_t)id);
}

static colibri_status sp_bpe(encoder *e, const uint8_t *norm, size_t m)
{
    uint32_t *start = take(e, 4u * m), *len = take(e, 4u * m);
    float *score = take(e, 4u * m);
    uint8_t *has = take(e, m);
    if (start == NULL || len == NULL || score == NULL || has == NULL)
        return COLIBRI_E_ARENA_TOO_SMALL;
    size_t count = 0;
    for (size_t i = 0; i < m; count++) {
        uint32_t id, l = longest_prefix(e, norm + i, m - i, TYPE_BIT(COLIBRI_TOKEN_USER_DEFINED), &id);
        start[count] = (uint32_t)i;
        if (l != 0)
            len[count] = l | FROZEN;
        else {
            decode_char(norm + i, &l);
            len[count] = l;
        }
        i += l;
    }
    for (size_t i = 0; i + 1u < count; i++)
        pair_score(e, norm, start, len, i, score, has);
    for (;;) {
        size_t best = count;
        for (size_t i = 0; i + 1u < count; i++)
            if (has[i] && (best == count || score[i] > score[best]))
                best = i;
        if (best == count)
            break;
        len[best] += len[best + 1u];
        for (size_t i = best + 1u; i + 1u < count; i++) {
            start[i] = start[i + 1u];
            len[i] = len[i + 1u];
            score[i] = score[i + 1u];
            has[i] = has[i + 1u];
        }
        count--;
        if (best > 0)
            pair_score(e, norm, start, len, best - 1u, score, has);
        if (best + 1u < count)
            pair_score(e, norm, start, len, best, score, has);
    }
    int prev_unknown = 0;
    for (size_t i = 0; i < count; i++) {
        const uint32_t l = len[i] & ~FROZEN;
        uint32_t id = sp_piece_id(e, norm + start[i], l);
        colibri_status st = sp_emit(e, norm + start[i], l, id, &prev_unknown);
        if (st != COLIBRI_OK)
            return st;
    }
    return COLIBRI_OK;
}

#define UNKNOWN_PENALTY 10.0f /* sentencepiece's kUnkPenalty */

static colibri_status sp_unigram(encoder *e, const uint8_t *norm, size_t m)
{
    /* cell[k].best: the best path's score ending at byte k, from[k] its last
     * piece's start (NONE: no path yet), piece[k] that piece's id */
    union cell {
        float best;    /* during the search */
        uint32_t next; /* then: where the best path's piece starting here ends */
    } *cell = take(e, sizeof(union cell) * (m + 1u));
    uint32_t *from = take(e, 4u * (m + 1u)), *piece = take(e, 4u * (m + 1u));
    if (cell == NULL || from == NULL || piece == NULL)
        return COLIBRI_E_ARENA_TOO_SMALL;
    const uint8_t *scores = e->p + colibri_rd_u32(e->p + AT_SCORES);
    float min_score = FLT_MAX, max_score = FLT_MIN; /* sentencepiece's starting values */
    for (uint32_t i = 0; i < e->tok->vocab; i++)
        if (e->types[i] == COLIBRI_TOKEN_NORMAL) {
            const float s = colibri_rd_f32(scores + 4u * (size_t)i);
            min_score = s < min_score ? s : min_score;
            max_score = s > max_score ? s : max_score;
        }
    const float unknown_score = min_score - UNKNOWN_PENALTY;
    for (size_t k = 0; k <= m; k++) {
        cell[k].best = 0.0f;
        from[k] = COLIBRI_NONE;
    }
    for (size_t at = 0; at < m;) {
        uint32_t char_len;
        decode_char(norm + at, &char_len);
        const float here = cell[at].best;
        int single = 0, more = 1;
        for (uint32_t len = 1; at + len <= m && more; len++) {
            const uint32_t id = find(e, norm + at, len, MODEL_PIECES, &more);
            if (id == COLIBRI_NONE)
                continue;
            /* as sentencepiece computes it: a double score, the sum in double */
            const double score = e->types[id] == COLIBRI_TOKEN_USER_DEFINED
                                     ? (double)((float)len * max_score) - 0.1
                                     : (double)colibri_rd_f32(scores + 4u * (size_t)id);
            const double candidate = score + (double)here;
            if (from[at + len] == COLIBRI_NONE || candidate > (double)cell[at + len].best) {
                cell[at + len].best = (float)candidate;
                from[at + len] = (uint32_t)at;
                piece[at + len] = id;
            }
            if (len == char_len)
                single = 1;
        }
        if (!single) {
            const float candidate = unknown_score + here;
            if (from[at + char_len] == COLIBRI_NONE || candidate > cell[at + char_len].best) {
                cell[at + char_len].best = candidate;
                from[at + char_len] = (uint32_t)at;
                piece[at + char_len] = COLIBRI_NONE;
            }
        }
        at += char_len;
    }
    for (size_t k = m; k > 0;) { /* the path backwards, linked forwards */
        const uint32_t s = from[k];
        cell[s].next = (uint32_t)k;
        k = s;
    }
    int prev_unknown = 0;
    for (size_t k = 0; k < m;) {
        const uint32_t end = cell[k].next;
        colibri_status st = sp_emit(e, norm + k, end - (uint32_t)k, piece[end], &prev_unknown);
        if (st != COLIBRI_OK)
            return st;
        k = end;
    }
    return COLIBRI_OK;
}

static colibri_status sp_encode(encoder *e, const uint8_t *s, size_t n)
{
    uint8_t *norm = take(e, n + 1u);
    if (norm == NULL)
        return COLIBRI_E_ARENA_TOO_SMALL;
    const size_t m = sp_normalize(e, s, n, norm);
    if (m == 0)
        return COLIBRI_OK;
    return e->tok->kind == COLIBRI_TOKENIZER_SENTENCEPIECE_BPE ? sp_bpe(e, norm, m) : sp_unigram(e, norm, m);
}

/* ---- The entry point ---- */

static int same(const uint8_t *a, uint32_t a_len, const char *b)
{
    uint32_t i = 0;
    for (; i < a_len && b[i] != '\0'; i++)
        if (a[i] != (uint8_t)b[i])
            return 0;
    return i == a_len && b[i] == '\0';
}

/* The byte-level pre-tokenizer as one the encoder implements, 0 if none. */
static int splitter(const uint8_t *p)
{
    if (p[33] == COLIBRI_PRE_TOKENIZER_BYTE_LEVEL)
        return SPLIT_GPT2;
    const uint8_t *pattern = p + colibri_rd_u32(p + AT_PATTERN);
    const uint32_t size = colibri_rd_u32(p + AT_PATTERN_SIZE);
    if (same(pattern, size, COLIBRI_SPLIT_PATTERN_QWEN2))
        return SPLIT_QWEN2;
    if (same(pattern, size, COLIBRI_SPLIT_PATTERN_LLAMA3))
        return SPLIT_LLAMA3;
    return 0;
}

colibri_status colibri_tokenizer_encode(const colibri_tokenizer *tok, const uint8_t *text, size_t text_len,
                                        int32_t *ids, size_t ids_cap, size_t *n_ids, void *work, size_t work_bytes)
{
    if (tok == NULL || n_ids == NULL || (text == NULL && text_len != 0) || (ids == NULL && ids_cap != 0) ||
        (work == NULL && work_bytes != 0))
        return COLIBRI_E_NULL_ARG;
    *n_ids = 0;
    const uint8_t *p = tok->section;
    encoder e = {
        .tok = tok, .p = p, .ids = ids, .cap = ids_cap, .work = work, .work_end = (uint8_t *)work + work_bytes};
    if (colibri_rd_u16(p + 4) < COLIBRI_TOKENIZER_INDEX_VERSION) /* no token index: re-export the image */
        return COLIBRI_E_UNSUPPORTED;
    e.offsets = p + colibri_rd_u32(p + AT_OFFSETS);
    e.blob = p + colibri_rd_u32(p + AT_BYTES);
    e.types = p + colibri_rd_u32(p + AT_TYPES);
    e.index = p + colibri_rd_u32(p + AT_INDEX);
    if (tok->kind == COLIBRI_TOKENIZER_BYTE_BPE && (e.split = splitter(p)) == 0)
        return COLIBRI_E_UNSUPPORTED;
    for (size_t i = 0; i < text_len;) {
        const uint32_t len = colibri_utf8_sequence(text + i, text_len - i);
        if (len == 0)
            return COLIBRI_E_BAD_TEXT;
        i += len;
    }
    if (text_len == 0)
        return COLIBRI_OK;
    if (work_bytes < COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(text_len))
        return COLIBRI_E_ARENA_TOO_SMALL;
    colibri_status st = tok->kind == COLIBRI_TOKENIZER_BYTE_BPE
                            ? split_added(&e, text, text_len, TYPE_BIT(COLIBRI_TOKEN_CONTROL), bpe_normalized)
                            : sp_encode(&e, text, text_len);
    if (st != COLIBRI_OK)
        return st;
    *n_ids = e.n;
    return e.n > ids_cap ? COLIBRI_E_BUFFER_SIZE : COLIBRI_OK;
}

#endif /* COLIBRI_NO_TOKENIZER */
