/*
 * Times encode.c's format_float on 1/(i+1), i < N, in C (no Python call in between):
 *   float_driver fast|dtoa STYLE N REPEATS  -> best ns per call over REPEATS passes
 * "dtoa" forces PyOS_double_to_string, the formatter before issue 12. Built by
 * benchmarks/bench_float.sh; run it under callgrind with --toggle-collect=format_float_as
 * to count instructions per call.
 */
#include "../src/native/encode.c"

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    int fast = strcmp(argv[1], "fast") == 0, style = atoi(argv[2]);
    long n = atol(argv[3]), repeats = atol(argv[4]);
    Py_Initialize();
    Buf b = {0};
    double best = 1e30;
    size_t sink = 0;
    for (long r = 0; r < repeats; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < n; i++) {
            b.len = 0;
            if (format_float_as(&b, 1.0 / (double)(i + 1), style, fast) < 0) return 1;
            sink += (size_t)b.len;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
        if (ns < best) best = ns;
    }
    printf("%s style %d: %.1f ns per call (best of %ld x %ld; %zu bytes)\n", argv[1], style, best, repeats, n, sink);
    PyMem_Free(b.data);
    return 0;
}
