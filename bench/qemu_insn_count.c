/*
 * A QEMU TCG plugin that counts the guest instructions a qemu-user process
 * executes and prints "insns: N" at exit (bench/aarch64_insns.py). Built
 * for the plugin API of Debian 12's QEMU 7.2 (version 1), declaring the five
 * API functions it calls itself, since Debian ships no qemu-plugin.h:
 *
 *   gcc -O2 -shared -fPIC bench/qemu_insn_count.c -o build/aarch64/libinsn.so
 *   qemu-aarch64 -plugin build/aarch64/libinsn.so -d plugin ./program
 *
 * Each translated block adds its instruction count when it starts executing
 * (an inline add, no callback): executed instructions of the emulated CPU,
 * not cycles, and nothing about the speed of a real one.
 */
#include <stdint.h>
#include <stdio.h>
#include <stddef.h>
typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
__attribute__((visibility("default"))) int qemu_plugin_version = 1;
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr, uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t, void *), void *userdata);
void qemu_plugin_outs(const char *string);
static uint64_t count;
static void trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &count, qemu_plugin_tb_n_insns(tb));
}
static void done(qemu_plugin_id_t id, void *p)
{
    (void)id; (void)p;
    char buf[64];
    snprintf(buf, sizeof buf, "insns: %llu\n", (unsigned long long)count);
    qemu_plugin_outs(buf);
}
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    (void)info; (void)argc; (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, trans);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
