/* An NVTX injection library for the tests: records the calls a process makes.
 *
 * NVTX loads the library named by NVTX_INJECTION64_PATH on first use and calls
 * InitializeInjectionNvtx2, which fills in the core domain functions below.
 * Each call appends one tab-separated line to the file named by TT_NVTX_LOG:
 *   domain <name> | push <domain> <tid> <message> <color> <payload type> <payload>
 *   pop <domain> <tid> <depth after> | mark <domain> <tid> <message> <color>
 * The types are written out here (from the NVTX ABI) so no CUDA headers are needed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*fn_t)(void);
typedef fn_t **table_t;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, table_t *out_table, unsigned int *out_size);
} callbacks_t;
typedef const void *(*get_export_table_t)(uint32_t id);

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    union { uint64_t u; int64_t i; double d; } payload;
    int32_t message_type;
    union { const char *ascii; const void *unicode; const char *registered; } message;
} attributes_t;

enum { MODULE_CORE2 = 5, ETID_CALLBACKS = 1 };
enum {
    MARK_EX = 1, RANGE_PUSH_EX = 4, RANGE_POP = 5, NAME_CATEGORY_A = 8,
    REGISTER_STRING_A = 10, DOMAIN_CREATE_A = 12, DOMAIN_DESTROY = 14,
};
enum { MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3 };
enum { PAYLOAD_U64 = 1, PAYLOAD_I64 = 2, PAYLOAD_DOUBLE = 3 };

static FILE *out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int depth;

static const char *message_of(const attributes_t *a) {
    if (!a) return "";
    if (a->message_type == MESSAGE_REGISTERED || a->message_type == MESSAGE_ASCII)
        return a->message.ascii ? a->message.ascii : "";
    return "?";
}

static void payload_of(const attributes_t *a, char *buf, size_t n) {
    if (!a) { snprintf(buf, n, "0\t"); return; }
    switch (a->payload_type) {
    case PAYLOAD_I64: snprintf(buf, n, "%d\t%lld", a->payload_type, (long long)a->payload.i); break;
    case PAYLOAD_U64: snprintf(buf, n, "%d\t%llu", a->payload_type, (unsigned long long)a->payload.u); break;
    case PAYLOAD_DOUBLE: snprintf(buf, n, "%d\t%g", a->payload_type, a->payload.d); break;
    default: snprintf(buf, n, "%d\t", a->payload_type);
    }
}

static void line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void line(const char *fmt, ...) {
    if (!out) return;
    va_list args;
    va_start(args, fmt);
    pthread_mutex_lock(&lock);
    vfprintf(out, fmt, args);
    fputc('\n', out);
    fflush(out);
    pthread_mutex_unlock(&lock);
    va_end(args);
}

static long tid(void) { return (long)syscall(SYS_gettid); }

static void *domain_create(const char *name) {
    line("domain\t%s", name);
    return strdup(name ? name : "");
}
static void domain_destroy(void *domain) { (void)domain; }
static void *register_string(void *domain, const char *s) { (void)domain; return strdup(s ? s : ""); }
static void name_category(void *domain, uint32_t id, const char *name) {
    line("category\t%s\t%u\t%s", (const char *)domain, id, name);
}
static int push(void *domain, const attributes_t *a) {
    char payload[64];
    payload_of(a, payload, sizeof payload);
    depth++;
    line("push\t%s\t%ld\t%s\t%06x\t%s\t%d", (const char *)domain, tid(), message_of(a),
         a ? a->color & 0xFFFFFF : 0, payload, depth);
    return depth - 1;
}
static int pop(void *domain) {
    depth--;
    line("pop\t%s\t%ld\t%d", (const char *)domain, tid(), depth);
    return depth;
}
static void mark(void *domain, const attributes_t *a) {
    line("mark\t%s\t%ld\t%s\t%06x", (const char *)domain, tid(), message_of(a), a ? a->color & 0xFFFFFF : 0);
}

static void set(table_t table, unsigned int size, unsigned int id, fn_t fn) {
    if (id < size && table[id]) *table[id] = fn;
}

int InitializeInjectionNvtx2(get_export_table_t get_export_table) {
    const char *path = getenv("TT_NVTX_LOG");
    out = path ? fopen(path, "a") : NULL;
    const callbacks_t *callbacks = (const callbacks_t *)get_export_table(ETID_CALLBACKS);
    if (!callbacks) return 0;
    table_t table = NULL;
    unsigned int size = 0;
    if (!callbacks->GetModuleFunctionTable(MODULE_CORE2, &table, &size) || !table) return 0;
    set(table, size, DOMAIN_CREATE_A, (fn_t)domain_create);
    set(table, size, DOMAIN_DESTROY, (fn_t)domain_destroy);
    set(table, size, REGISTER_STRING_A, (fn_t)register_string);
    set(table, size, NAME_CATEGORY_A, (fn_t)name_category);
    set(table, size, RANGE_PUSH_EX, (fn_t)push);
    set(table, size, RANGE_POP, (fn_t)pop);
    set(table, size, MARK_EX, (fn_t)mark);
    line("init");
    return 1;
}
