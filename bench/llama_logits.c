/*
 * llama_logits: llama.cpp's logits for given token ids, the peer's half of `make bench-lm`'s
 * accuracy check (bench/lm_vs_llama_cpp.py); built against the llama.cpp that
 * scripts/llama_cpp_setup.sh builds. The bench's own tools (llama-bench) take text or random
 * tokens, not the ids both engines must see, hence this driver over llama.h's C API.
 *
 *   llama_logits MODEL.gguf THREADS IDS.i32 WINDOW OUT.f32 [--defaults] [--routes ROUTES.i32]
 *
 * Every consecutive WINDOW tokens of IDS (int32, native order) from an empty cache in one decode
 * call, every position's logits out (f32, [windows * WINDOW, n_vocab]). Flash attention off and an
 * f32 KV cache, so that F32 weights give the model's own function; --defaults keeps the library's
 * context defaults for these two (flash attention "auto", f16 cache) to show what they cost.
 * --routes writes the experts each MoE layer chose for each token (llama.cpp's "ffn_moe_topk-L"
 * tensors, caught by the scheduler's eval callback), one record per layer and window: int32 layer,
 * k, tokens, then tokens x k expert indices (int32).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"

#define TOPK_PREFIX "ffn_moe_topk-"

/* Asked about each graph node before it runs: the top-k selections are wanted, and each is written
 * out once computed. The selection is a view into the argsort's rows, hence row by row. */
static bool on_tensor(struct ggml_tensor *t, bool ask, void *user)
{
    FILE *routes = user;
    if (strncmp(t->name, TOPK_PREFIX, strlen(TOPK_PREFIX)) != 0)
        return !ask;
    if (ask)
        return true;
    int32_t head[3] = {atoi(t->name + strlen(TOPK_PREFIX)), (int32_t)t->ne[0], (int32_t)t->ne[1]};
    int32_t row[64];
    if (t->type != GGML_TYPE_I32 || t->ne[0] > 64 || t->ne[2] != 1 || fwrite(head, sizeof head, 1, routes) != 1)
        return false;
    for (int64_t r = 0; r < t->ne[1]; r++) {
        ggml_backend_tensor_get(t, row, (size_t)r * t->nb[1], (size_t)t->ne[0] * sizeof(int32_t));
        if (fwrite(row, sizeof(int32_t), (size_t)t->ne[0], routes) != (size_t)t->ne[0])
            return false;
    }
    return true;
}

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

int main(int argc, char **argv)
{
    int defaults = 0;
    const char *routes_path = NULL;
    int bad = argc < 6;
    for (int a = 6; a < argc && !bad; a++) {
        if (strcmp(argv[a], "--defaults") == 0)
            defaults = 1;
        else if (strcmp(argv[a], "--routes") == 0 && a + 1 < argc)
            routes_path = argv[++a];
        else
            bad = 1;
    }
    if (bad) {
        fprintf(stderr, "usage: llama_logits MODEL.gguf THREADS IDS.i32 WINDOW OUT.f32 [--defaults] "
                        "[--routes ROUTES.i32]\n");
        return 2;
    }
    int threads = atoi(argv[2]);
    long window = atol(argv[4]);
    if (threads < 1 || window < 1) {
        fprintf(stderr, "llama_logits: THREADS and WINDOW must be positive\n");
        return 2;
    }
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        perror(argv[3]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f) / sizeof(llama_token);
    rewind(f);
    llama_token *ids = malloc(sizeof(llama_token) * (n ? n : 1));
    if (!ids || fread(ids, sizeof(llama_token), n, f) != n) {
        fprintf(stderr, "llama_logits: cannot read %s\n", argv[3]);
        return 1;
    }
    fclose(f);
    if (n == 0 || n % (size_t)window) {
        fprintf(stderr, "llama_logits: %zu ids is not a whole number of %ld-token windows\n", n, window);
        return 2;
    }

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama_logits: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)window;
    cp.n_batch = (uint32_t)window;
    cp.n_ubatch = (uint32_t)window;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    FILE *routes = NULL;
    if (routes_path) {
        routes = fopen(routes_path, "wb");
        if (!routes) {
            perror(routes_path);
            return 1;
        }
        cp.cb_eval = on_tensor;
        cp.cb_eval_user_data = routes;
    }
    if (!defaults) {
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_logits: cannot create a context\n");
        return 1;
    }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[5], "wb");
    if (!out) {
        perror(argv[5]);
        return 1;
    }
    struct llama_batch batch = llama_batch_init((int32_t)window, 0, 1);
    for (size_t w = 0; w < n; w += (size_t)window) {
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = (int32_t)window;
        for (long i = 0; i < window; i++) {
            batch.token[i] = ids[w + (size_t)i];
            batch.pos[i] = (llama_pos)i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        int rc = llama_decode(ctx, batch);
        if (rc != 0) {
            fprintf(stderr, "llama_logits: llama_decode returned %d\n", rc);
            return 1;
        }
        for (long i = 0; i < window; i++) {
            const float *row = llama_get_logits_ith(ctx, (int32_t)i);
            if (!row || fwrite(row, sizeof(float), (size_t)vocab, out) != (size_t)vocab) {
                fprintf(stderr, "llama_logits: no logits for position %ld\n", i);
                return 1;
            }
        }
    }
    if (fclose(out) != 0) {
        perror(argv[5]);
        return 1;
    }
    if (routes && fclose(routes) != 0) {
        perror(routes_path);
        return 1;
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(ids);
    return 0;
}
