/* Refused: a static variable in .bss is reached PC-relative, not through the GOT, and would
 * crash at run time; the linker must reject it at build time. */
static int counter;

int fixture_bump(void)
{
    return ++counter;
}
