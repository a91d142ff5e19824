/*
 * traintrace._scan: reads a job's JSON-lines files into the columns of the command's `raw` table
 * (optional; DuckDB's read_json in cli/_engine.py is the reference and is always there).
 *
 * A Scanner splits the files into chunks of whole lines and parses them on worker threads into
 * Arrow record batches, handed to DuckDB through the Arrow C stream interface (__arrow_c_stream__):
 * no Arrow library is involved. Every line is validated as JSON, but only the fields the analyses
 * read are converted (the others are skipped by a validator that builds nothing).
 *
 * A line is converted here only when its meaning is certain: a strict RFC 8259 object whose
 * tracked fields hold a string, an integer that fits 64 bits, null, or (attrs) an object, with no
 * tracked key twice and no escape in a key. Any other line (cut short, not JSON, a float duration,
 * a number where a string belongs, invalid UTF-8, a lone surrogate, ...) is *deferred*: kept,
 * byte for byte, for DuckDB's own reader, so that whatever DuckDB makes of it is the answer. Lines
 * without a kind are dropped (the command keeps `kind IS NOT NULL` only).
 *
 * Input is never trusted: every read is bounded by a '\n' sentinel at the end of each line; nested
 * values are skipped with an explicit stack, never recursion.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _WIN32
#define SCAN_THREADS 0
#else
#define SCAN_THREADS 1
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

/* ------------------------------------------------------------------ the Arrow C data interface (its ABI) */

#define ARROW_FLAG_NULLABLE 2

struct ArrowSchema {
    const char *format;
    const char *name;
    const char *metadata;
    int64_t flags;
    int64_t n_children;
    struct ArrowSchema **children;
    struct ArrowSchema *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};

struct ArrowArray {
    int64_t length;
    int64_t null_count;
    int64_t offset;
    int64_t n_buffers;
    int64_t n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

struct ArrowArrayStream {
    int (*get_schema)(struct ArrowArrayStream *, struct ArrowSchema *out);
    int (*get_next)(struct ArrowArrayStream *, struct ArrowArray *out);
    const char *(*get_last_error)(struct ArrowArrayStream *);
    void (*release)(struct ArrowArrayStream *);
    void *private_data;
};

/* ------------------------------------------------------------------ configuration */

#define MAX_FIELDS 48
#define MAX_DEPTH 1024
/* A line longer than this is deferred to DuckDB (its own maximum_object_size decides). */
#define MAX_LINE (64 * 1024 * 1024)
/* The longest key compared with an expected one (scan_string and a lookup find longer ones). */
#define EXPECT_MAX 40
/* Bytes after the sentinel of the last line, so that eight-byte reads from inside a line stay in the buffer, and
 * so does the comparison of an expected key (its closing quote, its bytes a word at a time) from a line cut short. */
#define PAD (EXPECT_MAX + 24)

enum { T_STR, T_INT, T_JSON, T_RARE_STR, T_RARE_INT };
enum { COL_DICT, COL_I64, COL_UTF8 };

typedef struct {
    char *name;
    size_t len;
    int type;
    int column;  /* output column of a core field (after `file`), -1 for a rare one */
    int literal; /* the name is written as is in JSON (no quote, backslash, control or non-ASCII byte) */
} Field;

typedef struct {
    int32_t file;
    int64_t offset, end; /* lines that start in [offset, end) */
} Chunk;

/* A batch ready for the consumer: one Arrow struct array and everything it owns. */
typedef struct Batch Batch;

typedef struct {
    atomic_int refs;
    /* what to read */
    int nfiles;
    char **paths;
    int64_t *sizes;
    int nchunks;
    Chunk *chunks;
    /* what to make of it */
    int nfields;
    Field fields[MAX_FIELDS];
    int ncore;        /* core fields, output columns 1..ncore */
    int core[MAX_FIELDS], nrare, rare[MAX_FIELDS];
    int ncols;        /* file + core + step + batch_size + rare */
    int col_type[MAX_FIELDS + 4];
    char *col_name[MAX_FIELDS + 4];
    int kind_field, name_field, attrs_field;
    short slot_of[512]; /* key slot -> field index + 1 (0: none) */
    unsigned seed;
    char *span_kind, *iteration, *step_key, *batch_key;
    size_t span_kind_len, iteration_len, step_key_len, batch_key_len;
    int nrare_kinds;
    char *rare_kinds[8];
    size_t rare_kinds_len[8];
    int lean;
    /* progress, under `lock` */
    int next_chunk;     /* the next chunk a producer takes */
    int done_chunks;    /* chunks whose batch (or nothing) is produced */
    int taken;          /* batches handed to the consumer */
    Batch **ready;      /* produced, not yet handed out (a LIFO of at most max_ready) */
    int nready, max_ready;
    int cancel;
    int error;
    char message[512];
    /* results, per chunk (deferred lines, in file order once concatenated) */
    char **deferred;
    int64_t *deferred_len;
    int64_t rows, deferred_lines, bytes_read;
#if SCAN_THREADS
    pthread_mutex_t lock;
    pthread_cond_t has_batch, has_room;
    pthread_t *workers;
    int nworkers, started;
#endif
} Shared;

/* ------------------------------------------------------------------ small growable buffers */

#if (defined(__GNUC__) || defined(__clang__)) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define SCAN_LITTLE_ENDIAN 1
#else
#define SCAN_LITTLE_ENDIAN 0
#endif

/* Eight bytes at p: callers keep eight bytes readable past what they compare (buffers are padded). */
static inline uint64_t load8(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

typedef struct {
    char *data;
    size_t len, cap;
} Bytes;

static int bytes_reserve(Bytes *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) {
        if (cap > SIZE_MAX / 2) return -1;
        cap *= 2;
    }
    char *p = realloc(b->data, cap);
    if (p == NULL) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static int bytes_add(Bytes *b, const void *src, size_t n) {
    if (bytes_reserve(b, n)) return -1;
    if (n) memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

/* One output column of a batch under construction. */
typedef struct {
    int type;
    size_t len, cap;   /* rows */
    uint8_t *validity; /* bit per row */
    int64_t nulls;
    int64_t *i64;  /* COL_I64 */
    int32_t *idx;  /* COL_DICT: index into the dictionary */
    int32_t *offs; /* COL_UTF8: len + 1 offsets; COL_DICT: the dictionary's offsets */
    Bytes data;    /* COL_UTF8 text; COL_DICT: the dictionary's text */
    /* COL_DICT: the interning table (open addressing over dictionary entries) */
    int32_t *slots;
    size_t nslots, nentries;
    int32_t last;   /* the entry of the previous row */
    size_t initial; /* rows to allocate first */
} Column;

static int column_grow(Column *c) {
    size_t cap = c->cap ? c->cap * 2 : c->initial;
    uint8_t *v = realloc(c->validity, (cap + 7) / 8);
    if (v == NULL) return -1;
    memset(v + (c->cap + 7) / 8, 0, (cap + 7) / 8 - (c->cap + 7) / 8);
    c->validity = v;
    if (c->type == COL_I64) {
        int64_t *p = realloc(c->i64, cap * sizeof(int64_t));
        if (p == NULL) return -1;
        c->i64 = p;
    } else if (c->type == COL_DICT) {
        int32_t *p = realloc(c->idx, cap * sizeof(int32_t));
        if (p == NULL) return -1;
        c->idx = p;
    } else {
        int32_t *p = realloc(c->offs, (cap + 1) * sizeof(int32_t));
        if (p == NULL) return -1;
        if (c->cap == 0) p[0] = 0;
        c->offs = p;
    }
    c->cap = cap;
    return 0;
}

static inline void set_valid(Column *c, size_t row) { c->validity[row >> 3] |= (uint8_t)(1u << (row & 7)); }

#if defined(__GNUC__) || defined(__clang__)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define UNLIKELY(x) (x)
#endif

static inline int column_null(Column *c) {
    if (UNLIKELY(c->len == c->cap) && column_grow(c)) return -1;
    size_t row = c->len++;
    c->nulls++;
    if (c->type == COL_I64)
        c->i64[row] = 0;
    else if (c->type == COL_DICT)
        c->idx[row] = 0;
    else
        c->offs[row + 1] = c->offs[row];
    return 0;
}

static inline int column_i64(Column *c, int64_t value) {
    if (UNLIKELY(c->len == c->cap) && column_grow(c)) return -1;
    size_t row = c->len++;
    c->i64[row] = value;
    set_valid(c, row);
    return 0;
}

static int column_text(Column *c, const char *s, size_t n) {
    if (c->len == c->cap && column_grow(c)) return -1;
    if (c->data.len + n > INT32_MAX || bytes_add(&c->data, s, n)) return -1;
    size_t row = c->len++;
    c->offs[row + 1] = (int32_t)c->data.len;
    set_valid(c, row);
    return 0;
}

/* a == b over n bytes, for the short keys and names compared per line. Both sides must be readable eight
 * bytes past n (every buffer here is padded: lines, decoded text, dictionaries, names), so that a word at
 * a time is compared, the bytes past n masked off. */
static inline int same_bytes(const char *a, const char *b, size_t n) {
#if SCAN_LITTLE_ENDIAN
    while (n >= 8) {
        if (load8(a) != load8(b)) return 0;
        a += 8;
        b += 8;
        n -= 8;
    }
    return n == 0 || ((load8(a) ^ load8(b)) & (~0ULL >> (64 - 8 * n))) == 0;
#else
    return memcmp(a, b, n) == 0;
#endif
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ULL;
    return h;
}

/* The dictionary index of s, added if new. */
static int32_t dict_intern(Column *c, const char *s, size_t n) {
    if (c->nentries > 0) { /* most rows repeat the previous row's value */
        int32_t e = c->last;
        if ((size_t)(c->offs[e + 1] - c->offs[e]) == n && same_bytes(c->data.data + c->offs[e], s, n)) return e;
    }
    if (c->nentries * 2 >= c->nslots) {
        size_t nslots = c->nslots ? c->nslots * 2 : 64;
        if (c->nentries >= INT32_MAX / 2) return -1;
        int32_t *slots = malloc(nslots * sizeof(int32_t));
        if (slots == NULL) return -1;
        for (size_t i = 0; i < nslots; i++) slots[i] = -1;
        for (size_t e = 0; e < c->nentries; e++) {
            const char *t = c->data.data + c->offs[e];
            size_t i = hash_bytes(t, (size_t)(c->offs[e + 1] - c->offs[e])) & (nslots - 1);
            while (slots[i] >= 0) i = (i + 1) & (nslots - 1);
            slots[i] = (int32_t)e;
        }
        free(c->slots);
        c->slots = slots;
        c->nslots = nslots;
    }
    size_t i = hash_bytes(s, n) & (c->nslots - 1);
    while (c->slots[i] >= 0) {
        int32_t e = c->slots[i];
        size_t m = (size_t)(c->offs[e + 1] - c->offs[e]);
        if (m == n && same_bytes(c->data.data + c->offs[e], s, n)) return c->last = e;
        i = (i + 1) & (c->nslots - 1);
    }
    /* a new entry: offsets for entries 0..nentries (the dictionary's own offsets array) */
    if (c->data.len + n > INT32_MAX) return -1;
    int32_t *offs = realloc(c->offs, (c->nentries + 2) * sizeof(int32_t));
    if (offs == NULL) return -1;
    c->offs = offs;
    if (c->nentries == 0) c->offs[0] = 0;
    if (bytes_add(&c->data, s, n) || bytes_reserve(&c->data, PAD)) return -1; /* padded for same_bytes */
    c->offs[c->nentries + 1] = (int32_t)c->data.len;
    c->slots[i] = (int32_t)c->nentries;
    c->last = (int32_t)c->nentries;
    return (int32_t)c->nentries++;
}

static inline int column_dict(Column *c, const char *s, size_t n) {
    if (UNLIKELY(c->len == c->cap) && column_grow(c)) return -1;
    int32_t e = dict_intern(c, s, n);
    if (e < 0) return -1;
    size_t row = c->len++;
    c->idx[row] = e;
    set_valid(c, row);
    return 0;
}

static void column_free(Column *c) {
    free(c->validity);
    free(c->i64);
    free(c->idx);
    free(c->offs);
    free(c->data.data);
    free(c->slots);
    memset(c, 0, sizeof(*c));
}

/* ------------------------------------------------------------------ batches as Arrow arrays */

struct Batch {
    struct ArrowArray top;
    int ncols;
    Column cols[MAX_FIELDS + 4];
    struct ArrowArray child[MAX_FIELDS + 4];
    struct ArrowArray *child_ptr[MAX_FIELDS + 4];
    struct ArrowArray dict[MAX_FIELDS + 4];
    const void *top_buffers[1];
    const void *child_buffers[MAX_FIELDS + 4][3];
    const void *dict_buffers[MAX_FIELDS + 4][3];
    int32_t empty_offset[1];
};

static void batch_free(Batch *b) {
    if (b == NULL) return;
    for (int i = 0; i < b->ncols; i++) column_free(&b->cols[i]);
    free(b);
}

static void release_child(struct ArrowArray *a) { a->release = NULL; }

static void release_batch(struct ArrowArray *a) {
    if (a->release == NULL) return;
    Batch *b = (Batch *)a->private_data;
    a->release = NULL;
    batch_free(b);
}

/* Fill `out` (moved to the consumer) with the batch's arrays. */
static void batch_export(Batch *b, struct ArrowArray *out) {
    int64_t rows = b->ncols ? (int64_t)b->cols[0].len : 0;
    for (int i = 0; i < b->ncols; i++) {
        Column *c = &b->cols[i];
        struct ArrowArray *a = &b->child[i];
        memset(a, 0, sizeof(*a));
        a->length = rows;
        a->null_count = c->nulls;
        a->release = release_child;
        a->buffers = b->child_buffers[i];
        b->child_buffers[i][0] = c->nulls ? c->validity : NULL;
        if (c->type == COL_I64) {
            a->n_buffers = 2;
            b->child_buffers[i][1] = c->i64;
        } else if (c->type == COL_UTF8) {
            a->n_buffers = 3;
            b->child_buffers[i][1] = c->offs ? (const void *)c->offs : (const void *)b->empty_offset;
            b->child_buffers[i][2] = c->data.data ? c->data.data : "";
        } else {
            a->n_buffers = 2;
            b->child_buffers[i][1] = c->idx;
            struct ArrowArray *d = &b->dict[i];
            memset(d, 0, sizeof(*d));
            d->length = (int64_t)c->nentries;
            d->n_buffers = 3;
            d->buffers = b->dict_buffers[i];
            b->dict_buffers[i][0] = NULL;
            b->dict_buffers[i][1] = c->offs ? (const void *)c->offs : (const void *)b->empty_offset;
            b->dict_buffers[i][2] = c->data.data ? c->data.data : "";
            d->release = release_child;
            a->dictionary = d;
        }
        b->child_ptr[i] = a;
    }
    memset(out, 0, sizeof(*out));
    out->length = rows;
    out->n_buffers = 1;
    b->top_buffers[0] = NULL;
    out->buffers = b->top_buffers;
    out->n_children = b->ncols;
    out->children = b->child_ptr;
    out->release = release_batch;
    out->private_data = b;
}

/* ------------------------------------------------------------------ JSON: validating and skipping */

/* Whitespace inside a line ('\n' ends it: every line is followed by one). */
#define IS_WS(c) ((c) == ' ' || (c) == '\t' || (c) == '\r')

static inline const char *skip_ws(const char *p) {
    while ((unsigned char)*p <= ' ' && IS_WS(*p)) p++;
    return p;
}

static inline int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static inline int hex4(const char *p) {
    int a = hexval(p[0]);
    if (a < 0) return -1;
    int b = hexval(p[1]);
    if (b < 0) return -1;
    int c = hexval(p[2]);
    if (c < 0) return -1;
    int d = hexval(p[3]);
    if (d < 0) return -1;
    return (a << 12) | (b << 8) | (c << 4) | d;
}

/* Length of the valid UTF-8 sequence at p (a lead byte >= 0x80), 0 if invalid (RFC 3629). */
static inline int utf8_len(const unsigned char *p) {
    unsigned c = p[0];
    if (c >= 0xC2 && c <= 0xDF) return (p[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        unsigned d = p[1];
        if ((d & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && d < 0xA0) return 0; /* overlong */
        if (c == 0xED && d > 0x9F) return 0; /* a surrogate */
        return (p[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        unsigned d = p[1];
        if ((d & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && d < 0x90) return 0; /* overlong */
        if (c == 0xF4 && d > 0x8F) return 0; /* beyond U+10FFFF */
        return ((p[2] & 0xC0) == 0x80 && (p[3] & 0xC0) == 0x80) ? 4 : 0;
    }
    return 0;
}

/* A string starting after its opening quote: returns the closing quote, NULL if invalid.
 * *escaped is set when it holds a backslash. */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
/* Whether any of the eight bytes needs a look: a quote, a backslash, a control character or a non-ASCII byte. */
/* Of eight bytes (little-endian order), the high bit of each that needs a look: a quote, a backslash, a control
 * character or a non-ASCII byte. Exact up to its lowest set bit (bits above it may be false alarms). */
static inline uint64_t special8(uint64_t v) {
    uint64_t quote = v ^ (ONES * '"'), backslash = v ^ (ONES * '\\');
    return (((quote - ONES) & ~quote) | ((backslash - ONES) & ~backslash) | ((v - ONES * 0x20) & ~v) | v) & HIGHS;
}

static inline const char *scan_string(const char *p, int *escaped) {
    for (;;) {
#if SCAN_LITTLE_ENDIAN
        uint64_t found;
        while ((found = special8(load8(p))) == 0) p += 8;
        p += __builtin_ctzll(found) >> 3; /* the first byte that needs a look */
#endif
        unsigned char c = (unsigned char)*p;
        /* the common bytes first: printable ASCII other than the quote and the backslash */
        while (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') c = (unsigned char)*++p;
        if (c == '"') return p;
        if (c == '\\') {
            *escaped = 1;
            char e = p[1];
            if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                p += 2;
            } else if (e == 'u') {
                int u = hex4(p + 2);
                if (u < 0) return NULL;
                p += 6;
                if (u >= 0xDC00 && u <= 0xDFFF) return NULL; /* a lone low surrogate */
                if (u >= 0xD800 && u <= 0xDBFF) {            /* must be followed by its low half */
                    if (p[0] != '\\' || p[1] != 'u') return NULL;
                    int v = hex4(p + 2);
                    if (v < 0xDC00 || v > 0xDFFF) return NULL;
                    p += 6;
                }
            } else {
                return NULL;
            }
            continue;
        }
        if (c < 0x20) return NULL; /* a control character, or the end of the line */
        int n = utf8_len((const unsigned char *)p);
        if (n == 0) return NULL;
        p += n;
    }
}

/* Decode a validated string body [p, end) into out (reset first). */
static int decode_string(const char *p, const char *end, Bytes *out) {
    out->len = 0;
    if (bytes_reserve(out, (size_t)(end - p) + PAD)) return -1; /* padded for same_bytes */
    char *w = out->data;
    while (p < end) {
        if (*p != '\\') {
            *w++ = *p++;
            continue;
        }
        char e = p[1];
        p += 2;
        switch (e) {
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            unsigned u = (unsigned)hex4(p);
            p += 4;
            if (u >= 0xD800 && u <= 0xDBFF) {
                unsigned v = (unsigned)hex4(p + 2);
                p += 6;
                u = 0x10000 + ((u - 0xD800) << 10) + (v - 0xDC00);
            }
            if (u < 0x80) {
                *w++ = (char)u;
            } else if (u < 0x800) {
                *w++ = (char)(0xC0 | (u >> 6));
                *w++ = (char)(0x80 | (u & 0x3F));
            } else if (u < 0x10000) {
                *w++ = (char)(0xE0 | (u >> 12));
                *w++ = (char)(0x80 | ((u >> 6) & 0x3F));
                *w++ = (char)(0x80 | (u & 0x3F));
            } else {
                *w++ = (char)(0xF0 | (u >> 18));
                *w++ = (char)(0x80 | ((u >> 12) & 0x3F));
                *w++ = (char)(0x80 | ((u >> 6) & 0x3F));
                *w++ = (char)(0x80 | (u & 0x3F));
            }
            break;
        }
        default: *w++ = e; break; /* '"', '\\', '/' */
        }
    }
    out->len = (size_t)(w - out->data);
    return 0;
}

/* A number (RFC 8259 grammar) at p: its end, NULL if invalid. *integral: no fraction, no exponent. */
static inline const char *scan_number(const char *p, int *integral) {
    *integral = 1;
    if (*p == '-') p++;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (*p >= '0' && *p <= '9') p++;
    } else {
        return NULL;
    }
    if (*p == '.') {
        *integral = 0;
        p++;
        if (!(*p >= '0' && *p <= '9')) return NULL;
        while (*p >= '0' && *p <= '9') p++;
    }
    if (*p == 'e' || *p == 'E') {
        *integral = 0;
        p++;
        if (*p == '+' || *p == '-') p++;
        if (!(*p >= '0' && *p <= '9')) return NULL;
        while (*p >= '0' && *p <= '9') p++;
    }
    return p;
}

/* Whether the eight bytes are all ASCII digits. */
static inline int is_eight_digits(uint64_t v) {
    return ((v & (ONES * 0xF0)) | (((v + ONES * 0x06) & (ONES * 0xF0)) >> 4)) == ONES * 0x33;
}

/* The value of eight ASCII digits, the first in the lowest byte (little-endian): pairs, then fours, then all. */
static inline uint32_t eight_digits(uint64_t v) {
    v -= ONES * '0';
    v = (v * 10 + (v >> 8)) & 0x00FF00FF00FF00FFULL;          /* each pair of digits in 16 bits */
    v = (v * 100 + (v >> 16)) & 0x0000FFFF0000FFFFULL;        /* each four in 32 bits */
    return (uint32_t)((v * 10000 + (v >> 32)) & 0xFFFFFFFFu); /* all eight */
}

/* A plain integer at p that fits 64 bits: its end, with *out set; NULL for anything else (a fraction, an
 * exponent, too many digits, not a number): the caller validates it another way or leaves the line. */
static inline const char *scan_int64(const char *p, int64_t *out) {
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    uint64_t v;
    if (*p == '0') {
        v = 0;
        p++;
    } else if (*p >= '1' && *p <= '9') {
        const char *first = p;
        v = 0;
#if SCAN_LITTLE_ENDIAN
        uint64_t w;
        while (is_eight_digits(w = load8(p))) { /* wraps past 20 digits: checked below */
            v = v * 100000000u + eight_digits(w);
            p += 8;
        }
#endif
        while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
        if (p - first > 19) return NULL;
    } else {
        return NULL;
    }
    if (*p == '.' || *p == 'e' || *p == 'E') return NULL;
    if (neg) {
        if (v > (uint64_t)INT64_MAX + 1) return NULL;
        *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    } else {
        if (v > (uint64_t)INT64_MAX) return NULL;
        *out = (int64_t)v;
    }
    return p;
}

static inline const char *scan_literal(const char *p) {
    if (p[0] == 't') return (p[1] == 'r' && p[2] == 'u' && p[3] == 'e') ? p + 4 : NULL;
    if (p[0] == 'f') return (p[1] == 'a' && p[2] == 'l' && p[3] == 's' && p[4] == 'e') ? p + 5 : NULL;
    if (p[0] == 'n') return (p[1] == 'u' && p[2] == 'l' && p[3] == 'l') ? p + 4 : NULL;
    return NULL;
}

/* Skip one JSON value at p (after whitespace): its end, NULL if invalid or nested deeper than MAX_DEPTH. */
static const char *skip_value(const char *p) {
    unsigned char stack[MAX_DEPTH]; /* 1: object, 0: array */
    int depth = 0;
    int integral, escaped;
value:
    p = skip_ws(p);
    switch (*p) {
    case '{':
        if (depth == MAX_DEPTH) return NULL;
        stack[depth++] = 1;
        p = skip_ws(p + 1);
        if (*p == '}') {
            p++;
            depth--;
            goto after;
        }
        goto key;
    case '[':
        if (depth == MAX_DEPTH) return NULL;
        stack[depth++] = 0;
        p = skip_ws(p + 1);
        if (*p == ']') {
            p++;
            depth--;
            goto after;
        }
        goto value;
    case '"':
        p = scan_string(p + 1, &escaped);
        if (p == NULL) return NULL;
        p++;
        goto after;
    case 't':
    case 'f':
    case 'n':
        p = scan_literal(p);
        if (p == NULL) return NULL;
        goto after;
    default:
        p = scan_number(p, &integral);
        if (p == NULL) return NULL;
        goto after;
    }
key:
    if (*p != '"') return NULL;
    p = scan_string(p + 1, &escaped);
    if (p == NULL) return NULL;
    p = skip_ws(p + 1);
    if (*p != ':') return NULL;
    p++;
    goto value;
after:
    if (depth == 0) return p;
    p = skip_ws(p);
    if (*p == ',') {
        p = skip_ws(p + 1);
        if (stack[depth - 1]) goto key;
        goto value;
    }
    if (*p == (stack[depth - 1] ? '}' : ']')) {
        p++;
        depth--;
        goto after;
    }
    return NULL;
}

/* ------------------------------------------------------------------ one line */

typedef struct {
    const char *start, *end; /* the literal (string: with its quotes) */
    int64_t i;
    int has; /* 1: a value (not null) */
    int escaped;
} Value;

#define DEFER 1
#define SKIP 2

/* The tracked keys are few and known: a hash seeded (at initialisation) so that none share a slot, and a
 * lookup is one comparison. */
static inline unsigned key_slot(unsigned seed, const char *s, size_t n) {
#if SCAN_LITTLE_ENDIAN
    uint64_t w = n >= 8 ? load8(s) : n ? load8(s) & (~0ULL >> (64 - 8 * n)) : 0; /* its first eight bytes */
    uint64_t h = (w ^ ((uint64_t)n << 56) ^ seed) * 0x9E3779B97F4A7C15ULL;
    return (unsigned)(h >> 55);
#else
    unsigned h = ((unsigned)n + seed) * 0x9E3779B1u;
    if (n) h ^= (unsigned char)s[0] * 0x85EBCA77u ^ (unsigned char)s[n - 1] * 0xC2B2AE3Du ^ (unsigned char)s[n / 2];
    return (h ^ (h >> 15)) & 511u;
#endif
}

static inline int lookup_field(const Shared *sh, const char *s, size_t n) {
    int f = sh->slot_of[key_slot(sh->seed, s, n)] - 1;
    if (f >= 0 && sh->fields[f].len == n && same_bytes(sh->fields[f].name, s, n)) return f;
    return -1;
}

/* Choose the seed: the first under which every field has a slot of its own; -1 if none does. */
static int place_fields(Shared *sh) {
    for (unsigned seed = 0; seed < 100000; seed++) {
        memset(sh->slot_of, 0, sizeof(sh->slot_of));
        int ok = 1;
        for (int f = 0; f < sh->nfields && ok; f++) {
            unsigned slot = key_slot(seed, sh->fields[f].name, sh->fields[f].len);
            if (sh->slot_of[slot]) ok = 0;
            sh->slot_of[slot] = (short)(f + 1);
        }
        if (ok) {
            sh->seed = seed;
            return 0;
        }
    }
    return -1;
}

#define SHAPE_KEYS 64
#define ATTR_KEYS 16

typedef struct {
    Value v[MAX_FIELDS];
    uint64_t seen;
    /* The tracked field of each of the previous line's first SHAPE_KEYS keys (-1: another key): lines of one
     * file mostly repeat their keys in the same order, so a key is first compared with the one expected. */
    signed char shape[SHAPE_KEYS];
    int shape_n;
    /* step and batch_size from attrs */
    int64_t step, batch;
    int has_step, has_batch, odd_attr; /* odd_attr: a value DuckDB would cast in a way we do not repeat */
    /* attrs' first ATTR_KEYS keys as an earlier line of the same chunk spelled them (pointing into the chunk's
     * buffer, which outlives its lines; NULL: none expected) and whether each spells step (1), batch_size (2)
     * or another key (0): attrs repeat their keys in one order as the top level does. */
    const char *akey[ATTR_KEYS];
    size_t aklen[ATTR_KEYS];
    signed char akind[ATTR_KEYS];
    int akey_n;
} Line;

/* attrs' top-level keys: the first step and batch_size, as integers. */
static const char *scan_attrs(const Shared *sh, const char *p, Line *ln, Bytes *scratch) {
    int integral, escaped;
    int seen_step = 0, seen_batch = 0;
    p = skip_ws(p + 1);
    if (*p == '}') return p + 1;
    for (int key = 0;; key++) {
        if (*p != '"') return NULL;
        const char *k = p + 1;
        const char *kend;
        int which = 0, spelled;
        const char *expected = key < ln->akey_n ? ln->akey[key] : NULL;
        /* The expected key, spelled exactly (its closing quote right after it): the key scan_string would find,
         * without an escape. Both sides are in the padded chunk buffer. */
        if (expected != NULL && k[ln->aklen[key]] == '"' && same_bytes(k, expected, ln->aklen[key])) {
            kend = k + ln->aklen[key];
            spelled = ln->akind[key];
        } else {
            escaped = 0;
            kend = scan_string(k, &escaped);
            if (kend == NULL) return NULL;
            size_t kn = (size_t)(kend - k);
            spelled = 0;
            if (escaped) { /* DuckDB decodes the key: one that spells step or batch_size is its to read */
                if (decode_string(k, kend, scratch)) return NULL;
                if ((scratch->len == sh->step_key_len && same_bytes(scratch->data, sh->step_key, scratch->len)) ||
                    (scratch->len == sh->batch_key_len && same_bytes(scratch->data, sh->batch_key, scratch->len)))
                    ln->odd_attr = 1;
            } else if (kn == sh->step_key_len && same_bytes(k, sh->step_key, kn)) {
                spelled = 1;
            } else if (kn == sh->batch_key_len && same_bytes(k, sh->batch_key, kn)) {
                spelled = 2;
            }
            if (key < ATTR_KEYS) {
                ln->akey[key] = escaped || kn > EXPECT_MAX ? NULL : k;
                ln->aklen[key] = kn;
                ln->akind[key] = (signed char)spelled;
                if (key >= ln->akey_n) ln->akey_n = key + 1;
            }
        }
        if (spelled == 1 && !seen_step)
            which = 1;
        else if (spelled == 2 && !seen_batch)
            which = 2;
        p = skip_ws(kend + 1);
        if (*p != ':') return NULL;
        p = skip_ws(p + 1);
        if (which) {
            if (which == 1) seen_step = 1;
            else seen_batch = 1;
            if (*p == 'n' || *p == '-' || (*p >= '0' && *p <= '9')) {
                if (*p == 'n') {
                    p = scan_literal(p);
                    if (p == NULL) return NULL;
                } else {
                    int64_t x;
                    const char *e = scan_int64(p, &x);
                    if (e == NULL) { /* valid JSON or not, DuckDB's cast decides */
                        p = scan_number(p, &integral);
                        if (p == NULL) return NULL;
                        ln->odd_attr = 1;
                    } else if (which == 1) {
                        p = e;
                        ln->step = x;
                        ln->has_step = 1;
                    } else {
                        p = e;
                        ln->batch = x;
                        ln->has_batch = 1;
                    }
                }
            } else {
                ln->odd_attr = 1; /* a string, bool or container: DuckDB's cast decides */
                p = skip_value(p);
                if (p == NULL) return NULL;
            }
        } else if (*p == '-' || (*p >= '0' && *p <= '9')) { /* a number (a loss, say): skip_value's own check */
            p = scan_number(p, &integral);
            if (p == NULL) return NULL;
        } else {
            p = skip_value(p);
            if (p == NULL) return NULL;
        }
        p = skip_ws(p);
        if (*p == ',') {
            p = skip_ws(p + 1);
            continue;
        }
        if (*p == '}') return p + 1;
        return NULL;
    }
}

/* Parse one line [p, '\n'): 0 (fields in ln), DEFER or SKIP (blank). */
static int parse_line(const Shared *sh, const char *p, Line *ln, Bytes *scratch) {
    int escaped;
    ln->seen = 0;
    ln->has_step = ln->has_batch = ln->odd_attr = 0;
    p = skip_ws(p);
    if (*p == '\n') return SKIP;
    if (*p != '{') return DEFER;
    p = skip_ws(p + 1);
    if (*p == '}') {
        p = skip_ws(p + 1);
        return *p == '\n' ? 0 : DEFER;
    }
    for (int key = 0;; key++) {
        if (*p != '"') return DEFER;
        const char *k = p + 1;
        escaped = 0;
        const char *kend;
        int f = key < ln->shape_n ? ln->shape[key] : -1;
        /* The expected key, spelled exactly (its closing quote right after the name): the key scan_string and
           lookup_field would find. The line is padded, so reading past a shorter key is safe. */
        if (f >= 0 && k[sh->fields[f].len] == '"' && same_bytes(k, sh->fields[f].name, sh->fields[f].len)) {
            kend = k + sh->fields[f].len;
        } else {
            kend = scan_string(k, &escaped);
            if (kend == NULL) return DEFER;
            f = lookup_field(sh, k, (size_t)(kend - k));
            if (escaped) { /* DuckDB matches the decoded name: a tracked one spelled with escapes is its to read */
                if (decode_string(k, kend, scratch)) return -1;
                if (lookup_field(sh, scratch->data, scratch->len) >= 0) return DEFER;
                f = -1;
            }
            if (key < SHAPE_KEYS) {
                ln->shape[key] = (signed char)(f >= 0 && sh->fields[f].literal ? f : -1);
                if (key >= ln->shape_n) ln->shape_n = key + 1;
            }
        }
        p = skip_ws(kend + 1);
        if (*p != ':') return DEFER;
        p = skip_ws(p + 1);
        if (f < 0) {
            p = skip_value(p);
            if (p == NULL) return DEFER;
        } else {
            if (ln->seen & (1ULL << f)) return DEFER; /* a field twice */
            ln->seen |= 1ULL << f;
            Value *v = &ln->v[f];
            v->start = p;
            v->has = 0;
            v->escaped = 0;
            if (*p == 'n') {
                if (p[1] != 'u' || p[2] != 'l' || p[3] != 'l') return DEFER;
                p += 4;
            } else {
                int type = sh->fields[f].type;
                if (type == T_STR || type == T_RARE_STR) {
                    if (*p != '"') return DEFER; /* DuckDB turns other values into text its own way */
                    const char *e = scan_string(p + 1, &v->escaped);
                    if (e == NULL) return DEFER;
                    p = e + 1;
                } else if (type == T_INT || type == T_RARE_INT) {
                    p = scan_int64(p, &v->i);
                    if (p == NULL) return DEFER;
                } else {
                    if (*p != '{') return DEFER;
                    p = scan_attrs(sh, p, ln, scratch);
                    if (p == NULL) return DEFER;
                }
                v->has = 1;
            }
            v->end = p;
        }
        p = skip_ws(p);
        if (*p == ',') {
            p = skip_ws(p + 1);
            continue;
        }
        if (*p == '}') break;
        return DEFER;
    }
    p = skip_ws(p + 1);
    return *p == '\n' ? 0 : DEFER;
}

/* ------------------------------------------------------------------ a chunk into a batch */

typedef struct {
    Batch *batch;
    Bytes scratch, scratch2, rare;
    Bytes deferred;
    int64_t deferred_lines;
    int64_t bytes_read;
} Work;

/* The decoded text of a string value (pointing into the line, or into `scratch`). */
static int string_of(const Value *v, Bytes *scratch, const char **s, size_t *n) {
    if (!v->escaped) {
        *s = v->start + 1;
        *n = (size_t)(v->end - v->start - 2);
        return 0;
    }
    if (decode_string(v->start + 1, v->end - 1, scratch)) return -1;
    *s = scratch->data;
    *n = scratch->len;
    return 0;
}

static inline int value_is(const Value *v, const char *s, size_t n, Bytes *scratch) {
    const char *t;
    size_t m;
    if (string_of(v, scratch, &t, &m)) return -1;
    return m == n && same_bytes(t, s, n);
}

/* Append the row of a parsed line: 0, DEFER (for DuckDB to read), -1 on failure to allocate. */
static int emit(const Shared *sh, Work *w, int32_t file, Line *ln) {
    Batch *b = w->batch;
    const Value *kind = &ln->v[sh->kind_field];
    const char *ks;
    size_t kn;
    if (string_of(kind, &w->scratch, &ks, &kn)) return -1;
    int plain = 0;
    if (kn == sh->span_kind_len && same_bytes(ks, sh->span_kind, kn) && sh->name_field >= 0 &&
        (ln->seen & (1ULL << sh->name_field)) && ln->v[sh->name_field].has) {
        int r = value_is(&ln->v[sh->name_field], sh->iteration, sh->iteration_len, &w->scratch2);
        if (r < 0) return -1;
        plain = r;
    }
    if (plain && ln->odd_attr) return DEFER; /* step or batch_size not a plain integer: DuckDB's cast decides */
    int rare = 0;
    for (int i = 0; i < sh->nrare_kinds; i++)
        if (kn == sh->rare_kinds_len[i] && same_bytes(ks, sh->rare_kinds[i], kn)) rare = 1;
    if (column_i64(&b->cols[0], file)) return -1;
    for (int i = 0; i < sh->ncore; i++) {
        int f = sh->core[i];
        const Field *fd = &sh->fields[f];
        Column *c = &b->cols[fd->column];
        const Value *v = &ln->v[f];
        if (!((ln->seen >> f) & 1) || !v->has) {
            if (column_null(c)) return -1;
            continue;
        }
        if (fd->type == T_INT) {
            if (column_i64(c, v->i)) return -1;
        } else if (fd->type == T_STR) {
            const char *s;
            size_t n;
            if (f == sh->kind_field) {
                s = ks;
                n = kn;
            } else if (string_of(v, &w->scratch2, &s, &n)) {
                return -1;
            }
            if (column_dict(c, s, n)) return -1;
        } else if (plain && sh->lean) { /* attrs of a plain iteration: not kept in a lean read */
            if (column_null(c)) return -1;
        } else if (column_text(c, v->start, (size_t)(v->end - v->start))) {
            return -1;
        }
    }
    Column *step = &b->cols[sh->ncore + 1], *batch = &b->cols[sh->ncore + 2], *rc = &b->cols[sh->ncore + 3];
    if (plain && ln->has_step ? column_i64(step, ln->step) : column_null(step)) return -1;
    if (plain && ln->has_batch ? column_i64(batch, ln->batch) : column_null(batch)) return -1;
    if (!rare) return column_null(rc) ? -1 : 0;
    /* The rare fields, as one JSON object of their literals (DuckDB reads it back with their types). */
    w->rare.len = 0;
    if (bytes_add(&w->rare, "{", 1)) return -1;
    int first = 1;
    for (int i = 0; i < sh->nrare; i++) {
        int f = sh->rare[i];
        const Field *fd = &sh->fields[f];
        const Value *v = &ln->v[f];
        if (!((ln->seen >> f) & 1) || !v->has) continue;
        if ((!first && bytes_add(&w->rare, ",", 1)) || bytes_add(&w->rare, "\"", 1) ||
            bytes_add(&w->rare, fd->name, fd->len) || bytes_add(&w->rare, "\":", 2) ||
            bytes_add(&w->rare, v->start, (size_t)(v->end - v->start)))
            return -1;
        first = 0;
    }
    if (bytes_add(&w->rare, "}", 1)) return -1;
    return column_text(rc, w->rare.data, w->rare.len) ? -1 : 0;
}

/* Read [offset, offset + n) of a file into buf (n bytes, or fewer at its end); the count read, -1 on error. */
static int64_t read_at(const char *path, int64_t offset, char *buf, int64_t n) {
#if SCAN_THREADS
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    int64_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, (size_t)(n - got), (off_t)(offset + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            close(fd);
            return -1;
        }
        if (r == 0) break;
        got += r;
    }
    close(fd);
    return got;
#else
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) return -1;
    if (_fseeki64(fp, offset, SEEK_SET) != 0) {
        fclose(fp);
        return -1;
    }
    int64_t got = (int64_t)fread(buf, 1, (size_t)n, fp);
    int bad = ferror(fp);
    fclose(fp);
    return bad ? -1 : got;
#endif
}

/* Parse chunk `ci` into a new batch (NULL with *err set on failure; a batch of 0 rows is fine). */
static Batch *produce(Shared *sh, int ci, Work *w, int *err, char *message, size_t message_len) {
    const Chunk *ch = &sh->chunks[ci];
    const char *path = sh->paths[ch->file];
    /* From one byte before the chunk (a newline there means a line starts at its first byte) to its end. */
    int64_t from = ch->offset > 0 ? ch->offset - 1 : 0;
    int64_t want = ch->end - from;
    Bytes buf = {0};
    Batch *b = NULL;
    *err = 0;
    if (bytes_reserve(&buf, (size_t)want + 1)) goto nomem;
    int64_t got = read_at(path, from, buf.data, want);
    if (got < 0) goto ioerror;
    w->bytes_read += got;
    buf.len = (size_t)got;
    size_t limit = (size_t)want < buf.len ? (size_t)want : buf.len; /* lines starting before it are ours */
    size_t start = 0;
    if (ch->offset > 0) {
        char *nl = memchr(buf.data, '\n', limit);
        start = nl == NULL ? limit : (size_t)(nl - buf.data) + 1;
    } else if (buf.len >= 3 && (unsigned char)buf.data[0] == 0xEF && (unsigned char)buf.data[1] == 0xBB &&
               (unsigned char)buf.data[2] == 0xBF) {
        start = 3; /* a byte-order mark, which DuckDB skips too */
    }
    if (start < limit && buf.len > 0 && buf.data[buf.len - 1] != '\n') {
        /* The last line starting here goes on past the chunk: read until its newline or the end of the file. */
        int64_t at = from + (int64_t)buf.len;
        for (;;) {
            if (bytes_reserve(&buf, 65536 + 1)) goto nomem;
            int64_t r = read_at(path, at, buf.data + buf.len, 65536);
            if (r < 0) goto ioerror;
            if (r == 0) break;
            w->bytes_read += r;
            char *nl = memchr(buf.data + buf.len, '\n', (size_t)r);
            buf.len += (size_t)r;
            at += r;
            if (nl != NULL) break;
        }
    }
    if (bytes_reserve(&buf, 1 + PAD)) goto nomem;
    buf.data[buf.len] = '\n'; /* the sentinel after a last line without one */
    memset(buf.data + buf.len + 1, 0, PAD);

    b = calloc(1, sizeof(Batch));
    if (b == NULL) goto nomem;
    b->ncols = sh->ncols;
    int64_t span = ch->end - ch->offset;
    size_t initial = span / 128 > 1024 ? (size_t)(span / 128) : 1024; /* a guess: lines are 100 to 300 bytes */
    for (int i = 0; i < sh->ncols; i++) {
        b->cols[i].type = sh->col_type[i];
        b->cols[i].initial = initial;
    }
    w->batch = b;
    char *p = buf.data + start, *end = buf.data + buf.len, *stop = buf.data + limit;
    Line ln;
    ln.shape_n = 0;
    ln.akey_n = 0;
    while (p < stop) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) nl = end; /* the file's last line, without a newline: the sentinel ends it */
        int rc = (nl - p) > MAX_LINE ? DEFER : parse_line(sh, p, &ln, &w->scratch);
        if (rc < 0) goto nomem;
        if (rc == 0 && (ln.seen >> sh->kind_field & 1) && ln.v[sh->kind_field].has) {
            rc = emit(sh, w, ch->file, &ln);
            if (rc < 0) goto nomem;
        }
        if (rc == DEFER) {
            if (bytes_add(&w->deferred, p, (size_t)(nl - p)) || bytes_add(&w->deferred, "\n", 1)) goto nomem;
            w->deferred_lines++;
        }
        p = nl + 1;
    }
    free(buf.data);
    return b;
nomem:
    *err = ENOMEM;
    snprintf(message, message_len, "out of memory scanning %s", path);
    goto fail;
ioerror:
    *err = errno ? errno : EIO;
    snprintf(message, message_len, "%s: %s", path, strerror(*err));
fail:
    free(buf.data);
    batch_free(b);
    w->batch = NULL;
    return NULL;
}

/* ------------------------------------------------------------------ the shared state, the workers */

static void shared_free(Shared *sh) {
    for (int i = 0; i < sh->nfiles; i++) free(sh->paths[i]);
    free(sh->paths);
    free(sh->sizes);
    free(sh->chunks);
    for (int f = 0; f < sh->nfields; f++) free(sh->fields[f].name);
    for (int i = 0; i < sh->ncols; i++) free(sh->col_name[i]);
    for (int i = 0; i < sh->nrare_kinds; i++) free(sh->rare_kinds[i]);
    free(sh->span_kind);
    free(sh->iteration);
    free(sh->step_key);
    free(sh->batch_key);
    if (sh->ready != NULL)
        for (int i = 0; i < sh->nready; i++) batch_free(sh->ready[i]);
    free(sh->ready);
    if (sh->deferred != NULL)
        for (int i = 0; i < sh->nchunks; i++) free(sh->deferred[i]);
    free(sh->deferred);
    free(sh->deferred_len);
#if SCAN_THREADS
    free(sh->workers);
    pthread_mutex_destroy(&sh->lock);
    pthread_cond_destroy(&sh->has_batch);
    pthread_cond_destroy(&sh->has_room);
#endif
    free(sh);
}

static void shared_decref(Shared *sh) {
    if (atomic_fetch_sub(&sh->refs, 1) == 1) shared_free(sh);
}

#if SCAN_THREADS
#define LOCK(sh) pthread_mutex_lock(&(sh)->lock)
#define UNLOCK(sh) pthread_mutex_unlock(&(sh)->lock)
#else
#define LOCK(sh) ((void)0)
#define UNLOCK(sh) ((void)0)
#endif

/* Record what producing chunk ci gave (under the lock): the batch queued, its deferred lines kept. */
static void finish_chunk(Shared *sh, int ci, Batch *b, Work *w, int err, const char *message) {
    if (err) {
        if (!sh->error) {
            sh->error = err;
            snprintf(sh->message, sizeof(sh->message), "%s", message);
        }
        free(w->deferred.data);
    } else {
        sh->deferred[ci] = w->deferred.data;
        sh->deferred_len[ci] = (int64_t)w->deferred.len;
        sh->deferred_lines += w->deferred_lines;
        sh->rows += (int64_t)b->cols[0].len;
        sh->ready[sh->nready++] = b;
    }
    memset(&w->deferred, 0, sizeof(w->deferred));
    w->deferred_lines = 0;
    sh->bytes_read += w->bytes_read;
    w->bytes_read = 0;
    sh->done_chunks++;
}

static void work_free(Work *w) {
    free(w->scratch.data);
    free(w->scratch2.data);
    free(w->rare.data);
    free(w->deferred.data);
}

#if SCAN_THREADS
static void *worker_main(void *arg) {
    Shared *sh = arg;
    Work w = {0};
    char message[512];
    LOCK(sh);
    for (;;) {
        while (!sh->cancel && !sh->error && sh->next_chunk < sh->nchunks && sh->nready >= sh->max_ready)
            pthread_cond_wait(&sh->has_room, &sh->lock);
        if (sh->cancel || sh->error || sh->next_chunk >= sh->nchunks) break;
        int ci = sh->next_chunk++;
        UNLOCK(sh);
        int err = 0;
        Batch *b = produce(sh, ci, &w, &err, message, sizeof(message));
        LOCK(sh);
        finish_chunk(sh, ci, b, &w, err, message);
        pthread_cond_broadcast(&sh->has_batch);
    }
    pthread_cond_broadcast(&sh->has_batch);
    UNLOCK(sh);
    work_free(&w);
    return NULL;
}
#endif

/* ------------------------------------------------------------------ the stream */

typedef struct {
    Shared *sh;
    char error[600];
#if !SCAN_THREADS
    Work work;
#endif
} StreamState;

static void release_schema(struct ArrowSchema *s);

/* The schema: a struct of the output columns (dictionary-encoded text for the core text fields). */
typedef struct {
    struct ArrowSchema child[MAX_FIELDS + 4];
    struct ArrowSchema *child_ptr[MAX_FIELDS + 4];
    struct ArrowSchema dict[MAX_FIELDS + 4];
    char *names[MAX_FIELDS + 4];
    int n;
} SchemaHolder;

static void release_schema_child(struct ArrowSchema *s) { s->release = NULL; }

static void release_schema(struct ArrowSchema *s) {
    if (s->release == NULL) return;
    SchemaHolder *h = s->private_data;
    for (int i = 0; i < h->n; i++) free(h->names[i]);
    free(h);
    s->release = NULL;
}

static int export_schema(const Shared *sh, struct ArrowSchema *out) {
    SchemaHolder *h = calloc(1, sizeof(SchemaHolder));
    if (h == NULL) return ENOMEM;
    h->n = sh->ncols;
    for (int i = 0; i < sh->ncols; i++) {
        size_t n = strlen(sh->col_name[i]);
        h->names[i] = malloc(n + 1);
        if (h->names[i] == NULL) {
            for (int j = 0; j < i; j++) free(h->names[j]);
            free(h);
            return ENOMEM;
        }
        memcpy(h->names[i], sh->col_name[i], n + 1);
        struct ArrowSchema *c = &h->child[i];
        c->name = h->names[i];
        c->flags = ARROW_FLAG_NULLABLE;
        c->release = release_schema_child;
        if (sh->col_type[i] == COL_I64) {
            c->format = "l";
        } else if (sh->col_type[i] == COL_UTF8) {
            c->format = "u";
        } else {
            c->format = "i";
            struct ArrowSchema *d = &h->dict[i];
            d->format = "u";
            d->flags = ARROW_FLAG_NULLABLE;
            d->release = release_schema_child;
            c->dictionary = d;
        }
        h->child_ptr[i] = c;
    }
    memset(out, 0, sizeof(*out));
    out->format = "+s";
    out->name = "";
    out->n_children = sh->ncols;
    out->children = h->child_ptr;
    out->release = release_schema;
    out->private_data = h;
    return 0;
}

static int stream_get_schema(struct ArrowArrayStream *s, struct ArrowSchema *out) {
    StreamState *st = s->private_data;
    return export_schema(st->sh, out);
}

static int stream_get_next(struct ArrowArrayStream *s, struct ArrowArray *out) {
    StreamState *st = s->private_data;
    Shared *sh = st->sh;
    Batch *b = NULL;
    int err = 0;
#if SCAN_THREADS
    LOCK(sh);
    for (;;) {
        if (sh->error) break;
        if (sh->nready > 0) {
            b = sh->ready[--sh->nready];
            sh->taken++;
            pthread_cond_signal(&sh->has_room);
            break;
        }
        if (sh->done_chunks >= sh->nchunks) break;
        pthread_cond_wait(&sh->has_batch, &sh->lock);
    }
    if (sh->error) {
        err = sh->error;
        snprintf(st->error, sizeof(st->error), "%s", sh->message);
        batch_free(b);
        b = NULL;
    }
    UNLOCK(sh);
#else
    while (b == NULL && !sh->error && sh->next_chunk < sh->nchunks) {
        char message[512];
        int ci = sh->next_chunk++;
        Batch *made = produce(sh, ci, &st->work, &err, message, sizeof(message));
        finish_chunk(sh, ci, made, &st->work, err, message);
        if (sh->nready > 0) {
            b = sh->ready[--sh->nready];
            sh->taken++;
        }
    }
    if (sh->error) {
        err = sh->error;
        snprintf(st->error, sizeof(st->error), "%s", sh->message);
    }
#endif
    if (err) return err;
    if (b == NULL) { /* the end of the stream */
        memset(out, 0, sizeof(*out));
        return 0;
    }
    batch_export(b, out);
    return 0;
}

static const char *stream_last_error(struct ArrowArrayStream *s) {
    StreamState *st = s->private_data;
    return st->error[0] ? st->error : NULL;
}

static void stop_workers(Shared *sh) {
#if SCAN_THREADS
    LOCK(sh);
    if (sh->done_chunks < sh->nchunks) sh->cancel = 1;
    pthread_cond_broadcast(&sh->has_room);
    int started = sh->started;
    sh->started = 0;
    UNLOCK(sh);
    for (int i = 0; i < started; i++) pthread_join(sh->workers[i], NULL);
#else
    (void)sh;
#endif
}

static void stream_release(struct ArrowArrayStream *s) {
    if (s->release == NULL) return;
    StreamState *st = s->private_data;
    stop_workers(st->sh);
#if !SCAN_THREADS
    work_free(&st->work);
#endif
    shared_decref(st->sh);
    free(st);
    s->release = NULL;
}

/* ------------------------------------------------------------------ the Python type */

typedef struct {
    PyObject_HEAD Shared *sh;
    int streamed;
    int launched; /* the workers were started (by start() or the stream) */
} Scanner;

/* Start the worker threads, once: 0, or -1 with OSError set when not even one could start. */
static int start_workers(Scanner *self) {
#if SCAN_THREADS
    if (self->launched) return 0;
    Shared *sh = self->sh;
    for (int i = 0; i < sh->nworkers; i++) {
        if (pthread_create(&sh->workers[i], NULL, worker_main, sh) != 0) {
            if (i == 0) {
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            break; /* fewer workers than asked: still correct */
        }
        LOCK(sh);
        sh->started++;
        UNLOCK(sh);
    }
#endif
    self->launched = 1;
    return 0;
}

static void stream_capsule_free(PyObject *capsule) {
    struct ArrowArrayStream *s = PyCapsule_GetPointer(capsule, "arrow_array_stream");
    if (s == NULL) {
        PyErr_Clear();
        return;
    }
    if (s->release != NULL) {
        Py_BEGIN_ALLOW_THREADS s->release(s);
        Py_END_ALLOW_THREADS
    }
    free(s);
}

static void schema_capsule_free(PyObject *capsule) {
    struct ArrowSchema *s = PyCapsule_GetPointer(capsule, "arrow_schema");
    if (s == NULL) {
        PyErr_Clear();
        return;
    }
    if (s->release != NULL) s->release(s);
    free(s);
}

static char *copy_utf8(PyObject *text, size_t *len) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL) return NULL;
    char *out = calloc((size_t)n + 1 + PAD, 1); /* padded for same_bytes */
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(out, s, (size_t)n);
    if (len) *len = (size_t)n;
    return out;
}

static int add_column(Shared *sh, const char *name, int type) {
    size_t n = strlen(name);
    char *copy = malloc(n + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, name, n + 1);
    sh->col_name[sh->ncols] = copy;
    sh->col_type[sh->ncols] = type;
    return sh->ncols++;
}

static const char *const type_names[] = {"str", "int", "json", "rare_str", "rare_int"};

static int Scanner_init(Scanner *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"paths", "fields", "span_kind", "iteration", "attrs_fields", "rare_kinds",
                             "lean", "threads", "chunk_size", NULL};
    PyObject *paths, *fields, *span_kind, *iteration, *attrs_fields, *rare_kinds;
    int lean = 0, threads = 1;
    long long chunk_size = 4 << 20;
    if (self->sh != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Scanner is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOUUOO|piL", kwlist, &paths, &fields, &span_kind, &iteration,
                                     &attrs_fields, &rare_kinds, &lean, &threads, &chunk_size))
        return -1;
    if (chunk_size < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk_size must be positive");
        return -1;
    }
    Shared *sh = calloc(1, sizeof(Shared));
    if (sh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    atomic_init(&sh->refs, 1);
#if SCAN_THREADS
    pthread_mutex_init(&sh->lock, NULL);
    pthread_cond_init(&sh->has_batch, NULL);
    pthread_cond_init(&sh->has_room, NULL);
#endif
    sh->kind_field = sh->name_field = sh->attrs_field = -1;
    sh->lean = lean;
    PyObject *seq = NULL, *item = NULL;
    /* fields: (name, type) pairs, in the order of the output columns for the core ones */
    seq = PySequence_Fast(fields, "fields must be a sequence of (name, type) pairs");
    if (seq == NULL) goto fail;
    Py_ssize_t nf = PySequence_Fast_GET_SIZE(seq);
    if (nf > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "too many fields");
        goto fail;
    }
    if (add_column(sh, "file", COL_I64) < 0) goto fail;
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *name, *type;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "UU", &name, &type)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "each field is a (name, type) tuple");
            goto fail;
        }
        Field *fd = &sh->fields[sh->nfields];
        fd->name = copy_utf8(name, &fd->len);
        if (fd->name == NULL) goto fail;
        fd->literal = fd->len <= EXPECT_MAX;
        for (size_t c = 0; c < fd->len; c++) {
            unsigned char ch = (unsigned char)fd->name[c];
            if (ch == '"' || ch == '\\' || ch < 0x20 || ch >= 0x80) fd->literal = 0;
        }
        sh->nfields++;
        const char *t = PyUnicode_AsUTF8(type);
        if (t == NULL) goto fail;
        fd->type = -1;
        for (int k = 0; k < 5; k++)
            if (strcmp(t, type_names[k]) == 0) fd->type = k;
        if (fd->type < 0) {
            PyErr_Format(PyExc_ValueError, "unknown field type %s", t);
            goto fail;
        }
        for (int g = 0; g < sh->nfields - 1; g++)
            if (sh->fields[g].len == fd->len && memcmp(sh->fields[g].name, fd->name, fd->len) == 0) {
                PyErr_Format(PyExc_ValueError, "field %s given twice", fd->name);
                goto fail;
            }
        fd->column = -1;
        if (fd->type == T_STR || fd->type == T_INT || fd->type == T_JSON) {
            int col_type = fd->type == T_STR ? COL_DICT : fd->type == T_INT ? COL_I64 : COL_UTF8;
            fd->column = add_column(sh, fd->name, col_type);
            if (fd->column < 0) goto fail;
            sh->core[sh->ncore++] = sh->nfields - 1;
        } else {
            sh->rare[sh->nrare++] = sh->nfields - 1;
        }
        if (strcmp(fd->name, "kind") == 0 && fd->type == T_STR) sh->kind_field = sh->nfields - 1;
        if (strcmp(fd->name, "name") == 0 && fd->type == T_STR) sh->name_field = sh->nfields - 1;
        if (fd->type == T_JSON) {
            if (sh->attrs_field >= 0) {
                PyErr_SetString(PyExc_ValueError, "one json field at most");
                goto fail;
            }
            sh->attrs_field = sh->nfields - 1;
        }
    }
    Py_CLEAR(seq);
    if (place_fields(sh)) {
        PyErr_SetString(PyExc_ValueError, "could not place the fields in the key table");
        goto fail;
    }
    if (sh->kind_field < 0) {
        PyErr_SetString(PyExc_ValueError, "fields must hold kind as str");
        goto fail;
    }
    /* The output columns after the core fields: step, batch_size (from attrs), rare (JSON text). */
    seq = PySequence_Fast(attrs_fields, "attrs_fields must be (step, batch_size)");
    if (seq == NULL) goto fail;
    if (PySequence_Fast_GET_SIZE(seq) != 2 || !PyUnicode_Check(PySequence_Fast_GET_ITEM(seq, 0)) ||
        !PyUnicode_Check(PySequence_Fast_GET_ITEM(seq, 1))) {
        PyErr_SetString(PyExc_ValueError, "attrs_fields must be two names");
        goto fail;
    }
    sh->step_key = copy_utf8(PySequence_Fast_GET_ITEM(seq, 0), &sh->step_key_len);
    sh->batch_key = copy_utf8(PySequence_Fast_GET_ITEM(seq, 1), &sh->batch_key_len);
    if (sh->step_key == NULL || sh->batch_key == NULL) goto fail;
    if (add_column(sh, sh->step_key, COL_I64) < 0 || add_column(sh, sh->batch_key, COL_I64) < 0 ||
        add_column(sh, "rare", COL_UTF8) < 0)
        goto fail;
    Py_CLEAR(seq);
    sh->span_kind = copy_utf8(span_kind, &sh->span_kind_len);
    sh->iteration = copy_utf8(iteration, &sh->iteration_len);
    if (sh->span_kind == NULL || sh->iteration == NULL) goto fail;
    seq = PySequence_Fast(rare_kinds, "rare_kinds must be a sequence of str");
    if (seq == NULL) goto fail;
    if (PySequence_Fast_GET_SIZE(seq) > 8) {
        PyErr_SetString(PyExc_ValueError, "at most 8 rare kinds");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "rare_kinds must be str");
            goto fail;
        }
        sh->rare_kinds[i] = copy_utf8(item, &sh->rare_kinds_len[i]);
        if (sh->rare_kinds[i] == NULL) goto fail;
        sh->nrare_kinds++;
    }
    Py_CLEAR(seq);
    /* The files, their sizes now, and their chunks. */
    seq = PySequence_Fast(paths, "paths must be a sequence of str");
    if (seq == NULL) goto fail;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    if (np > INT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "too many files");
        goto fail;
    }
    sh->paths = calloc((size_t)np + 1, sizeof(char *));
    sh->sizes = calloc((size_t)np + 1, sizeof(int64_t));
    if (sh->paths == NULL || sh->sizes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t total_chunks = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *encoded = NULL;
        if (!PyUnicode_FSConverter(item, &encoded)) goto fail;
        const char *s = PyBytes_AS_STRING(encoded);
        size_t n = (size_t)PyBytes_GET_SIZE(encoded);
        sh->paths[i] = malloc(n + 1);
        if (sh->paths[i] == NULL) {
            Py_DECREF(encoded);
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(sh->paths[i], s, n + 1);
        Py_DECREF(encoded);
        sh->nfiles++;
        FILE *fp = fopen(sh->paths[i], "rb");
        if (fp == NULL) {
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, item);
            goto fail;
        }
#ifdef _WIN32
        _fseeki64(fp, 0, SEEK_END);
        int64_t size = _ftelli64(fp);
#else
        fseeko(fp, 0, SEEK_END);
        int64_t size = (int64_t)ftello(fp);
#endif
        fclose(fp);
        sh->sizes[i] = size > 0 ? size : 0;
        total_chunks += sh->sizes[i] ? (sh->sizes[i] + chunk_size - 1) / chunk_size : 0;
        if (total_chunks > INT32_MAX / 4) {
            PyErr_SetString(PyExc_ValueError, "too many chunks: give a larger chunk_size");
            goto fail;
        }
    }
    Py_CLEAR(seq);
    sh->chunks = calloc((size_t)total_chunks + 1, sizeof(Chunk));
    sh->deferred = calloc((size_t)total_chunks + 1, sizeof(char *));
    sh->deferred_len = calloc((size_t)total_chunks + 1, sizeof(int64_t));
    if (sh->chunks == NULL || sh->deferred == NULL || sh->deferred_len == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int i = 0; i < sh->nfiles; i++)
        for (int64_t off = 0; off < sh->sizes[i]; off += chunk_size) {
            Chunk *ch = &sh->chunks[sh->nchunks++];
            ch->file = i;
            ch->offset = off;
            ch->end = off + chunk_size < sh->sizes[i] ? off + chunk_size : sh->sizes[i];
        }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    sh->max_ready = 2 * threads + 2;
    sh->ready = calloc((size_t)sh->max_ready + (size_t)threads + 1, sizeof(Batch *));
    if (sh->ready == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
#if SCAN_THREADS
    sh->nworkers = threads < sh->nchunks ? threads : sh->nchunks;
    sh->workers = calloc((size_t)sh->nworkers + 1, sizeof(pthread_t));
    if (sh->workers == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
#endif
    self->sh = sh;
    return 0;
fail:
    Py_XDECREF(seq);
    shared_free(sh);
    return -1;
}

static void Scanner_dealloc(Scanner *self) {
    if (self->sh != NULL && self->launched && !self->streamed) {
        /* Started early, never streamed: the workers wait for room that no reader will make. */
        Py_BEGIN_ALLOW_THREADS stop_workers(self->sh);
        Py_END_ALLOW_THREADS
    }
    if (self->sh != NULL) shared_decref(self->sh);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(Scanner *self) {
    if (self->sh == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Scanner not initialised");
        return -1;
    }
    return 0;
}

static PyObject *Scanner_schema(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(self)) return NULL;
    struct ArrowSchema *s = malloc(sizeof(*s));
    if (s == NULL) return PyErr_NoMemory();
    if (export_schema(self->sh, s)) {
        free(s);
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(s, "arrow_schema", schema_capsule_free);
    if (capsule == NULL) {
        s->release(s);
        free(s);
    }
    return capsule;
}

static PyObject *Scanner_start(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(self)) return NULL;
    if (self->streamed) {
        PyErr_SetString(PyExc_RuntimeError, "a Scanner reads its files once: its stream was already taken");
        return NULL;
    }
    if (start_workers(self)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Scanner_stream(Scanner *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"requested_schema", NULL};
    PyObject *requested = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &requested)) return NULL;
    if (check_ready(self)) return NULL;
    if (requested != Py_None) {
        PyErr_SetString(PyExc_NotImplementedError, "the scanner's stream has one schema");
        return NULL;
    }
    if (self->streamed) {
        PyErr_SetString(PyExc_RuntimeError, "a Scanner reads its files once: its stream was already taken");
        return NULL;
    }
    Shared *sh = self->sh;
    struct ArrowArrayStream *s = calloc(1, sizeof(*s));
    StreamState *st = calloc(1, sizeof(*st));
    if (s == NULL || st == NULL) {
        free(s);
        free(st);
        return PyErr_NoMemory();
    }
    st->sh = sh;
    atomic_fetch_add(&sh->refs, 1);
    s->get_schema = stream_get_schema;
    s->get_next = stream_get_next;
    s->get_last_error = stream_last_error;
    s->release = stream_release;
    s->private_data = st;
    if (start_workers(self)) {
        s->release(s);
        free(s);
        return NULL;
    }
    self->streamed = 1;
    PyObject *capsule = PyCapsule_New(s, "arrow_array_stream", stream_capsule_free);
    if (capsule == NULL) {
        s->release(s);
        free(s);
    }
    return capsule;
}

static PyObject *Scanner_deferred(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(self)) return NULL;
    Shared *sh = self->sh;
    int complete;
    Py_BEGIN_ALLOW_THREADS LOCK(sh);
    complete = sh->done_chunks >= sh->nchunks && !sh->error && self->streamed;
    UNLOCK(sh);
    Py_END_ALLOW_THREADS if (!complete) {
        PyErr_SetString(PyExc_RuntimeError, "the scan did not complete: its stream was not read to the end");
        return NULL;
    }
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    int ci = 0;
    while (ci < sh->nchunks) {
        int file = sh->chunks[ci].file;
        int64_t total = 0;
        int cj = ci;
        for (; cj < sh->nchunks && sh->chunks[cj].file == file; cj++) total += sh->deferred_len[cj];
        if (total > 0) {
            PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
            if (bytes == NULL) goto fail;
            char *w = PyBytes_AS_STRING(bytes);
            for (int k = ci; k < cj; k++) {
                if (sh->deferred_len[k]) memcpy(w, sh->deferred[k], (size_t)sh->deferred_len[k]);
                w += sh->deferred_len[k];
            }
            PyObject *key = PyLong_FromLong(file);
            if (key == NULL || PyDict_SetItem(out, key, bytes) < 0) {
                Py_XDECREF(key);
                Py_DECREF(bytes);
                goto fail;
            }
            Py_DECREF(key);
            Py_DECREF(bytes);
        }
        ci = cj;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *Scanner_get_rows(Scanner *self, void *Py_UNUSED(closure)) {
    if (check_ready(self)) return NULL;
    int64_t rows;
    LOCK(self->sh);
    rows = self->sh->rows;
    UNLOCK(self->sh);
    return PyLong_FromLongLong(rows);
}

static PyObject *Scanner_get_deferred_lines(Scanner *self, void *Py_UNUSED(closure)) {
    if (check_ready(self)) return NULL;
    int64_t n;
    LOCK(self->sh);
    n = self->sh->deferred_lines;
    UNLOCK(self->sh);
    return PyLong_FromLongLong(n);
}

static PyObject *Scanner_get_bytes_read(Scanner *self, void *Py_UNUSED(closure)) {
    if (check_ready(self)) return NULL;
    int64_t n;
    LOCK(self->sh);
    n = self->sh->bytes_read;
    UNLOCK(self->sh);
    return PyLong_FromLongLong(n);
}

static PyObject *Scanner_get_columns(Scanner *self, void *Py_UNUSED(closure)) {
    if (check_ready(self)) return NULL;
    PyObject *out = PyList_New(self->sh->ncols);
    if (out == NULL) return NULL;
    for (int i = 0; i < self->sh->ncols; i++) {
        PyObject *name = PyUnicode_FromString(self->sh->col_name[i]);
        if (name == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, name);
    }
    return out;
}

/* Read the whole stream here, dropping every batch (what the scan costs without a consumer). */
static PyObject *Scanner_drain(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) return NULL;
    PyObject *capsule = Scanner_stream(self, no_args, NULL);
    Py_DECREF(no_args);
    if (capsule == NULL) return NULL;
    struct ArrowArrayStream *s = PyCapsule_GetPointer(capsule, "arrow_array_stream");
    int64_t rows = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS for (;;) {
        struct ArrowArray a;
        err = s->get_next(s, &a);
        if (err || a.release == NULL) break;
        rows += a.length;
        a.release(&a);
    }
    Py_END_ALLOW_THREADS if (err) {
        PyErr_Format(PyExc_OSError, "%s", s->get_last_error(s));
        Py_DECREF(capsule);
        return NULL;
    }
    Py_DECREF(capsule);
    return PyLong_FromLongLong(rows);
}

static PyMethodDef Scanner_methods[] = {
    {"_drain", (PyCFunction)Scanner_drain, METH_NOARGS, "Read the stream to its end here; the rows read."},
    {"start", (PyCFunction)Scanner_start, METH_NOARGS,
     "Begin reading on the worker threads now, before the stream is taken (at most a few batches ahead)."},
    {"__arrow_c_schema__", (PyCFunction)Scanner_schema, METH_NOARGS, "The Arrow schema of the stream, as a capsule."},
    {"__arrow_c_stream__", (PyCFunction)(void (*)(void))Scanner_stream, METH_VARARGS | METH_KEYWORDS,
     "The records as an Arrow C stream capsule (once: the files are read while it is consumed)."},
    {"deferred", (PyCFunction)Scanner_deferred, METH_NOARGS,
     "{file index: the lines left for DuckDB's reader, newline-terminated, in file order}, once the stream ended."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Scanner_getset[] = {
    {"rows", (getter)Scanner_get_rows, NULL, "Rows produced so far.", NULL},
    {"deferred_lines", (getter)Scanner_get_deferred_lines, NULL, "Lines left for DuckDB's reader so far.", NULL},
    {"columns", (getter)Scanner_get_columns, NULL, "The stream's column names.", NULL},
    {"bytes_read", (getter)Scanner_get_bytes_read, NULL,
     "Bytes read from the files so far (each chunk also reads the byte before it, and on to its last line's end).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "traintrace._scan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Scanner(paths, fields, span_kind, iteration, attrs_fields, rare_kinds, lean=False, threads=1, "
              "chunk_size=4 MiB): a job's JSON-lines files as an Arrow C stream of the raw table's columns.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "traintrace._scan", "A job's JSON-lines files read into columns (the command's reader).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    if (PyType_Ready(&ScannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
