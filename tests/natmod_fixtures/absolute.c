/* Refused: compiled without -fpic (the test adds -fno-pic), taking an address gives an absolute
 * 32-bit relocation (R_X86_64_32, R_ARM_THM_MOVW_ABS_NC/MOVT_ABS) the .mpy loader cannot apply. */
const int fixture_target = 7;

const int *fixture_address(void)
{
    return &fixture_target;
}
