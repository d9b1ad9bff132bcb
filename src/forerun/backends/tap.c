/* Graph evaluation callback for llama.cpp (ggml_backend_sched_eval_callback), in C so that the
 * hundreds of calls per decode cost next to nothing.
 *
 * While active it asks the scheduler for a few nodes by name and copies their float data into
 * caller-owned buffers: up to FORERUN_TAP_MAX "capture" nodes (the graph goes on after them:
 * layer outputs for trained draft heads), and optionally one "stop" node, after which the
 * graph stops (returns false), so that everything after it -- the LM head -- is never
 * computed. Inactive, it asks for nothing. The ggml accessors are passed in as function
 * pointers, so this file needs no ggml headers.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define FORERUN_TAP_MAX 8

typedef const char *(*forerun_name_fn)(const void *);
typedef float *(*forerun_data_fn)(const void *);
typedef int64_t (*forerun_count_fn)(const void *);

struct forerun_tap {
    forerun_name_fn get_name;
    forerun_data_fn get_data;
    forerun_count_fn nelements;
    int32_t active;      /* 0: ask for nothing */
    int32_t stop;        /* 1: stop the graph after node[0] */
    int32_t n_nodes;     /* nodes to copy: node[0] (the stop node, if stop) and captures */
    int32_t pad;
    int64_t cap;         /* capacity of each buffer, in floats */
    float *buf[FORERUN_TAP_MAX];
    int64_t n[FORERUN_TAP_MAX];        /* out: floats copied, -1 did not fit, 0 not seen */
    char node[FORERUN_TAP_MAX][64];
};

static int find(const struct forerun_tap *s, const char *name) {
    for (int i = 0; i < s->n_nodes; i++) {
        if (strcmp(name, s->node[i]) == 0) return i;
    }
    return -1;
}

bool forerun_tap_eval(void *t, bool ask, void *user_data) {
    struct forerun_tap *s = (struct forerun_tap *)user_data;
    if (!s->active) {
        return ask ? false : true;
    }
    int i = find(s, s->get_name(t));
    if (ask) {
        return i >= 0;
    }
    if (i < 0) {
        return true;
    }
    int64_t n = s->nelements(t);
    if (n > s->cap) {
        s->n[i] = -1;
    } else {
        memcpy(s->buf[i], s->get_data(t), (size_t)n * sizeof(float));
        s->n[i] = n;
    }
    return !(s->stop && i == 0);
}
