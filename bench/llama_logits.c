/*
 * llama_logits: llama.cpp's logits for given token ids, the peer's half of `make bench-lm`'s
 * accuracy check (bench/lm_vs_llama_cpp.py); built against the llama.cpp that
 * scripts/llama_cpp_setup.sh builds. The bench's own tools (llama-bench) take text or random
 * tokens, not the ids both engines must see, hence this driver over llama.h's C API.
 *
 *   llama_logits MODEL.gguf THREADS IDS.i32 WINDOW OUT.f32 [--defaults]
 *
 * Every consecutive WINDOW tokens of IDS (int32, native order) from an empty cache in one decode
 * call, every position's logits out (f32, [windows * WINDOW, n_vocab]). Flash attention off and an
 * f32 KV cache, so that F32 weights give the model's own function; --defaults keeps the library's
 * context defaults for these two (flash attention "auto", f16 cache) to show what they cost.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

int main(int argc, char **argv)
{
    if (argc != 6 && !(argc == 7 && strcmp(argv[6], "--defaults") == 0)) {
        fprintf(stderr, "usage: llama_logits MODEL.gguf THREADS IDS.i32 WINDOW OUT.f32 [--defaults]\n");
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
    if (argc == 6) {
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
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(ids);
    return 0;
}
