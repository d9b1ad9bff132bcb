/* Graph evaluation callback for llama.cpp (ggml_backend_sched_eval_callback), in C so that the
 * hundreds of calls per decode cost next to nothing.
 *
 * In body mode it asks the scheduler for one node (by name), copies that node's float data
 * into a caller-owned buffer and stops the graph there (returns false), so everything after
 * the node -- the LM head -- is never computed. Out of body mode it asks for nothing.
 * The ggml accessors are passed in as function pointers, so this file needs no ggml headers.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*forerun_name_fn)(const void *);
typedef float *(*forerun_data_fn)(const void *);
typedef int64_t (*forerun_count_fn)(const void *);

struct forerun_tap {
    forerun_name_fn get_name;
    forerun_data_fn get_data;
    forerun_count_fn nelements;
    int32_t body;     /* 1: stop at the node and copy it */
    int32_t captured; /* out: 1 copied, -1 the node did not fit the buffer */
    int64_t n;        /* out: floats copied */
    int64_t cap;      /* capacity of buf, in floats */
    float *buf;
    char node[64];
};

bool forerun_tap_eval(void *t, bool ask, void *user_data) {
    struct forerun_tap *s = (struct forerun_tap *)user_data;
    if (!s->body) {
        return ask ? false : true;
    }
    if (ask) {
        return strcmp(s->get_name(t), s->node) == 0;
    }
    int64_t n = s->nelements(t);
    if (n > s->cap) {
        s->captured = -1;
        return false;
    }
    memcpy(s->buf, s->get_data(t), (size_t)n * sizeof(float));
    s->n = n;
    s->captured = 1;
    return false;
}
