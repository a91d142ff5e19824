/* A preload library for the tests: the process reads the wall clock as if its host's ran ahead.
 *
 * LD_PRELOAD=libclock_ahead.so CLOCK_AHEAD_NS=<n> shifts what clock_gettime(CLOCK_REALTIME[_COARSE]) and
 * gettimeofday return by n nanoseconds (negative: behind): a host whose NTP is off. Monotonic clocks, sleeps and
 * timeouts are left alone (libfaketime also fakes sleeps, and its clock_nanosleep fails with EINVAL).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long ahead_ns;
static int (*real_clock_gettime)(clockid_t, struct timespec *);
static int (*real_gettimeofday)(struct timeval *, void *);

__attribute__((constructor)) static void clock_ahead_init(void) {
    const char *text = getenv("CLOCK_AHEAD_NS");
    ahead_ns = text ? strtoll(text, NULL, 10) : 0;
    real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    real_gettimeofday = (int (*)(struct timeval *, void *))dlsym(RTLD_NEXT, "gettimeofday");
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + ahead_ns;
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime) clock_ahead_init();
    int status = real_clock_gettime(id, ts);
    if (status == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
    return status;
}

int gettimeofday(struct timeval *tv, void *tz) {
    if (!real_gettimeofday) clock_ahead_init();
    int status = real_gettimeofday(tv, tz);
    if (status == 0) {
        struct timespec ts = {tv->tv_sec, tv->tv_usec * 1000L};
        shift(&ts);
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000L;
    }
    return status;
}
