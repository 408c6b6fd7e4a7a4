/* Accepted: the smallest native module, an mpy_init at text offset 0 that returns None
 * (mp_fun_table slot 0) and defines no names. The refusal tests link each bad object with
 * it, so the bad object is the only thing wrong. */
extern const void *const mp_fun_table[];

__attribute__((section(".text.mpy_init"))) const void *mpy_init(void *self, unsigned long n_args,
                                                                 unsigned long n_kw, void **args);

const void *mpy_init(void *self, unsigned long n_args, unsigned long n_kw, void **args)
{
    (void)self, (void)n_args, (void)n_kw, (void)args;
    return mp_fun_table[0];
}
