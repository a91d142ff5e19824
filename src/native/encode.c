/*
 * traintrace._encode: the writer thread's record encoder (optional; the
 * pure-Python path in _pipeline.py is the reference and is always there).
 *
 * Encoder.convert() pops queued items (Span objects and EVENT tuples) and, for
 * the common case, writes their JSON lines straight into a C buffer, byte for
 * byte what _pipeline._convert_items + _serialize.dumps_lines would write.
 * Anything unusual (a value that needs converting, a redacted key, a new
 * thread, a link, a span the statistics observer must see in Python, a record
 * a dict-based backend wants) is *yielded*: the item is handed back untouched,
 * before any state was changed, and Python converts it as it always did.
 *
 * Every check happens before the first mutation of an item, so a yielded item
 * is converted by Python from scratch. Nothing here raises into the caller
 * except MemoryError from convert() itself (the item is then yielded).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#ifndef _WIN32
#include <poll.h>
#include <time.h>
#include <unistd.h>
#endif
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "span_core.h"

/* traintrace._span.SpanCore, when that module was built with this file's span_core.h: its
   instances' fields are read from the struct. NULL: every span through its getters. */
static PyTypeObject *SPAN_CORE = NULL;

/* traintrace._span's writer_beat (NULL without it): the writer's last sign of work, 0 while it waits by
   choice; a training loop that sees it stale lets the writer in (span.c: nudge_writer). */
static int64_t *writer_beat = NULL;
static long long mono_ns(void);

static inline void beat(void) {
    if (writer_beat != NULL) __atomic_store_n(writer_beat, (int64_t)mono_ns(), __ATOMIC_RELEASE);
}

static inline void beat_idle(void) {
    if (writer_beat != NULL) __atomic_store_n(writer_beat, 0, __ATOMIC_RELEASE);
}

#define RC_OK 0
#define RC_YIELD 1

/* Span.written as the writer sees it (_pipeline._OPEN, _DONE). */
#define W_OPEN 1
#define W_DONE 2
#define EVENT_TAG 2

/* Monotonic readings this far from 0 keep wall0 + t (|wall0| < 2**62, checked by the caller) in 64 bits. */
#define MONO_OK(t) ((t) >= 0 && (t) < (1LL << 61))

#define MAX_KEY 256
#define MAX_ITEMS 256
#define MAX_STRING 4096
#define MAX_NODES 4096 /* _sanitize.MAX_NODES */

enum { F_NAME, F_ATTRS, F_LEVEL, F_LINK, F_PARENT, F_ID, F_TID, F_T0, F_T1, F_STATUS, F_WRITTEN, F_METRICS, NF };
static const char *field_names[NF] = {"name", "attrs",  "level",  "link",    "parent",  "id",
                                      "tid",  "t0",     "t1",     "status",  "written", "metrics"};
static PyObject *FIELD[NF];
static PyObject *S_OK, *S_STEP, *S_CURRENT_ITERATION, *S_ITERATION, *S_TRAINING_LOOP, *S_INIT_SUFFIX,
    *S_NUM_ITERATIONS;
static PyObject *SMALL[5];

/* ------------------------------------------------------------------ buffer */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_grow(Buf *b, Py_ssize_t extra) {
    Py_ssize_t need = b->len + extra;
    Py_ssize_t cap = b->cap ? b->cap : 65536;
    while (cap < need) cap *= 2;
    char *p = PyMem_Realloc(b->data, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = p;
    b->cap = cap;
    return 0;
}

static inline int buf_reserve(Buf *b, Py_ssize_t extra) {
    return (b->len + extra <= b->cap) ? 0 : buf_grow(b, extra);
}

static inline int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) buf_put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static const char DIGIT_PAIRS[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* Two digits a division: a record's seven integers (a 19-digit ts among them) are much of a line. */
static int put_i64(Buf *b, long long v) {
    char tmp[24];
    int i = 24;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    while (u >= 100) {
        unsigned pair = (unsigned)(u % 100);
        u /= 100;
        i -= 2;
        memcpy(tmp + i, DIGIT_PAIRS + 2 * pair, 2);
    }
    if (u >= 10) {
        i -= 2;
        memcpy(tmp + i, DIGIT_PAIRS + 2 * u, 2);
    } else {
        tmp[--i] = (char)('0' + u);
    }
    if (v < 0) tmp[--i] = '-';
    return buf_put(b, tmp + i, 24 - i);
}

static const char HEX[] = "0123456789abcdef";

/* A JSON string as orjson / json(ensure_ascii=False) write it. RC_YIELD: not UTF-8 (lone surrogates). */
static int put_str(Buf *b, PyObject *u) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(u, &n);
    if (s == NULL) {
        PyErr_Clear();
        return RC_YIELD;
    }
    if (buf_reserve(b, n * 6 + 2) < 0) return -1;
    char *o = b->data + b->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *o++ = (char)c;
            continue;
        }
        *o++ = '\\';
        switch (c) {
            case '"': *o++ = '"'; break;
            case '\\': *o++ = '\\'; break;
            case '\b': *o++ = 'b'; break;
            case '\f': *o++ = 'f'; break;
            case '\n': *o++ = 'n'; break;
            case '\r': *o++ = 'r'; break;
            case '\t': *o++ = 't'; break;
            default:
                *o++ = 'u';
                *o++ = '0';
                *o++ = '0';
                *o++ = HEX[c >> 4];
                *o++ = HEX[c & 15];
        }
    }
    *o++ = '"';
    b->len = o - b->data;
    return RC_OK;
}

/* ------------------------------------------------------------------ shortest float digits */

/*
 * Python's repr(float) without PyOS_double_to_string's cost (a malloc and big-number arithmetic):
 * the shortest digits that read back as the double and, of those, the nearest to it, found with
 * one 64-bit approximation of a power of ten and *proven* from that approximation's error bound,
 * or "not sure" (0), and then the caller asks PyOS_double_to_string. It never guesses.
 *
 * The double v, its rounding interval's bounds lo < v < hi (the midpoints to its neighbours) are
 * multiplied by c ~ 10**k (float_powers.h, nearest to half a unit), each product rounded to 64
 * bits: W, Lo, Hi, each less than one unit (u) from the exact w*, lo*, hi* = (v, lo, hi) * 10**k.
 * So every point of the true interval, bounds included, lies in the open (Lo - u, Hi + u), and
 * every point of [Lo + u, Hi - u] lies strictly inside the true interval.
 *
 *  1. Digits of top = Hi + u, one position at a time, until top truncated to that position's grid
 *     g (a power of ten) is above bottom = Lo - u. Coarser grids had no point in (bottom, top), so
 *     none in the true interval: no shorter string reads back as v (whether or not the bounds
 *     count, as they do in round-half-even reading of an even significand).
 *  2. C: the grid point nearest W. It is the answer if it is provably strictly inside the true
 *     interval (Lo + u <= C <= Hi - u) and provably the grid point nearest w* (|C - W| <= g/2 - u:
 *     no tie, no nearer neighbour): then the shortest length is this grid's, and of its points in
 *     the interval C is the nearest to v, which is what repr prints. Anything else: not sure.
 * Near-ties and digits within an error unit of a bound are what fail, a fraction of a percent.
 */
#include "float_powers.h"

/* The high 64 bits of a * b, rounded to nearest: at most half a unit off. */
static inline uint64_t mul_hi_rounded(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__) && !defined(TT_NO_INT128)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)((p + ((unsigned __int128)1 << 63)) >> 64);
#else
    uint64_t a1 = a >> 32, a0 = a & 0xffffffffULL, b1 = b >> 32, b0 = b & 0xffffffffULL;
    uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    /* Bits 32..63 of the sum and the rounding half (2**63 = 2**31 in units of 2**32) carry into the top. */
    uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffULL) + (p10 & 0xffffffffULL) + (1ULL << 31);
    return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
#endif
}

static inline int clz64(uint64_t x) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_clzll(x);
#else
    int n = 0;
    while (!(x >> 63)) {
        x <<= 1;
        n++;
    }
    return n;
#endif
}

static const uint32_t POW10_32[10] = {1u,      10u,      100u,      1000u,      10000u,
                                      100000u, 1000000u, 10000000u, 100000000u, 1000000000u};

/*
 * Step 2 above, with every quantity measured down from top and scaled alike: rest = top - T
 * (T: top truncated to the grid g), dw = top - W, dlo = top - Lo, u the error unit. On success the
 * last digit is lowered to C's and 1 comes back.
 */
static int pick_nearest(char *last, uint64_t rest, uint64_t g, uint64_t dw, uint64_t dlo, uint64_t u) {
    uint64_t r = rest; /* top - C */
    int lowered = 0;
    while (r < dw && dw - r > g / 2) { /* the next grid point down is nearer W (g is even) */
        r += g;
        lowered++;
    }
    uint64_t off = r > dw ? r - dw : dw - r;                    /* |C - W| */
    if (g < 2 * u || off > (g - 2 * u) / 2) return 0;           /* maybe a tie or a nearer point */
    if (r < 2 * u || dlo < u || r > dlo - u) return 0;          /* maybe outside the interval */
    if (lowered >= *last - '0') return 0;                       /* implied by the above; a guard */
    *last = (char)(*last - lowered);
    return 1;
}

/*
 * The shortest digits of a finite double > 0 (bits as stored), without trailing zeros, into
 * digits[0..*count) with *exp10 the decimal exponent of the last one; 0: not sure (see above).
 */
static int shortest_digits(uint64_t bits, char digits[24], int *count, int *exp10) {
    uint64_t mant = bits & ((1ULL << 52) - 1);
    int biased = (int)((bits >> 52) & 0x7ff);
    uint64_t f = biased ? mant | (1ULL << 52) : mant;
    int e = biased ? biased - 1075 : -1074;
    if (f == 0 || biased == 0x7ff) return 0;
    /* hi = (2f + 1) 2**(e-1), normalized; v and lo with the same exponent. */
    uint64_t upper = 2 * f + 1;
    int s = clz64(upper);
    uint64_t hi_sig = upper << s, w_sig = f << (s + 1);
    /* At a power of two (not the smallest normal) the neighbour below is half as far. */
    uint64_t lo_sig = (mant == 0 && biased > 1) ? (4 * f - 1) << (s - 1) : (2 * f - 1) << s;
    int ex = e - 1 - s;
    /* k: the product's unit 2**E with E in [-60, -32], so its integer part has at most 32 bits. */
    int k = ((-ex - 47) * 1233) / 4096, E = 0;
    for (int tries = 0;; tries++) {
        if (tries > 8 || k < POW10_KMIN || k >= POW10_KMIN + POW10_COUNT) return 0;
        E = ex + pow10_table[k - POW10_KMIN].e + 64;
        if (E < -60)
            k++;
        else if (E > -32)
            k--;
        else
            break;
    }
    uint64_t c = pow10_table[k - POW10_KMIN].sig;
    uint64_t W = mul_hi_rounded(w_sig, c), Hi = mul_hi_rounded(hi_sig, c), Lo = mul_hi_rounded(lo_sig, c);
    int shift = -E;
    uint64_t one = 1ULL << shift;
    uint64_t top = Hi + 1; /* Hi <= 2**64 - 2: the product of two 64-bit numbers, rounded */
    uint64_t delta = Hi - Lo + 2, dw = top - W, dlo = top - Lo;
    uint32_t p1 = (uint32_t)(top >> shift); /* >= 4: both factors >= 2**63, shift <= 60 */
    uint64_t p2 = top & (one - 1);
    int n = 0, kappa = 0;
    while (kappa < 10 && p1 >= POW10_32[kappa]) kappa++;
    /* Integer digits: the grid 10**kappa is 10**kappa * one units. */
    while (kappa > 0) {
        kappa--;
        uint32_t d = p1 / POW10_32[kappa];
        p1 %= POW10_32[kappa];
        digits[n++] = (char)('0' + d);
        uint64_t rest = ((uint64_t)p1 << shift) + p2;
        if (rest < delta) {
            if (!pick_nearest(&digits[n - 1], rest, (uint64_t)POW10_32[kappa] << shift, dw, dlo, 1)) return 0;
            *count = n;
            *exp10 = kappa - k;
            return 1;
        }
    }
    /* Fractional digits: everything times ten per digit (dw and dlo once, at the end: both are
     * below delta), the grid stays one. delta < one before each step (rest = p2 < one was not
     * below it), so nothing passes 10 * 2**60 < 2**64. */
    uint64_t u = 1;
    while (n < 20) {
        p2 *= 10;
        delta *= 10;
        u *= 10;
        digits[n++] = (char)('0' + (p2 >> shift));
        p2 &= one - 1;
        kappa--;
        if (p2 < delta) {
            if (!pick_nearest(&digits[n - 1], p2, one, dw * u, dlo * u, u)) return 0;
            *count = n;
            *exp10 = kappa - k;
            return 1;
        }
    }
    return 0;
}

/*
 * repr(v) as PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0) writes it, into out (at least
 * 32 bytes); its length, or 0 when shortest_digits is not sure.
 */
static int float_repr(double v, char *out) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    char *o = out;
    if (bits >> 63) *o++ = '-';
    if ((bits << 1) == 0) {
        memcpy(o, "0.0", 3);
        return (int)(o - out) + 3;
    }
    char digits[24];
    int n, exp10;
    if (!shortest_digits(bits & ~(1ULL << 63), digits, &n, &exp10)) return 0;
    int decpt = n + exp10; /* digits[0] is the 10**(decpt-1) digit */
    if (decpt <= -4 || decpt > 16) {
        *o++ = digits[0];
        if (n > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, (size_t)(n - 1));
            o += n - 1;
        }
        int x = decpt - 1;
        *o++ = 'e';
        *o++ = x < 0 ? '-' : '+';
        if (x < 0) x = -x;
        if (x >= 100) *o++ = (char)('0' + x / 100);
        *o++ = (char)('0' + x / 10 % 10);
        *o++ = (char)('0' + x % 10);
    } else if (decpt <= 0) {
        *o++ = '0';
        *o++ = '.';
        for (int i = decpt; i < 0; i++) *o++ = '0';
        memcpy(o, digits, (size_t)n);
        o += n;
    } else if (decpt < n) {
        memcpy(o, digits, (size_t)decpt);
        o += decpt;
        *o++ = '.';
        memcpy(o, digits + decpt, (size_t)(n - decpt));
        o += n - decpt;
    } else {
        memcpy(o, digits, (size_t)n);
        o += n;
        for (int i = n; i < decpt; i++) *o++ = '0';
        *o++ = '.';
        *o++ = '0';
    }
    return (int)(o - out);
}

/*
 * A finite float as the active serialiser writes it. Both print the shortest
 * repr's digits; json (style 0) as Python's repr, orjson (style 1) in fixed
 * notation for decimal exponents -5..15 and otherwise as 1e-7 / 1e+16.
 * fast = 0 (tests only) skips float_repr, so that both ways are compared.
 */
static int format_float_as(Buf *b, double v, int style, int fast) {
    char text[32];
    char *owned = NULL;
    const char *r = text;
    int len = fast ? float_repr(v, text) : 0;
    if (len == 0) {
        if ((owned = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL)) == NULL) return -1;
        r = owned;
        len = (int)strlen(owned);
    }
    int rc = 0;
    const char *e = memchr(r, 'e', (size_t)len);
    if (style == 0 || e == NULL) {
        rc = buf_put(b, r, len);
    } else {
        int exp = 0; /* the text is not NUL-terminated when float_repr wrote it */
        const char *q = e + 1;
        int minus = (*q == '-');
        if (*q == '-' || *q == '+') q++;
        for (; q < r + len; q++) exp = exp * 10 + (*q - '0');
        if (minus) exp = -exp;
        const char *m = r;
        int negative = (*m == '-');
        if (negative) m++;
        if (exp == -5) {
            /* 1.5e-05 -> 0.000015 */
            rc = negative ? PUT_LIT(b, "-0.0000") : PUT_LIT(b, "0.0000");
            if (rc == 0) rc = buf_put(b, m, 1);
            if (rc == 0 && m + 1 < e) rc = buf_put(b, m + 2, (Py_ssize_t)(e - m - 2)); /* after the '.' */
        } else {
            char tail[16];
            int k = snprintf(tail, sizeof tail, "e%s%d", exp > 0 ? "+" : "-", exp > 0 ? exp : -exp);
            rc = buf_put(b, r, (Py_ssize_t)(e - r));
            if (rc == 0) rc = buf_put(b, tail, k);
        }
    }
    PyMem_Free(owned);
    return rc;
}

static int format_float(Buf *b, double v, int style) { return format_float_as(b, v, style, 1); }

/*
 * The text of recent floats, by their bits: format_float still costs a few hundred instructions
 * (thousands where it falls back to big-number arithmetic) and many values recur, in the statistics' events (percentiles of
 * histogram buckets, zero times) and in metrics (a learning rate). A hit writes the same bytes
 * format_float wrote for the same bits.
 */
#define FCACHE 256 /* a power of two */
#define FTEXT 32   /* the longest text is 24 bytes (-2.2250738585072014e-308, -0.0000 and 17 digits) */
#define TCACHE 64  /* a power of two */
#define TTEXT 48   /* the longest text kept, quotes included */

typedef struct {
    uint64_t bits[FCACHE];
    unsigned char len[FCACHE]; /* 0: empty */
    char text[FCACHE][FTEXT];
    /* Short exact str (span names, statuses, attribute keys: the same few objects in every record) as
       JSON text, by the object (held): put_text copies it instead of escaping it again. */
    PyObject *tkey[TCACHE]; /* strong references; NULL: empty */
    unsigned char tlen[TCACHE];
    char ttext[TCACHE][TTEXT];
    /* Attribute keys the redactor judged not secret, by the object (held): a judgment never changes
       (Redactor.secret caches it), so each key object is looked up in its cache once. */
    PyObject *safe[TCACHE];
} FloatCache;

static void text_cache_clear(FloatCache *fc) {
    for (int i = 0; fc != NULL && i < TCACHE; i++) {
        Py_CLEAR(fc->tkey[i]);
        Py_CLEAR(fc->safe[i]);
    }
}

static inline unsigned text_slot(PyObject *u) {
    return (unsigned)((((uintptr_t)u >> 4) * 0x9E3779B97F4A7C15ULL) >> 58) & (TCACHE - 1);
}

/* Whether the exact str key k may be written unredacted: judged not secret in the redactor's cache. */
static int key_harmless(PyObject *k, PyObject *cache, FloatCache *fc) {
    unsigned i = text_slot(k);
    if (fc != NULL && fc->safe[i] == k) return 1;
    PyObject *known = PyDict_GetItemWithError(cache, k);
    if (known != Py_False) {
        PyErr_Clear();
        return 0;
    }
    if (fc != NULL) Py_XSETREF(fc->safe[i], Py_NewRef(k)); /* (an exact str: its dealloc runs no Python code) */
    return 1;
}

/* put_str for a name, status or key: from the cache when the same str object was written before. */
static int put_text(Buf *b, PyObject *u, FloatCache *fc) {
    if (fc == NULL || !PyUnicode_CheckExact(u) || PyUnicode_GET_LENGTH(u) > TTEXT - 2) return put_str(b, u);
    unsigned i = text_slot(u);
    if (fc->tkey[i] == u) return buf_put(b, fc->ttext[i], fc->tlen[i]);
    Py_ssize_t mark = b->len;
    int rc = put_str(b, u);
    Py_ssize_t n = b->len - mark;
    if (rc == RC_OK && n <= TTEXT) {
        Py_XSETREF(fc->tkey[i], Py_NewRef(u)); /* (an exact str: its dealloc runs no Python code) */
        memcpy(fc->ttext[i], b->data + mark, (size_t)n);
        fc->tlen[i] = (unsigned char)n;
    }
    return rc;
}

static int put_float(Buf *b, double v, int style, FloatCache *fc) {
    if (fc == NULL) return format_float(b, v, style);
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    unsigned i = (unsigned)((bits * 0x9E3779B97F4A7C15ULL) >> 56) & (FCACHE - 1);
    if (fc->len[i] && fc->bits[i] == bits) return buf_put(b, fc->text[i], fc->len[i]);
    Py_ssize_t mark = b->len;
    int rc = format_float(b, v, style);
    Py_ssize_t n = b->len - mark;
    if (rc == 0 && n > 0 && n < FTEXT) {
        memcpy(fc->text[i], b->data + mark, (size_t)n);
        fc->len[i] = (unsigned char)n;
        fc->bits[i] = bits;
    }
    return rc;
}

/* ------------------------------------------------------------------ attrs */

/*
 * The checks of _pipeline.clean_attrs' fast path: a dict of at most 256 str
 * keys (each at most 256 characters) whose values are finite floats, ints
 * within 64 bits, str up to 4096 characters, bools or None; and no key the
 * redactor names (``cache``: Redactor._cache, keys known not secret map to
 * False; NULL: no redaction). Anything else is left to Python.
 */
/* A scalar value the encoder writes as the Python path would (clean_attrs leaves it as it is). */
static int value_plain(PyObject *v) {
    if (PyFloat_CheckExact(v)) return isfinite(PyFloat_AS_DOUBLE(v)) ? RC_OK : RC_YIELD;
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        PyLong_AsLongLongAndOverflow(v, &overflow);
        return overflow ? RC_YIELD : RC_OK;
    }
    if (PyUnicode_CheckExact(v)) return PyUnicode_GET_LENGTH(v) > MAX_STRING ? RC_YIELD : RC_OK;
    return (v == Py_None || v == Py_True || v == Py_False) ? RC_OK : RC_YIELD;
}

/*
 * RC_OK for a dict of string keys (short, judged harmless when redacting) to plain values, or
 * (at the top level only) to dicts of the same: a lifecycle event's ``data``. Its nodes stay far
 * below the sanitizer's MAX_NODES (257 * MAX_ITEMS could not), so nothing is cut.
 */
static int attrs_plain_at(PyObject *d, PyObject *cache, FloatCache *fc, int nested, Py_ssize_t *nodes) {
    if (!PyDict_CheckExact(d) || PyDict_GET_SIZE(d) > MAX_ITEMS) return RC_YIELD;
    *nodes += PyDict_GET_SIZE(d);
    if (*nodes > MAX_NODES) return RC_YIELD;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k) || PyUnicode_GET_LENGTH(k) > MAX_KEY) return RC_YIELD;
        if (cache != NULL && !key_harmless(k, cache, fc)) return RC_YIELD;
        if (value_plain(v) == RC_OK) continue;
        if (nested || !PyDict_CheckExact(v) || attrs_plain_at(v, cache, fc, 1, nodes) != RC_OK) return RC_YIELD;
    }
    return RC_OK;
}

static int attrs_plain(PyObject *d, PyObject *cache, FloatCache *fc) {
    Py_ssize_t nodes = 0;
    return attrs_plain_at(d, cache, fc, 0, &nodes);
}

static int put_attrs(Buf *b, PyObject *d, int style, FloatCache *fc);

/* The items of a dict, without its braces; ``first``: no comma before the first item. */
static int put_items(Buf *b, PyObject *d, int style, FloatCache *fc, int first) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    int rc;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!first && PUT_LIT(b, ",") < 0) return -1;
        first = 0;
        if ((rc = put_text(b, k, fc)) != RC_OK) return rc;
        if (PUT_LIT(b, ":") < 0) return -1;
        if (PyFloat_CheckExact(v)) {
            rc = put_float(b, PyFloat_AS_DOUBLE(v), style, fc);
        } else if (PyLong_CheckExact(v)) {
            rc = put_i64(b, PyLong_AsLongLong(v));
        } else if (PyUnicode_CheckExact(v)) {
            rc = put_str(b, v);
        } else if (v == Py_True) {
            rc = PUT_LIT(b, "true");
        } else if (v == Py_False) {
            rc = PUT_LIT(b, "false");
        } else if (PyDict_CheckExact(v)) {
            rc = put_attrs(b, v, style, fc); /* one level, checked by attrs_plain */
        } else {
            rc = PUT_LIT(b, "null");
        }
        if (rc != RC_OK) return rc;
    }
    return RC_OK;
}

/* Only after attrs_plain() said RC_OK; still RC_YIELD for strings that are not UTF-8. */
static int put_attrs(Buf *b, PyObject *d, int style, FloatCache *fc) {
    int rc;
    if (PUT_LIT(b, "{") < 0) return -1;
    if ((rc = put_items(b, d, style, fc, 1)) != RC_OK) return rc;
    return PUT_LIT(b, "}");
}

/* ------------------------------------------------------------------ encoder object */

#define TYPE_CACHE 4
/* convert() stops once this much is buffered (the training thread waits for the GIL meanwhile). */
#define CHUNK_BYTES (1 << 20)
/* Histogram buckets counted in C between flushes to the Python dict: an open-addressing table
   (a power of two), flushed once it is HBINS_FULL full or the interval ends. */
#define HBINS 256
#define HBINS_FULL 192
#define KCACHE 64 /* a power of two */

typedef struct {
    PyTypeObject *type;    /* strong reference */
    Py_ssize_t offset[NF]; /* a slot's offset (a Python class's __slots__), or -1 */
    getter get[NF];        /* or a C type's getter and setter (the native Span), or NULL: getattr */
    setter set[NF];
    void *closure[NF];
    int core;              /* every field is SpanCore's own (span_core.h): read from the struct */
} FieldMap;

typedef struct {
    PyObject_HEAD
    Buf buf;
    Py_ssize_t count;
    long long first_seq, last_seq; /* valid where has_first, has_last: the buffer's first and last lines */
    int has_first, has_last;
    /* configuration */
    PyObject *threads;      /* dict ident -> native tid */
    PyObject *open;         /* dict id -> span */
    PyObject *cache;        /* Redactor._cache, or NULL when nothing is redacted */
    PyObject *python_names; /* span names the statistics observer must see in Python */
    PyObject *reserved;     /* iteration attributes the statistics read rather than average (_stats.RESERVED) */
    long file_level, dict_level;
    int style;
    /* spans first seen already stopped, less stops of such spans seen since (_pipeline._whole_unstopped) */
    Py_ssize_t whole_unstopped;
    /* iterations the statistics observer has not absorbed yet */
    Py_ssize_t iter_n;
    PyObject *t0s, *last_step, *loop_id, *ident;
    /* (t0, batch_size, tokens, flops) of each iteration that gave any of the three (None: not given) */
    PyObject *consumed;
    /* Read when the batch is taken, not per iteration (names, ids and tids do not change once queued):
       the parent of the latest iterations, not yet looked at, and the latest iteration (its tid). */
    PyObject *parent_pending, *last_span;
    long long first_t0, last_t1, max_t1, sum_dur, min_dur, max_dur;
    FieldMap maps[TYPE_CACHE];
    int next_map;
    /* histogram buckets counted since the last hist_flush, for the dict hbuckets */
    PyObject *hbuckets;
    int hn;                  /* slots in use */
    long long hkey[HBINS];   /* a slot's bucket key, valid where its count is not 0 */
    long long hcount[HBINS]; /* 0: the slot is free */
    /* What RESERVED makes of an attribute key (K_*), by the key object: most spans reuse the same few. */
    PyObject *kkey[KCACHE]; /* strong references */
    unsigned char kclass[KCACHE];
    FloatCache *floats; /* NULL: not allocated (out of memory), floats are formatted every time */
    /* The last thread ident a native span was looked up by, and its threads[] value: valid within one
       convert() call (threads only gains entries, and only in Python, between calls). */
    int tid_cached;
    unsigned long tid_ident;
    long long tid_value;
    Py_ssize_t struct_reads; /* spans read from their struct (view_native), for tests */
} Encoder;

static void clear_batch(Encoder *e) {
    e->iter_n = 0;
    Py_CLEAR(e->t0s);
    Py_CLEAR(e->consumed);
    Py_CLEAR(e->last_step);
    Py_CLEAR(e->loop_id);
    Py_CLEAR(e->ident);
    Py_CLEAR(e->parent_pending);
    Py_CLEAR(e->last_span);
}

static int Encoder_traverse(Encoder *e, visitproc visit, void *arg) {
    Py_VISIT(e->threads);
    Py_VISIT(e->open);
    Py_VISIT(e->cache);
    Py_VISIT(e->python_names);
    Py_VISIT(e->reserved);
    Py_VISIT(e->hbuckets);
    Py_VISIT(e->t0s);
    Py_VISIT(e->consumed);
    Py_VISIT(e->last_step);
    Py_VISIT(e->loop_id);
    Py_VISIT(e->ident);
    Py_VISIT(e->parent_pending);
    Py_VISIT(e->last_span);
    return 0;
}

static int Encoder_clear(Encoder *e) {
    Py_CLEAR(e->threads);
    Py_CLEAR(e->open);
    Py_CLEAR(e->cache);
    Py_CLEAR(e->python_names);
    Py_CLEAR(e->reserved);
    Py_CLEAR(e->hbuckets);
    e->hn = 0;
    memset(e->hcount, 0, sizeof e->hcount);
    clear_batch(e);
    for (int i = 0; i < TYPE_CACHE; i++) Py_CLEAR(e->maps[i].type);
    for (int i = 0; i < KCACHE; i++) Py_CLEAR(e->kkey[i]);
    text_cache_clear(e->floats);
    return 0;
}

static void Encoder_dealloc(Encoder *e) {
    PyObject_GC_UnTrack(e);
    Encoder_clear(e);
    PyMem_Free(e->buf.data);
    PyMem_Free(e->floats);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *Encoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"threads",    "open",       "cache", "python_names", "reserved",
                             "file_level", "dict_level", "style", NULL};
    PyObject *threads, *open, *cache, *names, *reserved;
    long file_level, dict_level;
    int style;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO!O!lli", kwlist, &PyDict_Type, &threads, &PyDict_Type, &open,
                                     &cache, &PyFrozenSet_Type, &names, &PyFrozenSet_Type, &reserved, &file_level,
                                     &dict_level, &style))
        return NULL;
    if (cache != Py_None && !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "cache must be a dict or None");
        return NULL;
    }
    Encoder *e = (Encoder *)type->tp_alloc(type, 0);
    if (e == NULL) return NULL;
    e->threads = Py_NewRef(threads);
    e->open = Py_NewRef(open);
    e->cache = cache == Py_None ? NULL : Py_NewRef(cache);
    e->python_names = Py_NewRef(names);
    e->reserved = Py_NewRef(reserved);
    e->file_level = file_level;
    e->dict_level = dict_level;
    e->style = style;
    e->floats = PyMem_Calloc(1, sizeof(FloatCache)); /* optional: NULL formats every float */
    return (PyObject *)e;
}

/* ------------------------------------------------------------------ field access */

/* Whether a type's every field is SpanCore's own, so that its instances' struct holds what the getters
   return (a subclass that redefines one, as a property or a slot, is read through its getters). */
static int core_fields(PyTypeObject *tp) {
    if (SPAN_CORE == NULL || !PyType_IsSubtype(tp, SPAN_CORE) || tp->tp_getattro != PyObject_GenericGetAttr ||
        tp->tp_setattro != PyObject_GenericSetAttr)
        return 0;
    for (int f = 0; f < NF; f++) {
        PyObject *descr = _PyType_Lookup(tp, FIELD[f]);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyGetSetDescr_Type) || PyDescr_TYPE(descr) != SPAN_CORE) return 0;
    }
    return 1;
}

static FieldMap *field_map(Encoder *e, PyTypeObject *tp) {
    for (int i = 0; i < TYPE_CACHE; i++)
        if (e->maps[i].type == tp) return &e->maps[i];
    FieldMap *m = &e->maps[e->next_map];
    e->next_map = (e->next_map + 1) % TYPE_CACHE;
    Py_XSETREF(m->type, (PyTypeObject *)Py_NewRef(tp));
    for (int f = 0; f < NF; f++) {
        m->offset[f] = -1;
        m->get[f] = NULL;
        m->set[f] = NULL;
        m->closure[f] = NULL;
        if (tp->tp_getattro != PyObject_GenericGetAttr || tp->tp_setattro != PyObject_GenericSetAttr) continue;
        /* What generic getattr would find first: a data descriptor on the type wins over the instance dict. */
        PyObject *descr = _PyType_Lookup(tp, FIELD[f]);
        if (descr == NULL) continue;
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            /* A slot of this type's layout (a descriptor copied onto an unrelated class is not). */
            if (!PyType_IsSubtype(tp, PyDescr_TYPE(descr))) continue;
            PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
            if (def->type == T_OBJECT_EX && !(def->flags & READONLY)) m->offset[f] = def->offset;
        } else if (Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
            if (!PyType_IsSubtype(tp, PyDescr_TYPE(descr))) continue;
            PyGetSetDef *def = ((PyGetSetDescrObject *)descr)->d_getset;
            if (def->get == NULL || def->set == NULL) continue;
            m->get[f] = def->get;
            m->set[f] = def->set;
            m->closure[f] = def->closure;
        }
    }
    m->core = core_fields(tp);
    return m;
}

/* A new reference to obj.<field>, or NULL (no error set) when it has none. */
static PyObject *get(Encoder *e, PyObject *obj, int f) {
    FieldMap *m = field_map(e, Py_TYPE(obj));
    if (m->offset[f] >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + m->offset[f]);
        Py_XINCREF(v);
        return v;
    }
    PyObject *v = m->get[f] ? m->get[f](obj, m->closure[f]) : PyObject_GetAttr(obj, FIELD[f]);
    if (v == NULL) PyErr_Clear();
    return v;
}

static int set(Encoder *e, PyObject *obj, int f, PyObject *value) {
    FieldMap *m = field_map(e, Py_TYPE(obj));
    if (m->offset[f] >= 0) {
        PyObject **slot = (PyObject **)((char *)obj + m->offset[f]);
        Py_XSETREF(*slot, Py_NewRef(value));
        return 0;
    }
    if (m->set[f]) return m->set[f](obj, value, m->closure[f]);
    return PyObject_SetAttr(obj, FIELD[f], value);
}

static int any_i64(PyObject *v, long long *out) {
    if (v == NULL || !PyLong_Check(v)) return RC_YIELD;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return RC_YIELD;
    }
    return RC_OK;
}

/* An exact int within 64 bits (a bool or an IntEnum would be written differently). */
static int as_i64(PyObject *v, long long *out) {
    if (v == NULL || !PyLong_CheckExact(v)) return RC_YIELD;
    return any_i64(v, out);
}

static inline int short_str(PyObject *v, Py_ssize_t limit) {
    return v != NULL && PyUnicode_CheckExact(v) && PyUnicode_GET_LENGTH(v) <= limit;
}

/* ------------------------------------------------------------------ statistics */

/* What the statistics observer (_stats.IterationStats) does with an ended span. */
enum { OBS_NOTHING, OBS_ITERATION, OBS_PHASE, OBS_PYTHON };

/*
 * An interval sum kept in C while convert() runs, instead of a new float and int per value in the
 * dicts: a metric's sum and count (metric_sum, metric_count) or a phase's (phase_sum, phase_count).
 * A slot starts from the dicts' values and adds in the order Python would, so the float it writes
 * back is the one the sequential Python sums would hold (float addition is not associative: a
 * partial sum added to the old one could differ in the last bit). acc_flush() writes the slots
 * back before Python can read the dicts: when convert() returns, or when the table is full.
 */
#define ACC_SLOTS 64 /* a power of two */
#define ACC_FULL 48
enum { ACC_METRIC, ACC_PHASE };

typedef struct {
    PyObject *key; /* strong reference; NULL: the slot is free */
    Py_hash_t hash;
    int kind;      /* ACC_METRIC: fsum; ACC_PHASE: isum */
    int python;    /* the dicts hold what C cannot continue exactly (not a float, an int beyond 64 bits) */
    double fsum;
    long long isum, count;
} Acc;

/* The statistics' state for one convert() call (see _pipeline._convert_native). */
typedef struct {
    PyObject *phase_fields; /* dict: span name -> field (PHASE_FIELDS) */
    PyObject *phase_sum, *phase_count, *metric_sum, *metric_count, *metric_last; /* the interval's dicts */
    PyObject *buckets; /* the interval's LogHistogram._buckets */
    double inv_log;
    int acc_n; /* slots in use */
    Acc acc[ACC_SLOTS];
} Stats;

static int plain_value(PyObject *v) {
    return v == Py_None || v == Py_True || v == Py_False || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
           PyUnicode_CheckExact(v);
}

/* hold(): False without side effects? (iteration with plain values, or a name it ignores) */
static int hold_is_noop(Encoder *e, PyObject *name, PyObject *attrs, PyObject *metrics) {
    int is_iter = name == S_ITERATION || PyUnicode_Compare(name, S_ITERATION) == 0;
    if (!is_iter) return PySet_Contains(e->python_names, name) == 0;
    PyObject *values[2] = {attrs, metrics};
    for (int i = 0; i < 2; i++) {
        PyObject *d = values[i];
        if (d == NULL || d == Py_None) continue;
        if (!PyDict_CheckExact(d)) return 0;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(d, &pos, &k, &v))
            if (!plain_value(v)) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ tensors on the CPU */

static PyObject *S_IS_CPU, *S_IS_FLOATING_POINT, *S_NUMEL, *S_ITEM;
static PyObject *TENSOR_TYPE; /* torch.Tensor, once torch is imported */

/* torch.Tensor (borrowed), or NULL without an error while torch is not imported. */
static PyObject *tensor_type(void) {
    if (TENSOR_TYPE != NULL) return TENSOR_TYPE;
    PyObject *torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");
    if (torch == NULL) return NULL;
    PyObject *type = PyObject_GetAttrString(torch, "Tensor");
    if (type == NULL || !PyType_Check(type)) {
        Py_XDECREF(type);
        PyErr_Clear();
        return NULL;
    }
    TENSOR_TYPE = type; /* kept for the process, as sys.modules keeps torch */
    return type;
}

/* A bool attribute or no-argument method's answer: 1 for True, else 0 (an error is cleared). */
static int answers_true(PyObject *v, PyObject *name, int call) {
    PyObject *r = call ? PyObject_CallMethodNoArgs(v, name) : PyObject_GetAttr(v, name);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    int yes = r == Py_True;
    Py_DECREF(r);
    return yes;
}

/*
 * A one-element floating-point tensor on the CPU, read as a float (a new reference), as the
 * statistics' _read_cpu_floats and the Python path's .item() read it: a read of memory, no
 * device sync. NULL (no error) for anything else, left to Python (a tensor on an accelerator
 * is held for its interval's one read there).
 */
static PyObject *cpu_float(PyObject *v) {
    PyObject *type = tensor_type();
    if (type == NULL) return NULL;
    int is = PyObject_IsInstance(v, type);
    if (is <= 0) {
        PyErr_Clear();
        return NULL;
    }
    if (!answers_true(v, S_IS_CPU, 0) || !answers_true(v, S_IS_FLOATING_POINT, 1)) return NULL;
    PyObject *n = PyObject_CallMethodNoArgs(v, S_NUMEL);
    int one = n != NULL && PyLong_CheckExact(n) && PyLong_AsLong(n) == 1;
    Py_XDECREF(n);
    if (!one) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *number = PyObject_CallMethodNoArgs(v, S_ITEM);
    if (number != NULL && PyFloat_CheckExact(number)) return number;
    Py_XDECREF(number);
    PyErr_Clear();
    return NULL;
}

/* A copy of dict d with its CPU float tensors read (a new reference), or NULL (no error): none read. */
static PyObject *read_cpu_floats(PyObject *d) {
    if (d == NULL || !PyDict_CheckExact(d) || PyDict_GET_SIZE(d) == 0) return NULL;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    int any = 0;
    while (!any && PyDict_Next(d, &pos, &k, &v))
        any = !plain_value(v);
    /* torch looked up only now: by name in sys.modules, which costs a string's hash per look */
    if (!any || tensor_type() == NULL) return NULL;
    /* A snapshot: reading a tensor runs Python code (a subclass's __torch_function__). */
    PyObject *items = PyDict_Items(d), *out = PyDict_Copy(d);
    int read = 0;
    if (items == NULL || out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        if (plain_value(value)) continue;
        PyObject *number = cpu_float(value);
        if (number == NULL) continue;
        int bad = PyDict_SetItem(out, PyTuple_GET_ITEM(pair, 0), number) < 0;
        Py_DECREF(number);
        if (bad) goto fail;
        read = 1;
    }
    Py_DECREF(items);
    if (read) return out;
    Py_DECREF(out);
    return NULL;
fail:
    Py_XDECREF(items);
    Py_XDECREF(out);
    PyErr_Clear();
    return NULL;
}

/* An ended span's attrs and metrics with their CPU float tensors read, in the span and in f. */
static void read_span_tensors(Encoder *e, PyObject *span, PyObject **attrs, PyObject **metrics, int fa, int fm) {
    PyObject **slots[2] = {attrs, metrics};
    int fields[2] = {fa, fm};
    for (int i = 0; i < 2; i++) {
        PyObject *read = read_cpu_floats(*slots[i]);
        if (read == NULL) continue;
        if (set(e, span, fields[i], read) < 0) {
            PyErr_Clear(); /* left as it was, to Python */
            Py_DECREF(read);
            continue;
        }
        Py_SETREF(*slots[i], read);
    }
}

/* An attribute key of an iteration: averaged (K_PLAIN), its step, num_iterations, or another reserved key. */
enum { K_PLAIN = 1, K_STEP, K_NUM_ITERATIONS, K_RESERVED, K_BATCH, K_TOKENS, K_FLOPS };
#define N_CONSUMED 3 /* K_BATCH, K_TOKENS, K_FLOPS: what a step consumed */

static int is_step_key(PyObject *k) {
    return PyUnicode_Compare(k, S_STEP) == 0 || PyUnicode_Compare(k, S_CURRENT_ITERATION) == 0 ||
           PyUnicode_Compare(k, S_ITERATION) == 0;
}

/* The K_* of an exact str key (the set look-up and comparisons once per key object, not per span). */
static int key_class(Encoder *e, PyObject *k) {
    unsigned i = (unsigned)((((uintptr_t)k >> 4) * 0x9E3779B97F4A7C15ULL) >> 58) & (KCACHE - 1);
    if (e->kkey[i] == k) return e->kclass[i];
    int reserved = PySet_Contains(e->reserved, k);
    if (reserved < 0) {
        PyErr_Clear();
        return K_RESERVED; /* left to Python, which raises the same way */
    }
    int c = !reserved                                      ? K_PLAIN
            : is_step_key(k)                               ? K_STEP
            : PyUnicode_Compare(k, S_NUM_ITERATIONS) == 0 ? K_NUM_ITERATIONS
            : PyUnicode_CompareWithASCIIString(k, "batch_size") == 0 ? K_BATCH
            : PyUnicode_CompareWithASCIIString(k, "tokens") == 0     ? K_TOKENS
            : PyUnicode_CompareWithASCIIString(k, "flops") == 0      ? K_FLOPS
                                                           : K_RESERVED;
    Py_XSETREF(e->kkey[i], Py_NewRef(k));
    e->kclass[i] = (unsigned char)c;
    return c;
}

/*
 * span_ended(), the checks: OBS_ITERATION for a completed step whose reserved
 * keys are only step keys (and num_iterations), with plain values;
 * OBS_PHASE for a sub-phase span (``*field`` set); OBS_NOTHING for a name the
 * statistics ignore; OBS_PYTHON for everything else.
 */
static int observed(Encoder *e, Stats *st, PyObject *name, PyObject *attrs, PyObject *metrics, PyObject *status,
                    PyObject **field, PyObject **step, PyObject **consumed, int *counted) {
    if (name != S_ITERATION && PyUnicode_Compare(name, S_ITERATION) != 0) {
        PyObject *f = PyDict_GetItemWithError(st->phase_fields, name);
        if (f != NULL) {
            /* Not ``ok`` (an ``interrupted`` wait is no part of its phase's mean): Python's statistics decide. */
            if (status == NULL || !PyUnicode_Check(status) || (status != S_OK && PyUnicode_Compare(status, S_OK) != 0))
                return OBS_PYTHON;
            *field = f;
            return OBS_PHASE;
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return OBS_PYTHON;
        }
        if (PySet_Contains(e->python_names, name) != 0) return OBS_PYTHON;
        Py_ssize_t n = PyUnicode_GET_LENGTH(name);
        if (n >= 15 && PyUnicode_Tailmatch(name, S_INIT_SUFFIX, 0, n, 1) != 0) return OBS_PYTHON;
        return OBS_NOTHING;
    }
    if (status == NULL || !PyUnicode_Check(status) || (status != S_OK && PyUnicode_Compare(status, S_OK) != 0))
        return OBS_PYTHON;
    PyObject *values[2] = {attrs, metrics};
    for (int i = 0; i < 2; i++) {
        PyObject *d = values[i];
        if (d == NULL || d == Py_None) continue;
        if (!PyDict_CheckExact(d)) return OBS_PYTHON;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(d, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k) || !plain_value(v)) return OBS_PYTHON;
            /* NaN or infinite (a diverged loss): _iteration adds its non_finite_metric event */
            if (PyFloat_CheckExact(v) && !isfinite(PyFloat_AS_DOUBLE(v))) return OBS_PYTHON;
            int cls = key_class(e, k);
            if (cls == K_RESERVED) return OBS_PYTHON; /* skipped */
            if (cls == K_STEP)
                *step = v; /* borrowed: the caller takes a reference */
            else if (cls >= K_BATCH)
                consumed[cls - K_BATCH] = v; /* borrowed, as step; the last given wins, as in _iteration */
            else if (cls == K_PLAIN && v != Py_None)
                *counted = 1; /* a mean or a last value for count_iteration */
        }
    }
    return OBS_ITERATION;
}

static int add_to(PyObject *dict, PyObject *key, PyObject *amount, PyObject *start) {
    PyObject *old = PyDict_GetItemWithError(dict, key);
    if (old == NULL && PyErr_Occurred()) return -1;
    PyObject *sum = PyNumber_Add(old ? old : start, amount);
    if (sum == NULL) return -1;
    int rc = PyDict_SetItem(dict, key, sum);
    Py_DECREF(sum);
    return rc;
}

static PyObject *ZERO_F, *ZERO_I, *ONE;

/* Add the bucket counts kept in C to the histogram's dict. */
static int hist_flush(Encoder *e) {
    int rc = 0;
    for (int i = 0; i < HBINS && e->hn; i++) {
        if (e->hcount[i] == 0) continue;
        if (rc == 0) {
            PyObject *key = PyLong_FromLongLong(e->hkey[i]);
            PyObject *count = PyLong_FromLongLong(e->hcount[i]);
            rc = (key && count) ? add_to(e->hbuckets, key, count, ZERO_I) : -1;
            Py_XDECREF(key);
            Py_XDECREF(count);
        }
        e->hcount[i] = 0; /* after a failure too: the table is left empty */
        e->hn--;
    }
    e->hn = 0;
    Py_CLEAR(e->hbuckets);
    return rc;
}

/* An int from a sums dict as C continues it: 0 when absent; RC_YIELD when not an exact int within 64 bits. */
static int load_i64(PyObject *dict, PyObject *key, long long *out) {
    PyObject *v = PyDict_GetItemWithError(dict, key);
    *out = 0;
    if (v == NULL) return PyErr_Occurred() ? -1 : RC_OK;
    return as_i64(v, out);
}

/* Write a slot's sum and count back into its dicts (already holding the key, so nothing is reordered). */
static int acc_store(Stats *st, Acc *a) {
    PyObject *sums = a->kind == ACC_METRIC ? st->metric_sum : st->phase_sum;
    PyObject *counts = a->kind == ACC_METRIC ? st->metric_count : st->phase_count;
    PyObject *sum = a->kind == ACC_METRIC ? PyFloat_FromDouble(a->fsum) : PyLong_FromLongLong(a->isum);
    PyObject *count = PyLong_FromLongLong(a->count);
    int rc = (sum && count && PyDict_SetItem(sums, a->key, sum) == 0 && PyDict_SetItem(counts, a->key, count) == 0)
                 ? 0
                 : -1;
    Py_XDECREF(sum);
    Py_XDECREF(count);
    return rc;
}

/* Every slot back into the dicts, and the table emptied (after a failure too: those values are lost). */
static int acc_flush(Stats *st) {
    int rc = 0;
    for (int i = 0; i < ACC_SLOTS && st->acc_n; i++) {
        Acc *a = &st->acc[i];
        if (a->key == NULL) continue;
        if (!a->python && acc_store(st, a) < 0) {
            PyErr_Clear();
            rc = -1;
        }
        Py_CLEAR(a->key);
        st->acc_n--;
    }
    st->acc_n = 0;
    return rc;
}

/*
 * The slot of (kind, key), set up on first sight from the dicts' values, the key added to the dicts
 * now (with its values so far) so that they keep the order Python's first insertion gives them.
 * NULL on failure (an error set).
 */
static Acc *acc_slot(Stats *st, PyObject *key, int kind, int *fresh) {
    *fresh = 0;
    Py_hash_t hash = PyObject_Hash(key); /* a str: cached */
    if (hash == -1) return NULL;
    for (int pass = 0; pass < 2; pass++) {
        unsigned i = (unsigned)((((unsigned long long)hash ^ (unsigned long long)kind) * 0x9E3779B97F4A7C15ULL) >> 58);
        for (;; i = (i + 1) & (ACC_SLOTS - 1)) {
            Acc *a = &st->acc[i];
            if (a->key == NULL) break;
            if (a->kind == kind &&
                (a->key == key || (a->hash == hash && PyUnicode_Compare(a->key, key) == 0)))
                return a;
        }
        if (st->acc_n < ACC_FULL) break;
        acc_flush(st); /* full: nothing is lost, the values are in the dicts */
    }
    unsigned i = (unsigned)((((unsigned long long)hash ^ (unsigned long long)kind) * 0x9E3779B97F4A7C15ULL) >> 58);
    while (st->acc[i].key != NULL) i = (i + 1) & (ACC_SLOTS - 1);
    Acc *a = &st->acc[i];
    PyObject *sums = kind == ACC_METRIC ? st->metric_sum : st->phase_sum;
    PyObject *counts = kind == ACC_METRIC ? st->metric_count : st->phase_count;
    int rc_count = load_i64(counts, key, &a->count);
    if (rc_count < 0) return NULL;
    a->python = rc_count != RC_OK;
    a->fsum = 0.0;
    a->isum = 0;
    if (kind == ACC_METRIC) {
        PyObject *v = PyDict_GetItemWithError(sums, key);
        if (v == NULL && PyErr_Occurred()) return NULL;
        if (v != NULL) {
            if (PyFloat_CheckExact(v))
                a->fsum = PyFloat_AS_DOUBLE(v);
            else
                a->python = 1;
        }
    } else {
        int rc_sum = load_i64(sums, key, &a->isum);
        if (rc_sum < 0) return NULL;
        if (rc_sum != RC_OK) a->python = 1;
    }
    a->key = Py_NewRef(key);
    a->hash = hash;
    a->kind = kind;
    st->acc_n++;
    *fresh = 1;
    return a;
}

/* Python's ``sums[key] = sums.get(key, start) + value; counts[key] = counts.get(key, 0) + 1``. */
static int add_python(Stats *st, Acc *a, PyObject *value, PyObject *start) {
    PyObject *sums = a->kind == ACC_METRIC ? st->metric_sum : st->phase_sum;
    PyObject *counts = a->kind == ACC_METRIC ? st->metric_count : st->phase_count;
    if (add_to(sums, a->key, value, start) < 0) return -1;
    return add_to(counts, a->key, ONE, ZERO_I);
}

static int acc_metric(Stats *st, PyObject *key, PyObject *value) {
    int fresh;
    Acc *a = acc_slot(st, key, ACC_METRIC, &fresh);
    if (a == NULL) return -1;
    if (!a->python && a->count < LLONG_MAX) {
        a->fsum += PyFloat_AS_DOUBLE(value);
        a->count++;
        /* A slot new since the last flush writes its first value at once: a new key enters the dicts in
           the order Python's first insertion would give it. */
        return fresh ? acc_store(st, a) : 0;
    }
    if (!a->python) {
        a->python = 1;
        if (acc_store(st, a) < 0) return -1;
    }
    return add_python(st, a, value, ZERO_F);
}

static int acc_phase(Stats *st, PyObject *key, long long dur) {
    int fresh;
    Acc *a = acc_slot(st, key, ACC_PHASE, &fresh);
    if (a == NULL) return -1;
    int fits = dur >= 0 ? a->isum <= LLONG_MAX - dur : a->isum >= LLONG_MIN - dur;
    if (!a->python && fits && a->count < LLONG_MAX) {
        a->isum += dur;
        a->count++;
        return fresh ? acc_store(st, a) : 0;
    }
    if (!a->python) {
        a->python = 1; /* beyond 64 bits: Python ints from here on */
        if (acc_store(st, a) < 0) return -1;
    }
    PyObject *d = PyLong_FromLongLong(dur);
    if (d == NULL) return -1;
    int rc = add_python(st, a, d, ZERO_I);
    Py_DECREF(d);
    return rc;
}

/* _iteration's sums for a checked iteration: metric means and last values, the histogram, the interval. */
/* The pending parent's id becomes the loop's if it is a training loop (_iteration's ``self._loop_id``). */
static void resolve_parent(Encoder *e) {
    PyObject *parent = e->parent_pending;
    if (parent == NULL) return;
    e->parent_pending = NULL;
    if (parent != Py_None) {
        PyObject *pname = get(e, parent, F_NAME);
        if (pname != NULL && PyUnicode_Check(pname) && PyUnicode_Compare(pname, S_TRAINING_LOOP) == 0) {
            PyObject *pid = get(e, parent, F_ID);
            if (pid != NULL) Py_XSETREF(e->loop_id, pid);
        }
        Py_XDECREF(pname);
    }
    Py_DECREF(parent);
    PyErr_Clear();
}

/* ``step``: observed()'s (the last step key's value, or Py_None); ``counted``: whether any key is averaged or kept. */
static int count_iteration(Encoder *e, Stats *st, PyObject *span, PyObject *parent, PyObject *attrs,
                           PyObject *metrics, long long t0, long long t1, int want_t0, PyObject *step,
                           PyObject **consumed, int counted) {
    long long dur = t1 - t0;
    int shadow = attrs != Py_None && PyDict_GET_SIZE(attrs) && metrics != Py_None && PyDict_GET_SIZE(metrics);
    PyObject *values[2] = {attrs, metrics};
    for (int i = 0; i < 2 && counted; i++) {
        PyObject *d = values[i];
        if (d == Py_None) continue;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(d, &pos, &k, &v)) {
            if (key_class(e, k) != K_PLAIN) continue;
            if (shadow && i == 0 && PyDict_Contains(metrics, k) != 0) continue;
            if (PyFloat_CheckExact(v)) {
                if (acc_metric(st, k, v) < 0) return -1;
            } else if (v != Py_None) {
                if (PyDict_SetItem(st->metric_last, k, v) < 0) return -1;
            }
        }
    }
    /* LogHistogram.add_many's bucket, for this duration (counted here, added to the dict in hist_flush) */
    long long key = dur > 0 ? (long long)floor(log((double)dur) * st->inv_log) : -(1LL << 30);
    if (e->hbuckets != st->buckets || e->hn >= HBINS_FULL) {
        if (hist_flush(e) < 0) return -1;
        e->hbuckets = Py_NewRef(st->buckets);
    }
    /* hn < HBINS_FULL < HBINS: probing finds the key's slot or a free one */
    unsigned bin = (unsigned)(((unsigned long long)key * 0x9E3779B97F4A7C15ULL) >> 56) & (HBINS - 1);
    while (e->hcount[bin] != 0 && e->hkey[bin] != key) bin = (bin + 1) & (HBINS - 1);
    if (e->hcount[bin] == 0) {
        e->hkey[bin] = key;
        e->hn++;
    }
    e->hcount[bin]++;
    if (consumed[0] != NULL || consumed[1] != NULL || consumed[2] != NULL) {
        /* absorb() counts them as _iteration would, looking up step_info for any not given */
        if (e->consumed == NULL && (e->consumed = PyList_New(0)) == NULL) return -1;
        PyObject *row = Py_BuildValue("LOOO", t0, consumed[0] ? consumed[0] : Py_None,
                                      consumed[1] ? consumed[1] : Py_None, consumed[2] ? consumed[2] : Py_None);
        if (row == NULL || PyList_Append(e->consumed, row) < 0) {
            Py_XDECREF(row);
            return -1;
        }
        Py_DECREF(row);
    } else if (want_t0) {
        if (e->t0s == NULL && (e->t0s = PyList_New(0)) == NULL) return -1;
        PyObject *t = PyLong_FromLongLong(t0);
        if (t == NULL || PyList_Append(e->t0s, t) < 0) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    if (e->iter_n == 0) {
        e->first_t0 = t0;
        e->max_t1 = t1;
        e->min_dur = e->max_dur = dur;
        e->sum_dur = 0;
    }
    e->sum_dur += dur;
    if (dur < e->min_dur) e->min_dur = dur;
    if (dur > e->max_dur) e->max_dur = dur;
    e->last_t1 = t1;
    if (t1 > e->max_t1) e->max_t1 = t1;
    Py_XSETREF(e->last_step, Py_NewRef(step));
    /* Consecutive iterations share their parent: it is looked at once, when another follows or the batch is taken. */
    if (parent != NULL && parent != e->parent_pending) {
        resolve_parent(e);
        e->parent_pending = Py_NewRef(parent);
    }
    Py_XSETREF(e->last_span, Py_NewRef(span));
    e->iter_n++;
    return 0;
}

static int count_phase(Stats *st, PyObject *field, long long t0, long long t1) {
    return acc_phase(st, field, t1 - t0);
}

/* ------------------------------------------------------------------ records */

typedef struct {
    long long wall0;
    long long seq;
    int mode; /* 0: no observer; 1: the statistics observer only; 2: others (Python sees every end) */
    Py_ssize_t steps_left;
    int want_t0;
    int interval_done; /* the iteration that completes the interval was counted: Python emits its event */
    Stats st; /* mode 1 */
} Ctx;

/* Begin a record's line: {"seq":N,"kind":"<kind>","ts":T,"name":"..." */
static int put_head(Encoder *e, long long seq, const char *kind, long long ts, PyObject *name) {
    Buf *b = &e->buf;
    if (PUT_LIT(b, "{\"seq\":") < 0 || put_i64(b, seq) < 0 || PUT_LIT(b, ",\"kind\":\"") < 0 ||
        buf_put(b, kind, (Py_ssize_t)strlen(kind)) < 0 || PUT_LIT(b, "\",\"ts\":") < 0 || put_i64(b, ts) < 0 ||
        PUT_LIT(b, ",\"name\":") < 0)
        return -1;
    return put_text(b, name, e->floats);
}

static int put_field(Buf *b, const char *key, long long v) {
    if (buf_put(b, key, (Py_ssize_t)strlen(key)) < 0) return -1;
    return put_i64(b, v);
}

/* The line is complete in the buffer: count it. */
static int end_line(Encoder *e, long long seq) {
    if (PUT_LIT(&e->buf, "}\n") < 0) return -1;
    if (!e->has_first) {
        e->first_seq = seq;
        e->has_first = 1;
    }
    e->last_seq = seq;
    e->has_last = 1;
    e->count++;
    return 0;
}

/*
 * Encode one record into the buffer unless its level is beyond the file's; a
 * line cut short (a string that is not UTF-8) is rolled back and RC_YIELD
 * returned, which the callers check before changing any state.
 */
typedef struct {
    const char *kind;
    long long ts;
    PyObject *name;
    int has_id;
    long long id, parent, tid, dur;
    int has_parent, has_tid, has_dur;
    long long span; /* events */
    int has_span;
    PyObject *status;
    PyObject *attrs; /* checked dict or NULL */
    PyObject *step;  /* or NULL; else attrs are {"step": step, **attrs} (a native iteration's, checked) */
} Rec;

static int put_record(Encoder *e, long long seq, Rec *r) {
    Buf *b = &e->buf;
    Py_ssize_t mark = b->len;
    int rc = put_head(e, seq, r->kind, r->ts, r->name);
    if (rc != RC_OK) goto done;
    if (r->has_span && (rc = put_field(b, ",\"span\":", r->span)) != RC_OK) goto done;
    if (r->has_id && (rc = put_field(b, ",\"id\":", r->id)) != RC_OK) goto done;
    if (r->has_parent && (rc = put_field(b, ",\"parent\":", r->parent)) != RC_OK) goto done;
    if (r->has_tid && (rc = put_field(b, ",\"tid\":", r->tid)) != RC_OK) goto done;
    if (r->has_dur && (rc = put_field(b, ",\"dur\":", r->dur)) != RC_OK) goto done;
    if (r->status != NULL) {
        if ((rc = PUT_LIT(b, ",\"status\":")) != RC_OK) goto done;
        if ((rc = put_text(b, r->status, e->floats)) != RC_OK) goto done;
    }
    if (r->step != NULL) {
        if ((rc = PUT_LIT(b, ",\"attrs\":{\"step\":")) != RC_OK) goto done;
        if ((rc = put_i64(b, PyLong_AsLongLong(r->step))) != RC_OK) goto done;
        if (r->attrs != NULL && (rc = put_items(b, r->attrs, e->style, e->floats, 0)) != RC_OK) goto done;
        if ((rc = PUT_LIT(b, "}")) != RC_OK) goto done;
    } else if (r->attrs != NULL) {
        if ((rc = PUT_LIT(b, ",\"attrs\":")) != RC_OK) goto done;
        if ((rc = put_attrs(b, r->attrs, e->style, e->floats)) != RC_OK) goto done;
    }
    rc = end_line(e, seq);
done:
    if (rc != RC_OK) b->len = mark;
    return rc;
}

/* attrs as a record holds them: NULL (none), or a checked dict; RC_YIELD for anything else. */
static int record_attrs(Encoder *e, PyObject *attrs, PyObject **out) {
    *out = NULL;
    if (attrs == NULL || attrs == Py_None) return RC_OK;
    if (!PyDict_CheckExact(attrs)) return RC_YIELD;
    if (PyDict_GET_SIZE(attrs) == 0) return RC_OK;
    if (attrs_plain(attrs, e->cache, e->floats) != RC_OK) return RC_YIELD;
    *out = attrs;
    return RC_OK;
}

static int level_of(Encoder *e, PyObject *level, int *write) {
    long long lv;
    if (any_i64(level, &lv) != RC_OK) return RC_YIELD;
    if (lv <= e->dict_level) return RC_YIELD; /* a backend wants the record as a dict */
    *write = lv <= e->file_level;
    return RC_OK;
}

#define NEED(cond) \
    do {           \
        if (!(cond)) goto out; \
    } while (0)

static int do_event(Encoder *e, PyObject *item, Ctx *c) {
    /* (EVENT, name, attrs, span_id, ident, mono, level) */
    if (PyTuple_GET_SIZE(item) != 7) return RC_YIELD;
    long long tag;
    if (any_i64(PyTuple_GET_ITEM(item, 0), &tag) != RC_OK || tag != EVENT_TAG) return RC_YIELD;
    PyObject *name = PyTuple_GET_ITEM(item, 1);
    if (!short_str(name, MAX_KEY)) return RC_YIELD;
    Rec r = {.kind = "event", .name = name, .has_span = 1, .has_tid = 1};
    PyObject *attrs = PyTuple_GET_ITEM(item, 2);
    if (record_attrs(e, attrs, &r.attrs) != RC_OK) return RC_YIELD;
    if (as_i64(PyTuple_GET_ITEM(item, 3), &r.span) != RC_OK) return RC_YIELD;
    PyObject *tid = PyDict_GetItemWithError(e->threads, PyTuple_GET_ITEM(item, 4));
    if (tid == NULL || as_i64(tid, &r.tid) != RC_OK) {
        PyErr_Clear();
        return RC_YIELD;
    }
    long long mono;
    if (as_i64(PyTuple_GET_ITEM(item, 5), &mono) != RC_OK || !MONO_OK(mono)) return RC_YIELD;
    r.ts = c->wall0 + mono;
    int write = 0;
    if (level_of(e, PyTuple_GET_ITEM(item, 6), &write) != RC_OK) return RC_YIELD;
    if (write) {
        int rc = put_record(e, c->seq, &r);
        if (rc != RC_OK) return rc;
    }
    c->seq++;
    return RC_OK;
}

/* ------------------------------------------------------------------ spans */

/* A queued span's fields, read once, before anything changes: new references (or values). */
typedef struct {
    PyObject *name, *attrs, *metrics, *level, *status, *link, *parent;
    PyObject *step;    /* a native iteration's int step, for which attrs (then None) stands as {"step": step} */
    PyObject *ident;   /* the thread's ident as an object (the getters' path), or NULL */
    unsigned long raw_ident; /* the thread's ident (the native path) */
    long long written, id, t0, t1, parent_id;
    int stopped, native;
} View;

static void view_clear(View *v) {
    Py_CLEAR(v->name);
    Py_CLEAR(v->attrs);
    Py_CLEAR(v->metrics);
    Py_CLEAR(v->level);
    Py_CLEAR(v->status);
    Py_CLEAR(v->link);
    Py_CLEAR(v->parent);
    Py_CLEAR(v->step);
    Py_CLEAR(v->ident);
}

/* The common checks of a view, whichever way it was read. */
static int view_usable(View *v) {
    if (!short_str(v->name, MAX_KEY) || v->attrs == NULL || v->metrics == NULL || v->status == NULL ||
        v->level == NULL || v->link == NULL || v->parent == NULL || !MONO_OK(v->t0))
        return RC_YIELD;
    if (v->stopped && (v->t1 == 0 || !MONO_OK(v->t1))) return RC_YIELD;
    return RC_OK;
}

/* A native span, read from its struct. RC_YIELD where it must be read through its getters. */
static int view_native(Encoder *e, SpanCore *s, View *v) {
    if (s->attrs_step) {
        /* {"step": step} merged with metrics that name a step of their own: left to the generic path */
        if (!PyLong_CheckExact(s->attrs) || value_plain(s->attrs) != RC_OK) return RC_YIELD;
        if (s->metrics != Py_None && (!PyDict_CheckExact(s->metrics) || PyDict_Contains(s->metrics, S_STEP) != 0)) {
            PyErr_Clear();
            return RC_YIELD;
        }
        if (e->cache != NULL && !key_harmless(S_STEP, e->cache, e->floats))
            return RC_YIELD; /* "step" not judged harmless by the redactor yet */
        v->step = Py_NewRef(s->attrs);
        v->attrs = Py_NewRef(Py_None);
    } else {
        v->attrs = Py_NewRef(s->attrs);
    }
    v->native = 1;
    v->written = s->written;
    v->name = Py_NewRef(s->name);
    v->metrics = Py_NewRef(s->metrics);
    v->level = Py_NewRef(s->level);
    v->status = Py_NewRef(s->status);
    v->link = Py_NewRef(s->link);
    v->parent = Py_NewRef(s->parent);
    v->id = s->id;
    v->t0 = s->t0;
    v->stopped = s->has_t1;
    v->t1 = s->has_t1 ? s->t1 : 0;
    v->raw_ident = s->tid;
    if (v->parent != Py_None) {
        if (!PyObject_TypeCheck(v->parent, SPAN_CORE)) return RC_YIELD;
        v->parent_id = ((SpanCore *)v->parent)->id;
    }
    return view_usable(v);
}

static int get_i64(Encoder *e, PyObject *obj, int f, long long *out) {
    PyObject *value = get(e, obj, f);
    int rc = as_i64(value, out);
    Py_XDECREF(value);
    return rc;
}

/* Any span, through its getters (or slots). */
static int view_generic(Encoder *e, PyObject *span, View *v) {
    if (get_i64(e, span, F_WRITTEN, &v->written) != RC_OK || get_i64(e, span, F_T0, &v->t0) != RC_OK ||
        get_i64(e, span, F_ID, &v->id) != RC_OK)
        return RC_YIELD;
    PyObject *t1 = get(e, span, F_T1);
    if (t1 == NULL) return RC_YIELD;
    v->stopped = t1 != Py_None;
    int rc = v->stopped ? as_i64(t1, &v->t1) : RC_OK;
    Py_DECREF(t1);
    if (rc != RC_OK) return RC_YIELD;
    v->name = get(e, span, F_NAME);
    v->attrs = get(e, span, F_ATTRS);
    v->metrics = get(e, span, F_METRICS);
    v->level = get(e, span, F_LEVEL);
    v->status = get(e, span, F_STATUS);
    v->link = get(e, span, F_LINK);
    v->parent = get(e, span, F_PARENT);
    v->ident = get(e, span, F_TID);
    if (v->ident == NULL) return RC_YIELD;
    if (v->parent != NULL && v->parent != Py_None && get_i64(e, v->parent, F_ID, &v->parent_id) != RC_OK)
        return RC_YIELD;
    return view_usable(v);
}

static int view_read(Encoder *e, PyObject *span, View *v) {
    if (SPAN_CORE != NULL && field_map(e, Py_TYPE(span))->core) {
        if (view_native(e, (SpanCore *)span, v) == RC_OK) {
            e->struct_reads++;
            return RC_OK;
        }
        view_clear(v);
        memset(v, 0, sizeof *v);
    }
    return view_generic(e, span, v);
}

/* The stream's id of the span's thread (threads[ident]); RC_YIELD for a thread Python has not named yet. */
static int view_thread(Encoder *e, View *v, long long *out) {
    PyObject *key = v->ident;
    if (key == NULL) {
        if (e->tid_cached && e->tid_ident == v->raw_ident) {
            *out = e->tid_value;
            return RC_OK;
        }
        key = PyLong_FromUnsignedLong(v->raw_ident);
        if (key == NULL) {
            PyErr_Clear();
            return RC_YIELD;
        }
    } else {
        Py_INCREF(key);
    }
    PyObject *tid = PyDict_GetItemWithError(e->threads, key);
    Py_DECREF(key);
    if (tid == NULL) PyErr_Clear();
    if (as_i64(tid, out) != RC_OK) return RC_YIELD;
    if (v->ident == NULL) {
        e->tid_cached = 1;
        e->tid_ident = v->raw_ident;
        e->tid_value = *out;
    }
    return RC_OK;
}

static void view_set_written(Encoder *e, PyObject *span, View *v, int state) {
    if (v->native)
        ((SpanCore *)span)->written = state;
    else if (set(e, span, F_WRITTEN, SMALL[state]) < 0)
        PyErr_Clear();
}

/* The open spans' table (_pipeline's ``_open``): add (``span``) or remove (NULL) the span's id. */
static void view_open(Encoder *e, View *v, PyObject *span) {
    PyObject *id = PyLong_FromLongLong(v->id);
    if (id == NULL || (span ? PyDict_SetItem(e->open, id, span) : PyDict_DelItem(e->open, id)) < 0)
        PyErr_Clear(); /* out of memory after the record is in the buffer: Python must not write it again */
    Py_XDECREF(id);
}

static int do_span(Encoder *e, PyObject *span, Ctx *c) {
    View v = {0};
    PyObject *merged = NULL, *step = NULL;
    PyObject *consumed[N_CONSUMED] = {NULL, NULL, NULL};
    int rc = RC_YIELD;
    NEED(view_read(e, span, &v) == RC_OK);
    long long t0 = v.t0, t1 = v.t1;

    if (v.written != 0) {
        /* Second sighting: the span's stop. */
        int obs = OBS_NOTHING, counted = 0;
        PyObject *field = NULL;
        if (v.written != W_OPEN && c->mode == 0) {
            e->whole_unstopped--;
            rc = RC_OK;
            goto out;
        }
        NEED(c->mode != 2 && v.stopped);
        read_span_tensors(e, span, &v.attrs, &v.metrics, F_ATTRS, F_METRICS);
        if (c->mode == 1) {
            if (v.written == W_OPEN) NEED(hold_is_noop(e, v.name, v.attrs, v.metrics));
            PyObject *step_seen = v.step ? v.step : Py_None;
            obs = observed(e, &c->st, v.name, v.attrs, v.metrics, v.status, &field, &step_seen, consumed, &counted);
            /* Borrowed until here (released at out, whatever observed() said) */
            for (int i = 0; i < N_CONSUMED; i++) Py_XINCREF(consumed[i]);
            NEED(obs != OBS_PYTHON);
            step = Py_NewRef(step_seen); /* setting ``written`` below may run Python code that changes attrs */
            if (obs == OBS_ITERATION) {
                NEED(t1 - t0 < (1LL << 53));
                if (e->iter_n + 1 >= c->steps_left) {
                    /* The iteration that completes an interval: its event goes before its end record, so a
                       span whose start alone is written is left to Python; one already written whole is
                       counted here and convert() returns for Python to add the event after it. */
                    NEED(v.written != W_OPEN);
                    c->interval_done = 1;
                }
            }
        }
        if (v.written == W_OPEN) {
            Rec r = {.kind = "end", .ts = c->wall0 + t1, .name = v.name, .has_id = 1, .has_dur = 1, .id = v.id};
            r.dur = t1 - t0;
            NEED(PyUnicode_Check(v.status));
            r.status = v.status;
            PyObject *metrics = v.metrics;
            if (metrics != Py_None) {
                NEED(PyDict_CheckExact(metrics));
                if (PyDict_GET_SIZE(metrics)) {
                    NEED(attrs_plain(metrics, e->cache, e->floats) == RC_OK);
                    r.attrs = metrics;
                }
            }
            int write = 0;
            NEED(level_of(e, v.level, &write) == RC_OK);
            if (write) {
                rc = put_record(e, c->seq, &r);
                if (rc != RC_OK) goto out;
            }
            /* From here on the item is done: state changes. */
            c->seq++;
            view_open(e, &v, NULL);
            view_set_written(e, span, &v, W_DONE);
        }
        if (obs == OBS_ITERATION && count_iteration(e, &c->st, span, v.parent, v.attrs, v.metrics, t0, t1,
                                                    c->want_t0, step, consumed, counted) < 0)
            PyErr_Clear();
        if (obs == OBS_PHASE && count_phase(&c->st, field, t0, t1) < 0) PyErr_Clear();
        if (v.written != W_OPEN) e->whole_unstopped--;
        rc = RC_OK;
        goto out;
    }

    /* First sighting: a whole span (already stopped) or its start. */
    if (v.stopped && c->mode != 2) read_span_tensors(e, span, &v.attrs, &v.metrics, F_ATTRS, F_METRICS);
    if (v.stopped && c->mode != 0) {
        NEED(c->mode == 1 && hold_is_noop(e, v.name, v.attrs, v.metrics));
    }
    Rec r = {.name = v.name, .has_id = 1, .has_parent = 1, .has_tid = 1, .ts = c->wall0 + t0, .id = v.id,
             .parent = v.parent_id, .step = v.step};
    NEED(view_thread(e, &v, &r.tid) == RC_OK);
    NEED(v.link == Py_None);
    PyObject *attrs = v.attrs;
    if (v.stopped) {
        r.kind = "span";
        r.has_dur = 1;
        r.dur = t1 - t0;
        NEED(PyUnicode_Check(v.status));
        r.status = v.status;
        PyObject *metrics = v.metrics;
        if (metrics != Py_None) {
            NEED(PyDict_CheckExact(metrics));
            if (PyDict_GET_SIZE(metrics)) {
                /* _merge: {**attrs, **metrics} if attrs else metrics (a step in attrs: see view_native) */
                if (attrs != Py_None) {
                    NEED(PyDict_CheckExact(attrs));
                }
                if (attrs != Py_None && PyDict_GET_SIZE(attrs)) {
                    merged = PyDict_Copy(attrs);
                    if (merged == NULL || PyDict_Update(merged, metrics) < 0) {
                        PyErr_Clear();
                        goto out;
                    }
                    attrs = merged;
                } else {
                    attrs = metrics;
                }
            }
        }
    } else {
        r.kind = "start";
    }
    NEED(record_attrs(e, attrs, &r.attrs) == RC_OK);
    int write = 0;
    NEED(level_of(e, v.level, &write) == RC_OK);
    if (write) {
        rc = put_record(e, c->seq, &r);
        if (rc != RC_OK) goto out;
    }
    if (!v.stopped) view_open(e, &v, span);
    c->seq++;
    view_set_written(e, span, &v, v.stopped ? W_DONE : W_OPEN);
    if (v.stopped) e->whole_unstopped++;
    rc = RC_OK;
out:
    Py_XDECREF(merged);
    Py_XDECREF(step);
    for (int i = 0; i < N_CONSUMED; i++) Py_XDECREF(consumed[i]);
    view_clear(&v);
    return rc;
}

/* time.perf_counter_ns(), callable without the GIL. */
static long long mono_ns(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t = 0;
    (void)PyTime_PerfCounterRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetPerfCounter();
#endif
}

/* Items converted between two looks at the clock when a time budget is given. */
#define CLOCK_EVERY 16

/*
 * convert(popleft, n, wall0, seq, mode, steps_left, want_t0, stats=None, budget_ns=0) -> (taken, seq, item)
 * Pops up to n items (fewer once CHUNK_BYTES are buffered, or once ``budget_ns`` nanoseconds
 * have passed, when given: the GIL is held throughout, and a thread waiting for it waits that
 * long); ``item`` is the one handed back to Python (None when it stopped without one; True
 * when it counted the iteration that completes the statistics' interval, for Python to add the
 * interval's event and call again).
 */
/* The statistics' state tuple: (phase_fields, phase_sum, phase_count, metric_sum, metric_count, metric_last,
   buckets, inv_log), seven dicts and a float. */
static int stats_state(PyObject *stats, Stats *st) {
    PyObject **dicts[7] = {&st->phase_fields, &st->phase_sum,    &st->phase_count, &st->metric_sum,
                           &st->metric_count, &st->metric_last, &st->buckets};
    if (!PyTuple_CheckExact(stats) || PyTuple_GET_SIZE(stats) != 8) {
        PyErr_SetString(PyExc_TypeError, "convert: the statistics' state must be a tuple of 7 dicts and a float");
        return -1;
    }
    for (int i = 0; i < 7; i++) {
        PyObject *d = PyTuple_GET_ITEM(stats, i);
        if (!PyDict_Check(d)) {
            PyErr_SetString(PyExc_TypeError, "convert: the statistics' state must be a tuple of 7 dicts and a float");
            return -1;
        }
        *dicts[i] = d;
    }
    st->inv_log = PyFloat_AsDouble(PyTuple_GET_ITEM(stats, 7));
    return st->inv_log == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *Encoder_convert(Encoder *e, PyObject *const *args, Py_ssize_t nargs) {
    Ctx c;
    if (nargs < 7 || nargs > 9) {
        PyErr_Format(PyExc_TypeError, "convert() takes 7 to 9 arguments (%zd given)", nargs);
        return NULL;
    }
    /* Called once per chunk and at every interval's end: positional arguments, read without a format */
    PyObject *popleft = args[0], *stats = nargs > 7 ? args[7] : Py_None;
    Py_ssize_t n = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) return NULL;
    c.wall0 = PyLong_AsLongLong(args[2]);
    if (c.wall0 == -1 && PyErr_Occurred()) return NULL;
    c.seq = PyLong_AsLongLong(args[3]);
    if (c.seq == -1 && PyErr_Occurred()) return NULL;
    long mode = PyLong_AsLong(args[4]);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    c.mode = (int)mode;
    c.steps_left = PyNumber_AsSsize_t(args[5], PyExc_OverflowError);
    if (c.steps_left == -1 && PyErr_Occurred()) return NULL;
    c.want_t0 = PyObject_IsTrue(args[6]);
    if (c.want_t0 < 0) return NULL;
    long long budget_ns = 0;
    if (nargs > 8 && (budget_ns = PyLong_AsLongLong(args[8])) == -1 && PyErr_Occurred()) return NULL;
    long long until = budget_ns > 0 ? mono_ns() + budget_ns : 0;
    beat();
    e->tid_cached = 0;
    memset(&c.st, 0, sizeof c.st);
    c.interval_done = 0;
    if (c.mode == 1 && stats_state(stats, &c.st) < 0) return NULL;
    Py_ssize_t taken = 0;
    PyObject *back = NULL;
    while (taken < n) {
        PyObject *item = PyObject_CallNoArgs(popleft);
        if (item == NULL) {
            PyErr_Clear(); /* empty */
            break;
        }
        taken++;
        int rc;
        if (PyTuple_CheckExact(item))
            rc = PyTuple_GET_SIZE(item) ? do_event(e, item, &c) : RC_YIELD;
        else
            rc = do_span(e, item, &c);
        if (rc == RC_OK) {
            Py_DECREF(item);
            if (c.interval_done) {
                /* Python emits the interval's event now, then calls again for the rest of the chunk. */
                back = Py_NewRef(Py_True);
                break;
            }
            /* The GIL is held throughout: a chunk of huge records ends early, the rest waits for the next. */
            if (e->buf.len > CHUNK_BYTES) break;
            if (taken % CLOCK_EVERY == 0) {
                beat();
                if (until && mono_ns() >= until) break;
            }
            continue;
        }
        c.interval_done = 0; /* an item handed back changed nothing */
        PyErr_Clear(); /* -1 (no memory): Python converts it */
        back = item;
        break;
    }
    /* Python reads the sums next (the interval's event, an item handed back): they are in the dicts. */
    if (c.mode == 1) acc_flush(&c.st);
    return Py_BuildValue("nLN", taken, c.seq, back ? back : Py_NewRef(Py_None));
}

/* take() -> (bytes, count, first_seq, last_seq): the buffer's lines, and empty it. */
static PyObject *Encoder_take(Encoder *e, PyObject *unused) {
    (void)unused;
    PyObject *data = PyBytes_FromStringAndSize(e->buf.data, e->buf.len);
    if (data == NULL) return NULL;
    PyObject *first = e->has_first ? PyLong_FromLongLong(e->first_seq) : Py_NewRef(Py_None);
    PyObject *last = e->has_last ? PyLong_FromLongLong(e->last_seq) : Py_NewRef(Py_None);
    PyObject *out = first && last ? Py_BuildValue("NnNN", data, e->count, first, last) : NULL;
    if (out == NULL) {
        if (first == NULL || last == NULL) Py_DECREF(data);
        Py_XDECREF(first);
        Py_XDECREF(last);
        return NULL;
    }
    e->buf.len = 0;
    e->count = 0;
    e->has_first = e->has_last = 0;
    if (e->buf.cap > (1 << 22)) { /* do not keep a burst's buffer */
        PyMem_Free(e->buf.data);
        e->buf.data = NULL;
        e->buf.cap = 0;
    }
    return out;
}

/* extend(data, count, first_seq, last_seq): lines Python encoded, in their place. */
static PyObject *Encoder_extend(Encoder *e, PyObject *args) {
    Py_buffer view;
    Py_ssize_t count;
    PyObject *first, *last;
    if (!PyArg_ParseTuple(args, "y*nOO", &view, &count, &first, &last)) return NULL;
    long long first_seq = 0, last_seq = 0;
    int rc = 0;
    if (first != Py_None && (first_seq = PyLong_AsLongLong(first)) == -1 && PyErr_Occurred()) rc = -1;
    if (rc == 0 && last != Py_None && (last_seq = PyLong_AsLongLong(last)) == -1 && PyErr_Occurred()) rc = -1;
    if (rc == 0) rc = buf_put(&e->buf, view.buf, view.len);
    PyBuffer_Release(&view);
    if (rc < 0) return NULL;
    e->count += count;
    if (!e->has_first && first != Py_None) {
        e->first_seq = first_seq;
        e->has_first = 1;
    }
    if (last != Py_None) {
        e->last_seq = last_seq;
        e->has_last = 1;
    }
    Py_RETURN_NONE;
}

/* take_iterations() -> None or (n, sum, min, max, t0s, first_t0, last_t1, max_t1, last_step, loop_id, ident,
   consumed) */
static PyObject *Encoder_take_iterations(Encoder *e, PyObject *unused) {
    (void)unused;
    /* The histogram's buckets stay here until the interval ends (interval_quantiles) */
    if (e->iter_n == 0) Py_RETURN_NONE;
    resolve_parent(e);
    if (e->last_span != NULL) {
        PyObject *tid = get(e, e->last_span, F_TID);
        if (tid != NULL) Py_XSETREF(e->ident, tid);
        Py_CLEAR(e->last_span);
    }
    PyObject *out = Py_BuildValue("nLLLOLLLOOOO", e->iter_n, e->sum_dur, e->min_dur, e->max_dur,
                                  e->t0s ? e->t0s : Py_None, e->first_t0, e->last_t1, e->max_t1,
                                  e->last_step ? e->last_step : Py_None, e->loop_id ? e->loop_id : Py_None,
                                  e->ident ? e->ident : Py_None, e->consumed ? e->consumed : Py_None);
    if (out == NULL) return NULL;
    clear_batch(e);
    return out;
}

typedef struct {
    long long key, count;
} Bin;

static int bin_order(const void *a, const void *b) {
    long long x = ((const Bin *)a)->key, y = ((const Bin *)b)->key;
    return (x > y) - (x < y);
}

/*
 * interval_quantiles(buckets, qs, count, gamma, low, high) -> list of floats, or None
 * LogHistogram.quantiles for the interval that ends now, over its dict ``buckets`` and the buckets
 * counted here for it (which are then forgotten: the interval's histogram is not read again).
 * None, with this encoder's buckets added to the dict, when the dict holds what C does not read
 * (a key or count that is not an int within 64 bits): Python's quantiles then does it.
 */
static PyObject *Encoder_interval_quantiles(Encoder *e, PyObject *args) {
    PyObject *buckets, *qs;
    Py_ssize_t count;
    double gamma, low, high;
    if (!PyArg_ParseTuple(args, "O!O!nddd", &PyDict_Type, &buckets, &PyTuple_Type, &qs, &count, &gamma, &low, &high))
        return NULL;
    Py_ssize_t nq = PyTuple_GET_SIZE(qs);
    double qv[8];
    if (nq > 8 || count <= 0) {
        PyErr_SetString(PyExc_ValueError, "at most 8 quantiles of a histogram that holds values");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nq; i++) {
        qv[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(qs, i));
        if (qv[i] == -1.0 && PyErr_Occurred()) return NULL;
    }
    int ours = e->hbuckets == buckets;
    Py_ssize_t n = PyDict_GET_SIZE(buckets) + (ours ? e->hn : 0);
    Bin *bins = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Bin));
    if (bins == NULL) return PyErr_NoMemory();
    Py_ssize_t m = 0, pos = 0;
    PyObject *k, *v;
    int readable = 1;
    while (readable && PyDict_Next(buckets, &pos, &k, &v)) {
        readable = as_i64(k, &bins[m].key) == RC_OK && as_i64(v, &bins[m].count) == RC_OK;
        m++;
    }
    if (!readable) {
        PyMem_Free(bins);
        if (ours && e->hn && hist_flush(e) < 0) return NULL;
        Py_RETURN_NONE;
    }
    for (int i = 0; ours && i < HBINS; i++) {
        if (e->hcount[i] == 0) continue;
        bins[m].key = e->hkey[i];
        bins[m].count = e->hcount[i];
        m++;
    }
    qsort(bins, (size_t)m, sizeof(Bin), bin_order);
    PyObject *out = PyList_New(nq);
    if (out == NULL) {
        PyMem_Free(bins);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nq; i++) {
        /* the value ranked ceil(q * count): the first bucket whose running count exceeds the rank */
        double r = ceil(qv[i] * (double)count) - 1.0;
        long long rank = r > 0 ? (long long)r : 0, running = 0;
        long long key = m ? bins[m - 1].key : 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            running += bins[j].count;
            if (running > rank) {
                key = bins[j].key;
                break;
            }
        }
        double value = key == -(1LL << 30) ? 0.0 : pow(gamma, (double)key + 0.5);
        value = value < low ? low : value;
        value = value > high ? high : value;
        PyObject *f = PyFloat_FromDouble(value);
        if (f == NULL) {
            Py_DECREF(out);
            PyMem_Free(bins);
            return NULL;
        }
        PyList_SET_ITEM(out, i, f);
    }
    PyMem_Free(bins);
    if (ours) {
        memset(e->hcount, 0, sizeof e->hcount);
        e->hn = 0;
        Py_CLEAR(e->hbuckets);
    }
    return out;
}

/* set_dict_level(level): records at this level or below are wanted as dicts (handed back to Python). */
static PyObject *Encoder_set_dict_level(Encoder *e, PyObject *arg) {
    long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred()) return NULL;
    e->dict_level = level;
    Py_RETURN_NONE;
}

static PyMethodDef Encoder_methods[] = {
    {"set_dict_level", (PyCFunction)Encoder_set_dict_level, METH_O, "The level up to which records go to Python."},
    {"convert", (PyCFunction)(void (*)(void))Encoder_convert, METH_FASTCALL, "Convert queued items into JSON lines."},
    {"take", (PyCFunction)Encoder_take, METH_NOARGS, "The buffered lines, and empty the buffer."},
    {"extend", (PyCFunction)Encoder_extend, METH_VARARGS, "Add lines encoded in Python."},
    {"take_iterations", (PyCFunction)Encoder_take_iterations, METH_NOARGS, "Iterations counted, for statistics."},
    {"interval_quantiles", (PyCFunction)Encoder_interval_quantiles, METH_VARARGS,
     "The ending interval's histogram quantiles, its buckets counted here included."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Encoder_members[] = {
    {"whole_unstopped", T_PYSSIZET, offsetof(Encoder, whole_unstopped), 0,
     "Spans first seen already stopped, less the stops of such spans seen since (the writer resets it)."},
    {"buffered", T_PYSSIZET, offsetof(Encoder, buf) + offsetof(Buf, len), READONLY,
     "Bytes of lines in the buffer, not taken yet."},
    {"struct_reads", T_PYSSIZET, offsetof(Encoder, struct_reads), READONLY,
     "Spans whose fields were read from the native span's struct rather than through its getters."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "traintrace._encode.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Encoder_new,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_traverse = (traverseproc)Encoder_traverse,
    .tp_clear = (inquiry)Encoder_clear,
    .tp_methods = Encoder_methods,
    .tp_members = Encoder_members,
    .tp_doc = "The writer's record encoder (see _pipeline.NativeWriter).",
};

/* ------------------------------------------------------------------ module functions (tests) */

/* encode_attrs(attrs, cache, style) -> bytes or None: attrs as the encoder writes them, None when it would yield. */
static PyObject *mod_encode_attrs(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *attrs, *cache;
    int style;
    if (!PyArg_ParseTuple(args, "OOi", &attrs, &cache, &style)) return NULL;
    if (attrs_plain(attrs, cache == Py_None ? NULL : cache, NULL) != RC_OK) Py_RETURN_NONE;
    Buf b = {0};
    int rc = put_attrs(&b, attrs, style, NULL);
    PyObject *out;
    if (rc < 0)
        out = NULL;
    else if (rc == RC_YIELD)
        out = Py_NewRef(Py_None);
    else
        out = PyBytes_FromStringAndSize(b.data, b.len);
    PyMem_Free(b.data);
    return out;
}

/*
 * float_text(x, style, fast=True) -> bytes: a finite float as format_float writes it; fast=False
 * always asks PyOS_double_to_string. float_fast(x) -> str or None: float_repr's text, None where it
 * is not sure (the caller then falls back).
 */
static PyObject *mod_float_text(PyObject *mod, PyObject *args) {
    (void)mod;
    double v;
    int style, fast = 1;
    if (!PyArg_ParseTuple(args, "di|p", &v, &style, &fast)) return NULL;
    if (!isfinite(v)) {
        PyErr_SetString(PyExc_ValueError, "a finite float");
        return NULL;
    }
    Buf b = {0};
    PyObject *out = format_float_as(&b, v, style, fast) < 0 ? NULL : PyBytes_FromStringAndSize(b.data, b.len);
    PyMem_Free(b.data);
    return out;
}

static PyObject *mod_float_fast(PyObject *mod, PyObject *arg) {
    (void)mod;
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    if (!isfinite(v)) {
        PyErr_SetString(PyExc_ValueError, "a finite float");
        return NULL;
    }
    char text[32];
    int n = float_repr(v, text);
    if (n == 0) Py_RETURN_NONE;
    return PyUnicode_FromStringAndSize(text, n);
}

/*
 * write_pause(fd, data, pause_ns) -> int: os.write(fd, data), then a sleep of pause_ns, both in one
 * release of the GIL. The writer thread ends a slice of work with it: a thread waiting for the GIL
 * wakes while the writer writes and sleeps, and takes the GIL; with a separate write and sleep it
 * may take it at the write, and the writer then waits a whole switch interval (5 ms) before its sleep.
 */
#ifndef _WIN32
/* traintrace._span's gil_wanted_since (NULL without it): see let_writer_in there. */
static int64_t *gil_wanted = NULL;

/* With ``hurry``, just before it takes the GIL back: the training thread lets the writer in at its next
   span stop (span.c: let_writer_in), instead of after CPython's switch interval, or later. */
static void wish_gil(int hurry) {
    if (hurry && gil_wanted != NULL) __atomic_store_n(gil_wanted, (int64_t)mono_ns(), __ATOMIC_RELEASE);
}

static void wish_granted(int hurry) {
    if (hurry && gil_wanted != NULL) __atomic_store_n(gil_wanted, 0, __ATOMIC_RELEASE);
    beat();
}

static PyObject *mod_write_pause(PyObject *mod, PyObject *args) {
    (void)mod;
    int fd;
    Py_buffer view;
    long long pause_ns;
    int hurry = 0;
    if (!PyArg_ParseTuple(args, "iy*L|p", &fd, &view, &pause_ns, &hurry)) return NULL;
#ifdef __linux__
    /* The writer thread's sleeps end on time: 1 µs of timer slack for this thread instead of 50. */
    static _Thread_local int slack_set = 0;
    if (!slack_set) {
        slack_set = 1;
        (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    }
#endif
    Py_ssize_t n;
    int err;
    for (;;) {
        beat_idle(); /* a wait of its own: the wish below takes it back */
        Py_BEGIN_ALLOW_THREADS
        n = write(fd, view.buf, (size_t)view.len);
        err = errno;
        if (pause_ns > 0 && !(n < 0 && err == EINTR)) {
            struct timespec ts = {(time_t)(pause_ns / 1000000000LL), (long)(pause_ns % 1000000000LL)};
            nanosleep(&ts, NULL);
        }
        /* More to do: ask the training thread to let the writer in at its next span stop. */
        wish_gil(hurry);
        Py_END_ALLOW_THREADS
        wish_granted(hurry);
        if (n >= 0 || err != EINTR) break;
        if (PyErr_CheckSignals() < 0) { /* as os.write: a signal handler that raises ends it */
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    if (n < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n);
}

/*
 * The writer thread's other waits without the GIL (its slices' pause, its wait for the next cycle): a
 * training thread running Python back to back keeps the GIL for the switch interval before CPython hands
 * it over, and while other threads wait for it too, much longer (hundreds of ms measured here). With
 * ``hurry`` the writer asks for it back as its wait ends.
 */
/* writer_idle(): the writer has no work (it stops, or waits outside these functions). */
static PyObject *mod_writer_idle(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    beat_idle();
    Py_RETURN_NONE;
}

/* pause(ns, hurry=False): sleep ns without the GIL. */
static PyObject *mod_pause(PyObject *mod, PyObject *args) {
    (void)mod;
    long long pause_ns;
    int hurry = 0;
    if (!PyArg_ParseTuple(args, "L|p", &pause_ns, &hurry)) return NULL;
    if (pause_ns < 0) pause_ns = 0;
    beat_idle();
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts = {(time_t)(pause_ns / 1000000000LL), (long)(pause_ns % 1000000000LL)};
    nanosleep(&ts, NULL);
    wish_gil(hurry);
    Py_END_ALLOW_THREADS
    wish_granted(hurry);
    Py_RETURN_NONE;
}

/* wait_readable(fd, timeout_ns, hurry=False) -> bool: whether fd became readable within the timeout. */
static PyObject *mod_wait_readable(PyObject *mod, PyObject *args) {
    (void)mod;
    int fd, hurry = 0;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "iL|p", &fd, &timeout_ns, &hurry)) return NULL;
    long long until = mono_ns() + (timeout_ns > 0 ? timeout_ns : 0);
    for (;;) {
        long long left = until - mono_ns();
        int ms = left <= 0 ? 0 : (int)((left + 999999) / 1000000 > INT_MAX ? INT_MAX : (left + 999999) / 1000000);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int n, err;
        beat_idle();
        Py_BEGIN_ALLOW_THREADS
        n = poll(&p, 1, ms);
        err = errno;
        if (!(n < 0 && err == EINTR)) wish_gil(hurry);
        Py_END_ALLOW_THREADS
        if (n >= 0 || err != EINTR) {
            wish_granted(hurry);
            if (n < 0) {
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            return PyBool_FromLong(n > 0);
        }
        if (PyErr_CheckSignals() < 0) return NULL; /* as select: a signal handler that raises ends it */
    }
}
#endif

static PyMethodDef module_methods[] = {
    {"encode_attrs", mod_encode_attrs, METH_VARARGS, "An attrs dict as the encoder writes it (None: left to Python)."},
    {"float_text", mod_float_text, METH_VARARGS, "A finite float as the encoder writes it (tests)."},
    {"float_fast", mod_float_fast, METH_O, "repr(x) by the fast formatter, None where it falls back (tests)."},
#ifndef _WIN32
    {"write_pause", mod_write_pause, METH_VARARGS, "os.write, then a short sleep, in one release of the GIL."},
    {"pause", mod_pause, METH_VARARGS, "Sleep without the GIL, and ask the training thread for it back."},
    {"writer_idle", mod_writer_idle, METH_NOARGS, "The writer has no work: no training thread lets it in."},
    {"wait_readable", mod_wait_readable, METH_VARARGS,
     "Wait without the GIL for a descriptor to be readable, then ask the training thread for the GIL."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "traintrace._encode", "The writer thread's native record encoder.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__encode(void) {
    for (int i = 0; i < NF; i++)
        if ((FIELD[i] = PyUnicode_InternFromString(field_names[i])) == NULL) return NULL;
    if ((S_OK = PyUnicode_InternFromString("ok")) == NULL ||
        (S_STEP = PyUnicode_InternFromString("step")) == NULL ||
        (S_CURRENT_ITERATION = PyUnicode_InternFromString("current_iteration")) == NULL ||
        (S_ITERATION = PyUnicode_InternFromString("iteration")) == NULL ||
        (S_TRAINING_LOOP = PyUnicode_InternFromString("training_loop")) == NULL ||
        (S_INIT_SUFFIX = PyUnicode_InternFromString("_initialization")) == NULL ||
        (S_NUM_ITERATIONS = PyUnicode_InternFromString("num_iterations")) == NULL ||
        (S_IS_CPU = PyUnicode_InternFromString("is_cpu")) == NULL ||
        (S_IS_FLOATING_POINT = PyUnicode_InternFromString("is_floating_point")) == NULL ||
        (S_NUMEL = PyUnicode_InternFromString("numel")) == NULL ||
        (S_ITEM = PyUnicode_InternFromString("item")) == NULL)
        return NULL;
    if ((ZERO_F = PyFloat_FromDouble(0.0)) == NULL || (ZERO_I = PyLong_FromLong(0)) == NULL ||
        (ONE = PyLong_FromLong(1)) == NULL)
        return NULL;
    for (int i = 0; i < 5; i++)
        if ((SMALL[i] = PyLong_FromLong(i)) == NULL) return NULL;
#ifndef _WIN32
    gil_wanted = PyCapsule_Import("traintrace._span._gil_wanted", 0);
    if (gil_wanted == NULL) PyErr_Clear(); /* no native span core: no hand-over */
    writer_beat = PyCapsule_Import("traintrace._span._writer_beat", 0);
    if (writer_beat == NULL) PyErr_Clear();
#endif
    SpanCoreAPI *core = PyCapsule_Import("traintrace._span._core", 0);
    if (core == NULL)
        PyErr_Clear(); /* no native span core (or an older build): spans through their getters */
    else if (core->layout == SPAN_CORE_LAYOUT)
        SPAN_CORE = core->type;
    if (PyType_Ready(&EncoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Encoder", (PyObject *)&EncoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
