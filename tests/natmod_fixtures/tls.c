/* Refused: thread-local storage produces TLS relocations, which the .mpy format has no way to express. */
__thread int fixture_tls_value;

int fixture_tls_get(void)
{
    return fixture_tls_value;
}
