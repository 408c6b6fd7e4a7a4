/*
 * A QEMU TCG plugin that counts how often each guest instruction executes and
 * writes "pc count" lines (hex pc, decimal count; executed instructions only)
 * to the file named by its argument when QEMU exits. bench/m7_profile.py
 * maps the pcs to functions of the runner's ELF, to see where the emulated
 * Cortex-M7's instructions of one forward pass go (instructions, not cycles).
 * Built, like bench/qemu_insn_count.c, for the plugin API of Debian 12's
 * QEMU 7.2 (version 1), declaring the API functions it calls itself:
 *
 *   gcc -O2 -shared -fPIC bench/qemu_pc_profile.c -o build/m7/libpcprof.so
 *   qemu-system-arm ... -plugin build/m7/libpcprof.so,out=prof.txt
 *
 * Counters are one u64 per halfword of the code region [0, CODE_SIZE) (the
 * mps2-an500's 4 MB of code memory); instructions elsewhere are summed apart.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
__attribute__((visibility("default"))) int qemu_plugin_version = 1;
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
uint64_t qemu_plugin_insn_vaddr(const struct qemu_plugin_insn *insn);
void qemu_plugin_register_vcpu_insn_exec_inline(struct qemu_plugin_insn *insn, enum qemu_plugin_op op, void *ptr,
                                                uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, void *), void *userdata);

#define CODE_SIZE (4u << 20)
static uint64_t *counts;   /* [CODE_SIZE / 2] */
static uint64_t elsewhere; /* instructions outside the code region */
static char out_path[512];

static void trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    const size_t n = qemu_plugin_tb_n_insns(tb);
    for (size_t i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        const uint64_t pc = qemu_plugin_insn_vaddr(insn);
        uint64_t *slot = pc < CODE_SIZE ? &counts[pc / 2] : &elsewhere;
        qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, slot, 1);
    }
}

static void done(qemu_plugin_id_t id, void *p)
{
    (void)id;
    (void)p;
    FILE *f = fopen(out_path, "w");
    if (!f)
        return;
    for (uint64_t i = 0; i < CODE_SIZE / 2; i++)
        if (counts[i])
            fprintf(f, "%llx %llu\n", (unsigned long long)(i * 2), (unsigned long long)counts[i]);
    fprintf(f, "elsewhere %llu\n", (unsigned long long)elsewhere);
    fclose(f);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                                               char **argv)
{
    (void)info;
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "out=", 4) == 0 && strlen(argv[i] + 4) < sizeof out_path)
            strcpy(out_path, argv[i] + 4);
    if (!out_path[0]) {
        fprintf(stderr, "qemu_pc_profile: give out=FILE\n");
        return -1;
    }
    counts = calloc(CODE_SIZE / 2, sizeof *counts);
    if (!counts)
        return -1;
    qemu_plugin_register_vcpu_tb_trans_cb(id, trans);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
